"""Decode step time of a DeepSeek-V4-family model: B requests advanced one token each, either
one ``model(ids, state)`` call per request (the runner's old path), one ``model.decode``, or
(``--device cuda``) one replay of the captured decode graph (server/v4_cuda_graphs.py, pools
sized once as the server sizes them).

Checks first that every path gives the per-request logits (argmax equal, max |diff| printed),
then times steps (median of ``--steps``) and prints a short table; JSON to
``$OUT/bench_v4_decode.json`` when ``OUT`` is set. CPU by default; ``--device cuda`` syncs
around each step.

    python benchmarks/bench_v4_decode.py --model configs/arith-v41 --batch 16
    python benchmarks/bench_v4_decode.py --model tests/fixtures/dev-v4-s0 --device cuda --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from model.v4_family import load_v4_family


def _logits(model, out):
    return model.compute_logits(out) if hasattr(model, "compute_logits") else out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/arith-v41")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=40, help="longest prompt; they spread over [8, this]")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load_v4_family(args.model, getattr(torch, args.dtype), device)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lengths = [8 + (args.prompt_len - 8) * i // max(1, args.batch - 1) for i in range(args.batch)]
    max_tokens = args.prompt_len + args.steps + 2
    graphs = None
    if device.type == "cuda":
        from model.v4.cache_pool import PoolPlan
        from server.v4_cuda_graphs import V4DecodeGraphs

        model.cache_pools()
        pages = {(kind, r): (2 * args.batch * -(-(max_tokens // r) // 16) + 2, 16)
                 for kind in ("entries", "keys") for _, r in model._paged}
        model.configure_cache(args.kv_cache_dtype, plan=PoolPlan(2 * args.batch + 2, pages))
        graphs = V4DecodeGraphs(model, [args.batch], max_tokens)
        graphs.capture()
    else:
        model.configure_cache(args.kv_cache_dtype, page_rows=16)

    def fresh():
        g.manual_seed(1)  # the same prompts for every path
        states = [model.new_state() for _ in lengths]
        with torch.no_grad():
            for n, s in zip(lengths, states):
                model(torch.randint(2, vocab, (n,), generator=g).to(device), s)
        return states

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    ids = torch.randint(2, vocab, (args.steps + 1, args.batch), generator=torch.Generator().manual_seed(2)).to(device)
    results = {}
    paths = {"per-request": lambda t, st: torch.cat([_logits(model, model(t[b:b + 1], st[b]))
                                                      for b in range(len(st))])}
    paths["batched"] = lambda t, st: _logits(model, model.decode(t, st))
    if graphs is not None:
        paths["graph"] = lambda t, st: _logits(model, graphs.run(t, st))
    check = {}
    for name, fn in paths.items():
        states = None  # the previous path's units go back before the next fills the pools
        states = fresh()
        times = []
        with torch.no_grad():
            for i in range(args.steps + 1):
                sync()
                t0 = time.perf_counter()
                out = fn(ids[i], states)
                sync()
                if i == 0:
                    check[name] = out.float().cpu()
                else:
                    times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times) * 1e3
    for name in [n for n in check if n != "per-request"]:
        diff = (check[name] - check["per-request"]).abs().max().item()
        same = torch.equal(check[name].argmax(-1), check["per-request"].argmax(-1))
        print(f"check: max |{name} - per-request| logits {diff:.2e}, argmax equal: {same}")
        assert same, f"{name} decode disagrees with the per-request path"
    print(f"{'path':<12} {'ms / step':>10} {'ms / token':>11}   (B={args.batch}, {args.model}, {args.device})")
    for name, ms in results.items():
        print(f"{name:<12} {ms:>10.2f} {ms / args.batch:>11.3f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_v4_decode.json"), "w") as f:
            json.dump({"args": vars(args), "ms_per_step": results}, f, indent=1)


if __name__ == "__main__":
    main()
