"""Where one engine step's GPU time goes: torch.profiler around ``LLM.generate`` for one long
prompt (a prefill step) and, separately, three long prompts with a few decodes (mixed steps),
on a preset's shape with random weights.

Each scenario runs twice on the same engine: ``before`` with the fused glue kernels off
(``kernels.fused_glue.unfused_glue``: the torch compositions of RMSNorm, RoPE, K/V assembly,
SiLU·mul, the MoE slot alignment) and ``after`` with them on. Every CUDA kernel is put in one class by its name
(GEMM, attention, MoE experts, other = the memory-bound glue), and the last lines are a
compact table of each class's time and launch count per decoder layer, before → after
(per layer = the step's total over the layers; embedding, LM head and sampling land in it
too, a small share at these lengths). ``--top N`` also prints the N heaviest kernels of
each ``after`` run. With ``$OUT`` set, the table's numbers go to ``$OUT/profile_engine_step.json``.

    python3 -m benchmarks.profile_engine_step --model deepseek-v2-lite --input-len 8192 --kv-cache-dtype fp8

Correctness first: before timing, the first prompt's greedy token under both settings must
agree (a random model's logits are near-flat, so a disagreement is reported, not fatal,
together with the logits' largest difference).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections import defaultdict

import torch

from kernels.fused_glue import unfused_glue
from server import LLM, SamplingParams
from server.bench.throughput import materialize_model

CLASSES = ("gemm", "attention", "moe", "other")
# Kernel-name fragments, tried in this order (the first match wins; lower case).
ATTENTION_NAMES = ("sdpa", "fmha", "flash", "attention", "mla_decode", "_mla_", "batchprefill", "cudnn")
MOE_NAMES = ("_gate_up_kernel", "_down_kernel", "_sum_slots_kernel", "moe")
GEMM_NAMES = ("nvjet", "gemm", "cutlass", "xmma", "cublas", "_scaled_mm", "splitk", "matmul")


def kernel_class(name: str) -> str:
    n = name.lower()
    for cls, frags in (("attention", ATTENTION_NAMES), ("moe", MOE_NAMES), ("gemm", GEMM_NAMES)):
        if any(f in n for f in frags):
            return cls
    return "other"


def _device_events(prof):
    """(name, µs, launches) of every device kernel/memcpy/memset the profiler saw."""
    from torch.autograd import DeviceType

    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        yield evt.key, us, evt.count


def split(prof, num_layers: int) -> dict:
    """Per-class µs and launches per layer, plus the step's total ms."""
    us, launches = defaultdict(float), defaultdict(int)
    for name, t, count in _device_events(prof):
        cls = kernel_class(name)
        us[cls] += t
        launches[cls] += count
    total = sum(us.values())
    return dict(total_ms=total / 1e3,
                per_layer_us={c: us[c] / num_layers for c in CLASSES},
                launches_per_layer={c: launches[c] / num_layers for c in CLASSES})


def run_profiled(llm, prompts, max_tokens: int, fused: bool, top: int, title: str):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    span = min(1000, llm.engine.vocab_size - 10)
    warm = [[(t + 7919) % span + 10 for t in p[:64]] for p in prompts[:1]]  # no prefix shared with the prompts
    with contextlib.nullcontext() if fused else unfused_glue():
        llm.generate(prompt_token_ids=warm, sampling_params=params)  # compiles the kernels of this mode
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
            torch.cuda.synchronize()
    if top and fused:
        print(f"==== {title} (fused glue)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))
    return prof


def first_step(llm, prompt, fused: bool):
    """The engine's greedy first token for the prompt and its top-5 logprobs {token: logprob}."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    with contextlib.nullcontext() if fused else unfused_glue():
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
    return out.token_ids[0], out.logprobs[0].top


def check(llm, prompt) -> dict:
    tok_a, top_a = first_step(llm, prompt, fused=False)
    tok_b, top_b = first_step(llm, prompt, fused=True)
    common = set(top_a) & set(top_b)
    res = dict(greedy_token_before=tok_a, greedy_token_after=tok_b, agree=tok_a == tok_b, top5_overlap=len(common),
               max_logprob_diff_top5=max((abs(top_a[t] - top_b[t]) for t in common), default=None))
    print(f"correctness (first token, glue unfused vs fused): {res}", flush=True)
    return res


def table(rows: list[dict]) -> str:
    head = "| scenario | step ms | " + " | ".join(f"{c} µs/layer" for c in CLASSES) + " | launches/layer |"
    lines = [head, "|" + "---|" * (3 + len(CLASSES))]
    for r in rows:
        b, a = r["before"], r["after"]
        cells = [f"{b['per_layer_us'][c]:.0f} → {a['per_layer_us'][c]:.0f}" for c in CLASSES]
        nb, na = sum(b["launches_per_layer"].values()), sum(a["launches_per_layer"].values())
        lines.append(f"| {r['scenario']} | {b['total_ms']:.1f} → {a['total_ms']:.1f} | " + " | ".join(cells)
                     + f" | {nb:.0f} → {na:.0f} (other {b['launches_per_layer']['other']:.0f} → "
                     f"{a['launches_per_layer']['other']:.0f}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--top", type=int, default=0, help="also print the N heaviest kernels of each fused run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_engine_step needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    with materialize_model(args.model, args.num_layers) as model_dir:
        # Prefix caching off: the before and after runs of a scenario prefill the same prompts.
        llm = LLM(model_dir, device="cuda", kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.input_len + 64,
                  load_format="dummy", enable_prefix_caching=False)
        layers = llm.engine.model_config.num_hidden_layers
        vocab = llm.engine.vocab_size
        prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(4)]
        correctness = check(llm, prompts[0])
        scenarios = [(f"prefill {args.input_len}", prompts[:1], 1),
                     (f"3x{args.input_len} + 8 out", prompts[1:], 8)]
        rows = []
        for title, ps, max_tokens in scenarios:
            row = dict(scenario=title)
            for key, fused in (("before", False), ("after", True)):
                row[key] = split(run_profiled(llm, ps, max_tokens, fused, args.top, title), layers)
            rows.append(row)
            print(row, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "profile_engine_step.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), model=args.model, input_len=args.input_len,
                           kv_cache_dtype=args.kv_cache_dtype, layers=layers, correctness=correctness, rows=rows),
                      f, indent=1)
    print(f"per decoder layer ({layers} layers), before (torch glue) → after (fused glue kernels):")
    print(table(rows))


if __name__ == "__main__":
    main()
