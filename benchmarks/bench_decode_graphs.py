"""Decode step time with full-decode CUDA graphs vs eager, on a preset's shape (random weights).

    python3 -m benchmarks.bench_decode_graphs --model deepseek-v2-lite --batch 1 2 4 8 --context 512

For each batch size it starts ``batch`` requests with ``context``-token prompts, runs until
all are decoding, then times ``--steps`` whole engine steps (schedule + forward + sample)
with the GPU synchronized, once with ``--enforce-eager`` and once with graphs. Prints a
table and writes JSON to ``--output-json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time



def time_decode_steps(core, batch: int, context: int, steps: int, vocab: int) -> float:
    import torch

    from server.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid in ids:
        core.add_request(rid, torch.randint(10, vocab, (context,), generator=g).tolist(), params)
    while core.scheduler.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in core.scheduler.running.values()):
        core.step()
    for _ in range(3):  # warm-up decode steps
        core.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - t0) / steps
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()

    from model.checkpoint import load_config_dict, write_checkpoint_metadata
    from server.config import EngineConfig
    from server.engine_core import EngineCore

    cfg = load_config_dict(ns.model)
    if ns.num_layers:
        cfg["num_hidden_layers"] = ns.num_layers
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint_metadata(cfg, tmp)
        for eager in (True, False):
            config = EngineConfig(model=tmp, load_format="dummy", device="cuda", enforce_eager=eager,
                                  kv_cache_dtype=ns.kv_cache_dtype, max_model_len=ns.context + ns.steps + 64,
                                  max_num_seqs=max(ns.batch), max_cudagraph_capture_size=max(ns.batch),
                                  num_gpu_blocks_override=max(ns.batch) * (-(-(ns.context + ns.steps + 64) // 64)) + 8)
            core = EngineCore(config, tmp)
            for b in ns.batch:
                rows.setdefault(b, {})["eager" if eager else "graph"] = time_decode_steps(
                    core, b, ns.context, ns.steps, min(cfg["vocab_size"], 1000))
            del core
            import torch

            torch.cuda.empty_cache()
    print(f"\n{ns.model} ({cfg['num_hidden_layers']} layers), context {ns.context}, kv {ns.kv_cache_dtype}")
    print(f"{'batch':>5} {'eager ms':>10} {'graph ms':>10} {'speed-up':>9}")
    for b, r in rows.items():
        print(f"{b:>5} {r['eager'] * 1e3:>10.2f} {r['graph'] * 1e3:>10.2f} {r['eager'] / r['graph']:>8.2f}x")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"model": ns.model, "context": ns.context, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
