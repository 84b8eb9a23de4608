"""Our prefill log-softmax equals HF transformers' DeepseekV3/V2ForCausalLM (the oracle)."""

from __future__ import annotations

import pytest
import torch

from model.loader import load_model
from tests.model.hf_oracle import build_hf_model, tiny_config_dict


@pytest.fixture(scope="module", params=["tiny-v3", "tiny-v2"])
def hf_pair(request, tmp_path_factory):
    cfg = tiny_config_dict(request.param)
    hf = build_hf_model(cfg, seed=1)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    ours = load_model(str(out), dtype="float32", progress=False)
    return request.param, hf, ours


def test_oracle_config_exercises_the_architecture(hf_pair):
    name, hf, ours = hf_pair
    c = ours.config
    assert c.n_routed_experts >= 8
    assert c.rope_scaling.factor > 1  # YaRN
    if name == "tiny-v3":
        assert c.q_lora_rank and c.n_group == 4 and c.topk_group == 2
        bias = ours.layers[1].mlp.e_score_correction_bias
        assert bias.abs().min() > 0  # non-zero correction bias
        assert c.v_head_dim != c.qk_nope_head_dim
    else:
        assert c.q_lora_rank is None and c.n_shared_experts == 2 and c.scoring_func == "softmax"


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_prefill_log_softmax_matches_hf(hf_pair, seq_len):
    _, hf, ours = hf_pair
    gen = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, ours.config.vocab_size, (1, seq_len), generator=gen)
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        hidden = ours(ids[0], torch.arange(seq_len))
        out = torch.log_softmax(ours.compute_logits(hidden), dim=-1)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-3


def test_routing_matches_hf_router(hf_pair):
    """The chosen experts and weights equal HF's router on random hidden states."""
    _, hf, ours = hf_pair
    x = torch.randn(50, ours.config.hidden_size)
    with torch.no_grad():
        _, w_ref, ids_ref = hf.model.layers[1].mlp.gate(x)
        w, ids = ours.layers[1].mlp.select_experts(x)
    order_ref, order = ids_ref.sort(-1), ids.sort(-1)
    assert torch.equal(order_ref.values, order.values)
    assert torch.allclose(w_ref.gather(1, order_ref.indices), w.gather(1, order.indices), atol=1e-6)
