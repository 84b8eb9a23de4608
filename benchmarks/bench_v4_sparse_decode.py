"""V4 / V4.1 sparse FP8 decode: our Triton and CUDA C++ kernels vs FlashMLA's SM90 sparse decode on
the same MODEL1 tensors, and on V4.1's records (``--records v41``), in one process.

Each case: B requests x s_q query tokens x H heads; per query token 128 window rows (a cache
of 64-record pages) plus top-k compressed entries picked at random from 4096 per request (a
second cache). Both kernels are first checked against the float64 reference on the first
requests (relative error of out, max |Δ lse|), then timed as CUDA-graph replays with the L2
emptied before each (a 256 MB read), median over ``--reps`` ms of replays. FLOPs = 2·B·s_q·H·(128 + k)·1024
(FlashMLA's count); bytes = the records each query token gathers (584 B each) + q + out.
FlashMLA takes 64 or 128 heads: at 8 and 16 heads it runs padded to 64 (its time is what a
server would pay). FlashMLA is used when its build is at ``.flashmla/`` (``--flashmla DIR``; or importable),
else skipped.

    python3 benchmarks/bench_v4_sparse_decode.py [--quick] [--sweep] [--reps 30] [--heads 8 16]
        [--topk 512 2048] [--s-q 1] [--variants triton cuda cuda_v2 cuda_v3] [--records v4 v41]
        [--diagnostics]

``--variants`` picks our kernels (default all): ``triton`` (its default config, and the sweep),
``cuda`` (kernels/v4_sparse_decode_cuda.py, variant v1), ``cuda_v2`` (variant v2; at 65-128
heads also ``cuda_v2_nocluster``, its two head blocks as independent CTAs), ``cuda_v3`` (variant
v3: v2 with the tokens2 kernel up to 16 heads) — each checked, then timed, like the others.
``--diagnostics`` adds v3's timing diagnostics up to 16 heads on V4 records (``cuda_v3_nopf``: no
L2 prefetches of the next tile; ``cuda_v3_fence``: no prefetches and the tokens kernel's proxy
fence back in the loop, to compare with nopf; ``cuda_v3_nohbm``: every record from an L1-resident
zero record, the loop's pace without HBM, wrong numbers). Targets (the last column):
at 64+ heads ≥ 1.2× FlashMLA's TFLOP/s, at up to 16 heads ≤ 1/3 of its time and ≥ 80 % of the HBM
roofline for the bytes read (HBM peak by device name: H100 3.35 TB/s, else the H200's 4.8).

``--records v41``: the same cases on V4.1's records (window rows 528 B: e4m3 with a UE8M0 scale per 32
dims; entries 288 B: e2m1 with an e4m3 scale per 16 dims) in pages of 64, for ``triton`` and
``cuda_v2`` (v1 and FlashMLA read MODEL1 records only: FlashMLA's V4.1 record formats are its SM100
kernels'), with bytes = 128 · 528 + top-k · 288 per query token; its own table, whose last column is
the time over that of V4 records on the same shape (``cuda_v2``, when both ran in the process).

With ``cuda_v3`` a last, short table compares the two tokens-major kernels (up to 16 heads) per
record family: v2 µs, v3 µs, their ratio, v3's HBM %, the diagnostics, FlashMLA's time over v3's.

The main columns are the default config (what ``auto`` runs); with ``--sweep`` every variant of
``SWEEP`` and the kernel's first shapes (``legacy``) are timed too, the table shows legacy and the
fastest, the JSON all of them.

Prints a table last; with $OUT set, writes $OUT/bench_v4_sparse_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.bench_mla_decode import import_flashmla, time_call
from kernels.v4_cache_formats import pack_v41_entries, pack_v41_window_rows
from kernels.v4_sparse_decode import RECORD_BYTES, SparseKV, pack_v4_cache, v4_sparse_decode_reference
from kernels.v4_sparse_decode_cuda import TOKENS_MAX_HEADS, uses_cluster, v4_sparse_decode_cuda
from kernels.v4_sparse_decode_triton import (SparseDecodeConfig, default_config, resolve_config,
                                             v4_sparse_decode_triton)

WINDOW = 128
ENTRIES_PER_REQUEST = 4096
PAGE = 64
REF_REQUESTS = 2
HBM_PEAKS = {"H100": 3.35e12, "H200": 4.8e12}  # spec sheets (H100 SXM), by device name
SCALE = 512**-0.5
C = SparseDecodeConfig
# The kernel's first shapes (1 stage, 4-piece dequant before the MMAs, token-major grid): "legacy".
LEGACY = {
    16: C(block_h=16, dv_split=1, num_warps=4, num_stages=1, block_n=32, heads_first=False),
    64: C(block_h=64, dv_split=2, num_warps=4, num_stages=1, block_n=32, heads_first=False),
    128: C(block_h=128, dv_split=2, num_warps=8, num_stages=1, block_n=32, heads_first=False),
}
SWEEP = {  # alternatives to default_config, by heads (None fields: the default's)
    16: {"st2": C(num_stages=2), "splits4": C(num_splits=4), "tokens_major": C(tokens_major=True),
         "dv2_bn64": C(dv_split=2, block_n=64)},
    64: {"w4_st2": C(num_warps=4, num_stages=2), "pad128": C(block_h=128),
         "bh16_x4": C(block_h=16, dv_split=1, num_warps=4, num_stages=3)},
    128: {"st3": C(num_stages=3), "bh64_w8": C(block_h=64),
          "bh16_x8": C(block_h=16, dv_split=1, num_warps=4, num_stages=3)},
}


def sweep_configs(heads: int, sweep: bool) -> dict[str, SparseDecodeConfig]:
    key = 16 if heads <= 16 else (64 if heads <= 64 else 128)
    cfgs = {"default": default_config(heads)}
    if sweep:
        cfgs["legacy"] = LEGACY[key]
        cfgs.update(SWEEP[key])
    return cfgs


# (window record, entry record, packer of each) per record family
FAMILIES = {"v4": ("v4", "v4", pack_v4_cache, pack_v4_cache),
            "v41": ("v41_window", "v41_entry", pack_v41_window_rows, pack_v41_entries)}


def build_case(bsz: int, s_q: int, heads: int, topk: int, seed: int = 0, records: str = "v4"):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    w_rec, e_rec, w_pack, e_pack = FAMILIES[records]
    w_pages = -(-bsz * WINDOW // PAGE)
    e_pages = -(-bsz * ENTRIES_PER_REQUEST // PAGE)
    window = w_pack(torch.randn(w_pages, PAGE, 512, device=dev, generator=gen))
    entries = e_pack(torch.randn(e_pages, PAGE, 512, device=dev, generator=gen))
    w_idx = (torch.arange(bsz, device=dev).view(-1, 1, 1) * WINDOW + torch.arange(WINDOW, device=dev)).expand(
        bsz, s_q, WINDOW).to(torch.int32).contiguous()
    picks = torch.rand(bsz, s_q, ENTRIES_PER_REQUEST, device=dev, generator=gen).argsort(-1)[..., :topk]
    e_idx = (torch.arange(bsz, device=dev).view(-1, 1, 1) * ENTRIES_PER_REQUEST + picks).to(torch.int32).contiguous()
    q = torch.randn(bsz, s_q, heads, 512, device=dev, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(heads, device=dev, generator=gen)
    return q, [SparseKV(window, w_idx, w_rec), SparseKV(entries, e_idx, e_rec)], sinks


def flashmla_call(flash_mla, q, scopes, sinks):
    """A closure running FlashMLA on our tensors (heads padded to 64 when fewer)."""
    heads = q.shape[2]
    pad = 64 if heads < 64 else heads
    if pad != heads:
        q = torch.cat([q, q.new_zeros(*q.shape[:2], pad - heads, 512)], dim=2).contiguous()
        sinks = torch.cat([sinks, sinks.new_full((pad - heads,), float("-inf"))])
    sched, _ = flash_mla.get_mla_metadata()
    w, e = scopes

    def run():
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, w.cache.unsqueeze(2), None, None, 512, sched, None, SCALE, False, True, w.indices, sinks,
            e.cache.unsqueeze(2), e.indices, None, None)
        return out[:, :, :heads], lse[:, :heads].transpose(1, 2)  # FlashMLA's lse is [B, H, s_q]

    return run


def hbm_peak() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in HBM_PEAKS.items() if k in name), HBM_PEAKS["H200"])


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def timed_us(fn, reps_ms: int) -> float:
    """µs per call: the median CUDA-graph replay over ~``reps_ms`` ms, L2 emptied before each
    (the project's timer, ``benchmarks.bench_mla_decode.time_call``)."""
    return time_call(fn, (5, reps_ms), use_graph=True)[0] * 1e6


def check(out, lse, want, want_lse) -> dict:
    n = want.shape[0]
    lse = lse[:n]
    return {"rel_err": rel_err(out[:n], want), "lse_err": (lse.double() - want_lse).abs().max().item()}


CUDA_ARMS = {"cuda": {"variant": "v1"}, "cuda_v2": {"variant": "v2"},
             "cuda_v2_nocluster": {"variant": "v2", "cluster": False}, "cuda_v3": {"variant": "v3"},
             "cuda_v3_fence": {"variant": "v3", "diagnostic": "fence"},
             "cuda_v3_nohbm": {"variant": "v3", "diagnostic": "no_hbm"},
             "cuda_v3_nopf": {"variant": "v3", "diagnostic": "no_prefetch"}}
DIAG_ARMS = ("cuda_v3_fence", "cuda_v3_nohbm", "cuda_v3_nopf")  # timing only (--diagnostics): V4, <= 16 heads


def arm_runs(arm: str, variants, heads: int, records: str, diagnostics: bool) -> bool:
    """Whether ``arm`` runs on this case: asked for, and where its kernel exists."""
    if arm == "cuda_v2_nocluster":
        return "cuda_v2" in variants and records == "v4" and uses_cluster("v2", heads)
    if arm in DIAG_ARMS:
        return diagnostics and "cuda_v3" in variants and records == "v4" and heads <= TOKENS_MAX_HEADS
    return arm in variants


def bench_case(bsz, s_q, heads, topk, flash_mla, sweep: bool, reps: int, variants=("triton", "cuda"),
               records: str = "v4", diagnostics: bool = False) -> dict:
    q, scopes, sinks = build_case(bsz, s_q, heads, topk, seed=bsz + s_q + heads + topk, records=records)
    n = REF_REQUESTS
    sub = [SparseKV(s.cache, s.indices[:n], s.record) for s in scopes]
    want, want_lse = v4_sparse_decode_reference(q[:n], sub, sinks, SCALE, compute_dtype=torch.float64)
    keys = WINDOW + topk
    flops = 2 * bsz * s_q * heads * keys * 1024
    record_bytes = WINDOW * RECORD_BYTES[scopes[0].record] + topk * RECORD_BYTES[scopes[1].record]
    nbytes = bsz * s_q * record_bytes + q.numel() * 2 * 2
    row = {"B": bsz, "s_q": s_q, "H": heads, "topk": topk, "records": records, "ours": []}
    if records != "v4":  # v1 and FlashMLA read MODEL1 records only
        variants = tuple(v for v in variants if v in ("triton", "cuda_v2", "cuda_v3"))
        flash_mla = None
    out = torch.empty(bsz, s_q, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(bsz, s_q, heads, device="cuda")
    for name, cfg in (sweep_configs(heads, sweep) if "triton" in variants else {}).items():
        def ours(cfg=cfg):
            return v4_sparse_decode_triton(q, scopes, sinks, SCALE, config=cfg, out=out, lse=lse)
        try:
            out.fill_(float("nan"))
            ours()
            acc = check(out, lse, want, want_lse)
            us = timed_us(ours, reps)
        except Exception as exc:  # noqa: BLE001 — one failing variant must not lose the others
            row["ours"].append({"name": name, "config": resolve_config(heads, cfg).__dict__,
                                "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        row["ours"].append({"name": name, "config": resolve_config(heads, cfg).__dict__, "us": us, **acc})
    timed = [r for r in row["ours"] if "us" in r]
    default = next((r for r in timed if r["name"] == "default"), None)
    if default is not None:
        best = min(timed, key=lambda r: r["us"])
        legacy = next((r for r in timed if r["name"] == "legacy"), None)
        row.update(us=default["us"], tflops=flops / default["us"] * 1e-6,
                   hbm_pct=100 * nbytes / (default["us"] * 1e-6) / hbm_peak(), rel_err=default["rel_err"],
                   lse_err=default["lse_err"], best=best["name"], best_us=best["us"],
                   legacy_us=legacy["us"] if legacy else None)
    for arm, kwargs in CUDA_ARMS.items():
        if arm_runs(arm, variants, heads, records, diagnostics):
            row[arm] = cuda_arm(q, scopes, sinks, out, lse, want, want_lse, flops, nbytes, reps, **kwargs)
    if flash_mla is not None:
        fm = flashmla_call(flash_mla, q, scopes, sinks)
        fo, fl = fm()
        row["flashmla"] = {"us": timed_us(fm, reps), **check(fo, fl, want, want_lse)}
        row["flashmla"]["tflops"] = flops / row["flashmla"]["us"] * 1e-6
        if "us" in row:
            row["speedup"] = row["flashmla"]["us"] / row["us"]
        for arm in CUDA_ARMS:
            if "us" in row.get(arm, {}):
                row[arm]["speedup"] = row["flashmla"]["us"] / row[arm]["us"]
                row[arm]["target_met"] = target_met(heads, row[arm])
    return row


def target_met(heads: int, arm: dict) -> bool:
    """The issue's targets: 64+ heads ≥ 1.2× FlashMLA's speed (same FLOPs: TFLOP/s ratio = time
    ratio); up to 16 heads ≥ 3× and ≥ 80 % of the HBM roofline."""
    if heads >= 64:
        return arm["speedup"] >= 1.2
    return arm["speedup"] >= 3.0 and arm["hbm_pct"] >= 80.0


def cuda_arm(q, scopes, sinks, out, lse, want, want_lse, flops, nbytes, reps, **kwargs) -> dict:
    """A CUDA C++ kernel (``kwargs``: variant, cluster): checked against float64 first, then timed
    (an error is recorded, not raised: the other arms still run)."""
    def run():
        return v4_sparse_decode_cuda(q, scopes, sinks, SCALE, out=out, lse=lse, **kwargs)
    try:
        out.fill_(float("nan"))
        run()
        acc = check(out, lse, want, want_lse)
        us = timed_us(run, reps)
    except Exception as exc:  # noqa: BLE001 — a failing arm must not lose the others
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"us": us, "tflops": flops / us * 1e-6, "hbm_pct": 100 * nbytes / (us * 1e-6) / hbm_peak(), **acc}


def cases(quick: bool, topks=None, s_qs=None):
    """(B, s_q, H, top-k) of a run: 64 and 128 heads, then 8 and 16."""
    for heads in (64, 128):
        for topk in topks or ((512, 2048) if quick else (512, 1024, 2048)):
            for bsz in ((128,) if quick else (64, 128)):
                for s_q in s_qs or (1, 2):
                    yield bsz, s_q, heads, topk
    for heads in (8, 16):
        for topk in topks or (512, 2048):
            for bsz in ((128,) if quick else (64, 128)):
                for s_q in s_qs or (1, 2):
                    yield bsz, s_q, heads, topk


def fmt(r: dict, arms=tuple(CUDA_ARMS)) -> str:
    fm = r.get("flashmla")
    fm_s = "-"
    if fm:
        speed = f"{r['speedup']:5.2f}x" if "speedup" in r else "    -"
        fm_s = f"{fm['us']:8.1f} {fm['tflops']:6.1f} {fm['rel_err']:.1e} {speed}"
    tri = f"{'-':>8} {'-':>6} {'-':>6} {'-':>7} {'-':>7} | {'-':>8} {'-':>8} {'-':>12}"
    if "us" in r:
        legacy = f"{r['legacy_us']:8.1f}" if r.get("legacy_us") else "       -"
        tri = (f"{r['us']:8.1f} {r['tflops']:6.1f} {r['hbm_pct']:5.1f}% {r['rel_err']:.1e} {r['lse_err']:.1e} | "
               f"{legacy} {r['best_us']:8.1f} {r['best']:>12}")
    cu_s = []
    for arm in arms:
        cu = r.get(arm, {})
        if "us" in cu:
            speed = f"{cu['speedup']:5.2f}x{'*' if cu.get('target_met') else ' '}" if "speedup" in cu else "     - "
            cu_s.append(f"{cu['us']:8.1f} {cu['tflops']:6.1f} {cu['hbm_pct']:5.1f}% {cu['rel_err']:.1e} {speed}")
        else:
            cu_s.append(f"{cu.get('error', '-')[:45]:>45}")
    return f"{r['H']:4d} {r['topk']:5d} {r['B']:4d} {r['s_q']:3d} | {tri} | {' | '.join(cu_s)} | {fm_s}"


def error_line(r: dict) -> str:
    return f"{r['H']:4d} {r['topk']:5d} {r['B']:4d} {r['s_q']:3d} | {r['error']}"


def fmt_v41(r: dict, v4_rows: list[dict], arm: str = "cuda_v2") -> str:
    """A V4.1 row: Triton, a CUDA arm, their ratio, and the arm's time over its time on V4 records."""
    tri = f"{r['us']:9.1f} {r['hbm_pct']:5.1f}% {r['rel_err']:.1e}" if "us" in r else f"{'-':>9} {'-':>6} {'-':>7}"
    cu = r.get(arm, {})
    if "us" in cu:
        cu_s = f"{cu['us']:10.1f} {cu['tflops']:7.1f} {cu['hbm_pct']:5.1f}% {cu['rel_err']:.1e}"
        speed = f"{r['us'] / cu['us']:10.2f}x" if "us" in r else f"{'-':>11}"
    else:
        cu_s, speed = f"{cu.get('error', '-')[:36]:>36}", f"{'-':>11}"
    same = next((v for v in v4_rows if (v["H"], v["topk"], v["B"], v["s_q"]) == (r["H"], r["topk"], r["B"], r["s_q"])
                 and "us" in v.get(arm, {})), None)
    vs_v4 = f"{cu['us'] / same[arm]['us']:6.2f}" if same is not None and "us" in cu else "     -"
    return f"{r['H']:4d} {r['topk']:5d} {r['B']:4d} {r['s_q']:3d} | {tri} | {cu_s} | {speed} | {vs_v4}"


def fmt_tokens(r: dict) -> str:
    """A row of the tokens-major comparison (up to 16 heads): v2, v3, v2/v3, v3's HBM % and rel.
    err, its diagnostics, FlashMLA (padded to 64 heads) over v3 (target >= 3)."""
    def us(arm):
        return r.get(arm, {}).get("us")

    def cell(v, width=8):
        return f"{v:{width}.1f}" if v is not None else f"{'-':>{width}}"

    v2, v3 = us("cuda_v2"), us("cuda_v3")
    ratio = f"{v2 / v3:6.2f}x" if v2 and v3 else f"{'-':>7}"
    hbm = f"{r['cuda_v3']['hbm_pct']:5.1f}%" if v3 else f"{'-':>6}"
    err = f"{r['cuda_v3']['rel_err']:.1e}" if v3 else f"{'-':>7}"
    fm = r.get("flashmla", {}).get("us")
    speed = f"{fm / v3:6.2f}x" if fm and v3 else f"{'-':>7}"
    diags = f"{cell(us('cuda_v3_fence'))} {cell(us('cuda_v3_nohbm'), 9)} {cell(us('cuda_v3_nopf'), 9)}"
    return (f"{r.get('records', 'v4'):>7} {r['H']:3d} {r['topk']:5d} {r['B']:4d} {r['s_q']:3d} | {cell(v2)} {cell(v3)} "
            f"{ratio} {hbm} {err} | {diags} | {cell(fm, 11)} {speed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B=128 and top-k 512/2048 only")
    ap.add_argument("--sweep", action="store_true", help="also time the alternative launch configs")
    ap.add_argument("--reps", type=int, default=30, help="milliseconds of timed replays per case")
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--flashmla", default=".flashmla", help="FlashMLA kit folder (its src/ goes on sys.path)")
    ap.add_argument("--heads", type=int, nargs="*", help="only these head counts (default 64 128 8 16)")
    ap.add_argument("--topk", type=int, nargs="*", help="only these top-k (default 512 2048; 1024 too without --quick)")
    ap.add_argument("--s-q", type=int, nargs="*", help="only these query tokens per request (default 1 2)")
    ours = ("triton", "cuda", "cuda_v2", "cuda_v3")
    ap.add_argument("--variants", nargs="+", choices=ours, default=ours, help="which of our kernels to check and time")
    ap.add_argument("--records", nargs="+", choices=tuple(FAMILIES), default=("v4",),
                    help="record family of the caches: v4 (MODEL1, all arms), v41 (window rows + entries)")
    ap.add_argument("--diagnostics", action="store_true", help="v3's timing diagnostics up to 16 heads (V4 records)")
    args = ap.parse_args()
    flash_mla = None if args.no_flashmla or args.records == ["v41"] else import_flashmla(args.flashmla)
    rows = []
    for bsz, s_q, heads, topk in cases(args.quick, args.topk, args.s_q):
        if args.heads and heads not in args.heads:
            continue
        for records in args.records:
            try:
                rows.append(bench_case(bsz, s_q, heads, topk, flash_mla, args.sweep, args.reps, tuple(args.variants),
                                       records, args.diagnostics))
            except Exception as exc:  # noqa: BLE001 — one failing case must not lose the others
                rows.append({"B": bsz, "s_q": s_q, "H": heads, "topk": topk, "records": records,
                             "error": f"{type(exc).__name__}: {exc}"})
                print("case failed:", rows[-1], flush=True)
                continue
            print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_v4_sparse_decode.json"), "w") as f:
            json.dump(rows, f, indent=1)
    v4_rows = [r for r in rows if r.get("records", "v4") == "v4"]
    if v4_rows:
        arms = tuple(a for a in CUDA_ARMS if a not in DIAG_ARMS and any(a in r for r in v4_rows))
        arm_head = " | ".join(f"{arm[:8]:>8} µs TFLOP/s  HBM%  rel.err speedup" for arm in arms)
        print("\n   H  topk    B s_q | triton µs TFLOP/s  HBM%  rel.err  lse.err |   legacy  best µs    best cfg | "
              f"{arm_head} | FlashMLA µs TFLOP/s rel.err  speedup (triton)   (* = target met)")
        for r in v4_rows:
            print(fmt(r, arms) if "error" not in r else error_line(r))
    v41_rows = [r for r in rows if r.get("records") == "v41"]
    if v41_rows:
        print("\nV4.1 records (window 528 B + entries 288 B; FlashMLA's SM90 kernel cannot read them)")
        print("   H  topk    B s_q | triton µs  HBM%  rel.err | cuda_v2 µs TFLOP/s  HBM%  rel.err | cuda/triton "
              "| µs / V4 records' (cuda_v2)")
        for arm in ("cuda_v2", "cuda_v3"):
            if any(arm in r for r in v41_rows):
                print(f"{arm}:")
                for r in v41_rows:
                    print(fmt_v41(r, v4_rows, arm) if "error" not in r else error_line(r))
    tok_rows = [r for r in rows if "error" not in r and r["H"] <= TOKENS_MAX_HEADS and "cuda_v3" in r]
    if tok_rows:
        print(f"\nTokens-major kernels up to 16 heads on {torch.cuda.get_device_name()} (HBM peak "
              f"{hbm_peak() / 1e12:.2f} TB/s): v2 = tokens, v3 = tokens2; fence / nohbm / nopf = v3's diagnostics")
        print("records   H  topk    B s_q |    v2 µs    v3 µs   v2/v3   HBM% rel.err | fence µs nohbm µs   nopf µs |"
              " FlashMLA µs   FM/v3 (target >= 3)")
        for r in tok_rows:
            print(fmt_tokens(r))


if __name__ == "__main__":
    main()
