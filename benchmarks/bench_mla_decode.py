"""Paged MLA decode on one GPU: our CUDA C++ FP8 kernels (``cuda-fp8``) and bf16 kernel
(``cuda-bf16``, up to 32 query rows per request), our Triton kernel (FP8 ``ours-fp8``, bf16
``ours-bf16``), FlashInfer fa3 (bf16, FP8 cache), FlashMLA's dense bf16 decode
(``flashmla-bf16``, when its build is at ``--flashmla DIR``, default ``.flashmla/``) and the torch
reference, over batch x heads x query tokens x context lengths.

    python3 -m benchmarks.bench_mla_decode                      # B 64/128 x H 16/128 x s_q 1/2
    python3 -m benchmarks.bench_mla_decode --sweep --sq 1       # also time candidate configs
    python3 -m benchmarks.bench_mla_decode --grid small         # B 1-16 x S 2k-32k, 128 heads, vs 1.3x
    python3 -m benchmarks.bench_mla_decode --grid small --split-sweep   # + cuda-fp8 at every split count

When ``cuda-bf16`` ran, the last table sets it against the other bf16 kernels per point.
``--grid small`` prints, per point, ours (cuda-fp8) against the faster of FlashInfer fa3 bf16 and
FlashMLA bf16 and whether ours is 1.3x faster; ``--split-sweep`` adds cuda-fp8 at forced split
counts, each with and without the combine (``merge_splits=False``: the decode kernel alone), the
data the split planner's cost model (kernels/mla_decode_cuda.py) is fitted to. With $OUT set,
every row goes to $OUT/bench_mla_decode.json.

Prints µs, achieved TB/s and TFLOP/s, their share of ceilings measured in the same run, and
the relative error against a float64 reference on the same (quantized) inputs, computed on
the first few requests. Cost model (FlashMLA's): FLOPs = 2·B·H·s_q·S·(576+512),
bytes = B·S·576·element size.

Each call is captured in a CUDA graph and the replays are timed (``--timing eager`` times the
Python calls): a split-KV call is several launches plus allocations, and at 16 heads the host
takes longer to issue them than the GPU takes to run them, so eager timing measured the host
(the serving path replays decode graphs too). Before each call the L2 is emptied by reading a
256 MB buffer (``--l2-flush write`` zeroes it instead, as triton's do_bench does, which leaves
dirty lines for the timed kernel to write back).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch


from kernels.fp8 import quantize_per_tensor
from kernels.mla_decode import mla_decode_reference

D, DV, PAGE = 576, 512, 64
SM_SCALE = 192 ** -0.5
Q_SCALE, K_SCALE = 0.02, 0.03
REF_REQUESTS = 4
SMALL_GRID = dict(batch=[1, 2, 4, 8, 16], seq=[2048, 8192, 32768], heads=[128], sq=[1])
TARGET_SPEEDUP = 1.3  # ours FP8 against the faster of FlashInfer fa3 bf16 and FlashMLA bf16
SPLIT_SWEEP = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def import_flashmla(root: str = ".flashmla"):
    """FlashMLA's Python package from the kit at ``root`` (its ``src/`` and ``src/tests/`` go on
    sys.path), or None with one line saying why (benches then time the other arms only)."""
    for path in (os.path.join(root, "src"), os.path.join(root, "src", "tests")):
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
    try:
        import flash_mla

        return flash_mla
    except Exception as exc:  # noqa: BLE001 — any import failure means "skip FlashMLA"
        print(f"FlashMLA not importable ({type(exc).__name__}: {exc}); timing ours only")
        return None

# Candidate launch shapes (each compiled once per specialization), per regime.
SWEEP = {
    ("fp8", "many"): [  # rows >= 64: compute-bound
        dict(block_h=64, block_n=32, num_warps=4, num_stages=2, dv=256),
        dict(block_h=64, block_n=32, num_warps=4, num_stages=2, dv=256, pv="fp8"),
        dict(block_h=64, block_n=32, num_warps=8, num_stages=2, dv=512),
        dict(block_h=64, block_n=32, num_warps=8, num_stages=2, dv=512, pv="fp8"),
        dict(block_h=128, block_n=32, num_warps=8, num_stages=2, dv=256),
        dict(block_h=128, block_n=32, num_warps=8, num_stages=2, dv=256, pv="fp8"),
        dict(block_h=128, block_n=64, num_warps=8, num_stages=2, dv=256),
    ],
    ("fp8", "few"): [  # rows <= 32: memory-bound
        dict(block_h=16, block_n=32, num_warps=4, num_stages=3, dv=256),
        dict(block_h=16, block_n=32, num_warps=8, num_stages=3, dv=512, num_splits=8),
        dict(block_h=16, block_n=64, num_warps=4, num_stages=3, dv=256, tokens_major=True),
        dict(block_h=16, block_n=64, num_warps=4, num_stages=3, dv=256, pv="fp8", tokens_major=True),
        dict(block_h=16, block_n=64, num_warps=8, num_stages=3, dv=512, tokens_major=True),
        dict(block_h=16, block_n=32, num_warps=4, num_stages=3, dv=256, tokens_major=True),
        dict(block_h=16, block_n=64, num_warps=4, num_stages=3, dv=128, tokens_major=True),
    ],
    ("bf16", "many"): [
        dict(block_h=64, block_n=32, num_warps=4, num_stages=2, dv=256),
        dict(block_h=64, block_n=32, num_warps=8, num_stages=2, dv=512),
        dict(block_h=64, block_n=16, num_warps=8, num_stages=2, dv=512),
    ],
    ("bf16", "few"): [
        dict(block_h=16, block_n=32, num_warps=4, num_stages=3, dv=256),
        dict(block_h=16, block_n=32, num_warps=8, num_stages=2, dv=512, tokens_major=True),
        dict(block_h=16, block_n=32, num_warps=4, num_stages=2, dv=256, tokens_major=True),
    ],
}

def measure_ceilings() -> dict:
    """HBM copy bandwidth (read + write bytes) and dense bf16 / fp8 matmul rates, at the sizes the
    kernel tables have always used (8192³ GEMMs, a 2 GiB copy)."""
    from server.step_roofline import measure_ceilings as measure

    c = measure(torch.device("cuda"), size=8192, copy_bytes=2 << 30)
    return dict(hbm_tbs=c.hbm_bytes / 1e12, bf16_tflops=c.bf16_flops / 1e12, fp8_tflops=c.fp8_flops / 1e12)


@dataclasses.dataclass
class Case:
    bsz: int
    seq: int
    heads: int
    s_q: int

    def flops(self) -> float:
        return 2.0 * self.bsz * self.heads * self.s_q * self.seq * (D + DV)

    def bytes(self, elt: int) -> float:
        return float(self.bsz * self.seq * D * elt)


def build_inputs(case: Case, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-case.seq // PAGE)
    num_blocks = case.bsz * pages
    kv = torch.randn(num_blocks, PAGE, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(case.bsz, case.s_q, case.heads, D, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(num_blocks, device="cuda", generator=g).reshape(case.bsz, pages).int()
    lens = torch.full((case.bsz,), case.seq, dtype=torch.int32, device="cuda")
    q8, kv8 = quantize_per_tensor(q, Q_SCALE), quantize_per_tensor(kv, K_SCALE)
    return dict(q16=q, kv16=kv, q8=q8, kv8=kv8, tables=tables, lens=lens)


def reference64(q, kv, tables, lens, q_scale, k_scale, s_q, n_req=REF_REQUESTS):
    """float64 decode of the first n_req requests (same math as mla_decode_reference)."""
    outs, lses = [], []
    for b in range(n_req):
        n = int(lens[b])
        kvb = kv[tables[b, : -(-n // PAGE)].long()].reshape(-1, D)[:n].double() * k_scale
        qb = q[b].double() * q_scale
        scores = torch.einsum("shd,nd->shn", qb, kvb) * SM_SCALE
        pos = torch.arange(n, device=q.device)
        mask = pos[None, :] > (n - s_q + torch.arange(s_q, device=q.device))[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.einsum("shn,nc->shc", torch.exp(scores - lse[..., None]), kvb[:, :DV]))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rel_err(out, ref) -> float:
    out = out[: ref.shape[0]].double()
    return ((out - ref).norm() / ref.norm()).item()


def compiled_kernels(kernel_fn) -> dict:
    return dict(kernel_fn.device_caches[torch.cuda.current_device()][0])


def sass_stats(compiled) -> dict:
    """Registers, spills and the instruction mix of one compiled Triton kernel."""
    import re
    import subprocess
    import tempfile

    compiled._init_handles()
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    except FileNotFoundError:
        sass = ""
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass, re.M)
    count = {k: ops.count(k) for k in ("QGMMA", "HGMMA", "HMMA", "LDL", "STL", "PRMT")}
    return dict(regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared, **count)


_FLUSH: dict[str, torch.Tensor] = {}


def timed_median(target, reps: tuple[int, int], flush: str = "read") -> float:
    """Median seconds of ``target()`` over about ``reps[1]`` ms of calls (after ``reps[0]`` ms of
    warm-up), the L2 cache emptied before each call by a 256 MB pass. ``flush="read"`` reads the
    buffer, so the L2 holds only clean lines when the timed call starts; ``"write"`` (what
    triton.testing.do_bench does) zeroes it, which leaves ~50 MB of dirty lines that a
    memory-bound kernel then writes back to HBM inside its own timing."""
    buf = _FLUSH.get("buf")
    if buf is None:
        buf = _FLUSH["buf"] = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        target()
    end.record()
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end) / 5, 1e-3)
    n_warm, n_rep = max(1, int(reps[0] / per_call)), max(5, int(reps[1] / per_call))
    for _ in range(n_warm):
        target()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_rep)]
    for a, b in events:
        if flush == "read":
            buf.max()
        else:
            buf.zero_()
        a.record()
        target()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events)
    return times[len(times) // 2] * 1e-3


def time_call(fn, reps: tuple[int, int], use_graph: bool, flush: str = "read") -> tuple[float, str]:
    """Median seconds per call of ``fn`` and how it was timed: as a CUDA-graph replay (the
    kernels' GPU time, no host gaps between launches) or eager, where capture is not asked for
    or fails."""
    target, mode = fn, "eager"
    if use_graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # first calls (lazy setup) outside the capture
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            target, mode = graph.replay, "graph"
        except Exception as exc:  # not capturable: eager timing, said in the row
            torch.cuda.synchronize()
            print(f"graph capture failed ({exc!r}); timing eagerly", flush=True)
    return timed_median(target, reps, flush), mode


def bench_case(case: Case, variants: list[str], sweep: bool, ceil: dict, sweep_triton: bool = True,
               sweep_cuda: bool = True, use_graph: bool = True, flush: str = "read", flash_mla=None,
               split_sweep: bool = False) -> list[dict]:
    from kernels.mla_decode_triton import MLADecodeConfig, _mla_decode_kernel, default_config, mla_decode_triton

    x = build_inputs(case)
    ref8 = reference64(x["q8"], x["kv8"], x["tables"], x["lens"], Q_SCALE, K_SCALE, case.s_q)
    ref16 = reference64(x["q16"], x["kv16"], x["tables"], x["lens"], 1.0, 1.0, case.s_q)
    rows = []

    def record(name, fn, ref, elt, extra=None, reps=(25, 100)):
        try:
            _record(name, fn, ref, elt, extra, reps)
        except Exception as exc:  # one broken variant must not cost the whole device run
            print(f"B={case.bsz} H={case.heads} s_q={case.s_q} {name} {extra} FAILED: {exc!r}", flush=True)

    def _record(name, fn, ref, elt, extra, reps):
        before = compiled_kernels(_mla_decode_kernel)
        out, lse = fn()
        torch.cuda.synchronize()
        new = [k for key, k in compiled_kernels(_mla_decode_kernel).items() if key not in before]
        if new and name.startswith(("ours", "sweep")):
            extra = dict(extra or {}, **sass_stats(new[0]))
        err = rel_err(out, ref[0])
        lse_err = (lse[: ref[1].shape[0]].double() - ref[1]).abs().max().item()
        if reps is None:  # slow reference: one warm-up, three timed calls
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t = (time.perf_counter() - t0) / 3
            extra = dict(extra or {}, timing="eager")
        else:
            t, mode = time_call(fn, reps, use_graph, flush)
            extra = dict(extra or {}, timing=mode)
        tbs = case.bytes(elt) / t / 1e12
        tfl = case.flops() / t / 1e12
        row = dict(B=case.bsz, S=case.seq, H=case.heads, s_q=case.s_q, variant=name, us=t * 1e6,
                   tbs=tbs, tflops=tfl, pct_hbm=100 * tbs / ceil["hbm_tbs"],
                   pct_bf16=100 * tfl / ceil["bf16_tflops"], relerr=err, lse_err=lse_err, **(extra or {}))
        rows.append(row)
        print(fmt_row(row), flush=True)

    args8 = (x["q8"], x["kv8"], x["tables"], x["lens"], SM_SCALE)
    args16 = (x["q16"], x["kv16"], x["tables"], x["lens"], SM_SCALE)
    rows_per_req = case.heads * case.s_q
    if "ours-fp8" in variants:
        cfg = dataclasses.asdict(default_config(torch.float8_e4m3fn, torch.float8_e4m3fn, rows_per_req))
        record("ours-fp8", lambda: mla_decode_triton(*args8, q_scale=Q_SCALE, k_scale=K_SCALE), ref8, 1,
               dict(config={k: v for k, v in cfg.items() if v is not None}))
    if "ours-bf16" in variants:
        cfg = dataclasses.asdict(default_config(torch.bfloat16, torch.bfloat16, rows_per_req))
        record("ours-bf16", lambda: mla_decode_triton(*args16), ref16, 2,
               dict(config={k: v for k, v in cfg.items() if v is not None and k != "pv"}))
    if "cuda-fp8" in variants:
        from kernels.mla_decode_cuda import TILE, choose_kernel, choose_num_splits, mla_decode_cuda
        from kernels.gpu import num_sms

        kernel = choose_kernel(rows_per_req)
        planned = choose_num_splits(case.bsz, rows_per_req, x["tables"].shape[1] * PAGE // TILE,
                                    num_sms(x["q8"].device), kernel)
        record("cuda-fp8", lambda: mla_decode_cuda(*args8, q_scale=Q_SCALE, k_scale=K_SCALE), ref8, 1,
               dict(config=kernel, splits=planned))
        if split_sweep:
            sweep_split_counts(case, args8, ref8, record)
        if sweep and sweep_cuda:
            for name in ("narrow", "wgmma"):
                for splits in (None, 1, 2, 3, 4, 8):
                    record("sweep-cuda", lambda: mla_decode_cuda(*args8, q_scale=Q_SCALE, k_scale=K_SCALE,
                                                                 kernel=name, num_splits=splits),
                           ref8, 1, dict(config=name, splits=splits))
    if "cuda-bf16" in variants:
        from kernels.mla_decode_cuda import NARROW_MAX_ROWS, TILE, choose_num_splits, mla_decode_cuda
        from kernels.gpu import num_sms

        if rows_per_req <= NARROW_MAX_ROWS:
            planned = choose_num_splits(case.bsz, rows_per_req, x["tables"].shape[1] * PAGE // TILE,
                                        num_sms(x["q16"].device), "narrow-bf16")
            record("cuda-bf16", lambda: mla_decode_cuda(*args16), ref16, 2, dict(config="narrow-bf16", splits=planned))
            if sweep and sweep_cuda:  # the split counts around the planner's (its bf16 tile cost is a first guess)
                for splits in (1, 2, 3, 4, 8):
                    record("sweep-cuda-bf16", lambda splits=splits: mla_decode_cuda(*args16, num_splits=splits),
                           ref16, 2, dict(config="narrow-bf16", splits=splits))
    if sweep and sweep_triton:
        regime = "many" if case.heads * case.s_q >= 64 else "few"
        for kw in SWEEP[("fp8", regime)]:
            cfg = MLADecodeConfig(**kw)
            record("sweep-fp8", lambda: mla_decode_triton(*args8, q_scale=Q_SCALE, k_scale=K_SCALE, config=cfg),
                   ref8, 1, dict(config=kw))
        for kw in SWEEP[("bf16", regime)]:
            cfg = MLADecodeConfig(**kw)
            record("sweep-bf16", lambda: mla_decode_triton(*args16, config=cfg), ref16, 2, dict(config=kw))
    for name, kv_key, ref, elt in (("fi-fa3-bf16", "kv16", ref16, 2), ("fi-fa3-fp8", "kv8", ref8, 1)):
        if name not in variants:
            continue
        from kernels.attention import AttentionSpec, FlashInferDecode

        kv = x[kv_key]
        backend = FlashInferDecode(AttentionSpec(torch.device("cuda"), kv.dtype, case.heads, DV, D - DV, PAGE,
                                                 SM_SCALE, torch.bfloat16, query_len=case.s_q))
        metadata = backend.build_metadata(x["tables"], x["lens"], case.s_q)  # the plan, once, as per step
        if kv_key == "kv8":  # FlashInfer takes a bf16 query: the FP8 one, dequantized outside the timing
            q, qs, ks = (x["q8"].float() * Q_SCALE).to(torch.bfloat16), 1.0, K_SCALE
        else:
            q, qs, ks = x["q16"], 1.0, 1.0
        record(name, lambda: backend.decode(q, kv, metadata, SM_SCALE, DV, k_scale=ks, q_scale=qs), ref, elt)
    if "flashmla-bf16" in variants and flash_mla is not None:
        sched, _ = flash_mla.get_mla_metadata()  # filled by the first call, reused by the replays
        kcache = x["kv16"].unsqueeze(2)  # [blocks, page, one latent head, 576]

        def flashmla():
            out, lse = flash_mla.flash_mla_with_kvcache(x["q16"], kcache, x["tables"], x["lens"], DV, sched, None,
                                                        softmax_scale=SM_SCALE, causal=case.s_q > 1)
            return out, lse.transpose(1, 2)  # FlashMLA's lse is [B, H, s_q]

        record("flashmla-bf16", flashmla, ref16, 2)
    if "torch" in variants:
        record("torch-ref", lambda: mla_decode_reference(*args8, q_scale=Q_SCALE, k_scale=K_SCALE),
               ref8, 1, reps=None)
    return rows


def sweep_split_counts(case: Case, args8: tuple, ref8, record) -> None:
    """cuda-fp8 at each split count of SPLIT_SWEEP (and the planner's), with the combine and
    without it (the decode kernel alone): rows ``sweep-splits``; the planner's split count with
    the combine launched without PDL: row ``sweep-no-pdl``; past 32 rows, the narrow kernel
    (32-row CTAs) at its planned split count: row ``sweep-narrow``."""
    from kernels.mla_decode_cuda import TILE, choose_kernel, choose_num_splits, mla_decode_cuda
    from kernels.gpu import num_sms

    rows = case.heads * case.s_q
    kernel = choose_kernel(rows)
    max_tiles = args8[2].shape[1] * PAGE // TILE
    planned = choose_num_splits(case.bsz, rows, max_tiles, num_sms(args8[0].device), kernel)
    for splits in sorted({n for n in SPLIT_SWEEP if n <= max_tiles} | {planned}):
        for merged in (True, False) if splits > 1 else (True,):
            def call(splits=splits, merged=merged):
                return mla_decode_cuda(*args8, q_scale=Q_SCALE, k_scale=K_SCALE, num_splits=splits,
                                       merge_splits=merged)

            record("sweep-splits", call, ref8, 1,
                   dict(config=kernel, splits=splits, merged=merged, planned=splits == planned))
    if planned > 1:  # the combine as a plain launch after the decode, not a programmatic dependent one
        record("sweep-no-pdl", lambda: mla_decode_cuda(*args8, q_scale=Q_SCALE, k_scale=K_SCALE, num_splits=planned,
                                                       pdl=False), ref8, 1, dict(config=kernel, splits=planned))
    if kernel == "wgmma":  # the narrow kernel's 32-row CTAs instead: twice the CTAs for the same tiles
        narrow = choose_num_splits(case.bsz, rows, max_tiles, num_sms(args8[0].device), "narrow")
        record("sweep-narrow", lambda: mla_decode_cuda(*args8, q_scale=Q_SCALE, k_scale=K_SCALE, kernel="narrow",
                                                       num_splits=narrow), ref8, 1,
               dict(config="narrow", splits=narrow))


def speedup_table(rows: list[dict]) -> str:
    """Per point: ours (cuda-fp8) against the faster of FlashInfer fa3 bf16 and FlashMLA bf16,
    and, where the split sweep ran, the planner's split count against the best one."""
    points: dict[tuple, dict] = {}
    for r in rows:
        points.setdefault((r["B"], r["S"], r["H"], r["s_q"]), []).append(r)
    lines = [f"ours = cuda-fp8; others = min(FlashInfer fa3 bf16, FlashMLA bf16); target ours >= "
             f"{TARGET_SPEEDUP}x others",
             "",
             "| B | S | H | s_q | ours µs | splits | FlashInfer µs | FlashMLA µs | others / ours | meets | "
             "best split (µs) | planned split: kernel / + combine / + combine without PDL µs | narrow kernel µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (bsz, seq, heads, s_q), rs in sorted(points.items()):
        us = {r["variant"]: r["us"] for r in rs if not r["variant"].startswith("sweep")}
        ours, fi, fm = us.get("cuda-fp8"), us.get("fi-fa3-bf16"), us.get("flashmla-bf16")
        others = min([t for t in (fi, fm) if t is not None], default=None)
        ratio = others / ours if ours and others else None
        sweep = [r for r in rs if r["variant"] == "sweep-splits"]
        best = min((r for r in sweep if r["merged"]), key=lambda r: r["us"], default=None)
        plan = {r["merged"]: r["us"] for r in sweep if r["planned"]}
        no_pdl = next((r["us"] for r in rs if r["variant"] == "sweep-no-pdl"), None)
        narrow = next((r["us"] for r in rs if r["variant"] == "sweep-narrow"), None)
        planned = next((r.get("splits", "") for r in rs if r["variant"] == "cuda-fp8"), "")

        def f(t):
            return f"{t:.1f}" if t is not None else "-"

        verdict = "-" if ratio is None else ("yes" if ratio >= TARGET_SPEEDUP else "no")
        best_s = f"{best['splits']} ({best['us']:.1f})" if best else "-"
        ratio_s = f"{ratio:.2f}" if ratio else "-"
        lines.append(f"| {bsz} | {seq} | {heads} | {s_q} | {f(ours)} | {planned} | {f(fi)} | {f(fm)} | {ratio_s} | "
                     f"{verdict} | {best_s} | {f(plan.get(False))} / {f(plan.get(True))} / {f(no_pdl)} | {f(narrow)} |")
    return "\n".join(lines) + "\n"


def bf16_table(rows: list[dict]) -> str:
    """Per point: ours bf16 (cuda-bf16) against the Triton bf16 kernel (ours-bf16), FlashInfer
    fa3 bf16 and FlashMLA bf16, times and ratios (> 1: cuda-bf16 is faster)."""
    points: dict[tuple, dict] = {}
    for r in rows:
        if not r["variant"].startswith("sweep"):
            points.setdefault((r["B"], r["S"], r["H"], r["s_q"]), {})[r["variant"]] = r
    lines = ["bf16 cache: cuda-bf16 against the other bf16 kernels (ratio = their µs / cuda-bf16 µs)", "",
             "| B | S | H | s_q | cuda-bf16 µs | % HBM | splits | triton µs | FlashInfer µs | FlashMLA µs | "
             "triton / cuda | FlashInfer / cuda | FlashMLA / cuda |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (bsz, seq, heads, s_q), vs in sorted(points.items()):
        ours = vs.get("cuda-bf16")
        if ours is None:
            continue

        def us(name):
            return f"{vs[name]['us']:.1f}" if name in vs else "-"

        def ratio(name):
            return f"{vs[name]['us'] / ours['us']:.2f}" if name in vs else "-"

        lines.append(f"| {bsz} | {seq} | {heads} | {s_q} | {ours['us']:.1f} | {ours['pct_hbm']:.0f} | "
                     f"{ours.get('splits', '')} | {us('ours-bf16')} | {us('fi-fa3-bf16')} | {us('flashmla-bf16')} | "
                     f"{ratio('ours-bf16')} | {ratio('fi-fa3-bf16')} | {ratio('flashmla-bf16')} |")
    return "\n".join(lines) + "\n"


def fmt_row(r: dict) -> str:
    cfg = r.get("config", "")
    cfg = ",".join(f"{k}={v}" for k, v in cfg.items()) if isinstance(cfg, dict) else str(cfg)
    if "splits" in r:
        cfg += f" splits={r['splits']}"
    cfg += f" [{r.get('timing', '?')}]"
    sass = f" regs={r['regs']} spills={r['spills']} QGMMA={r['QGMMA']} HGMMA={r['HGMMA']}" if "regs" in r else ""
    return (f"B={r['B']:4d} S={r['S']:6d} H={r['H']:4d} s_q={r['s_q']} {r['variant']:12s} {r['us']:9.1f} us "
            f"{r['tbs']:5.2f} TB/s ({r['pct_hbm']:5.1f}%) {r['tflops']:6.1f} TFLOP/s ({r['pct_bf16']:5.1f}% bf16) "
            f"relerr {r['relerr']:.2e} lse {r['lse_err']:.1e} {cfg}{sass}")


def markdown(rows: list[dict], ceil: dict) -> str:
    lines = [
        f"Ceilings measured in this run: HBM copy {ceil['hbm_tbs']:.2f} TB/s, bf16 GEMM "
        f"{ceil['bf16_tflops']:.0f} TFLOP/s, fp8 GEMM {ceil['fp8_tflops']:.0f} TFLOP/s. Times are "
        "CUDA-graph replays unless the config says eager.",
        "",
        "| B | S | H | s_q | variant | µs | TB/s | % HBM | TFLOP/s | % bf16 | rel. err | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["variant"].startswith("sweep"):
            continue
        cfg = r.get("config", "")
        cfg = " ".join(f"{k}={v}" for k, v in cfg.items()) if isinstance(cfg, dict) else str(cfg)
        cfg += " (eager)" if r.get("timing") == "eager" else ""
        lines.append(f"| {r['B']} | {r['S']} | {r['H']} | {r['s_q']} | {r['variant']} | {r['us']:.1f} | "
                     f"{r['tbs']:.2f} | {r['pct_hbm']:.0f} | {r['tflops']:.0f} | {r['pct_bf16']:.0f} | "
                     f"{r['relerr']:.1e} | {cfg} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from kernels.mla_decode_cuda import set_cache_dir
    from server import envs

    set_cache_dir(envs.MLASERVE_KERNEL_CACHE)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=("small",), help="a preset: small = B 1-16 x S 2k/8k/32k, 128 heads, s_q 1")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--sq", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variants", default=None,
                    help="comma-separated arms (default cuda-fp8,cuda-bf16,ours-fp8,ours-bf16,fi-fa3-bf16,"
                         "fi-fa3-fp8,flashmla-bf16,torch; with --grid small cuda-fp8,fi-fa3-bf16,flashmla-bf16)")
    ap.add_argument("--flashmla", default=".flashmla", help="FlashMLA kit folder (its src/ goes on sys.path)")
    ap.add_argument("--sweep", action="store_true", help="also time the candidate configs")
    ap.add_argument("--sweep-what", choices=("all", "cuda", "triton"), default="all",
                    help="which kernel's candidate launch shapes to sweep")
    ap.add_argument("--sweep-batch", type=int, nargs="+", default=[128], help="sweep only at these batch sizes")
    ap.add_argument("--split-sweep", action="store_true",
                    help="cuda-fp8 at every split count of SPLIT_SWEEP, with and without the combine")
    ap.add_argument("--json", help="write every row here (and to $OUT/bench_mla_decode.json when $OUT is set)")
    ap.add_argument("--markdown", help="write the summary table here")
    ap.add_argument("--timing", choices=("graph", "eager"), default="graph",
                    help="time CUDA-graph replays of each call (default) or the eager calls")
    ap.add_argument("--l2-flush", choices=("read", "write"), default="read",
                    help="empty the L2 before each call by reading (default) or by zeroing a 256 MB buffer")
    args = ap.parse_args()
    if args.grid == "small":
        for k, v in SMALL_GRID.items():
            setattr(args, k, v)
    default_variants = ("cuda-fp8,fi-fa3-bf16,flashmla-bf16" if args.grid else
                        "cuda-fp8,cuda-bf16,ours-fp8,ours-bf16,fi-fa3-bf16,fi-fa3-fp8,flashmla-bf16,torch")
    variants = (args.variants or default_variants).split(",")
    flash_mla = import_flashmla(args.flashmla) if "flashmla-bf16" in variants else None
    ceil = measure_ceilings()
    print(f"ceilings: {ceil}", flush=True)
    rows = []
    for s_q in args.sq:
        for heads in args.heads:
            for seq in args.seq:
                for bsz in args.batch:
                    sweep = args.sweep and bsz in args.sweep_batch and s_q == args.sq[0]
                    try:
                        rows += bench_case(Case(bsz, seq, heads, s_q), variants, sweep, ceil,
                                           sweep_triton=args.sweep_what != "cuda",
                                           sweep_cuda=args.sweep_what != "triton", use_graph=args.timing == "graph",
                                           flush=args.l2_flush, flash_mla=flash_mla, split_sweep=args.split_sweep)
                    except Exception as exc:  # noqa: BLE001 — e.g. out of memory at one point: keep the others
                        print(f"B={bsz} S={seq} H={heads} s_q={s_q} FAILED: {exc!r}", flush=True)
                    torch.cuda.empty_cache()
    result = dict(ceilings=ceil, device=torch.cuda.get_device_name(), argv=sys.argv[1:], rows=rows)
    out_dir = os.environ.get("OUT")
    for path in (args.json, os.path.join(out_dir, "bench_mla_decode.json") if out_dir else None):
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    table = markdown(rows, ceil) + "\n" + speedup_table(rows)
    if any(r["variant"] == "cuda-bf16" for r in rows):
        table += "\n" + bf16_table(rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table)


if __name__ == "__main__":
    main()
