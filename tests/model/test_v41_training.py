"""The batched training forward of DeepSeek-V4.1 against the inference forward.

The model is the HF-golden fixture ``dev-v41-s0`` (8 layers, ratios [0,2,2,2,1,1,1,1], KV sources
1 and 4, re-indexing and reuse layers, candidate blocks, engram, mHC, sinks, window 8), so a
match here is a match with HF's V4.1 on every feature.
"""

from __future__ import annotations

import os

import pytest
import torch

from model.v41.model import load_deepseek_v41
from model.v41.training import (
    FROZEN_SUFFIXES,
    forward_sequences,
    masked_lm_loss,
    prepare_for_training,
    update_router_biases,
)

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "dev-v41-s0")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return load_deepseek_v41(FIXTURE, torch.float32)


def _ids(b: int, t: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_each_row_equals_a_one_shot_prefill(model):
    ids = _ids(3, 41, 0, model.config.vocab_size)  # 41: an open ratio-2 group at the end
    with torch.no_grad():
        batched = forward_sequences(model, ids).logits
        for b in range(ids.shape[0]):
            ref = model(ids[b], model.new_state())
            # As below: GEMMs of other shapes round differently by CPU (1.2e-4 measured on an AMD
            # EPYC, under 1e-5 elsewhere), which may flip one FP4/FP8 rounding.
            assert (batched[b] - ref).abs().max().item() <= 1e-3, b


def test_right_padding_changes_nothing_before_it(model):
    ids = _ids(2, 30, 1, model.config.vocab_size)
    with torch.no_grad():
        batched = forward_sequences(model, ids).logits
        for n in (3, 8, 17):  # shorter than the window, one window, past it
            ref = model(ids[0, :n], model.new_state())
            # A 1e-7 difference in a GEMM of another shape may flip one FP4/FP8 rounding.
            assert (batched[0, :n] - ref).abs().max().item() <= 1e-4, n


def test_hash_sequences_equals_the_incremental_hasher(model):
    ids = _ids(2, 13, 2, model.config.vocab_size)
    batched = model.hasher.hash_sequences(ids)
    for b in range(2):
        assert torch.equal(batched[b], model.hasher(ids[b], [])[0])


def test_dense_moe_equals_the_routed_one(model):
    moe = model.model.layers[2].ffn
    x = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense, ids = moe.forward_dense(x)
        assert torch.allclose(dense, moe(x), atol=1e-6, rtol=0)
        assert torch.equal(ids, moe.gate(x)[1])


def test_gradients_reach_every_trained_parameter(model):
    from model.config import parse_model_config
    from model.v41.model import DeepseekV41ForCausalLM

    fresh = DeepseekV41ForCausalLM(parse_model_config(model.config.raw), torch.float32)
    prepare_for_training(fresh, seed=0)
    fresh.bind_tokenizer(os.path.join(FIXTURE, "tokenizer.json"))
    fresh.load_weights(model.state_dict())  # non-zero sinks, mHC bases, biases
    ids = _ids(2, 24, 4, model.config.vocab_size)
    out = forward_sequences(fresh, ids)
    labels = ids.clone()
    labels[:, :5] = -100
    loss = masked_lm_loss(out.logits, labels) + torch.stack(out.indexer_losses).sum()
    loss.backward()
    assert len(out.indexer_losses) == len(fresh.config.index_source_layer_ids)
    assert all(float(x.detach()) >= 0 for x in out.indexer_losses)
    chosen = [set(ids.unique().tolist()) for ids in out.expert_ids]
    assert any(len(c) < fresh.config.n_routed_experts for c in chosen)  # some expert is idle
    for name, p in fresh.named_parameters():
        reached = p.grad is not None and bool(p.grad.abs().sum() > 0)
        parts = name.split(".")
        if name.endswith(FROZEN_SUFFIXES):
            assert not p.requires_grad, name
        elif "experts" in parts and "shared_experts" not in parts:  # only experts some token chose
            layer, expert = int(parts[2]), int(parts[5])
            assert reached == (expert in chosen[layer]), name
        else:
            assert reached, name
    # The indexer learns from its own loss only: the language-model loss leaves it untouched.
    fresh.zero_grad()
    masked_lm_loss(forward_sequences(fresh, ids).logits, labels).backward()
    idx = fresh.model.layers[1].attn.indexer
    assert all(p.grad is None or not p.grad.any() for p in idx.parameters())


def test_router_bias_moves_toward_balance(model):
    from model.config import parse_model_config
    from model.v41.model import DeepseekV41ForCausalLM

    m = DeepseekV41ForCausalLM(parse_model_config(model.config.raw), torch.float32)
    ids = [torch.tensor([[0, 1], [0, 1], [0, 2]])] + [torch.tensor([[3, 2]])] * (len(m.model.layers) - 1)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.ffn.gate.bias.zero_()
    fractions = update_router_biases(m, ids, 0.01)
    bias = m.model.layers[0].ffn.gate.bias
    assert bias.tolist() == pytest.approx([0.0, 0.0, 0.02, 0.02])  # over-loaded experts lowered
    assert fractions[0].tolist() == pytest.approx([0.5, 2 / 6, 1 / 6, 0.0])


def _identity(x, *args, **kwargs):
    return x


@pytest.mark.gpu
def test_training_step_on_cuda_matches_cpu(model, monkeypatch):
    """The training forward on a GPU: the CPU's logits, and a backward pass that runs.

    The model's FP4/FP8 fake quantizations are discontinuous: a 1e-7 difference between the two
    devices' float32 arithmetic can flip one rounding and move a logit by 1e-3 or more (seen in
    float64 too, where parts still run in float32), and the indexer's top-k breaks ties at ReLU
    zeros by device. So the exact comparison runs with the quantizers as the identity, on six
    tokens (no more visible entries than index_topk, so every entry is picked); with them on,
    at 40 tokens, most rows must still agree.
    """
    import model.v41.attention as attention
    import model.v41.indexer as indexer
    import model.v41.model as v41_model

    cpu = load_deepseek_v41(FIXTURE, torch.float64)
    gpu = load_deepseek_v41(FIXTURE, torch.float64, "cuda")
    assert cpu.config.index_topk >= 6
    short = _ids(4, 6, 4, model.config.vocab_size)
    with monkeypatch.context() as m, torch.no_grad():
        for module, name in ((attention, "fake_quant_fp4"), (attention, "fake_quant_fp8_ue8m0"),
                             (indexer, "fake_quant_fp4"), (v41_model, "fake_quant_fp4"),
                             (v41_model, "fake_quant_fp8_ue8m0")):
            m.setattr(module, name, _identity)
        diff = (forward_sequences(gpu, short.cuda()).logits.cpu() - forward_sequences(cpu, short).logits).abs()
    assert diff.max().item() <= 1e-5
    for p in gpu.parameters():
        p.requires_grad_(True)
    ids = _ids(4, 40, 5, model.config.vocab_size)
    with torch.no_grad():
        cpu_logits = forward_sequences(cpu, ids).logits
    out = forward_sequences(gpu, ids.cuda())
    row_diff = (out.logits.detach().cpu() - cpu_logits).abs().amax(-1)
    assert torch.isfinite(out.logits).all()
    assert (row_diff <= 1e-4).float().mean().item() >= 0.75, row_diff
    (out.logits.logsumexp(-1).mean() + torch.stack(out.indexer_losses).sum()).backward()
    assert gpu.model.layers[1].attn.indexer.wq_b.weight.grad.abs().sum() > 0
    load = update_router_biases(gpu, out.expert_ids, 1e-3)
    assert all(abs(float(f.sum()) - 1.0) < 1e-6 for f in load)
