"""V4.1 decode KV writes: the fused Triton kernels vs the torch chain, at V4.1-Flash shapes.

Per layer kind of ``deepseek-v41-flash`` (head_dim 512, RoPE 64, index keys 128, window 128):

- ``window``: the window row every layer writes (norm + RoPE + encode + ring insert);
- ``source_r2``: a ratio-2 KV source (layers 2, 8, 14): the window row, the compressor step
  (ring store, softmax pooling of the 2 slots, norm, RoPE at the window's first position,
  entry encode + paged insert) and the indexer key (``wk`` GEMM on the latent, then
  norm + RoPE + encode + insert);
- ``source_r1``: the ratio-1 source (layer 20): window row, entry row, indexer key.

The raw projections (``wkv``, ``wgate``) are inputs, the same for both; ``wk`` is timed in
both. Decode batches B = 1, 32, 128 at random positions (three in four close a ratio-2 window),
both cache dtypes (``auto``: bf16 fake-quantized values; ``fp8``: the 528 / 288 / 68-byte
records). Each case is first checked (the written rows of both paths: ≥ 90 % byte-identical,
the rest within a quantization step), then timed as CUDA-graph replays with the L2 emptied
before each, median (``benchmarks.bench_mla_decode.time_call``). The last table gives µs per
layer for both and torch / fused, and the per-step sum over the 40 layers (36 window-only,
3 ratio-2 sources, 1 ratio-1 source).

    python3 benchmarks/bench_v4_kv_write.py [--batches 1 32 128] [--reps 100]

Prints a table last; with $OUT set, writes $OUT/bench_v4_kv_write.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from benchmarks.bench_mla_decode import time_call
from kernels.attention.v4_kv_write import compress_step, write_rows
from kernels.v4_kv_write import RowNorm, RowStore, RowTarget
from model.checkpoint import load_config_dict
from model.config import parse_model_config
from model.v41.model import v41_row_codecs

KINDS = ("window", "source_r2", "source_r1")
LAYERS_PER_KIND = {"window": 36, "source_r2": 3, "source_r1": 1}
PAGE_ROWS = 64
MAX_POSITION = 4096


def build_case(config, kind: str, batch: int, cache: str, seed: int = 0, dev: str = "cuda") -> dict:
    """Pools (NaN / 0xFF poisoned), inputs and targets of one layer's decode writes."""
    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    d, k, rope, w = config.head_dim, config.index_head_dim, config.qk_rope_head_dim, config.sliding_window
    window_codec, entry_codec, key_codec = v41_row_codecs(config, cache, bf16)

    def pool(rows, codec):
        t = torch.empty(rows, codec.width, dtype=codec.dtype, device=dev)
        return t.fill_(float("nan")) if codec.dtype.is_floating_point else t.fill_(0xFF)

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    positions = torch.randint(0, MAX_POSITION, (batch,), generator=g)
    positions[::2] |= 1  # every other request closes a ratio-2 window (B = 1 too)
    positions = positions.to(dev)
    units = torch.randperm(batch, generator=g).to(dev) + 1
    pages = MAX_POSITION // PAGE_ROWS + 1
    table = (torch.arange(batch * pages, device=dev).view(batch, pages) + 1)
    ang = torch.rand(batch, rope // 2, generator=g) * 6.2832
    case = {
        "kind": kind, "positions": positions, "cos": ang.cos().to(bf16).to(dev), "sin": ang.sin().to(bf16).to(dev),
        "x": randn(batch, d), "kv_norm": RowNorm(randn(d) * 0.1 + 1, config.rms_norm_eps, True),
        "window": pool((batch + 1) * w, window_codec), "window_codec": window_codec,
        "ring": RowTarget(positions, w, ring_base=units * w),
    }
    if kind == "window":
        return case
    ratio = 2 if kind == "source_r2" else 1
    entry_rows = (batch * pages + 1) * PAGE_ROWS
    case.update({
        "ratio": ratio, "comp_norm": RowNorm(randn(d) * 0.1 + 1, config.rms_norm_eps, True),
        "k_norm": RowNorm(randn(k) * 0.1 + 1, config.rms_norm_eps, True), "wk": randn(k, d) * d**-0.5,
        "entries": pool(entry_rows, entry_codec), "entry_codec": entry_codec,
        "keys": pool(entry_rows, key_codec), "key_codec": key_codec,
        "paged": RowTarget(positions, PAGE_ROWS, page_table=table, ratio=ratio),
        "entry_cos": ang.cos().to(bf16).to(dev).flip(0), "entry_sin": ang.sin().to(bf16).to(dev).flip(0),
    })
    if ratio == 2:
        case.update({"raw_kv": randn(batch, d, dtype=torch.float32), "raw_gate": randn(batch, d, dtype=torch.float32),
                     "kv_ring": randn((batch + 1) * 2, d, dtype=torch.float32),
                     "gate_ring": randn((batch + 1) * 2, d, dtype=torch.float32),
                     "comp_ring": RowTarget(positions, 2, ring_base=units * 2)})
    else:
        case["raw_kv"] = randn(batch, d)
    return case


def layer_writes(c: dict, impl: str) -> None:
    """One layer's decode KV writes (the model's calls: model/v41/attention.py)."""
    write_rows(c["x"], c["kv_norm"], c["cos"], c["sin"], RowStore(c["window"], c["window_codec"].encode,
                                                                  c["window_codec"].format), c["ring"], impl)
    if c["kind"] == "window":
        return
    entries = RowStore(c["entries"], c["entry_codec"].encode, c["entry_codec"].format)
    cos, sin = c["entry_cos"], c["entry_sin"]
    if c["ratio"] == 2:
        latent = compress_step(c["raw_kv"], c["raw_gate"], c["kv_ring"], c["gate_ring"], c["comp_ring"],
                               c["comp_ring"].ring_base, 2, False, None, c["comp_norm"], cos, sin, entries,
                               c["paged"], impl, True)
    else:
        latent = write_rows(c["raw_kv"], c["comp_norm"], cos, sin, entries, c["paged"], impl, True)
    write_rows(torch.nn.functional.linear(latent, c["wk"]), c["k_norm"], cos, sin,
               RowStore(c["keys"], c["key_codec"].encode, c["key_codec"].format), c["paged"], impl)


POOLS = ("window", "entries", "keys", "kv_ring", "gate_ring")


def check(case: dict) -> tuple[bool, str]:
    """Both paths from the same pools: written rows ≥ 90 % byte-identical, all within a step."""
    start = {n: case[n].clone() for n in POOLS if n in case}
    results = {}
    for impl in ("torch", "triton"):
        for n, t in start.items():
            case[n].copy_(t)
        layer_writes(case, impl)
        if case["x"].is_cuda:
            torch.cuda.synchronize()
        results[impl] = {n: case[n].clone() for n in start}
    closes = (case["positions"] + 1) % case.get("ratio", 1) == 0
    written = {"window": case["ring"].flat_rows()}
    if "paged" in case:
        written["entries"] = written["keys"] = case["paged"].flat_rows()[closes]
    notes, ok = [], True
    for n, rows in written.items():
        if rows.numel() == 0:
            continue
        a, b = results["triton"][n][rows], results["torch"][n][rows]
        same = (a.view(torch.uint8) == b.view(torch.uint8)).all(-1).float().mean().item()
        codec = case[{"window": "window_codec", "entries": "entry_codec", "keys": "key_codec"}[n]]
        da, db = codec.decode(a).float(), codec.decode(b).float()
        step = 0.35 if n != "window" else 0.13
        close = bool(((da - db).abs() <= step * db.abs().amax(-1, keepdim=True) + 1e-6).all())
        ok &= same >= 0.9 and close
        notes.append(f"{n} {same:.1%} identical")
    for n in ("kv_ring", "gate_ring"):
        if n in results["torch"]:
            ok &= torch.equal(results["torch"][n], results["triton"][n])
    return ok, ", ".join(notes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--reps", type=int, default=100, help="ms of graph replays per timing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    config = parse_model_config(load_config_dict("deepseek-v41-flash"))
    rows, all_ok = [], True
    for cache in ("auto", "fp8"):
        for batch in args.batches:
            for kind in KINDS:
                case = build_case(config, kind, batch, cache)
                ok, note = check(case)
                all_ok &= ok
                print(f"check {cache} B={batch} {kind}: {'ok' if ok else 'MISMATCH'} ({note})", flush=True)
                row = {"cache": cache, "batch": batch, "kind": kind, "correct": ok}
                for impl in ("torch", "triton"):
                    sec, mode = time_call(lambda i=impl: layer_writes(case, i), (25, args.reps), use_graph=True)
                    row[impl + "_us"], row["timing"] = sec * 1e6, mode
                rows.append(row)
    print(f"\n{'cache':5} {'B':>4} {'layer':10} {'torch µs':>9} {'fused µs':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['cache']:5} {r['batch']:>4} {r['kind']:10} {r['torch_us']:9.1f} {r['triton_us']:9.1f} "
              f"{r['torch_us'] / r['triton_us']:6.2f}{'' if r['correct'] else '  MISMATCH'}")
    print("\nper decode step, 40 layers (36 window-only, 3 ratio-2 sources, 1 ratio-1 source):")
    for cache in ("auto", "fp8"):
        for batch in args.batches:
            sel = [r for r in rows if r["cache"] == cache and r["batch"] == batch]
            t = sum(LAYERS_PER_KIND[r["kind"]] * r["torch_us"] for r in sel)
            f = sum(LAYERS_PER_KIND[r["kind"]] * r["triton_us"] for r in sel)
            print(f"  {cache:5} B={batch:>4}: torch {t:8.1f} µs, fused {f:8.1f} µs, ratio {t / f:5.2f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_v4_kv_write.json"), "w") as fh:
            json.dump({"rows": rows, "all_correct": all_ok}, fh, indent=1)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
