"""--load-format dummy for the V4 family: every tensor gets a deterministic finite value, the
models run end to end on it, and V4.1's engram hashing works without a matching tokenizer."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from model.checkpoint import load_config_dict, write_checkpoint_metadata
from model.config import parse_model_config
from model.v4.model import DeepseekV4ForCausalLM
from model.v4_family import random_v4_family
from model.v4_random import init_random_weights, initializer_std
from model.v41.engram import EngramHasher, synthetic_compressed_token_map
from model.v41.model import DeepseekV41ForCausalLM

PRESETS = [("tiny-v4", DeepseekV4ForCausalLM), ("tiny-v41", DeepseekV41ForCausalLM)]


def _poisoned(preset, cls):
    """The model with every float tensor NaN and the hash table -1, so nothing left unset hides."""
    cfg = parse_model_config(load_config_dict(preset))
    model = cls(cfg, torch.float32)
    with torch.no_grad():
        for _, t in [*model.named_parameters(), *model.named_buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else -1)
    return model


@pytest.mark.parametrize("preset,cls", PRESETS)
def test_every_tensor_gets_a_deterministic_finite_value(preset, cls):
    model = init_random_weights(_poisoned(preset, cls), seed=3, std=0.02, num_experts=4)
    state = model.state_dict()
    for name, t in state.items():
        assert torch.isfinite(t.float()).all(), name
    for name, t in model.named_parameters():
        if name.endswith(("sinks", "attn_sink", "gate.bias", "gate.bias_vl", "_base", "position_bias")):
            assert not t.any(), name
        elif name.endswith(("norm.weight", "_scale", "embed.scale", "q_weight", "k_weight")):
            assert (t == 1).all(), name
        elif t.dim() >= 2:
            assert 0.01 < t.std().item() < 0.03, name  # normal(0, 0.02)
    again = init_random_weights(_poisoned(preset, cls), seed=3, std=0.02, num_experts=4).state_dict()
    other = init_random_weights(_poisoned(preset, cls), seed=4, std=0.02, num_experts=4).state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert not torch.equal(state["lm_head.weight"], other["lm_head.weight"])
    if cls is DeepseekV4ForCausalLM:  # hash-routed layer 0: k distinct experts per token
        table = model.model.layers[0].mlp.gate.tid2eid
        assert table.min() >= 0 and table.max() < 4
        assert (table[:, 0] != table[:, 1]).all()
        assert len(set(table[:, 0].tolist())) == 4


def test_a_tensor_no_rule_names_is_an_error():
    model = init_random_weights(_poisoned("tiny-v41", DeepseekV41ForCausalLM), 0, 0.02, 4)
    model.model.layers[0].attn.mystery = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.attn\.mystery"):
        init_random_weights(model, 0, 0.02, 4)


@pytest.mark.parametrize("preset,cls", PRESETS)
def test_random_model_runs_prefill_and_decode_finite(preset, cls, tmp_path, caplog):
    cfg = load_config_dict(preset)  # tiny-v41: all 8 layers, two engram layers
    write_checkpoint_metadata(cfg, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="model.v4_family"):
        model = random_v4_family(str(tmp_path), torch.float32, "cpu", seed=0)
    assert isinstance(model, cls)
    assert initializer_std(model.config) == 0.02
    if cls is DeepseekV41ForCausalLM:  # the bundled test tokenizer's compressed vocab is not 270
        assert "synthetic token map id mod 270" in caplog.text
    state = model.new_state()
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0))
    outs = [model(ids, state)] + [model(ids[i:i + 1], state) for i in range(2)]
    for out in outs:
        logits = model.compute_logits(out) if hasattr(model, "compute_logits") else out
        assert torch.isfinite(logits).all() and logits.std() > 0
    same = random_v4_family(str(tmp_path), torch.float32, "cpu", seed=0).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in model.state_dict().items())


def test_synthetic_token_map_covers_the_compressed_vocabulary():
    cfg = parse_model_config(load_config_dict("tiny-v41"))
    token_map = synthetic_compressed_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    assert len(token_map) >= cfg.vocab_size and max(token_map) + 1 == cfg.engram_compressed_vocab_size
    assert token_map[5] == 5 and token_map[275] == 5
    # A vocabulary smaller than the compressed one still names every compressed id.
    assert max(synthetic_compressed_token_map(10, 50)) == 49
    hasher = EngramHasher(cfg, token_map)
    ids, _ = hasher(torch.arange(cfg.vocab_size), [])
    for j, rows in enumerate(cfg.engram_num_embeddings):
        assert 0 <= ids[:, j].min() and ids[:, j].max() < rows


@pytest.mark.gpu
@pytest.mark.parametrize("preset,cls", PRESETS)
def test_random_model_is_made_on_the_gpu(preset, cls, tmp_path):
    write_checkpoint_metadata(load_config_dict(preset), str(tmp_path))
    model = random_v4_family(str(tmp_path), torch.bfloat16, "cuda", seed=0)
    assert all(t.is_cuda for t in (*model.parameters(), *model.buffers()))
    again = random_v4_family(str(tmp_path), torch.bfloat16, "cuda", seed=0)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    out = model(torch.arange(1, 21, device="cuda"), model.new_state())
    logits = model.compute_logits(out) if hasattr(model, "compute_logits") else out
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("preset,cls", PRESETS)
def test_a_ranks_shard_gets_values_and_its_replicated_tensors_match_the_other_rank(preset, cls, tmp_path):
    """TP2 with expert parallelism, built per rank (no process groups needed to build): the
    same seed gives both ranks the same replicated tensors, and each rank half the experts."""
    from model.parallel import ParallelContext
    from server.bench.roofline import decode_weights

    write_checkpoint_metadata(load_config_dict(preset), str(tmp_path))
    ranks = [random_v4_family(str(tmp_path), torch.float32, "cpu", seed=0,
                              par=ParallelContext(tp_rank=r, tp_size=2, ep_rank=r, ep_size=2)) for r in (0, 1)]
    states = [m.state_dict() for m in ranks]
    for name, t in states[0].items():
        assert torch.isfinite(t.float()).all(), name
        if name.endswith(("norm.weight", "_fn", "gate.weight")):  # replicated on every rank
            assert torch.equal(t, states[1][name]), name
    full_model = random_v4_family(str(tmp_path), torch.float32, "cpu", seed=0)
    full = decode_weights(full_model)
    shard = decode_weights(ranks[0])
    assert shard.expert_bytes == full.expert_bytes  # whole experts per rank, half as many
    routed = [sum(p.numel() for n, p in m.named_parameters() if ".experts." in n) for m in (ranks[0], full_model)]
    assert 2 * routed[0] == routed[1]



def test_random_fp8_preset_gets_mxfp8_linears_in_the_stored_format(tmp_path):
    """An FP8 V4.1 config (32×32 blocks) with ``--linear-backend mxfp8``: random e4m3 values and
    E8M0 block scales whose weights have about the initializer's std, made in place; the model
    runs, and the roofline counts the linears' one byte per weight."""
    from model.v41.fp8_linear import MXFP8Linear
    from server.bench.roofline import decode_weights, linear_format

    cfg = load_config_dict("tiny-v41")
    cfg["text_config"]["o_lora_rank"] = 32  # whole 32-row output groups
    write_checkpoint_metadata(cfg, str(tmp_path))
    model = random_v4_family(str(tmp_path), torch.float32, "cpu", seed=0, linear_backend="mxfp8")
    plain = random_v4_family(str(tmp_path), torch.float32, "cpu", seed=0)  # auto on the CPU: dequantized
    linears = [m for m in model.modules() if isinstance(m, MXFP8Linear)]
    assert linears and not any(isinstance(m, MXFP8Linear) for m in plain.modules())
    for m in linears:
        w = m.dequantized()
        assert torch.isfinite(w).all() and 0.01 < w.std().item() < 0.04
        assert len(set(m.scale.view(torch.uint8).flatten().tolist())) <= 2  # 2^(b-1) or 2^b
    again = random_v4_family(str(tmp_path), torch.float32, "cpu", seed=0, linear_backend="mxfp8").state_dict()
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731 (fp8 has no torch.equal)
    assert all(torch.equal(raw(v), raw(again[k])) for k, v in model.state_dict().items())
    logits = model(torch.arange(1, 21), model.new_state())
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert linear_format(model) == "mxfp8" and linear_format(plain) == "float32"
    assert decode_weights(model).dense_bytes < decode_weights(plain).dense_bytes
