"""Where a chunked-prefill step's host time goes in the prompt attention: a step of ``--layers``
layers, each one GEMM of about a real layer's GPU time plus the SDPA prefill backend's
``forward_varlen`` over the step's chunks, timed on the host clock (synchronized at the
step's ends) and with device events, for the chunk layouts continuous batching produces.

Layouts (V2-Lite heads: 16 x qk 192, v 128 padded to 192; 8192-token steps):

    one        one chunk from position 0, a new length every step (8192 - step)
    two        a prompt's tail after its cached context + the next prompt's head from 0, the
               split moving every step (the e2e workload's steady state)
    two-fixed  the same two chunks with the same lengths every step (a 300-row tail)
    two-700    the same with a 700-row tail

A step whose wall time is well above its device time has left the GPU idle while the host
was stuck (a synchronizing call, or a plan built on the host); the table says which layout
and which backend path does that. ``--paths``: ``current`` is ``SdpaPrefill.forward_varlen``
as served, ``flash-all`` every chunk of the step in one call of torch's varlen flash kernel,
``split-tails`` the served path with ``split_short_tails`` (a short chunk after context runs
with its prefix cut into pieces; ``kernels.mla_prefill.mla_prefill_after_context_split``).

    python3 -m benchmarks.bench_prefill_layout
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels.attention.base import PrefillMetadata
from kernels.attention.prefill import SdpaPrefill
from kernels.mla_prefill import mla_prefill_flash_varlen


def metadata_for(query_lens: list[int], context_lens: list[int], device) -> PrefillMetadata:
    qo = [0]
    kv = [0]
    for q, c in zip(query_lens, context_lens):
        qo.append(qo[-1] + q)
        kv.append(kv[-1] + q + c)
    as_dev = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return PrefillMetadata(row_start=0, query_lens=query_lens, context_lens=context_lens, qo_indptr=as_dev(qo),
                           kv_indptr=as_dev(kv), prefix_slots=None, kv_order=None)


def layout(kind: str, step: int, tokens: int) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens) of one step."""
    if kind == "one":
        return [tokens - step], [0]
    cut = 2 + 5 * step if kind == "two" else (700 if kind == "two-700" else 300)
    return [cut, tokens - cut], [tokens - cut, 0]


def run_step(path, backend, md, q, k, v, w, x, layers, scale):
    for _ in range(layers):
        torch.mm(x, w)  # the layer's GEMM work, ~3 ms
        if path in ("current", "split-tails"):
            backend[path].forward_varlen(q, k, v, md, scale)
        else:  # every chunk in one call of the varlen flash kernel
            mla_prefill_flash_varlen(q, k, v, md.qo_indptr, md.kv_indptr, md.max_query_len, md.max_kv_len, scale)


def timed_step(path, backend, md, q, k, v, w, x, layers, scale, queued: bool) -> tuple[float, float]:
    """(wall ms on the host clock, ms between the step's first and last device events). With
    ``queued`` the device first sleeps ~50 ms so the host can enqueue the whole step: the event
    time is then the GPU's own time unless something in the step waits for the device."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    if queued:
        torch.cuda._sleep(100_000_000)
    e0.record()
    run_step(path, backend, md, q, k, v, w, x, layers, scale)
    e1.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, e0.elapsed_time(e1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layouts", nargs="+", default=["one", "two", "two-fixed"])
    ap.add_argument("--paths", nargs="+", default=["current", "flash-all"])
    args = ap.parse_args()
    dev = torch.device("cuda")
    heads, dqk = 16, 192
    scale = dqk ** -0.5
    backend = {"current": SdpaPrefill(), "split-tails": SdpaPrefill(split_short_tails=True)}
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    w = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    rows = []
    for path in args.paths:
        for kind in args.layouts:
            for step in range(args.steps + 1):  # step 0 warms up
                ql, cl = layout(kind, step, args.tokens)
                md = metadata_for(ql, cl, dev)
                tq, tk = sum(ql), sum(q + c for q, c in zip(ql, cl))
                q = torch.randn(tq, heads, dqk, device=dev, dtype=torch.bfloat16)
                k = torch.randn(tk, heads, dqk, device=dev, dtype=torch.bfloat16)
                v = torch.randn(tk, heads, dqk, device=dev, dtype=torch.bfloat16)
                wall, _ = timed_step(path, backend, md, q, k, v, w, x, args.layers, scale, queued=False)
                _, gpu = timed_step(path, backend, md, q, k, v, w, x, args.layers, scale, queued=True)
                if step:
                    rows.append((path, kind, step, ql, cl, wall, gpu))
    print("\n| path | layout | step | chunks (context:tokens) | wall ms | GPU ms (queued) | wall - GPU |")
    print("|---|---|---:|---|---:|---:|---:|")
    for path, kind, step, ql, cl, wall, gpu in rows:
        chunks = " ".join(f"{c}:{q}" for q, c in zip(ql, cl))
        print(f"| {path} | {kind} | {step} | {chunks} | {wall:.1f} | {gpu:.1f} | {wall - gpu:.1f} |")

if __name__ == "__main__":
    main()
