"""V4 / V4.1 sparse prefill: our Triton kernels vs the torch reference path on one 8192-token
chunk per layer kind, at the Flash models' shapes (configs/deepseek-v41-flash.json,
configs/deepseek-v4-flash.json: 512-dim latent, window 128, top-k 512; heads per GPU 64 at
TP1 and 8 at TP8).

Each case is one request's chunk of ``--tokens`` tokens at ``--start`` (a later chunk of a
long prompt: the window reaches into the cached ring rows, entries exist from before the
chunk) over pools shaped as the server's (ring rows of a 128-row unit, entries on scattered
64-row pages, every other row poisoned with 0xFF / NaN). Picks: each token's top-k of random
scores among its visible entries. First the kernels' output is checked against the float32
reference (relative error of out; tests/kernels/test_v4_sparse_prefill.py checks against
float64), then the kernels and the model's torch attention (what a chunk ran before: the
rows gathered and decoded to bf16, query blocks of 256 over [window slice ‖ all entries]
with additive masks, model/v4/attention.py) are timed as CUDA-graph replays with the L2
emptied before each (the project's timer, ``benchmarks.bench_mla_decode.time_call``), median
over ``--reps`` ms.
TFLOP/s counts the products actually needed: 2·2·512 FLOPs per head per visible key
(window rows in range + valid picks, or visible entries), not the masked tiles.

    python3 benchmarks/bench_v4_sparse_prefill.py [--quick] [--reps 200] [--tokens 8192] [--start 8192]

Prints a table last; with $OUT set, writes $OUT/bench_v4_sparse_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.bench_mla_decode import time_call
from kernels.v4_cache_formats import pack_v41_entries, pack_v41_window_rows, pack_v4_rows
from kernels.v4_sparse_prefill import PrefillEntries, PrefillWindow, StoredRows, v4_sparse_prefill_reference
from kernels.v4_sparse_prefill_triton import SparsePrefillConfig, resolve_prefill_config, v4_sparse_prefill_triton
from model.v4.attention_core import causal_entry_bias, selected_entry_bias, sink_attention, window_bias

DIM, WINDOW, TOPK, PAGE = 512, 128, 512, 64
SCALE = DIM**-0.5
C = SparsePrefillConfig
# (name, window record, entry record, entries: picks / causal / none, ratio)
KINDS = [
    ("v41 ratio-2 (KV source, top-k)", "v41_window", "v41_entry", "picks", 2),
    ("v41 ratio-1 (top-k)", "v41_window", "v41_entry", "picks", 1),
    ("v41 window only", "v41_window", None, "none", 0),
    ("v4 CSA ratio-4 (top-k)", "v4", "v4", "picks", 4),
    ("v4 HCA ratio-128 (all)", "v4", "v4", "causal", 128),
    ("v41 ratio-2, kv auto (bf16)", "rows", "rows", "picks", 2),
]
SWEEP = {  # window-kernel alternatives by heads (None fields: the default's)
    8: {"bt8_w4": C(block_t=8, num_warps=4), "bt16_dv1": C(dv_split=1), "bn64": C(block_n=64),
        "st1": C(num_stages=1)},
    64: {"bt2_w8": C(block_t=2, num_warps=8), "bh16_bt4": C(block_h=16, block_t=4), "bn64": C(block_n=64),
         "st1": C(num_stages=1)},
}


def _pack(rows: torch.Tensor, record: str) -> torch.Tensor:
    if record == "rows":
        return rows.to(torch.bfloat16)
    if record == "v4":
        return pack_v4_rows(rows, 64)
    return (pack_v41_window_rows if record == "v41_window" else pack_v41_entries)(rows)


def _pool(num_rows: int, live: torch.Tensor, values: torch.Tensor, record: str) -> torch.Tensor:
    packed = _pack(values, record)
    fill = float("nan") if record == "rows" else 0xFF
    pool = torch.full((num_rows, packed.shape[-1]), fill, dtype=packed.dtype, device=values.device)
    pool[live] = packed
    return pool


def build_case(tokens: int, start: int, heads: int, record_w: str, record_e: str | None, mode: str, ratio: int,
               seed: int = 0):
    """(q, window, entries, sinks, visible keys per token [T]) on the GPU."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    end = start + tokens

    def rows(n):
        return torch.randn(n, DIM, device=dev, generator=gen) * (1 + 2 * torch.rand(n, 1, device=dev, generator=gen))

    p_cached = min(start, WINDOW - 1)
    cached_pos = torch.arange(start - p_cached, start, device=dev)
    wrows = WINDOW + cached_pos % WINDOW  # ring unit 1 of 4
    cached = StoredRows(_pool(4 * WINDOW, wrows, rows(p_cached), record_w), record_w)
    chunk = StoredRows(_pack(rows(tokens), record_w), record_w).read(torch.arange(tokens, device=dev), DIM,
                                                                    torch.bfloat16)
    window = PrefillWindow(chunk, cached, wrows.to(torch.int32), WINDOW)
    positions = torch.arange(start, end, device=dev)
    keys = torch.clamp(positions + 1, max=WINDOW)
    entries = None
    if mode != "none":
        n = end // ratio
        pages = -(-n // PAGE)
        perm = torch.randperm(2 * pages, device=dev, generator=gen)[:pages] + 1  # scattered pages, none is 0
        erows = perm.repeat_interleave(PAGE)[:n] * PAGE + torch.arange(n, device=dev) % PAGE
        store = StoredRows(_pool((2 * pages + 2) * PAGE, erows, rows(n), record_e), record_e)
        picks = None
        visible = (positions + 1) // ratio
        if mode == "picks":
            picks = torch.empty(tokens, TOPK, dtype=torch.long, device=dev)
            for a in range(0, tokens, 1024):  # top-k of random scores among the visible entries
                b = min(a + 1024, tokens)
                scores = torch.rand(b - a, n, device=dev, generator=gen)
                scores = scores.masked_fill(torch.arange(n, device=dev) >= visible[a:b, None], float("-inf"))
                top = scores.topk(min(TOPK, n), dim=-1)
                picks[a:b, : top.indices.shape[1]] = torch.where(top.values > float("-inf"), top.indices, -1)
                picks[a:b, top.indices.shape[1]:] = -1
            keys = keys + (picks >= 0).sum(-1)
        else:
            keys = keys + visible.clamp(max=n)
        entries = PrefillEntries(store, erows, picks, ratio)
    q = (torch.randn(tokens, heads, DIM, device=dev, generator=gen) * 2).to(torch.bfloat16)
    sinks = torch.randn(heads, device=dev, generator=gen)
    return q, window, entries, sinks, keys


def model_torch_attention(q, start, window, entries, sinks, block: int = 256):
    """The model's attention of a chunk before the sparse prefill (model/v4/attention.py's query
    blocks on gathered, decoded rows), in q's dtype."""
    t, dim = q.shape[0], q.shape[-1]
    cached = window.cached.read(window.rows, dim, q.dtype)
    keys = torch.cat([cached, window.chunk.to(q.dtype)])
    first = start - cached.shape[0]
    key_pos = torch.arange(first, start + t, device=q.device)
    positions = torch.arange(start, start + t, device=q.device)
    ent = entries.stored.read(entries.rows, dim, q.dtype) if entries is not None else None
    out = torch.empty_like(q)
    for a in range(0, t, block):
        b = min(a + block, t)
        lo, hi = max(0, start + a - window.size + 1 - first), start + b - first
        block_keys, bias = keys[lo:hi], window_bias(positions[a:b], key_pos[lo:hi], window.size)
        if ent is not None:
            if entries.picks is not None:
                entry_bias = selected_entry_bias(entries.picks[a:b], ent.shape[0])
            else:
                entry_bias = causal_entry_bias(positions[a:b], ent.shape[0], entries.ratio)
            block_keys, bias = torch.cat([block_keys, ent]), torch.cat([bias, entry_bias], dim=1)
        out[a:b] = sink_attention(q[a:b], block_keys, bias, sinks, SCALE)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def timed_us(fn, reps_ms: int) -> float:
    return time_call(fn, (5, reps_ms), use_graph=True)[0] * 1e6


def bench_case(kind, heads: int, tokens: int, start: int, reps: int, sweep: bool) -> dict:
    name, record_w, record_e, mode, ratio = kind
    q, window, entries, sinks, keys = build_case(tokens, start, heads, record_w, record_e, mode, ratio,
                                                 seed=heads + ratio)
    flops = 4 * DIM * heads * keys.sum().item()
    row = {"kind": name, "H": heads, "T": tokens, "start": start, "keys_per_token": keys.float().mean().item(),
           "gflop": flops * 1e-9, "ours": []}

    want = v4_sparse_prefill_reference(q, start, window, entries, sinks, SCALE)

    def torch_path():
        return model_torch_attention(q, start, window, entries, sinks)

    row["torch_rel_err"] = rel_err(torch_path(), want)
    configs = {"default": None}
    if sweep:
        configs.update(SWEEP[8 if heads <= 8 else 64])
    out = torch.empty_like(want)
    for label, cfg in configs.items():
        def ours(cfg=cfg):
            return v4_sparse_prefill_triton(q, start, window, entries, sinks, SCALE, config=cfg, out=out)
        try:
            out.fill_(float("nan"))
            ours()
            err = rel_err(out, want)
            us = timed_us(ours, reps)
        except Exception as exc:  # noqa: BLE001 — one failing variant must not lose the others
            row["ours"].append({"name": label, "config": resolve_prefill_config(heads, cfg).__dict__,
                                "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        row["ours"].append({"name": label, "config": resolve_prefill_config(heads, cfg).__dict__, "us": us,
                            "rel_err": err, "nan": bool(out.isnan().any())})
    default = next(r for r in row["ours"] if r["name"] == "default")
    if "us" in default:
        timed = [r for r in row["ours"] if "us" in r]
        best = min(timed, key=lambda r: r["us"])
        row.update(us=default["us"], tflops=flops / default["us"] * 1e-6, rel_err=default["rel_err"],
                   best=best["name"], best_us=best["us"])
    row["torch_us"] = timed_us(torch_path, max(reps, 1))
    row["torch_tflops"] = flops / row["torch_us"] * 1e-6
    if "us" in row:
        row["speedup"] = row["torch_us"] / row["us"]
    return row


def fmt(r: dict) -> str:
    head = f"{r['kind']:31s} {r['H']:3d} {r['keys_per_token']:6.0f} {r['gflop']:7.1f} |"
    if "us" not in r:
        return head + f" {r.get('error') or r['ours'][0].get('error')}"
    return (head + f" {r['us']:9.1f} {r['tflops']:6.1f} {r['rel_err']:.1e} {r['best_us']:9.1f} {r['best']:>11} |"
            f" {r['torch_us']:10.1f} {r['torch_tflops']:6.1f} | {r['speedup']:6.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 heads, V4.1 ratio-2 and V4 HCA only")
    ap.add_argument("--sweep", action="store_true", help="also time the window kernel's alternative shapes")
    ap.add_argument("--reps", type=int, default=200, help="milliseconds of timed replays per case")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--start", type=int, default=8192, help="the chunk's first position")
    ap.add_argument("--heads", type=int, nargs="*", default=[64, 8], help="query heads per GPU")
    args = ap.parse_args()
    rows = []
    kinds = [KINDS[0], KINDS[4]] if args.quick else KINDS
    heads_list = [64] if args.quick else args.heads
    for heads in heads_list:
        for kind in kinds:
            try:
                rows.append(bench_case(kind, heads, args.tokens, args.start, args.reps, args.sweep))
            except Exception as exc:  # noqa: BLE001 — one failing case must not lose the others
                rows.append({"kind": kind[0], "H": heads, "keys_per_token": 0, "gflop": 0, "ours": [],
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
                print("case failed:", rows[-1], flush=True)
                torch.cuda.empty_cache()
                continue
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_v4_sparse_prefill.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\nT = {args.tokens} tokens at start {args.start}; keys = visible keys per token (window + valid picks "
          "or entries); torch = the model's torch attention")
    print(f"{'kind':31s}   H   keys  GFLOP |   ours µs TFLOP/s rel.err   best µs    best cfg |   torch µs TFLOP/s |"
          " speedup")
    for r in rows:
        print(fmt(r))


if __name__ == "__main__":
    main()
