"""How much of a decode phase the GPU sits idle: the host's share that async scheduling does
not hide. Runs ``--batch`` requests of ``--input-len`` random tokens to ``--output-len`` tokens
on a preset's shape (random weights), profiles the decode steps after the prompts are in
(torch.profiler, CUDA activity), and reports from the kernel timeline: the span, the union of
kernel intervals (busy), the idle share, the largest gaps, and a Chrome trace for a viewer.

    python3 -m benchmarks.trace_decode_gaps --model deepseek-v2-lite --kv-cache-dtype fp8 \\
        --batch 96 --input-len 1024 --output-len 64 [--no-async-scheduling] [--trace $OUT/decode.json]

Nothing is asserted on time; the numbers go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from server import LLM, SamplingParams
from server.bench.throughput import materialize_model


def kernel_intervals(trace_path: str) -> list[tuple[float, float]]:
    """(start µs, end µs) of every GPU kernel and memcpy/memset in a Chrome trace, sorted."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(spans)


def idle_report(spans: list[tuple[float, float]], top: int = 5) -> dict:
    """Span, busy time (union of intervals), idle share and the ``top`` largest gaps, in µs."""
    if not spans:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_share": 0.0, "largest_gaps_us": [], "num_gaps_over_20us": 0}
    busy, gaps = 0.0, []
    start, end = spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = max(e for _, e in spans) - spans[0][0]
    return {"span_us": span, "busy_us": busy, "idle_share": 1 - busy / span if span else 0.0,
            "largest_gaps_us": sorted(gaps, reverse=True)[:top], "num_gaps_over_20us": sum(g > 20 for g in gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--device", default="cuda", help="cpu only checks the script (no kernel timeline there)")
    ap.add_argument("--trace", default=None, help="Chrome trace path (default: $OUT/decode_trace.json or a temp file)")
    args = ap.parse_args()
    if args.output_len < 4:
        ap.error("--output-len: at least 4 (the first tokens are the prefill steps')")
    g = torch.Generator().manual_seed(0)
    with materialize_model(args.model, args.num_layers) as model_dir:
        llm = LLM(model_dir, device=args.device, kv_cache_dtype=args.kv_cache_dtype, load_format="dummy",
                  max_model_len=args.input_len + args.output_len + 64, async_scheduling=args.async_scheduling,
                  max_num_seqs=max(args.batch, 1))
        vocab = llm.engine.vocab_size
        prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.batch)]
        warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        llm.generate(prompt_token_ids=[p[:64] for p in prompts], sampling_params=warm)
        # Prefill everything first (1 token each), so the profiled run is decode steps only
        # beyond its first step: prefix caching turns the second run's prompts into hits.
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, top_p=0.95)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
            sync()
        out_dir = os.environ.get("OUT")
        path = args.trace or (os.path.join(out_dir, "decode_trace.json") if out_dir
                              else os.path.join(tempfile.mkdtemp(), "decode_trace.json"))
        prof.export_chrome_trace(path)
    spans = kernel_intervals(path)
    rep = idle_report(spans)
    steps = args.output_len - 1
    print(f"decode of {args.batch} requests x {args.output_len} tokens ({args.kv_cache_dtype} KV, async "
          f"{'on' if args.async_scheduling else 'off'}): span {rep['span_us'] / 1e3:.1f} ms over ~{steps} steps "
          f"({rep['span_us'] / 1e3 / steps:.2f} ms/step), GPU busy {rep['busy_us'] / 1e3:.1f} ms, "
          f"idle {100 * rep['idle_share']:.1f} %; largest gaps (µs): "
          + ", ".join(f"{x:.0f}" for x in rep["largest_gaps_us"]) + f"; gaps > 20 µs: {rep['num_gaps_over_20us']}")
    print(f"trace: {path}")
    if out_dir:
        with open(os.path.join(out_dir, "decode_gaps.json"), "w") as f:
            json.dump({"args": vars(args), **rep}, f, indent=1)


if __name__ == "__main__":
    main()
