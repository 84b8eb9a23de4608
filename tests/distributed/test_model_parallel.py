"""The model under real process groups (gloo, fp32): TP2 in reduce-scatter and all-reduce
modes, DP2 and DP2 × TP2 (data-parallel attention, the MoE over all ranks: expert parallel
or every expert split), equal single-process TP1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.checkpoint import write_random_checkpoint
from model.forward_context import ForwardContext, build_attention_metadata, forward_context

BLOCK = 16


def _inputs(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g)


def _run_model(model, ids, decode_steps: int):
    """Prefill ids[:-decode_steps] through a paged cache, then decode the rest one by one.
    Returns log-softmax rows of every step, concatenated."""
    c = model.config
    caches = [torch.full((16, BLOCK, c.kv_cache_entry_dim), float("nan")) for _ in range(c.num_hidden_layers)]
    table = [3, 1, 7, 5]
    n0 = len(ids) - decode_steps
    outs = []
    with torch.no_grad():
        md = build_attention_metadata([table], [0], [n0], BLOCK)
        with forward_context(ForwardContext(md, caches)):
            outs.append(model.compute_logits(model(ids[:n0], torch.arange(n0))))
        for p in range(n0, len(ids)):
            md = build_attention_metadata([table], [p], [1], BLOCK, num_decode_seqs=1)
            with forward_context(ForwardContext(md, caches)):
                outs.append(model.compute_logits(model(ids[p:p + 1], torch.tensor([p]))))
    return torch.log_softmax(torch.cat(outs), -1)


def _tp_worker(rank, world_size, local_rank, cfg, out_dir, ckpt, mode):
    from distributed import comm
    from distributed.parallel_state import get_tp_group, init_distributed
    from model.loader import load_model
    from model.parallel import ParallelContext

    torch.set_num_threads(1)
    init_distributed(rank, world_size, local_rank, cfg, timeout_s=60)
    par = ParallelContext.from_groups(get_tp_group(), tp_reduction=mode)
    model = load_model(ckpt, dtype="float32", par=par, progress=False)
    comm.reset_collective_counts()
    out = _run_model(model, _inputs(0, 13), decode_steps=4)
    torch.save({"logprobs": out, "counts": comm.collective_counts()}, Path(out_dir) / f"rank{rank}.pt")


def _dp_worker(rank, world_size, local_rank, cfg, out_dir, ckpt, mode="reduce_scatter"):
    """DP on DP × TP ranks (the TP ranks of one DP group run that group's tokens); the MoE
    spans all ranks: whole experts (expert parallel) or a slice of every expert."""
    from distributed import comm
    from distributed.parallel_state import get_ep_group, get_tp_group, get_world_group, init_distributed
    from model.loader import load_model
    from model.parallel import ParallelContext

    torch.set_num_threads(1)
    init_distributed(rank, world_size, local_rank, cfg, timeout_s=60)
    ep = cfg.enable_expert_parallel
    par = ParallelContext.from_groups(get_tp_group(), get_ep_group() if ep else get_world_group(),
                                      tp_reduction=mode, dispatch_moe=True, moe_tensor_parallel=not ep)
    model = load_model(ckpt, dtype="float32", par=par, progress=False)
    comm.reset_collective_counts()
    # Unbalanced: DP rank 0 runs 11 tokens, DP rank 1 runs 5, then DP rank 1 is idle (a dummy
    # 1-token step with no attention work) while DP rank 0 decodes.
    dp = cfg.dp_rank(rank)
    ids = _inputs(dp + 1, 11 if dp == 0 else 5)
    out = _run_model(model, ids, decode_steps=3)
    if dp == 1:
        c = model.config
        for _ in range(2):
            caches = [torch.zeros(1, BLOCK, c.kv_cache_entry_dim) for _ in range(c.num_hidden_layers)]
            md = build_attention_metadata([], [], [], BLOCK, num_pad_tokens=1)
            with torch.no_grad(), forward_context(ForwardContext(md, caches)):
                model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    else:
        extra = _inputs(9, 2)
        caches = [torch.full((4, BLOCK, model.config.kv_cache_entry_dim), float("nan"))
                  for _ in range(model.config.num_hidden_layers)]
        with torch.no_grad():
            for p in range(2):
                md = build_attention_metadata([[2]], [p], [1], BLOCK, num_decode_seqs=1 if p else 0)
                with forward_context(ForwardContext(md, caches)):
                    model(extra[p:p + 1], torch.tensor([p]))
    experts = model.layers[-1].mlp.experts
    torch.save({"logprobs": out, "counts": comm.collective_counts(),
                "experts": (experts.num_local, experts.inter_local)}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny-v3", str(tmp_path_factory.mktemp("mp") / "m"), seed=13)


@pytest.fixture(scope="module")
def tp1(ckpt):
    from model.loader import load_model

    return load_model(ckpt, dtype="float32", progress=False)


def _spawn(fn, world, tmp_path, *args, dp_size=1, ep=False):
    from distributed.launcher import find_free_port, spawn_workers
    from distributed.parallel_state import ParallelConfig
    from tests.distributed.conftest import START_METHOD

    cfg = ParallelConfig(tp_size=world // dp_size, dp_size=dp_size, enable_expert_parallel=ep,
                         master_port=find_free_port())
    group = spawn_workers(fn, world, (str(tmp_path), *args), cfg, device="cpu", start_method=START_METHOD,
                          join_timeout_s=120)
    codes = group.join()
    assert all(c == 0 for c in codes.values()), codes
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("mode", ["reduce_scatter", "all_reduce"])
def test_tp2_matches_tp1(ckpt, tp1, tmp_path, mode):
    ref = _run_model(tp1, _inputs(0, 13), decode_steps=4)
    results = _spawn(_tp_worker, 2, tmp_path, ckpt, mode)
    for r in results:
        assert (r["logprobs"] - ref).abs().max().item() < 1e-5
    counts = results[0]["counts"]
    if mode == "reduce_scatter":
        # 13-token prefill padded to 14, then 1-token decodes padded to 2: always equal shards
        assert counts["reduce_scatter_tensor"] > 0 and counts["reduce_scatter_v"] == 0
        assert counts["all_reduce"] == 0
    else:
        assert counts["all_reduce"] > 0 and counts["reduce_scatter_tensor"] == 0


def _check_dp(results, tp1, tp_size, ep):
    for rank, r in enumerate(results):
        dp = rank // tp_size
        ref = _run_model(tp1, _inputs(dp + 1, 11 if dp == 0 else 5), decode_steps=3)
        assert (r["logprobs"] - ref).abs().max().item() < 1e-5, f"rank {rank}"
    experts, world = tp1.layers[-1].mlp.experts, len(results)
    # whole experts, E/world per rank; or every expert, 1/world of its intermediate dim
    want = (experts.num_local // world, experts.inter) if ep else (experts.num_local, experts.inter // world)
    assert all(tuple(r["experts"]) == want for r in results)
    counts = results[0]["counts"]
    assert counts["all_gather_v"] > 0 and counts["reduce_scatter_v"] > 0  # unbalanced rows
    assert counts["all_gather_tensor"] > 0  # the per-step row-count exchange (and equal steps)


@pytest.mark.parametrize("ep", [True, False], ids=["dep", "moe_tp"])
def test_dp2_matches_single_process(ckpt, tp1, tmp_path, ep):
    _check_dp(_spawn(_dp_worker, 2, tmp_path, ckpt, dp_size=2, ep=ep), tp1, tp_size=1, ep=ep)


@pytest.mark.parametrize("mode, ep", [("reduce_scatter", True), ("all_reduce", True), ("reduce_scatter", False)])
def test_dp2_tp2_matches_single_process(ckpt, tp1, tmp_path, mode, ep):
    """DP2 × TP2 with the MoE over all 4 ranks: heads split in each DP group, each TP rank
    dispatches its own slice of its group's rows."""
    results = _spawn(_dp_worker, 4, tmp_path, ckpt, mode, dp_size=2, ep=ep)
    _check_dp(results, tp1, tp_size=2, ep=ep)
    if mode == "reduce_scatter":
        assert results[0]["counts"]["reduce_scatter_tensor"] > 0  # the TP layers' equal shards
    else:
        assert results[0]["counts"]["all_reduce"] > 0
