"""V4.1 lightning indexer step (Triton) next to the sparse attention it feeds
(kernels/v4_sparse_decode_triton.py), at V4.1-Flash's shapes, old and new in one process.

Indexer: 32 heads × 128 dims, keys as 68-byte FP4 records in shuffled pages of 64, top-k 512,
candidate blocks of 8 (top 2048). Attention: 64 heads × 512, 128 window rows (528-byte
records) + the 512 picked entries (288-byte records) per query. Cases: decode B = 1, 32, 128
at 8k and 64k keys per request (a ratio-1 layer: one key per token; every request at the full
context), and one 8192-token prefill chunk ending at 8k / 64k (scored 256 queries per launch,
as the model does). Indexer layer kinds: ``plain`` (scores + top-k), ``cand_src`` (the
candidate source: + block maxima + block top-k), ``restricted`` (a later layer: scores under
the candidate mask + top-k) and ``ratio2`` (plain over half the keys: layers 2, 8, 14). The
``model`` ratio puts the 8 index layers of a V4.1-Flash token over its 38 sparse attention
layers (:func:`with_model_ratio`).

Two implementations of the step (quantize the queries, score, select):

- ``old`` — as main ran it: the torch quantization, the scoring launch writing int64 order
  keys over the full width, ``torch.topk`` on them, the candidate blocks in torch (with the
  current scoring kernel: its own speed-up shows in ``kernel``, not in old vs new);
- ``new`` — ``index_picks_triton``: the quantization kernel, the scoring launch with the
  selection's histogram (float32 scores, live tiles only), the Triton collect/finish selection
  and candidate-block mask (kernels/topk_triton.py); a restricted layer scores only its 2048
  allowed blocks, compacted into dense keys first (``compact_allowed_blocks``).

Correctness first: the kernel's scores against the torch reference on the same records
(first requests / queries; unused pages NaN-poisoned); the new picks and masks equal to the old
ones exactly (the same kernel's scores, the same order) and the reference picks up to ties.
Then timing: CUDA-graph replays, L2 emptied before each, median
(``benchmarks.bench_mla_decode.time_call``). ``kernel`` is the new scoring launch alone;
``GB/s`` counts each visible key's 68 bytes once per launch plus its 4-byte score. Ratios are
the step's time ÷ one layer's attention, against the 30 % target.

    python3 -m benchmarks.bench_v4_indexer [--quick] [--sweep] [--reps 30]

Prints a table last; with $OUT set, writes $OUT/bench_v4_indexer.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.bench_mla_decode import time_call
from kernels.v4_cache_formats import pack_v41_entries, pack_v41_index_keys, pack_v41_window_rows
from kernels.topk import key_scores
from kernels.topk_triton import new_histogram
from kernels.v4_indexer import (candidate_blocks, index_scores_reference, quantize_index_queries, topk_picks,
                                topk_picks_from_keys)
from kernels.v4_indexer_triton import index_picks_triton, index_scores_triton, quantize_queries_triton
from kernels.v4_sparse_decode import SparseKV
from kernels.v4_sparse_decode_triton import v4_sparse_decode_triton

HEADS, DIM, TOPK, BLOCK, TOPK_BLOCKS = 32, 128, 512, 8, 2048  # V4.1-Flash indexer
ATTN_HEADS, LATENT, WINDOW = 64, 512, 128  # V4.1-Flash attention (one GPU)
PAGE = 64
QUERY_BLOCK = 256  # prefill queries per launch (model/v41/indexer.py)
TARGET = 0.30
MODEL_ATTN_LAYERS = 38
REF_ROWS = 2
KINDS = ("plain", "cand_src", "restricted", "ratio2")
SWEEP = [dict(block_n=64), dict(block_n=128, num_warps=8), dict(num_stages=2), dict(programs_per_sm=4),
         dict(prefetch=False), dict(skip_dead_tiles=False)]
PREFILL_SWEEP = [dict(block_q=2, block_n=64, num_warps=4, num_stages=3), dict(block_q=4, block_n=32, num_warps=4,
                                                                               num_stages=3),
                 dict(num_stages=1), dict(prefetch=False)]


def paged_keys(num_requests: int, num_keys: int, gen: torch.Generator):
    """(record pool [rows, 68] with NaN-poisoned spare pages, page tables [R, pages] of shuffled pages)."""
    pages = -(-num_keys // PAGE)
    total = num_requests * pages + 8
    pool = torch.full((total * PAGE, DIM // 2 + DIM // 32), 0xFF, dtype=torch.uint8, device="cuda")
    order = torch.randperm(total - 1, device="cuda", generator=gen)[: num_requests * pages] + 1
    tables = order.view(num_requests, pages)
    for r in range(num_requests):
        rows = (tables[r].view(-1, 1) * PAGE + torch.arange(PAGE, device="cuda")).flatten()[:num_keys]
        pool[rows] = pack_v41_index_keys(torch.randn(num_keys, DIM, device="cuda", generator=gen))
    return pool, tables


def attention_inputs(num_queries: int, num_entries: int, per_query: bool, gen: torch.Generator):
    """q and the two scopes of one query token per row: 128 window rows + 512 entries picked
    among ``num_entries`` (each query's own with ``per_query``, decode's requests; else shared,
    one prefill request's)."""
    window = pack_v41_window_rows(torch.randn(num_queries + WINDOW, LATENT, device="cuda", generator=gen))
    total = num_entries * (num_queries if per_query else 1)
    entries = pack_v41_entries(torch.randn(total, LATENT, device="cuda", generator=gen))
    w_idx = (torch.arange(num_queries, device="cuda").view(-1, 1, 1) + torch.arange(WINDOW, device="cuda"))
    picks = torch.randint(0, num_entries, (num_queries, 1, TOPK), device="cuda", generator=gen)
    if per_query:
        picks += torch.arange(num_queries, device="cuda").view(-1, 1, 1) * num_entries
    q = torch.randn(num_queries, 1, ATTN_HEADS, LATENT, device="cuda", generator=gen).to(torch.bfloat16)
    sinks = torch.randn(ATTN_HEADS, device="cuda", generator=gen)
    scopes = [SparseKV(window.unsqueeze(1), w_idx.to(torch.int32).contiguous(), "v41_window"),
              SparseKV(entries.unsqueeze(1), picks.to(torch.int32), "v41_entry")]
    return q, scopes, sinks


def same_picks_up_to_ties(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> bool:
    for g, w, s in zip(got.tolist(), want.tolist(), scores):
        g, w = [p for p in g if p >= 0], [p for p in w if p >= 0]
        if len(g) != len(w) or len(set(g)) != len(g):
            return False
        if w and not torch.allclose(s[g].sort().values, s[w].sort().values, rtol=1e-5, atol=1e-6):
            return False
    return True


def check_scores(got: torch.Tensor, want: torch.Tensor) -> float:
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)) or got.isnan().any():
        return float("inf")
    return ((got[fin] - want[fin]).abs().max() / want[fin].abs().max().clamp_min(1e-30)).item()


def timed_us(fn, reps_ms: int) -> float:
    return time_call(fn, (5, reps_ms), use_graph=True)[0] * 1e6


def old_step(q_raw, w, pool, tables, vis, num_keys, allowed, topk_blocks, qpr=1):
    """The indexer step as main ran it: torch quantization, int64 keys, torch.topk, torch blocks."""
    a8, a_s = quantize_index_queries(q_raw)
    keys, bm = index_scores_triton(a8, a_s, w, pool, tables, PAGE, vis, num_keys, DIM**-0.5, qpr, allowed, BLOCK,
                                   topk_blocks is not None, keys_out=True)
    picks = topk_picks_from_keys(keys, TOPK)
    return picks, (None if topk_blocks is None else candidate_blocks(bm, vis.view(-1, 1), topk_blocks, BLOCK))


def new_step(q_raw, w, pool, tables, vis, num_keys, allowed, topk_blocks, qpr=1, **shape):
    """The step as the model now runs it on CUDA (restricted layers on their compacted blocks)."""
    return index_picks_triton(q_raw, w, pool, tables, PAGE, vis, num_keys, DIM**-0.5, TOPK, qpr, allowed, BLOCK,
                              topk_blocks, None if allowed is None else TOPK_BLOCKS, **shape)


def same_steps(old, new) -> bool:
    return torch.equal(old[0], new[0]) and (old[1] is None) == (new[1] is None) and (
        old[1] is None or torch.equal(old[1], new[1]))


def decode_case(bsz: int, num_keys: int, reps: int, sweep: bool, gen: torch.Generator) -> dict:
    pool, tables = paged_keys(bsz, num_keys, gen)
    q_raw = torch.randn(bsz, HEADS, DIM, device="cuda", generator=gen)
    w = torch.randn(bsz, HEADS, device="cuda", generator=gen) * HEADS**-0.5
    vis = torch.full((bsz,), num_keys, dtype=torch.long, device="cuda")
    nblocks = -(-num_keys // BLOCK)
    allowed = torch.zeros(bsz, nblocks, dtype=torch.bool, device="cuda")
    allowed[:, torch.randperm(nblocks, device="cuda", generator=gen)[:TOPK_BLOCKS]] = True
    q8, qs = quantize_index_queries(q_raw)
    q8m, _ = quantize_queries_triton(q_raw)
    row = {"case": "decode", "B": bsz, "keys": num_keys}
    n = min(REF_ROWS, bsz)
    half = num_keys // 2
    kinds = {"plain": (None, None, num_keys, vis), "cand_src": (None, TOPK_BLOCKS, num_keys, vis),
             "restricted": (allowed, None, num_keys, vis), "ratio2": (None, None, half, vis // 2)}
    for kind, (al, kb, nk, vk) in kinds.items():  # mask, candidate blocks, keys and counts of this kind
        got, got_b = index_scores_triton(q8, qs, w, pool, tables, PAGE, vk, nk, DIM**-0.5, 1, al, BLOCK, kb is not None,
                                         keys_out=True)  # the old step's launch
        sub = (q8[:n], qs[:n], w[:n], pool, tables[:n], PAGE, vk[:n], nk, DIM**-0.5, 1)
        want, want_b = index_scores_reference(*sub, None if al is None else al[:n], BLOCK, kb is not None)
        err = check_scores(key_scores(got[:n]), want)
        if kb is not None:
            err = max(err, check_scores(got_b[:n], want_b))
        args = (q_raw, w, pool, tables, vk, nk, al, kb)
        new = new_step(*args)
        ties = same_picks_up_to_ties(new[0][:n].cpu(), topk_picks(want, TOPK).cpu(), want.cpu())
        hist = new_histogram(bsz, torch.device("cuda")).zero_()

        def kernel(al=al, kb=kb, nk=nk, vk=vk, hist=hist, **shape):
            return index_scores_triton(q8m, qs, w, pool, tables, PAGE, vk, nk, DIM**-0.5, 1, al, BLOCK, kb is not None,
                                       hist=hist, mma_ordered=True, **shape)

        k_us = timed_us(kernel, reps)
        entry = {"kernel_us": k_us, "new_us": timed_us(lambda a=args: new_step(*a), reps),
                 "old_us": timed_us(lambda a=args: old_step(*a), reps), "rel_err": err, "picks_ok": ties,
                 "same_as_old": same_steps(old_step(*args), new), "GBps": (bsz * nk * (68 + 4)) / (k_us * 1e-6) * 1e-9}
        if kind == "plain":  # the histogram by its own pass instead of the scoring launch's atomics
            entry["new_unfused_hist_us"] = timed_us(lambda a=args: new_step(*a, fused_histogram=False), reps)
        if sweep and kind == "plain":
            entry["sweep"] = {json.dumps(sh): timed_us(lambda sh=sh: kernel(**sh), reps) for sh in SWEEP}
        row[kind] = entry
    q, scopes, sinks = attention_inputs(bsz, 4096, True, gen)
    out = torch.empty(bsz, 1, ATTN_HEADS, LATENT, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(bsz, 1, ATTN_HEADS, device="cuda")
    row["attn_us"] = timed_us(lambda: v4_sparse_decode_triton(q, scopes, sinks, LATENT**-0.5, out=out, lse=lse), reps)
    return with_model_ratio(row)


def with_model_ratio(row: dict) -> dict:
    """Per layer: each kind's old / new step over one attention layer. V4.1-Flash per token:
    index sources 2, 8, 14 score half the keys (ratio 2), 20 is the candidate source, 24 … 36
    (4) are restricted; 38 layers attend window + top-k (the 2 window-only layers left out, so
    the ratio is not flattered)."""
    for impl in ("old", "new"):
        key = f"{impl}_us"
        for kind in KINDS:
            row[kind][f"{impl}_ratio"] = row[kind][key] / row["attn_us"]
        idx = 3 * row["ratio2"][key] + row["cand_src"][key] + 4 * row["restricted"][key]
        row[f"model_ratio_{impl}"] = idx / (MODEL_ATTN_LAYERS * row["attn_us"])
    return row


def prefill_case(context: int, chunk: int, reps: int, sweep: bool, gen: torch.Generator) -> dict:
    pool, tables = paged_keys(1, context, gen)
    first = context - chunk
    positions = torch.arange(first, context, device="cuda")
    vis = positions + 1  # ratio 1
    q_raw = torch.randn(chunk, HEADS, DIM, device="cuda", generator=gen)
    w = torch.randn(chunk, HEADS, device="cuda", generator=gen) * HEADS**-0.5
    row = {"case": "prefill", "chunk": chunk, "keys": context}

    def blocks(step, kb, allowed=None, ratio=1, **shape):
        keys, seen = context // ratio, (positions + 1) // ratio
        spans = [(s, min(chunk, s + QUERY_BLOCK)) for s in range(0, chunk, QUERY_BLOCK)]
        return [step(q_raw[s:e], w[s:e], pool, tables, seen[s:e], keys, None if allowed is None else allowed[s:e], kb,
                     e - s, **shape) for s, e in spans]

    q8, qs = quantize_index_queries(q_raw)
    s, e = chunk - QUERY_BLOCK, chunk  # the last block: the most keys visible
    got, _ = index_scores_triton(q8[s:e], qs[s:e], w[s:e], pool, tables, PAGE, vis[s:e], context, DIM**-0.5, e - s,
                                 keys_out=True)
    idx = torch.arange(s, e, 37, device="cuda")  # a spread of its queries
    want, _ = index_scores_reference(q8[idx], qs[idx], w[idx], pool, tables, PAGE, vis[idx], context, DIM**-0.5,
                                     idx.numel())
    row["rel_err"] = check_scores(key_scores(got[idx - s]), want)
    new, _ = new_step(q_raw[s:e], w[s:e], pool, tables, vis[s:e], context, None, None, e - s)
    row["picks_ok"] = same_picks_up_to_ties(new[idx - s].cpu(), topk_picks(want, TOPK).cpu(), want.cpu())
    keys_read = sum(int(vis[min(chunk, b + QUERY_BLOCK) - 1]) for b in range(0, chunk, QUERY_BLOCK))
    nblocks = -(-context // BLOCK)
    allowed = torch.zeros(chunk, nblocks, dtype=torch.bool, device="cuda")
    allowed[:, torch.randperm(nblocks, device="cuda", generator=gen)[:TOPK_BLOCKS]] = True
    kinds = {"plain": (None, None, 1), "cand_src": (TOPK_BLOCKS, None, 1), "restricted": (None, allowed, 1),
             "ratio2": (None, None, 2)}
    for kind, (kb, al, ratio) in kinds.items():
        same = all(same_steps(o, n) for o, n in zip(blocks(old_step, kb, al, ratio), blocks(new_step, kb, al, ratio)))
        new_us = timed_us(lambda kb=kb, al=al, ratio=ratio: blocks(new_step, kb, al, ratio), reps)
        row[kind] = {"new_us": new_us, "old_us": timed_us(lambda kb=kb, al=al, ratio=ratio: blocks(old_step, kb, al,
                                                                                                    ratio), reps),
                     "same_as_old": same, "GBps": keys_read * 68 / ratio / (new_us * 1e-6) * 1e-9}
        if sweep and kind == "plain":
            row[kind]["sweep"] = {json.dumps(sh): timed_us(lambda sh=sh: blocks(new_step, None, **sh), reps)
                                  for sh in PREFILL_SWEEP}
    q, scopes, sinks = attention_inputs(chunk, context, False, gen)
    out = torch.empty(chunk, 1, ATTN_HEADS, LATENT, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(chunk, 1, ATTN_HEADS, device="cuda")
    row["attn_us"] = timed_us(lambda: v4_sparse_decode_triton(q, scopes, sinks, LATENT**-0.5, out=out, lse=lse), reps)
    return with_model_ratio(row)


def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:8s} {r.get('B', r.get('chunk')):>5} {r['keys']:6d} | {r['error']}"
    size = r["B"] if r["case"] == "decode" else r["chunk"]
    cells = []
    for kind in KINDS:
        e = r[kind]
        k = f"{e['kernel_us']:7.1f} " if "kernel_us" in e else " " * 8
        cells.append(f"{k}{e['old_us']:8.1f}→{e['new_us']:7.1f} {e['old_ratio']:5.2f}→{e['new_ratio']:5.2f}")
    plain = r["plain"]
    ok = r.get("picks_ok", plain.get("picks_ok"))
    same = all(r[kind]["same_as_old"] for kind in KINDS)
    err = r.get("rel_err", plain.get("rel_err"))
    return (f"{r['case']:8s} {size:5d} {r['keys']:6d} | {r['attn_us']:8.1f} | " + " | ".join(cells)
            + f" | {r['model_ratio_old']:5.2f}→{r['model_ratio_new']:5.2f} | {plain['GBps']:6.0f} {err:.1e} "
            + f"{'ok' if ok else 'DIFF'} {'same' if same else 'NOT-SAME'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B = 1, 128 and the 64k prefill only")
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes of the plain kernel")
    ap.add_argument("--reps", type=int, default=30, help="milliseconds of timed replays per measurement")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    decode = [(b, k) for k in (8192, 65536) for b in ((1, 128) if args.quick else (1, 32, 128))]
    prefill = [(65536, 8192)] if args.quick else [(8192, 8192), (65536, 8192)]
    for run, params in [(decode_case, p) for p in decode] + [(prefill_case, p) for p in prefill]:
        try:
            rows.append(run(*params, args.reps, args.sweep, gen))
        except Exception as exc:  # noqa: BLE001 — one failing case must not lose the others
            case = "decode" if run is decode_case else "prefill"
            rows.append({"case": case, "B" if case == "decode" else "chunk": params[0 if case == "decode" else 1],
                         "keys": params[1 if case == "decode" else 0], "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_v4_indexer.json"), "w") as f:
            json.dump({"target_ratio": TARGET, "rows": rows}, f, indent=1)
    print(f"\nindexer step µs, old → new (kernel: the new scoring launch alone), and ÷ one layer's sparse"
          f" attention; model: the 8 index layers ÷ {MODEL_ATTN_LAYERS} attention layers per token"
          f" (target ≤ {TARGET:.2f}x)")
    print("case     B|chunk  keys |  attn µs | " + " | ".join(f"{k:>10s} kernel old→new ratio old→new"
                                                        for k in KINDS) + " | model | GB/s rel.err picks")
    for r in rows:
        print(fmt(r))


if __name__ == "__main__":
    main()
