"""MXFP8 GEMMs on one GPU: our CUDA C++ kernels (kernels/mxfp8_gemm_cuda.py: v1, the default,
and v2) and our Triton kernel (all promote per 32 of K) against cuBLAS' blockwise
``torch._scaled_mm`` (1×128 activations, 128×128 weights: the R1 path), at
DeepSeek-V4.1-Flash shapes, and the output projection (inverse RoPE → wo_a → wo_b) fused,
unfused and as HF's bf16 path, at TP1 and TP8 shard shapes.

    python3 -m benchmarks.bench_mxfp8                  # from the repo root (~4 min on an H200)
    python3 -m benchmarks.bench_mxfp8 --m 1 128 --o-proj-tokens --sweep --json out.json
    python3 -m benchmarks.bench_mxfp8 --m 1024 8192 --o-proj-tokens --skip-triton --cuda-variants

"v2 np" is v2's no-promotion diagnostic at v2's default cluster (the same pipeline without the
per-32 scales: wrong numbers, its time is the pipeline's ceiling). ``--cuda-variants`` also
times v2 in every CTA-cluster shape built (pairs along M share B's tile, along N A's, by TMA
multicast) and its diagnostic, in a second table. ``--skip-v2`` leaves v2 (and v2 np) out of
the first table.

Correctness is checked first (first 256 rows against the float32 references on the same
quantized operands). Each call is a CUDA-graph replay with the L2 emptied before it (a 256 MB
read), median over ~40 ms of replays (benchmarks/bench_mla_decode.py's ``time_call``), and
the median of three such rounds. "v1" and "v2" are the CUDA kernels at the same tiles and K
split (v1 is what the default backend runs on Hopper; "+quant" times the default backend with
its activation quantization), "triton" the Triton kernel at its default
tiles (or the best of ``--sweep``).
"GEMM" columns time the GEMM alone on pre-quantized inputs; "+quant" adds each path's
activation quantization (ours: MXFP8 per 32; scaled_mm: 1×128 per token, M padded to 16).
TFLOP/s = 2·M·N·K / time. The markdown tables come last.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.bench_mla_decode import time_call
from kernels.fp8 import quantize_weight_blocks
from kernels.fp8_gemm import fp8_block_linear
from kernels.fp8_quant_triton import quantize_per_token_group_triton
from kernels.mxfp8_gemm import (
    default_config,
    mxfp8_gemm,
    mxfp8_gemm_reference,
    mxfp8_linear,
)
from kernels.mxfp8_gemm_cuda import (
    CLUSTERS,
    NO_PROMOTION_CLUSTERS,
    cluster_fits,
    cuda_gemm_available,
    default_cuda_config,
)
from kernels.mxfp8_o_proj import inverse_rope_reference, mxfp8_o_proj, o_proj_reference
from kernels.mxfp8_quant_triton import quantize_mxfp8_triton
from kernels.weight_formats import dequantize_fp8_blocks, quantize_fp8_blocks

# (layer, N, K) of V4.1-Flash's linears on one GPU (TP1)
SHAPES = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wo_b", 5120, 8192)]
O_PROJ_TP = {"tp1": (64, 8), "tp8": (8, 1)}  # one rank's (heads, wo_a groups)
O_PROJ_DIMS = (1024, 512, 32, 5120)  # wo_a rank per group, head dim, rope pairs, hidden
MX_WEIGHT_BLOCK = (32, 32)  # V4.1's FP8 weight blocks, UE8M0 scales
CHECK_ROWS = 256
REPS = (5, 40)  # ms of warm-up, ms of timed replays
ROUNDS = 3
O_PROJ_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def timed(fn) -> float:
    """Median of ROUNDS rounds of graph-replay timing (seconds)."""
    return sorted(time_call(fn, REPS, use_graph=True)[0] for _ in range(ROUNDS))[ROUNDS // 2]


def sweep_configs(m: int, n: int, k: int) -> list[dict]:
    """Candidate tiles around the default (``--sweep``)."""
    base = default_config(m, n, k)
    out = [base]
    for bm in sorted({16, 64, base["BLOCK_M"]} if m <= 64 else {128, 256}):
        for bn in (64, 128, 256) if bm < 256 else (64, 128):
            for bk in (32, 128):
                for stages in (3, 4):
                    for split in sorted({1, base["SPLIT_K"]}):
                        c = dict(base, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages,
                                 num_warps=4 if bm < 64 else 8, SPLIT_K=split)
                        if c not in out and k % bk == 0 and (k // bk) % split == 0:
                            out.append(c)
    return out


def cuda_variants(x8, xs, w8, ws, m: int, n: int, k: int) -> dict:
    """v2's time (µs) in each cluster shape built that fits, and without promotion (``np``), at
    the default tiles and K split; a variant that fails prints why and is left out."""
    base = default_cuda_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    out = {}
    if base["consumers"] != 2:
        return out
    cases = [(f"v2 {cm}x{cn}", {"cluster": (cm, cn)}) for cm, cn in CLUSTERS if cluster_fits((cm, cn), n, 1)]
    cases += [(f"v2 np {cm}x{cn}", {"cluster": (cm, cn), "promote": False}) for cm, cn in NO_PROMOTION_CLUSTERS]
    for name, extra in cases:
        cfg = dict(base, kernel="v2", **extra)
        try:
            out[name] = timed(lambda cfg=cfg: mxfp8_gemm(x8, xs, w8, ws, config=cfg, backend="cuda")) * 1e6
        except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
            print(f"  M={m} N={n} K={k} {name} FAILED: {exc!r}", flush=True)
    return out


def bench_linear(layer: str, m: int, n: int, k: int, sweep: bool, skip_triton: bool = False,
                 variants: bool = False, skip_v2: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w8, ws = quantize_fp8_blocks(w, MX_WEIGHT_BLOCK)
    w8r, wsr = quantize_weight_blocks(w)  # R1's 128×128 fp32 scales
    wsr = wsr.float().contiguous()
    x8, xs = quantize_mxfp8_triton(x)
    pad = -m % 16
    xp = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
    xr8, xrs = quantize_per_token_group_triton(xp, 128, column_major_scales=True)
    r = min(m, CHECK_ROWS)
    row = {"layer": layer, "M": m, "N": n, "K": k}

    ref = mxfp8_gemm_reference(x8[:r], xs[:r], w8, ws, out_dtype=torch.float32)
    cuda = cuda_gemm_available()
    # the anchors first (scaled_mm, v1, Triton): a failing default kernel leaves them in the row
    y_mm = fp8_block_linear(x, w8r, wsr, backend="scaled_mm")
    row["err_scaled_mm_vs_x"] = rel_err(y_mm[:r], x[:r].float() @ w.t())
    row["mm_us"] = timed(lambda: torch._scaled_mm(xr8, w8r.t(), scale_a=xrs, scale_b=wsr.t(),
                                                  out_dtype=torch.bfloat16)) * 1e6
    row["mm_quant_us"] = timed(lambda: fp8_block_linear(x, w8r, wsr, backend="scaled_mm")) * 1e6
    row["v1_us"] = float("nan")
    if cuda:
        y1 = mxfp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, config={"kernel": "v1"}, backend="cuda")
        row["err_v1"] = rel_err(y1[:r], ref)
        row["v1_us"] = timed(lambda: mxfp8_gemm(x8, xs, w8, ws, config={"kernel": "v1"}, backend="cuda")) * 1e6
    if not skip_triton:
        row["err_triton"] = rel_err(mxfp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, backend="triton")[:r], ref)

    configs = [] if skip_triton else sweep_configs(m, n, k) if sweep else [default_config(m, n, k)]
    best = (float("nan"), None)
    for cfg in configs:
        try:
            t = timed(lambda cfg=cfg: mxfp8_gemm(x8, xs, w8, ws, config=cfg, backend="triton"))
        except Exception as exc:  # a candidate that does not compile or fit
            if not sweep:
                raise
            print(f"  {layer} M={m} {cfg} FAILED: {exc!r}", flush=True)
            continue
        if sweep:
            print(f"  {layer} M={m} {cfg} {t * 1e6:.1f} us", flush=True)
        if best[1] is None or t < best[0]:
            best = (t, cfg)
    row["triton_us"], row["triton_config"] = best[0] * 1e6, best[1]

    row["v2_us"] = row["v2_np_us"] = row["default_quant_us"] = float("nan")
    try:  # the default backend with its activation quantization (v1 on Hopper)
        row["err_default_vs_x"] = rel_err(mxfp8_linear(x[:r], w8, ws), x[:r].float() @ w.t())
        row["default_quant_us"] = timed(lambda: mxfp8_linear(x, w8, ws)) * 1e6
    except Exception as exc:  # noqa: BLE001 - the anchors above still make the row
        print(f"{layer} M={m} default MXFP8 linear FAILED: {exc!r}", flush=True)
    # v2 and v2 without promotion (Hopper only); each failure leaves the rest of the row
    kernels = (("v2", {"kernel": "v2"}), ("v2_np", {"kernel": "v2", "promote": False}))
    for name, cfg in kernels:
        if not cuda or skip_v2:
            continue
        try:
            if name != "v2_np":
                y = mxfp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, config=cfg, backend="cuda")
                row[f"err_{name}"] = rel_err(y[:r], ref)
                row[f"{name}_equals_v1"] = bool(torch.equal(y1, y))
            row[f"{name}_us"] = timed(lambda cfg=cfg: mxfp8_gemm(x8, xs, w8, ws, config=cfg, backend="cuda")) * 1e6
        except Exception as exc:  # noqa: BLE001
            row[f"{name}_error"] = repr(exc)
            print(f"{layer} M={m} {name} FAILED: {exc!r}", flush=True)
    if variants and cuda:
        row["variants_us"] = cuda_variants(x8, xs, w8, ws, m, n, k)
    if sweep and cuda:  # the CUDA kernel's tile heights and K splits
        base = default_cuda_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        stages = -(-k // 128)
        for consumers in (1, 2):
            for split in sorted({1, 2, base["SPLIT_K"], 2 * base["SPLIT_K"]}):
                if stages % split == 0:
                    cfg = {"consumers": consumers, "SPLIT_K": split}
                    t = timed(lambda cfg=cfg: mxfp8_gemm(x8, xs, w8, ws, config=cfg, backend="cuda")) * 1e6
                    print(f"  {layer} M={m} cuda {cfg} {t:.1f} us", flush=True)
    flops = 2.0 * m * n * k
    for name in ("v1", "v2", "v2_np", "mm", "triton"):
        row[f"{name}_tflops"] = flops / row[f"{name}_us"] / 1e6
    row["v1_over_mm"] = row["v1_tflops"] / row["mm_tflops"]
    row["v2_over_mm"] = row["v2_tflops"] / row["mm_tflops"]
    row["v2_np_over_mm"] = row["v2_np_tflops"] / row["mm_tflops"]
    row["v2_over_v1"] = row["v1_us"] / row["v2_us"]
    print(json.dumps(row), flush=True)
    return row


def bench_o_proj(tp: str, t: int) -> dict:
    """V4.1's output projection at one rank's shapes: the fused MXFP8 path (inverse RoPE in the
    quantization pass, z written as MXFP8 by wo_a's epilogue) against the same math unfused
    (torch inverse RoPE, quantization launches, bf16 z) and against HF's bf16 path."""
    heads, groups = O_PROJ_TP[tp]
    rank, d, half, hidden = O_PROJ_DIMS
    g = torch.Generator(device="cuda").manual_seed(t)
    o = torch.randn(t, heads, d, device="cuda", generator=g).bfloat16()
    ang = torch.rand(t, half, device="cuda", generator=g) * 1000
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    wa = quantize_fp8_blocks(torch.randn(groups * rank, heads * d // groups, device="cuda", generator=g) * 0.02,
                             MX_WEIGHT_BLOCK)
    wb = quantize_fp8_blocks(torch.randn(hidden, groups * rank, device="cuda", generator=g) * 0.02, MX_WEIGHT_BLOCK)
    wa16 = dequantize_fp8_blocks(*wa, MX_WEIGHT_BLOCK).bfloat16().reshape(groups, rank, -1)
    wa16 = wa16.transpose(1, 2)  # [g, Kg, R]
    wb16 = dequantize_fp8_blocks(*wb, MX_WEIGHT_BLOCK).bfloat16()

    def fused():
        return mxfp8_o_proj(o, cos, sin, wa, wb, groups)

    def unfused():
        op = inverse_rope_reference(o, cos, sin).reshape(t, -1)
        z = mxfp8_gemm(*quantize_mxfp8_triton(op), *wa, groups=groups)
        return mxfp8_gemm(*quantize_mxfp8_triton(z), *wb)

    def bf16():
        op = inverse_rope_reference(o, cos, sin).reshape(t, groups, -1)
        return torch.bmm(op.transpose(0, 1), wa16).transpose(0, 1).reshape(t, -1) @ wb16.t()

    r = min(t, CHECK_ROWS)
    ref = o_proj_reference(o[:r], cos[:r], sin[:r], wa, wb, groups)
    row = {"tp": tp, "T": t, "heads": heads, "groups": groups,
           "err_fused": rel_err(fused()[:r], ref), "err_unfused": rel_err(unfused()[:r], ref),
           "err_bf16_vs_ref": rel_err(bf16()[:r], ref),
           "fused_us": timed(fused) * 1e6, "unfused_us": timed(unfused) * 1e6, "bf16_us": timed(bf16) * 1e6}
    row["speedup"] = row["unfused_us"] / row["fused_us"]
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict], o_rows: list[dict]) -> str:
    lines = [f"MXFP8 GEMM vs blockwise _scaled_mm on {torch.cuda.get_device_name()} (CUDA-graph replays, cold L2; "
             "v2 np = v2 without promotion, wrong numbers: the pipeline's ceiling)",
             "", ("| layer | M | N | K | v1 µs | v2 µs | v2 np µs | triton µs | scaled_mm µs | v1 TFLOP/s |"
                  " v2 TFLOP/s | v2 np TFLOP/s | scaled_mm TFLOP/s | v1/mm | v2/mm | v2 np/mm | v2/v1 |"
                  " default+quant µs | scaled_mm+quant µs | v2 rel. err | v2 = v1 |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['M']} | {r['N']} | {r['K']} | {r['v1_us']:.1f} | {r['v2_us']:.1f} | "
                     f"{r['v2_np_us']:.1f} | {r['triton_us']:.1f} | {r['mm_us']:.1f} | "
                     f"{r['v1_tflops']:.0f} | {r['v2_tflops']:.0f} | {r['v2_np_tflops']:.0f} | {r['mm_tflops']:.0f} | "
                     f"{r['v1_over_mm']:.2f} | {r['v2_over_mm']:.2f} | {r['v2_np_over_mm']:.2f} | "
                     f"{r['v2_over_v1']:.2f} | {r['default_quant_us']:.1f} | {r['mm_quant_us']:.1f} | "
                     f"{r.get('err_v2', float('nan')):.1e} | {r.get('v2_equals_v1', '-')} |")
    with_variants = [r for r in rows if r.get("variants_us")]
    if with_variants:
        names = sorted({name for r in with_variants for name in r["variants_us"]})
        lines += ["", "v2 by CTA cluster (along M x along N; TMA multicast of the shared operand) and without "
                  "promotion (np: the pipeline's ceiling), TFLOP/s; scaled_mm for reference", "",
                  "| layer | M | " + " | ".join(names) + " | scaled_mm |", "|---|---|" + "---|" * (len(names) + 1)]
        for r in with_variants:
            flops = 2.0 * r["M"] * r["N"] * r["K"]
            cells = [f"{flops / r['variants_us'][n] / 1e6:.0f}" if n in r["variants_us"] else "-" for n in names]
            lines.append(f"| {r['layer']} | {r['M']} | " + " | ".join(cells) + f" | {r['mm_tflops']:.0f} |")
    if o_rows:
        lines += ["", ("o_proj (inverse RoPE → wo_a → wo_b, V4.1-Flash, one rank): fused MXFP8 vs unfused MXFP8 "
                  "vs HF's bf16 path"), "", "| TP | T | fused µs | unfused µs | speedup | bf16 µs | fused err |",
                  "|---|---|---|---|---|---|---|"]
        for r in o_rows:
            lines.append(f"| {r['tp']} | {r['T']} | {r['fused_us']:.1f} | {r['unfused_us']:.1f} | {r['speedup']:.2f} | "
                         f"{r['bf16_us']:.1f} | {r['err_fused']:.1e} |")
        for tp in sorted({r["tp"] for r in o_rows}):
            worst = min((r for r in o_rows if r["tp"] == tp), key=lambda r: r["speedup"])
            lines.append(f"\n{tp}: slowest fused/unfused speedup {worst['speedup']:.2f} at T={worst['T']}")
    prefill = [r for r in rows if r["M"] >= 1024]
    if prefill:
        worst = min(prefill, key=lambda r: r["v1_over_mm"] if r["v1_over_mm"] == r["v1_over_mm"] else -1.0)
        lines.append(f"\nprefill (M ≥ 1024): lowest v1 (the default)/scaled_mm {worst['v1_over_mm']:.2f} "
                     f"({worst['layer']} M={worst['M']}; target ≥ 0.85)")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 128, 1024, 8192])
    ap.add_argument("--o-proj-tokens", type=int, nargs="*", default=O_PROJ_TOKENS)
    ap.add_argument("--tp", nargs="*", default=sorted(O_PROJ_TP), choices=sorted(O_PROJ_TP))
    ap.add_argument("--sweep", action="store_true",
                    help="also time ~20 Triton tile configs and the CUDA kernel's tile heights and K splits per "
                         "shape (minutes: pair with a short --m)")
    ap.add_argument("--skip-triton", action="store_true", help="leave the Triton GEMM out (saves its compiles)")
    ap.add_argument("--cuda-variants", action="store_true",
                    help="also time v2 in each CTA-cluster shape and without promotion (128-row tiles)")
    ap.add_argument("--skip-v2", action="store_true", help="leave v2 and its diagnostic out of the first table")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows, o_rows = [], []
    for layer, n, k in SHAPES:
        for m in args.m:
            try:
                rows.append(bench_linear(layer, m, n, k, args.sweep, args.skip_triton, args.cuda_variants,
                                         args.skip_v2))
            except Exception as exc:  # noqa: BLE001 - one failing shape must not hide the others
                print(f"{layer} M={m} FAILED: {exc!r}", flush=True)
    for tp in args.tp:
        for t in args.o_proj_tokens:
            try:
                o_rows.append(bench_o_proj(tp, t))
            except Exception as exc:  # noqa: BLE001
                print(f"o_proj {tp} T={t} FAILED: {exc!r}", flush=True)
    path = args.json or (os.path.join(os.environ["OUT"], "mxfp8.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gemm": rows, "o_proj": o_rows}, f, indent=1)
    print(markdown(rows, o_rows))


if __name__ == "__main__":
    main()
