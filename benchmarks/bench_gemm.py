"""Block-FP8 linears on one GPU: the fused activation quantization, cuBLAS blockwise
``_scaled_mm`` behind it, the Triton block-FP8 GEMM fallback, and a bf16 matmul baseline.

    python3 -m benchmarks.bench_gemm [--m 16 256 4096] [--json OUT] [--markdown OUT]

Shapes are DeepSeek-V3's (N, K): 7168 x 2048 (the first blockwise ``_scaled_mm`` measurement,
benchmarks/KERNEL_NOTES.md), q_b_proj, kv_a_proj
(N = 576, the Triton path), o_proj. Relative error is against float64 on the same
quantized operands (first 64 rows), so it is the GEMM's own error.
"""

from __future__ import annotations

import argparse
import json

import torch


from kernels.fp8 import dequantize_per_token_group, dequantize_weight_blocks, quantize_weight_blocks
from kernels.fp8_gemm import choose_backend, fp8_block_gemm_triton, fp8_block_linear
from kernels.fp8_quant_triton import quantize_per_token_group_triton

SHAPES = [(7168, 2048), (24576, 1536), (576, 7168), (7168, 16384)]
CHECK_ROWS = 64


def bench(fn) -> float:
    """GPU time per call from CUDA-graph replays: small-M GEMMs last less than the Python
    and Triton launch overhead, which plain event timing would measure instead."""
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


def run(m: int, n: int, k: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w8, sw = quantize_weight_blocks(w)
    w16 = w.to(torch.bfloat16)
    x8, sx = quantize_per_token_group_triton(x)
    r = min(m, CHECK_ROWS)
    ref = (dequantize_per_token_group(x8[:r], sx[:r]).double()
           @ dequantize_weight_blocks(w8, sw, dtype=torch.float64).t())
    flops = 2.0 * m * n * k
    rows = []

    def add(name, fn, out=None, bytes_moved=None):
        t = bench(fn)
        row = dict(M=m, N=n, K=k, variant=name, us=t * 1e6, tflops=flops / t / 1e12)
        if out is not None:
            row["relerr"] = ((out[:r].double() - ref).norm() / ref.norm()).item()
        if bytes_moved is not None:
            row["tbs"] = bytes_moved / t / 1e12
        rows.append(row)
        print(" ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()), flush=True)

    path = choose_backend(True, n, k, (128, 128))
    add(f"ours({path})", lambda: fp8_block_linear(x, w8, sw), fp8_block_linear(x, w8, sw))
    add("act-quant", lambda: quantize_per_token_group_triton(x, column_major_scales=path == "scaled_mm"),
        bytes_moved=m * k * 3 + m * (k // 128) * 4)
    if path == "scaled_mm":
        x8c, sxc = quantize_per_token_group_triton(x, column_major_scales=True)
        swf = sw.float().contiguous()
        mm = lambda: torch._scaled_mm(x8c, w8.t(), scale_a=sxc, scale_b=swf.t(), out_dtype=torch.bfloat16)  # noqa: E731
        add("scaled_mm-only", mm, mm())
    tri = lambda: fp8_block_gemm_triton(x8, sx, w8, sw.float().contiguous(), torch.bfloat16)  # noqa: E731
    add("triton-gemm-only", tri, tri())
    add("bf16-matmul", lambda: x @ w16.t())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[16, 256, 4096])
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    rows = []
    for n, k in SHAPES:
        for m in args.m:
            rows += run(m, n, k)
    lines = ["| M | N | K | variant | µs | TFLOP/s | rel. err |", "|---|---|---|---|---|---|---|"]
    for r_ in rows:
        err = f"{r_['relerr']:.1e}" if "relerr" in r_ else ""
        lines.append(f"| {r_['M']} | {r_['N']} | {r_['K']} | {r_['variant']} | {r_['us']:.1f} "
                     f"| {r_['tflops']:.0f} | {err} |")
    table = "\n".join(lines) + "\n"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table)


if __name__ == "__main__":
    main()
