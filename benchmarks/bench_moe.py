"""Routed-expert compute on one GPU: grouped_mm bf16, the Triton MoE in bf16, today's FP8 path
(dequantize all local experts to bf16 every call, then grouped_mm) and the Triton FP8 MoE that
reads e4m3 weights directly.

    python3 -m benchmarks.bench_moe [--quick] [--t 1 8 ...] [--shapes v2-lite r1-tp8 r1-ep8]
                                    [--sweep-configs] [--output-json OUT.json]

Shapes (E_local, H, I, top-k, expert_offset, E_global): DeepSeek-V2-Lite (64, 2048, 1408, 6,
0, 64); R1 under TP8 (256, 7168, 256, 8, 0, 256: every expert, intermediate split 8 ways); R1
under EP8, rank 0's 32 of 256 whole experts (32, 7168, 2048, 8, 0, 256: ~1/8 of the choices
are local). Routing is uniform random top-k over E_global, weights U(0, 1).

L2: the H200's 50 MB L2 holds e.g. the 8 FP8 experts one R1 token hits (44 MB), and a real
model reads each layer's experts cold. So every variant cycles through ROUTING_SETS different
routings (the graph unrolls the calls, each captured with the next set): consecutive calls hit
different experts and weights come from HBM, as in a forward pass.

Timing: CUDA-graph replay median (``triton.testing.do_bench_cudagraph``), so small-T calls
measure GPU time and not Python/launch overhead; the whole call is timed (routing sort, the
activation quantization for FP8, both GEMMs, the final sum). "TB/s" is effective weight
bandwidth: the bytes of the *distinct local experts hit* in the variant's storage format (bf16:
2 B/weight; FP8: 1 B/weight + block scales; for today's dequant path also the FP8 bytes, the
minimum it must read — it actually reads every local expert and writes them back in bf16) over
the time. Relative error is against ``moe_experts_reference`` in fp32 on the dequantized FP8
weights (the bf16 weights are those dequantized weights rounded to bf16), so FP8 variants show
their activation quantization error (~3-5 %) and bf16 variants their rounding (~1e-3).
``--sweep-configs`` also times every row of ``kernels.moe_triton.CONFIG_TABLE`` forced, to
check the regime thresholds of ``default_config``; ``--tiles`` times the candidate tiles of
``TILE_CANDIDATES`` (prefill sizes: many rows per expert), to pick that regime's row, e.g.

    python3 -m benchmarks.bench_moe --shapes v2-lite r1-ep8 --t 2048 8192 --tiles

``--tma`` times the TMA-descriptor kernels (``kernels/moe_triton_tma.py``) of ``TMA_CANDIDATES``
against the pointer-load kernels with the same tiles (``[today]``: the many-rows regime before
the TMA path), both dtypes, and prints their table last, e.g.

    python3 -m benchmarks.bench_moe --shapes v2-lite r1-ep8 --t 2048 8192 --tma
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch


from kernels.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from kernels.moe import moe_experts_grouped, moe_experts_reference
from kernels.moe_triton import (CONFIG_TABLE, MoEConfig, align_slots_to_blocks, default_config,
                                moe_experts_fp8_triton, moe_experts_triton)

SHAPES = {  # name: (E_local, H, I, k, expert_offset, E_global)
    "v2-lite": (64, 2048, 1408, 6, 0, 64),
    "r1-tp8": (256, 7168, 256, 8, 0, 256),
    "r1-ep8": (32, 7168, 2048, 8, 0, 256),
}
T_ALL = [1, 8, 32, 128, 512, 2048]
T_QUICK = [1, 32, 512]
VARIANTS = ["grouped-bf16", "triton-bf16", "dequant+grouped-fp8", "triton-fp8"]
ROUTING_SETS = 8
# MoEConfig(block_m, block_n, block_n_down, block_k, group_m, num_warps, num_stages) candidates for
# the many-rows regime on the pointer-load kernels; the first of each list is CONFIG_TABLE's tiles.
TILE_CANDIDATES = {
    "bf16": [MoEConfig(128, 128, 128, 64, 8, 8, 3), MoEConfig(128, 128, 128, 64, 8, 8, 4),
             MoEConfig(128, 64, 128, 64, 8, 4, 4), MoEConfig(128, 128, 256, 64, 8, 8, 3),
             MoEConfig(64, 128, 128, 64, 8, 4, 4), MoEConfig(128, 128, 128, 64, 16, 8, 3),
             MoEConfig(256, 64, 128, 64, 8, 8, 3), MoEConfig(128, 128, 64, 64, 8, 4, 4)],
    "fp8": [MoEConfig(64, 128, 128, 128, 8, 8, 3), MoEConfig(64, 128, 128, 128, 8, 8, 4),
            MoEConfig(64, 128, 256, 128, 8, 8, 3), MoEConfig(64, 128, 64, 128, 8, 4, 4),
            MoEConfig(64, 128, 128, 128, 16, 8, 3)],
}
# TMA-descriptor candidates for the many-rows regime (MoEConfig(..., tma, persistent, tma_a)); the first of
# each list has CONFIG_TABLE's tiles (that row itself runs the pointer kernels: `[today]`).
TMA_CANDIDATES = {
    "bf16": [MoEConfig(128, 128, 128, 64, 8, 8, 3, tma=True),
             MoEConfig(128, 128, 128, 64, 8, 8, 3, tma=True, persistent=True),
             MoEConfig(128, 128, 128, 64, 8, 8, 4, tma=True),
             MoEConfig(128, 128, 256, 64, 8, 8, 3, tma=True),
             MoEConfig(128, 128, 128, 64, 8, 8, 3, tma=True, tma_a=False)],
    "fp8": [MoEConfig(64, 128, 128, 128, 8, 8, 3, tma=True),
            MoEConfig(64, 128, 128, 128, 8, 8, 3, tma=True, persistent=True),
            MoEConfig(64, 128, 128, 128, 8, 8, 4, tma=True),
            MoEConfig(64, 128, 128, 128, 8, 8, 3, tma=True, tma_a=False)],
}
DEVICE = "cuda"  # a module constant so the bench's plumbing can be dry-run elsewhere


def bench(fn) -> float:
    """Seconds per call, median of CUDA-graph replays (plain events if capture fails)."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    try:
        ms = do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report and fall back, the number is still useful
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing with events)", flush=True)
        ms = do_bench(fn, rep=100, return_mode="median")
    return ms * 1e-3


def quantize_stacked(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] → e4m3 [E, N, K] and scale_inv [E, N/128, ⌈K/128⌉] (N a multiple of 128, so
    no block straddles two experts and the 2-D quantizer can take the experts stacked)."""
    e, n, k = w.shape
    assert n % 128 == 0, n
    w8, s = quantize_weight_blocks(w.reshape(e * n, k))
    return w8.view(e, n, k), s.view(e, n // 128, -1)


def make_experts(e: int, h: int, inter: int, seed: int) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    ws = {}
    for name, shape in (("w13", (e, 2 * inter, h)), ("w2", (e, h, inter))):
        w = torch.randn(*shape, device=DEVICE, generator=g).mul_(0.02)
        w8, s = quantize_stacked(w)
        del w
        ws[name + "_8"], ws[name + "_s"] = w8, s
        ws[name + "_f32"] = dequantize_weight_blocks(w8, s)  # the reference's weights
        ws[name + "_bf16"] = ws[name + "_f32"].to(torch.bfloat16)
    return ws


def routing(t: int, k: int, e_global: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    ids = torch.rand(t, e_global, device=DEVICE, generator=g).topk(k, dim=-1).indices
    return torch.rand(t, k, device=DEVICE, generator=g), ids


def tile_name(c: MoEConfig) -> str:
    load = ("+tma" + ("-persistent" if c.persistent else "") + ("" if c.tma_a else "-gatherA")) if c.tma else ""
    return (f"m{c.block_m}n{c.block_n}d{c.block_n_down}k{c.block_k}g{c.group_m}"
            f"w{c.num_warps}s{c.num_stages}{load}")


def variant_fns(ws: dict, x, off, sweep: bool, tiles: bool = False, tma: bool = False, k: int = 1) -> dict:
    """name → fn(wts, ids) for each variant (and each forced config with ``sweep``, ``tiles``, ``tma``)."""
    w13b, w2b, w13_8, s13, w2_8, s2 = (ws[n] for n in ("w13_bf16", "w2_bf16", "w13_8", "w13_s", "w2_8", "w2_s"))

    def today_fp8(wts, ids):  # model/layers/moe.py before the Triton path: dequantize, then grouped_mm
        return moe_experts_grouped(x, dequantize_weight_blocks(w13_8, s13, dtype=torch.bfloat16),
                                   dequantize_weight_blocks(w2_8, s2, dtype=torch.bfloat16), wts, ids, off)

    fns = {
        "grouped-bf16": lambda wts, ids: moe_experts_grouped(x, w13b, w2b, wts, ids, off),
        "triton-bf16": lambda wts, ids: moe_experts_triton(x, w13b, w2b, wts, ids, off),
        "dequant+grouped-fp8": today_fp8,
        "triton-fp8": lambda wts, ids: moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, off),
    }
    if sweep:
        for _, bcfg, fcfg in CONFIG_TABLE:
            fns[f"triton-bf16[bm{bcfg.block_m}]"] = (
                lambda wts, ids, c=bcfg: moe_experts_triton(x, w13b, w2b, wts, ids, off, c))
            fns[f"triton-fp8[bm{fcfg.block_m}]"] = (
                lambda wts, ids, c=fcfg: moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, off, c))
    if tiles:
        for c in TILE_CANDIDATES["bf16"]:
            fns[f"triton-bf16[{tile_name(c)}]"] = (
                lambda wts, ids, c=c: moe_experts_triton(x, w13b, w2b, wts, ids, off, c))
        for c in TILE_CANDIDATES["fp8"]:
            fns[f"triton-fp8[{tile_name(c)}]"] = (
                lambda wts, ids, c=c: moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, off, c))
    if tma:
        slots = x.shape[0] * k
        for dtype, fp8 in (("bf16", False), ("fp8", True)):
            default = default_config(slots, w13b.shape[0], fp8)
            today = dataclasses.replace(default, tma=False, persistent=False)
            cands = [today] + [c for c in TMA_CANDIDATES[dtype] if c != default]
            for c in cands:
                name = f"triton-{dtype}[today]" if c is today else f"triton-{dtype}[{tile_name(c)}]"
                if fp8:
                    fns[name] = lambda wts, ids, c=c: moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, off, c)
                else:
                    fns[name] = lambda wts, ids, c=c: moe_experts_triton(x, w13b, w2b, wts, ids, off, c)
    return fns


def cycling(fn, sets: list):
    """A no-argument call that uses the next routing set each time (see the L2 note above)."""
    state = {"i": 0}

    def call():
        wts, ids = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(wts, ids)

    return call


def run_shape(name: str, ts: list[int], sweep: bool, tiles: bool = False, tma: bool = False) -> list[dict]:
    e, h, inter, k, off, eg = SHAPES[name]
    ws = make_experts(e, h, inter, seed=e + h)
    per_expert = 3 * inter * h  # weights per expert (w13 + w2)
    scale_bytes = 4 * (ws["w13_s"][0].numel() + ws["w2_s"][0].numel())
    rows = []
    for t in ts:
        x = torch.randn(t, h, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(t)).bfloat16()
        sets = [routing(t, k, eg, seed=t * ROUTING_SETS + i) for i in range(ROUTING_SETS)]
        hits = []
        for _, ids in sets:
            local = ids.flatten() - off
            hits.append(local[(local >= 0) & (local < e)].unique().numel())
        hit = sum(hits) / len(hits)  # distinct local experts read per call, on average
        owned = sum(int(((i - off >= 0) & (i - off < e)).sum()) for _, i in sets) / len(sets)  # local slots
        wts, ids = sets[0]
        ref = moe_experts_reference(x.float(), ws["w13_f32"], ws["w2_f32"], wts, ids, off)
        ref_norm = ref.double().norm().item()
        align = bench(cycling(lambda w_, i_: align_slots_to_blocks(i_, e, off, default_config(t * k, e, True).block_m),
                              sets))
        print(f"{name:8s} T={t:5d} {'(expert sort alone)':24s} {align * 1e6:9.1f} us", flush=True)
        for variant, fn in variant_fns(ws, x, off, sweep, tiles, tma, k).items():
            out = fn(wts, ids)
            err = (out.double() - ref.double()).norm().item() / ref_norm if ref_norm > 0 else float("nan")
            sec = bench(cycling(fn, sets))
            fp8 = "fp8" in variant
            wbytes = hit * (per_expert * (1 if fp8 else 2) + (scale_bytes if fp8 else 0))
            row = dict(shape=name, E=e, H=h, I=inter, k=k, T=t, variant=variant, us=sec * 1e6, align_us=align * 1e6,
                       experts_hit=hit, weight_bytes=wbytes, tbs=wbytes / sec / 1e12, relerr=err,
                       tflops=6 * h * inter * owned / sec / 1e12)
            rows.append(row)
            print(f"{name:8s} T={t:5d} {variant:24s} {row['us']:9.1f} us  {row['tbs']:6.2f} TB/s  "
                  f"rel.err {err:.2e}  (experts hit {hit:.1f})", flush=True)
        del x, sets, wts, ids, ref, out
    del ws
    torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> str:
    """One line per (shape, T): µs of each variant, TB/s of triton-fp8, speed-up vs today, and
    the time of the expert sort alone (included in the Triton variants' µs)."""
    lines = ["| shape | T | " + " | ".join(f"{v} µs" for v in VARIANTS)
             + " | triton-fp8 TB/s | fp8 speed-up vs today | rel.err bf16 / fp8 | expert sort µs |",
             "|---" * (len(VARIANTS) + 6) + "|"]
    keys = dict.fromkeys((r["shape"], r["T"]) for r in rows)
    for shape, t in keys:
        by = {r["variant"]: r for r in rows if r["shape"] == shape and r["T"] == t}
        us = " | ".join(f"{by[v]['us']:.1f}" if v in by else "-" for v in VARIANTS)
        tri, today = by.get("triton-fp8"), by.get("dequant+grouped-fp8")
        speed = f"{today['us'] / tri['us']:.1f}x" if tri and today else "-"
        errs = "/".join(f"{by[v]['relerr']:.1e}" if v in by else "-" for v in ("triton-bf16", "triton-fp8"))
        tbs = f"{tri['tbs']:.2f}" if tri else "-"
        sort_us = next(iter(by.values()))["align_us"]
        lines.append(f"| {shape} | {t} | {us} | {tbs} | {speed} | {errs} | {sort_us:.1f} |")
    return "\n".join(lines)


def tile_summary(rows: list[dict]) -> str:
    """Per (shape, T, dtype): each tile candidate's µs and its speed against today's config."""
    lines = ["| shape | T | dtype | tile | µs | vs default |", "|---|---|---|---|---|---|"]
    for shape, t in dict.fromkeys((r["shape"], r["T"]) for r in rows):
        for dtype in ("bf16", "fp8"):
            base = next((r for r in rows if r["shape"] == shape and r["T"] == t and r["variant"] == f"triton-{dtype}"),
                        None)
            cands = sorted((r for r in rows if r["shape"] == shape and r["T"] == t
                            and r["variant"].startswith(f"triton-{dtype}[m") and "+tma" not in r["variant"]),
                           key=lambda r: r["us"])
            for r in cands:
                ratio = f"{base['us'] / r['us']:.2f}x" if base else "-"
                tile = r["variant"].split("[")[1][:-1]
                lines.append(f"| {shape} | {t} | {dtype} | {tile} | {r['us']:.1f} | {ratio} |")
    return "\n".join(lines)


def tma_summary(rows: list[dict]) -> str:
    """Per (shape, T, dtype): today's pointer kernels, the default (first TMA candidate) and the
    other TMA candidates; µs of the whole call, its TFLOP/s (6·H·I per owned slot) and the speed-up
    against today's."""
    lines = ["| shape | T | dtype | kernels | µs | TFLOP/s | vs today | rel.err |", "|---|---|---|---|---|---|---|---|"]
    for shape, t in dict.fromkeys((r["shape"], r["T"]) for r in rows):
        for dtype in ("bf16", "fp8"):
            by = {r["variant"]: r for r in rows if r["shape"] == shape and r["T"] == t}
            base = by.get(f"triton-{dtype}[today]")
            cands = [by[v] for v in by if v == f"triton-{dtype}" or (v.startswith(f"triton-{dtype}[") and "+tma" in v)]
            for r in [base] * (base is not None) + cands:
                label = r["variant"].removeprefix(f"triton-{dtype}") or "[default]"
                ratio = f"{base['us'] / r['us']:.2f}x" if base else "-"
                lines.append(f"| {shape} | {t} | {dtype} | {label} | {r['us']:.1f} | {r['tflops']:.0f} | {ratio} | "
                             f"{r['relerr']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"T in {T_QUICK} only")
    ap.add_argument("--t", type=int, nargs="+", help=f"token counts (default {T_ALL})")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--sweep-configs", action="store_true", help="also time each CONFIG_TABLE row forced")
    ap.add_argument("--tiles", action="store_true", help="also time the many-rows tile candidates (TILE_CANDIDATES)")
    ap.add_argument("--tma", action="store_true", help="also time the TMA kernels (TMA_CANDIDATES) against today's")
    ap.add_argument("--output-json", metavar="PATH")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU")
    ts = args.t or (T_QUICK if args.quick else T_ALL)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    rows = []
    for name in args.shapes:
        rows += run_shape(name, ts, args.sweep_configs, args.tiles, args.tma)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    print()
    print(summary(rows))
    if args.tiles:
        print()
        print(tile_summary(rows))
    if args.tma:
        print()
        print(tma_summary(rows))


if __name__ == "__main__":
    main()
