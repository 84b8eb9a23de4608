"""What a step costs as a function of its decode rows: every step of a continuous batch timed
on its own (synchronized before and after), and a few steps profiled kernel by kernel.

The workload is the end-to-end one in miniature: ``--prompts`` prompts of ``--input-len``
tokens arrive at once, so under the 8192-token step budget each step carries one prompt's
chunk (or two: a prompt's tail plus the next prompt's head) and every sequence admitted
before it as a decode row. The per-step table says how the step's time grows with its decode
rows and whether a chunk that starts after cached context costs more than one that starts at
0; the profiled steps (a prefill with no decodes, then steps with about half and all of the
decode rows, each the second of its kind so nothing compiles inside it) show which kernels
carry the growth. A pure-decode step is profiled last for reference.

    python3 -m benchmarks.profile_mixed_steps --model deepseek-v2-lite --kv-cache-dtype fp8

With ``$OUT`` set, the per-step rows and the profiles' kernel tables go to
``$OUT/profile_mixed_steps.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from benchmarks.profile_engine_step import kernel_class
from server import LLM, SamplingParams
from server.bench.throughput import materialize_model


def step_signature(out) -> dict:
    """The step's shape: decode rows, and each prefill chunk as (start position, tokens)."""
    return dict(decodes=out.num_decodes,
                chunks=[(e.start_pos, e.num_new_tokens) for e in out.prefills])


def host_table(prof, n: int = 12) -> list[tuple[str, float, int]]:
    """(op, self CPU ms, calls) of the host ops that took the most CPU time themselves: where a
    step whose wall time exceeds its GPU time spends it (a sync shows as a long self time)."""
    rows = [(evt.key[:90], evt.self_cpu_time_total / 1e3, int(evt.count)) for evt in prof.key_averages()
            if evt.self_cpu_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:n]


def kernel_table(prof) -> list[tuple[str, str, float, int]]:
    """(class, name, µs, launches) of every device kernel, heaviest first."""
    from torch.autograd import DeviceType

    rows = []
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None)
        us = evt.self_cuda_time_total if us is None else us
        rows.append((kernel_class(evt.key), evt.key[:90], float(us), int(evt.count)))
    return sorted(rows, key=lambda r: -r[2])


class StepRecorder:
    """Wraps ``runner.execute``: times every step and profiles the ones ``want`` picks."""

    def __init__(self, runner, want) -> None:
        self.runner, self.want = runner, want
        self.sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
        self.inner = runner.execute
        self.steps: list[dict] = []
        self.profiles: dict[str, dict] = {}
        runner.execute = self

    def allocator_counts(self) -> dict[str, int]:
        """The caching allocator's retries (it freed its cache to satisfy a request: a device
        sync) and its cudaMalloc / cudaFree calls, so far."""
        if self.runner.device.type != "cuda":
            return dict(alloc_retries=0, device_mallocs=0, device_frees=0)
        st = torch.cuda.memory_stats(self.runner.device)
        return dict(alloc_retries=st.get("num_alloc_retries", 0), device_mallocs=st.get("num_device_alloc", 0),
                    device_frees=st.get("num_device_free", 0))

    def __call__(self, out):
        if out.is_empty:
            return self.inner(out)
        sig = step_signature(out)
        label = self.want(sig, self.profiles)
        self.sync()
        before = self.allocator_counts()
        t0 = time.perf_counter()
        if label is None:
            result = self.inner(out)
            self.sync()
        else:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = self.inner(out)
                self.sync()
        sig["wall_ms"] = (time.perf_counter() - t0) * 1e3
        sig.update({k: v - before[k] for k, v in self.allocator_counts().items()})
        if label is not None:
            table = kernel_table(prof)
            by_class = defaultdict(float)
            for cls, _, us, _ in table:
                by_class[cls] += us
            self.profiles[label] = dict(sig, gpu_ms=sum(r[2] for r in table) / 1e3,
                                        by_class_ms={c: v / 1e3 for c, v in by_class.items()}, kernels=table[:40],
                                        host=host_table(prof))
        self.steps.append(sig)
        return result


def chooser(num_prompts: int):
    """Profile, each at its second occurrence: a lone prefill, mixed steps at about half and at
    all of the decode rows (chunk from 0, and the step where a chunk starts after cached
    context), and a pure decode step."""
    seen = defaultdict(int)
    half, full = num_prompts // 2, num_prompts - 2

    def want(sig, done):
        d, chunks = sig["decodes"], sig["chunks"]
        if not chunks:
            kind = "decode only" if d >= full else None
        elif d == 0:
            kind = "prefill, no decodes"
        elif d in (half, half + 1) or d >= full:
            tail = any(start > 0 for start, _ in chunks)
            kind = f"{'half' if d < full else 'all'} decodes, {'chunk after context' if tail else 'chunk from 0'}"
        else:
            kind = None
        if kind is None or kind in done:
            return None
        seen[kind] += 1
        return kind if seen[kind] >= 2 or kind == "prefill, no decodes" else None

    return want


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per profiled step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step budget (engine default: 8192)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (CPU ops, no kernels)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_mixed_steps needs a CUDA GPU (or --device cpu for a smoke run)")
    g = torch.Generator().manual_seed(0)
    with materialize_model(args.model, args.num_layers) as model_dir:
        llm = LLM(model_dir, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                  max_model_len=args.input_len + args.output_len + 64, load_format="dummy",
                  enable_prefix_caching=False, max_num_seqs=max(8, args.prompts),
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization)
        vocab = llm.engine.vocab_size
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        warm = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(2)]
        llm.generate(prompt_token_ids=warm, sampling_params=params)  # compiles the step shapes
        rec = StepRecorder(llm.engine.runner, chooser(args.prompts))
        prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.prompts)]
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    print("| step | decodes | chunks (start:tokens) | wall ms | allocator retries | cudaMalloc | cudaFree |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for i, s in enumerate(rec.steps):
        if s["chunks"] or i % 4 == 0:
            chunks = " ".join(f"{a}:{n}" for a, n in s["chunks"])
            print(f"| {i} | {s['decodes']} | {chunks} | {s['wall_ms']:.1f} | {s['alloc_retries']} | "
                  f"{s['device_mallocs']} | {s['device_frees']} |")
    for label, p in rec.profiles.items():
        cls = ", ".join(f"{c} {v:.1f}" for c, v in sorted(p["by_class_ms"].items()))
        print(f"\n#### {label}: decodes {p['decodes']}, chunks {p['chunks']}, wall {p['wall_ms']:.1f} ms, "
              f"GPU {p['gpu_ms']:.1f} ms ({cls})")
        for cls_name, name, us, n in p["kernels"][: args.top]:
            print(f"  {us / 1e3:8.2f} ms  {n:5d}x  {cls_name:9s} {name}")
        print("  host ops by self CPU time:")
        for name, ms, n in p["host"]:
            print(f"  {ms:8.2f} ms  {n:5d}x  {name}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "profile_mixed_steps.json"), "w") as f:
            gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
            json.dump(dict(device=gpu, args=vars(args), steps=rec.steps,
                           profiles=rec.profiles), f, indent=1)


if __name__ == "__main__":
    main()
