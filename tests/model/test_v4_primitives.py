"""The shared V4 building blocks equal HF transformers' DeepSeek-V4 modules on random inputs."""

from __future__ import annotations

import pytest
import torch

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from model.v4.attention_core import (
    causal_entry_bias,
    selected_entry_bias,
    sink_attention,
    window_bias,
)
from model.v4.mhc import HyperConnection, HyperHead, collapse_streams, expand_streams
from model.v4.moe import V4MoE
from model.v4.output_proj import GroupedLinear
from model.v4.rope import RopeSpec, RotaryTable, YarnParams, apply_trailing_rope
from tests.model.v4_oracle import randomize_, tiny_hf_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cfg():
    return tiny_hf_config()


def test_mhc_site_matches_hf(cfg):
    hf = hf_v4.DeepseekV4HyperConnection(cfg).float()
    randomize_(hf, 3)
    ours = HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(1, 7, cfg.hc_mult, cfg.hidden_size)
    post_ref, comb_ref, collapsed_ref = hf(x)
    pre, post, comb = ours(x[0])
    torch.testing.assert_close(post, post_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(comb, comb_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(collapse_streams(x[0], pre), collapsed_ref[0], rtol=0, atol=1e-6)
    assert not torch.allclose(comb, comb.transpose(-1, -2))  # a transposed mix would be caught
    out = torch.randn(7, cfg.hidden_size)
    ref = post_ref[0].unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb_ref[0].transpose(-1, -2), x[0])
    torch.testing.assert_close(expand_streams(x[0], out, post, comb), ref, rtol=0, atol=1e-6)


def test_hyper_head_matches_hf(cfg):
    hf = hf_v4.DeepseekV4HyperHead(cfg).float()
    randomize_(hf, 4)
    ours = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(1, 5, cfg.hc_mult, cfg.hidden_size)
    torch.testing.assert_close(ours(x[0]), hf(x)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_rope_tables_and_inverse_match_hf(cfg, kind):
    hf = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    p = cfg.rope_parameters[kind]
    yarn = None
    if p["rope_type"] == "yarn":
        yarn = YarnParams(p["factor"], p["original_max_position_embeddings"], p["beta_fast"], p["beta_slow"])
    table = RotaryTable(cfg.qk_rope_head_dim, RopeSpec(p["rope_theta"], yarn, p.get("attention_factor", 1.0)))
    pos = torch.tensor([0, 3, 17, 200, 1000])
    x = torch.randn(5, cfg.num_attention_heads, cfg.head_dim)
    cos_ref, sin_ref = hf(x, pos[None], layer_type=kind)
    cos, sin = table.cos_sin(pos, x.dtype)
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=0)
    ref = hf_v4.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos_ref, sin_ref)[0].transpose(0, 1)
    y = apply_trailing_rope(x, cos, sin)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_trailing_rope(y, cos, sin, inverse=True), x, rtol=0, atol=1e-5)
    assert torch.equal(y[..., : -cfg.qk_rope_head_dim], x[..., : -cfg.qk_rope_head_dim])


def test_sink_attention_matches_hf_eager(cfg):
    class Holder(torch.nn.Module):
        num_key_value_groups = cfg.num_attention_heads
        training = False

    mod = Holder()
    mod.sinks = torch.randn(cfg.num_attention_heads)
    t, s, n_e, d = 6, 9, 4, cfg.head_dim
    q = torch.randn(t, cfg.num_attention_heads, d)
    kv = torch.randn(s + n_e, d)
    q_pos = torch.arange(3, 3 + t)
    bias = torch.cat([window_bias(q_pos, torch.arange(0, s), 5), causal_entry_bias(q_pos, n_e, 2)], dim=1)
    ref, _ = hf_v4.eager_attention_forward(mod, q.transpose(0, 1)[None], kv[None, None], kv[None, None],
                                           bias[None, None], scaling=d**-0.5)
    torch.testing.assert_close(sink_attention(q, kv, bias, mod.sinks, d**-0.5), ref[0], rtol=0, atol=1e-6)


def test_mask_rules():
    q_pos = torch.tensor([0, 3, 7, 8])
    vis = causal_entry_bias(q_pos, 3, 4) == 0
    assert vis.tolist() == [[False] * 3, [True, False, False], [True, True, False], [True, True, False]]
    win = window_bias(torch.tensor([5]), torch.arange(8), 3) == 0
    assert win[0].nonzero().flatten().tolist() == [3, 4, 5]
    sel = selected_entry_bias(torch.tensor([[2, -1], [0, 1]]), 3) == 0
    assert sel.tolist() == [[False, False, True], [True, True, False]]


def test_grouped_linear_matches_hf(cfg):
    in_pg = cfg.num_attention_heads * cfg.head_dim // cfg.o_groups
    hf = hf_v4.DeepseekV4GroupedLinear(in_pg, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
    ours = GroupedLinear(in_pg, cfg.o_lora_rank, cfg.o_groups)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(5, cfg.o_groups, in_pg)
    torch.testing.assert_close(ours(x), hf(x[None])[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer", [0, 2])  # hash-routed, top-k with bias
def test_moe_matches_hf(cfg, layer):
    hf = hf_v4.DeepseekV4SparseMoeBlock(cfg, layer).float()
    randomize_(hf, 5 + layer)
    ours = V4MoE(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                 cfg.moe_intermediate_size, cfg.swiglu_limit, cfg.routed_scaling_factor, layer == 0,
                 cfg.vocab_size, torch.float32)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(1, 11, cfg.hidden_size) * 3
    ids = torch.randint(0, cfg.vocab_size, (1, 11))
    torch.testing.assert_close(ours(x[0], ids[0]), hf(x, ids)[0], rtol=0, atol=1e-5)
