"""DeepSeek-V4.1 with MXFP8 linears (model/v41/fp8_linear.py, the CPU torch reference of their
numerics) under TP2 on real process groups (gloo, fp32) equals one process: each rank holds
its heads' ``wq_b`` rows, its output group of ``wo_a``, its ``wo_b`` columns and shared-expert
slice as stored e4m3 + UE8M0 blocks, and the reduce-scatter (or all-reduce) after ``wo_b``
and ``w2`` sums the partials. tiny-v41 at o_lora_rank 32 and a 64-wide shared expert, so
every shard is whole 32-blocks.

As in test_v4_model_parallel.py the QAT fake quantizers are the identity on both sides. A
1e-7 partial-sum difference may still move one MXFP8 activation by an e4m3 step (6% of that
value); where the indexer's top-k then picks another entry, a request's later log-probs move
by up to 0.8 (measured by perturbing the attention output by 1e-7), so this config's top-k
(32 entries, 8 candidate blocks) keeps every visible entry: then a flip costs at most 2e-4
(measured), hence 1e-3 on log-probs instead of that module's 5e-5. A wrong shard misses by
far: rank 1 holding rank 0's ``wo_b`` columns is checked to fail it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed.test_v4_model_parallel import REQUESTS, _spawn, exact_rounding, run_request
from tests.model.test_v41_mxfp8_linears import mxfp8_checkpoint

TOL = 1e-3


def _load(path: str, par=None):
    from model.v41.model import load_deepseek_v41

    return load_deepseek_v41(path, torch.float32, par=par, mxfp4_experts=False, linear_backend="mxfp8")


def _tp_worker(rank, world_size, local_rank, cfg, out_dir):
    from distributed.parallel_state import get_tp_group, init_distributed
    from model.parallel import ParallelContext

    torch.set_num_threads(1)
    exact_rounding()
    init_distributed(rank, world_size, local_rank, cfg, timeout_s=60)
    tp = get_tp_group()
    path = str(Path(out_dir) / "ckpt")
    got = {}
    for layout, par in (("rs", ParallelContext.from_groups(tp)),
                        ("ar", ParallelContext.from_groups(tp, tp_reduction="all_reduce"))):
        model = _load(path, par)
        assert model.mxfp8_linears
        attn = model.model.layers[0].attn
        got[f"{layout}-shapes"] = (tuple(attn.wq_b.weight.shape), tuple(attn.wo_a.weight.shape),
                                   tuple(attn.wo_b.scale.shape))
        got[layout] = run_request(model, *REQUESTS[0])[0]
    if rank == 1:  # a wrong shard: rank 0's wo_b columns (and their scales) on rank 1 too
        other = _load(path, ParallelContext(tp_rank=0, tp_size=2))
        with torch.no_grad():
            for mine, theirs in zip(model.model.layers, other.model.layers):
                mine.attn.wo_b.weight.copy_(theirs.attn.wo_b.weight)
                mine.attn.wo_b.scale.copy_(theirs.attn.wo_b.scale)
    got["broken"] = run_request(model, *REQUESTS[0])[0]  # every rank runs it: the collectives pair up
    torch.save(got, Path(out_dir) / f"rank{rank}.pt")


def test_tp2_mxfp8_matches_one_process(tmp_path, monkeypatch):
    ckpt = mxfp8_checkpoint(tmp_path / "ckpt", inter=64, index_topk=32, candidate_topk_blocks=8)
    exact_rounding(monkeypatch.setattr)
    want = run_request(_load(ckpt), *REQUESTS[0])[0]
    for rank, got in enumerate(_spawn(_tp_worker, tmp_path, dp_size=1)):
        for layout in ("rs", "ar"):
            assert got[f"{layout}-shapes"] == ((128, 32), (32, 128), (2, 1)), (rank, layout)
            diff = (got[layout] - want).abs().max().item()
            assert diff < TOL, (rank, layout, diff)
        assert (got["broken"] - want).abs().max().item() > 100 * TOL, rank
