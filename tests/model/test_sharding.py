"""Tensor-parallel sharding lives in the layers: per-rank shards reassemble the full weights."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import write_random_checkpoint
from model.deepseek import ParallelContext
from model.loader import load_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny-v3", str(tmp_path_factory.mktemp("tp") / "m"), seed=11)


@pytest.fixture(scope="module")
def models(ckpt):
    full = load_model(ckpt, dtype="float32", progress=False)
    ranks = [load_model(ckpt, dtype="float32", par=ParallelContext(r, 2), progress=False) for r in range(2)]
    return full, ranks


def test_column_and_row_shards_concatenate_to_full(models):
    full, ranks = models
    fa, ra = full.layers[1].self_attn, [m.layers[1].self_attn for m in ranks]
    assert torch.equal(torch.cat([r.q_b_proj.weight for r in ra], 0), fa.q_b_proj.weight)
    assert torch.equal(torch.cat([r.kv_b_proj.weight for r in ra], 0), fa.kv_b_proj.weight)
    assert torch.equal(torch.cat([r.o_proj.weight for r in ra], 1), fa.o_proj.weight)
    for r in ra:  # replicated
        assert torch.equal(r.q_a_proj.weight, fa.q_a_proj.weight)
        assert torch.equal(r.kv_a_proj_with_mqa.weight, fa.kv_a_proj_with_mqa.weight)
    # absorbed matrices: per-rank heads are slices of the single-rank ones
    h = fa.num_local_heads // 2
    for i, r in enumerate(ra):
        assert torch.equal(r.w_uk, fa.w_uk[i * h:(i + 1) * h])
        assert torch.equal(r.w_uv, fa.w_uv[i * h:(i + 1) * h])
    # experts split on the intermediate dim (gate ‖ up per rank), dense MLP likewise
    fe, re_ = full.layers[1].mlp.experts, [m.layers[1].mlp.experts for m in ranks]
    i = fe.inter
    gate = torch.cat([r.w13[:, : i // 2] for r in re_], 1)
    up = torch.cat([r.w13[:, i // 2:] for r in re_], 1)
    assert torch.equal(torch.cat([gate, up], 1), fe.w13)
    assert torch.equal(torch.cat([r.w2 for r in re_], 2), fe.w2)
    emb = torch.cat([m.embed_tokens.weight for m in ranks], 0)[: full.config.vocab_size]
    assert torch.equal(emb, full.embed_tokens.weight[: full.config.vocab_size])


def test_partial_sums_add_up_to_single_rank_layer(models):
    """Row-parallel partial outputs of the two ranks sum to the single-rank output."""
    full, ranks = models
    x = torch.randn(6, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)
    with torch.no_grad():
        ref_attn = full.layers[1].self_attn(pos, x)
        ref_moe = full.layers[1].mlp(x)
        ref_mlp = full.layers[0].mlp(x)
        attn = sum(m.layers[1].self_attn(pos, x) for m in ranks)
        moe = sum(m.layers[1].mlp(x) for m in ranks)
        mlp = sum(m.layers[0].mlp(x) for m in ranks)
        emb = sum(m.embed_tokens(torch.tensor([0, 300, 511])) for m in ranks)
    assert torch.allclose(attn, ref_attn, atol=1e-5)
    assert torch.allclose(moe, ref_moe, atol=1e-5)
    assert torch.allclose(mlp, ref_mlp, atol=1e-5)
    assert torch.equal(emb, full.embed_tokens(torch.tensor([0, 300, 511])))


def test_expert_parallel_split(ckpt):
    full = load_model(ckpt, dtype="float32", progress=False)
    parts = [load_model(ckpt, dtype="float32", par=ParallelContext(0, 1, r, 2), progress=False) for r in range(2)]
    x = torch.randn(5, full.config.hidden_size)
    with torch.no_grad():
        w, ids = full.layers[2].mlp.select_experts(x)
        ref = full.layers[2].mlp.experts(x, w, ids)
        out = sum(p.layers[2].mlp.experts(x, w, ids) for p in parts)
    assert parts[1].layers[2].mlp.experts.w13.shape[0] == 4
    assert torch.allclose(out, ref, atol=1e-5)
