"""V4.1 lightning indexer (Triton, kernels/v4_indexer_triton.py) next to the sparse attention it
feeds (kernels/v4_sparse_decode_triton.py), at V4.1-Flash's shapes, in one process.

Indexer: 32 heads × 128 dims, keys as 68-byte FP4 records in shuffled pages of 64, top-k 512,
candidate blocks of 8 (top 2048). Attention: 64 heads × 512, 128 window rows (528-byte
records) + the 512 picked entries (288-byte records) per query. Cases: decode B = 1, 32, 128
at 8k and 64k keys per request (a ratio-1 layer: one key per token; every request at the full
context), and one 8192-token prefill chunk ending at 8k / 64k (scored 256 queries per launch,
as the model does). Indexer layer kinds: ``plain`` (scores + top-k), ``cand_src`` (the
candidate source: + block maxima + block top-k), ``restricted`` (a later layer: scores under
the candidate mask + top-k) and ``ratio2`` (plain over half the keys: layers 2, 8, 14). The
``model`` column puts the 8 index layers of a V4.1-Flash token over its 38 sparse attention
layers (:func:`with_model_ratio`).

Correctness first: the kernel's scores against the torch reference on the same records
(first requests / queries; unused pages NaN-poisoned), the picks the same up to ties. Then
timing: CUDA-graph replays, L2 emptied before each, median (``benchmarks.bench_mla_decode.time_call``).
``kernel`` is the scoring launch alone (writing the int64 top-k keys, as the model runs it);
``total`` adds the query quantization and the selection (one ``torch.topk`` on the keys).
The ratio is ``total`` / attention against the 30 % target; ``GB/s`` counts each visible
key's 68 bytes once per launch plus its 8-byte top-k key written.

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
from kernels.v4_indexer import (candidate_blocks, index_scores_reference, quantize_index_queries, topk_picks,
                                topk_picks_from_keys)
from kernels.v4_indexer_triton import index_scores_triton
from kernels.v4_sparse_decode import SparseKV
from kernels.v4_sparse_decode_triton import v4_sparse_decode_triton

HEADS, DIM, TOPK, BLOCK, TOPK_BLOCKS = 32, 128, 512, 8, 2048  # V4.1-Flash indexer
ATTN_HEADS, LATENT, WINDOW = 64, 512, 128  # V4.1-Flash attention (one GPU)
PAGE = 64
QUERY_BLOCK = 256  # prefill queries per launch (model/v41/indexer.py)
TARGET = 0.30
MODEL_ATTN_LAYERS = 38
REF_ROWS = 2
SWEEP = [dict(block_n=64), dict(block_n=256, num_warps=8), dict(block_n=128, num_warps=8), dict(num_stages=1),
         dict(skip_dead_tiles=False)]
PREFILL_SWEEP = [dict(block_q=2, block_n=64, num_warps=4, num_stages=3), dict(block_q=4, block_n=32, num_warps=4,
                                                                               num_stages=3),
                 dict(num_stages=1)]


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


def decode_case(bsz: int, num_keys: int, reps: int, sweep: bool, gen: torch.Generator) -> dict:
    pool, tables = paged_keys(bsz, num_keys, gen)
    q_raw = torch.randn(bsz, HEADS, DIM, device="cuda", generator=gen)
    w = torch.randn(bsz, HEADS, device="cuda", generator=gen) * HEADS**-0.5
    vis = torch.full((bsz,), num_keys, dtype=torch.long, device="cuda")
    nblocks = -(-num_keys // BLOCK)
    allowed = torch.zeros(bsz, nblocks, dtype=torch.bool, device="cuda")
    allowed[:, torch.randperm(nblocks, device="cuda", generator=gen)[:TOPK_BLOCKS]] = True
    q8, qs = quantize_index_queries(q_raw)
    row = {"case": "decode", "B": bsz, "keys": num_keys}
    n = min(REF_ROWS, bsz)
    half = num_keys // 2
    kinds = {"plain": (None, False, num_keys, vis), "cand_src": (None, True, num_keys, vis),
             "restricted": (allowed, False, num_keys, vis), "ratio2": (None, False, half, vis // 2)}
    for kind, (al, bmax, nk, vk) in kinds.items():  # keys and counts of this kind
        args = (q8, qs, w, pool, tables, PAGE, vk, nk, DIM**-0.5, 1)
        got, got_b = index_scores_triton(*args, al, BLOCK, bmax)
        sub = (q8[:n], qs[:n], w[:n], pool, tables[:n], PAGE, vk[:n], nk, DIM**-0.5, 1)
        want, want_b = index_scores_reference(*sub, None if al is None else al[:n], BLOCK, bmax)
        err = check_scores(got[:n], want)
        if bmax:
            err = max(err, check_scores(got_b[:n], want_b))
        keys, _ = index_scores_triton(*args, al, BLOCK, bmax, keys_out=True)
        ties = same_picks_up_to_ties(topk_picks_from_keys(keys[:n], TOPK).cpu(), topk_picks(want, TOPK).cpu(),
                                     want.cpu())

        def kernel(al=al, bmax=bmax, nk=nk, vk=vk, **shape):
            return index_scores_triton(q8, qs, w, pool, tables, PAGE, vk, nk, DIM**-0.5, 1, al, BLOCK, bmax,
                                       keys_out=True, **shape)

        def total(al=al, bmax=bmax, nk=nk, vk=vk):
            a8, a_s = quantize_index_queries(q_raw)
            keys, bm = index_scores_triton(a8, a_s, w, pool, tables, PAGE, vk, nk, DIM**-0.5, 1, al, BLOCK,
                                           bmax, keys_out=True)
            picks = topk_picks_from_keys(keys, TOPK)
            return picks, (candidate_blocks(bm, vk.view(-1, 1), TOPK_BLOCKS, BLOCK) if bmax else None)

        k_us = timed_us(kernel, reps)
        entry = {"kernel_us": k_us, "total_us": timed_us(total, reps), "rel_err": err, "picks_ok": ties,
                 "GBps": (bsz * nk * (68 + 8)) / (k_us * 1e-6) * 1e-9}
        if sweep and kind == "plain":
            entry["sweep"] = {json.dumps(s): timed_us(lambda s=s: kernel(**s), reps) for s in SWEEP}
        row[kind] = entry
    q, scopes, sinks = attention_inputs(bsz, 4096, True, gen)
    out = torch.empty(bsz, 1, ATTN_HEADS, LATENT, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(bsz, 1, ATTN_HEADS, device="cuda")
    row["attn_us"] = timed_us(lambda: v4_sparse_decode_triton(q, scopes, sinks, LATENT**-0.5, out=out, lse=lse), reps)
    return with_model_ratio(row)


def with_model_ratio(row: dict) -> dict:
    """V4.1-Flash per token: index sources 2, 8, 14 score half the keys (ratio 2), 20 is the
    candidate source, 24 … 36 (4) are restricted; 38 layers attend window + top-k (the 2
    window-only layers left out, so the ratio is not flattered)."""
    idx = 3 * row["ratio2"]["total_us"] + row["cand_src"]["total_us"] + 4 * row["restricted"]["total_us"]
    row["model_ratio"] = idx / (MODEL_ATTN_LAYERS * row["attn_us"])
    return row


def prefill_case(context: int, chunk: int, reps: int, sweep: bool, gen: torch.Generator) -> dict:
    pool, tables = paged_keys(1, context, gen)
    first = context - chunk
    positions = torch.arange(first, context, device="cuda")
    vis = positions + 1  # ratio 1
    q_raw = torch.randn(chunk, HEADS, DIM, device="cuda", generator=gen)
    w = torch.randn(chunk, HEADS, device="cuda", generator=gen) * HEADS**-0.5
    row = {"case": "prefill", "chunk": chunk, "keys": context}

    def blocks(bmax: bool, allowed: torch.Tensor | None = None, ratio: int = 1, **shape):
        picks = []
        a8, a_s = quantize_index_queries(q_raw)
        keys, seen = context // ratio, (positions + 1) // ratio
        for s in range(0, chunk, QUERY_BLOCK):
            e = min(chunk, s + QUERY_BLOCK)
            ordered, bm = index_scores_triton(a8[s:e], a_s[s:e], w[s:e], pool, tables, PAGE, seen[s:e], keys,
                                              DIM**-0.5, e - s, None if allowed is None else allowed[s:e], BLOCK,
                                              bmax, keys_out=True, **shape)
            picks.append(topk_picks_from_keys(ordered, TOPK))
            if bmax:
                candidate_blocks(bm, seen[s:e].view(-1, 1), TOPK_BLOCKS, BLOCK)
        return picks

    q8, qs = quantize_index_queries(q_raw)
    s, e = chunk - QUERY_BLOCK, chunk  # the last block: the most keys visible
    got, _ = index_scores_triton(q8[s:e], qs[s:e], w[s:e], pool, tables, PAGE, vis[s:e], context, DIM**-0.5, e - s)
    idx = torch.arange(s, e, 37, device="cuda")  # a spread of its queries
    want, _ = index_scores_reference(q8[idx], qs[idx], w[idx], pool, tables, PAGE, vis[idx], context, DIM**-0.5,
                                     idx.numel())
    row["rel_err"] = check_scores(got[idx - s], want)
    keys, _ = index_scores_triton(q8[s:e], qs[s:e], w[s:e], pool, tables, PAGE, vis[s:e], context, DIM**-0.5, e - s,
                                  keys_out=True)
    row["picks_ok"] = same_picks_up_to_ties(topk_picks_from_keys(keys[idx - s], TOPK).cpu(),
                                            topk_picks(want, TOPK).cpu(), want.cpu())
    keys_read = sum(int(vis[min(chunk, b + QUERY_BLOCK) - 1]) for b in range(0, chunk, QUERY_BLOCK))
    nblocks = -(-context // BLOCK)
    allowed = torch.zeros(chunk, nblocks, dtype=torch.bool, device="cuda")
    allowed[:, torch.randperm(nblocks, device="cuda", generator=gen)[:TOPK_BLOCKS]] = True
    kinds = {"plain": (False, None, 1), "cand_src": (True, None, 1), "restricted": (False, allowed, 1),
             "ratio2": (False, None, 2)}
    for kind, (bmax, al, ratio) in kinds.items():
        total = timed_us(lambda bmax=bmax, al=al, ratio=ratio: blocks(bmax, al, ratio), reps)
        row[kind] = {"total_us": total, "GBps": keys_read * 68 / ratio / (total * 1e-6) * 1e-9}
        if sweep and kind == "plain":
            row[kind]["sweep"] = {json.dumps(sh): timed_us(lambda sh=sh: blocks(False, **sh), reps)
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
    for kind in ("plain", "cand_src", "restricted", "ratio2"):
        if kind in r:
            e = r[kind]
            k = f"{e['kernel_us']:7.1f}/" if "kernel_us" in e else ""
            cells.append(f"{k}{e['total_us']:8.1f} {e['total_us'] / r['attn_us']:6.2f}x")
    ok = r.get("picks_ok", r.get("plain", {}).get("picks_ok"))
    err = r.get("rel_err", r.get("plain", {}).get("rel_err"))
    gbps = r["plain"]["GBps"]
    return (f"{r['case']:8s} {size:5d} {r['keys']:6d} | {r['attn_us']:8.1f} | " + " | ".join(cells)
            + f" | {r['model_ratio']:5.2f}x | {gbps:6.0f} {err:.1e} {'ok' if ok else 'DIFF'}")


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
    print(f"\nindexer µs (kernel/total) and total ÷ one layer's sparse attention; model: the 8 index"
          f" layers ÷ {MODEL_ATTN_LAYERS} attention layers per token (target ≤ {TARGET:.2f}x)")
    print("case     B|chunk  keys |  attn µs |      plain kernel/total ratio |   cand_src kernel/total ratio |"
          " restricted kernel/total ratio | ratio2 (half the keys) | model | GB/s  rel.err picks")
    for r in rows:
        print(fmt(r))


if __name__ == "__main__":
    main()
