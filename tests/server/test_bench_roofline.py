"""The decode-step HBM roofline arithmetic (server/bench/roofline.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from model.checkpoint import load_config_dict
from model.config import parse_model_config
from model.v4.model import DeepseekV4ForCausalLM
from model.v41.model import DeepseekV41ForCausalLM
from server.bench.roofline import (
    H200_HBM_BYTES_PER_S,
    decode_roofline,
    decode_step_bytes,
    decode_weights,
    expected_distinct_experts,
    expert_format,
    format_roofline,
)


def test_expected_distinct_experts_is_exact_for_uniform_routing():
    """Against every routing of B tokens, each picking k of E experts uniformly."""
    for e, k, b in ((4, 2, 3), (5, 1, 4), (6, 3, 2)):
        choices = list(itertools.combinations(range(e), k))
        total = sum(len(set().union(*picks)) for picks in itertools.product(choices, repeat=b))
        assert expected_distinct_experts(e, k, b) == pytest.approx(total / len(choices) ** b)
    assert expected_distinct_experts(384, 6, 1) == pytest.approx(6)
    assert expected_distinct_experts(384, 6, 10_000) == pytest.approx(384)


def test_decode_step_bytes_adds_its_parts():
    r = decode_step_bytes(dense_bytes=1000, per_request_bytes=10, expert_bytes=100, num_experts=4, top_k=2,
                          moe_layers=3, batch=2, kv_bytes_per_request=50)
    assert r["expected_experts_per_layer"] == pytest.approx(3.0)  # 4 * (1 - (1/2)^2)
    assert r["routed_expert_bytes"] == pytest.approx(3 * 3.0 * 100)
    assert (r["per_request_bytes"], r["kv_bytes"]) == (20, 100)
    assert r["total_bytes"] == pytest.approx(1000 + 20 + 900 + 100)


@pytest.mark.parametrize("preset,cls", [("tiny-v4", DeepseekV4ForCausalLM), ("tiny-v41", DeepseekV41ForCausalLM)])
def test_decode_weights_split_the_model(preset, cls):
    cfg = parse_model_config(load_config_dict(preset))
    model = cls(cfg, torch.bfloat16)
    w = decode_weights(model)
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2  # gate, up, down in bf16
    assert w.expert_bytes == expert
    assert (w.num_experts, w.top_k, w.moe_layers) == (4, 2, cfg.num_hidden_layers)
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    embed = cfg.vocab_size * cfg.hidden_size * 2
    tables = 0
    if cls is DeepseekV41ForCausalLM:  # engram tables: bf16 rows + fp32 scales, one per 32 channels
        tables = sum(rows * (cfg.engram_head_dim * 2 + cfg.engram_head_dim // 32 * 4)
                     for rows in cfg.engram_num_embeddings)
    assert w.dense_bytes == total - embed - tables - expert * 4 * cfg.num_hidden_layers
    row = cfg.hidden_size * 2
    if cls is DeepseekV41ForCausalLM:
        cols = cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1)
        row += len(cfg.engram_layer_ids) * cols * (cfg.engram_head_dim * 2 + cfg.engram_head_dim // 32 * 4)
    assert w.per_request_bytes == row


def test_decode_roofline_against_a_step_profile():
    cfg = parse_model_config(load_config_dict("tiny-v41"))
    model = DeepseekV41ForCausalLM(cfg, torch.bfloat16)
    profile = {"kinds": {
        "prefill": {"steps": 2, "total_s": 1.0, "mean_batch": 3.0},
        "decode-eager": {"steps": 3, "total_s": 0.03, "mean_batch": 2.0},
        "decode-graph": {"steps": 1, "total_s": 0.002, "mean_batch": 6.0},
    }}
    r = decode_roofline(model, profile, kv_bytes_per_request=1e6)
    assert r["mean_decode_batch"] == pytest.approx(3.0) and r["decode_steps"] == 4
    assert r["measured_mean_ms"] == pytest.approx(8.0)
    assert r["kv_bytes"] == pytest.approx(3e6)
    assert r["roofline_ms"] == pytest.approx(1e3 * r["total_bytes"] / H200_HBM_BYTES_PER_S)
    assert r["fraction_of_roofline"] == pytest.approx(r["roofline_ms"] / 8.0)
    assert "ms per decode step" in format_roofline(r)
    assert r["expert_format"] == "bfloat16" and "routed experts bfloat16" in format_roofline(r)
    assert decode_roofline(model, {"kinds": {"prefill": profile["kinds"]["prefill"]}}, 0.0) is None


def test_decode_weights_count_stacked_mxfp4_experts_when_the_model_runs_them():
    cfg = parse_model_config(load_config_dict("tiny-v41"))
    model = DeepseekV41ForCausalLM(cfg, torch.bfloat16)
    bf16 = decode_weights(model)
    for layer in model.model.layers:
        layer.ffn.pack_experts_mxfp4(backend="reference")
    w = decode_weights(model)
    # 4-bit codes (two per byte) plus one E8M0 byte per 32 values: 17/64 of the bf16 bytes
    assert w.expert_bytes == bf16.expert_bytes * 17 // 64
    assert w.dense_bytes == bf16.dense_bytes  # the per-expert bf16 copies are not read
    assert expert_format(model) == "mxfp4"
    stacked = DeepseekV41ForCausalLM(cfg, torch.bfloat16, mxfp4_experts=True)  # as an MXFP4 checkpoint loads
    assert decode_weights(stacked) == w
    moe = stacked.model.layers[0].ffn
    moe.mxfp4_path = "w4a8"  # what a call on an H200 records
    assert expert_format(stacked) == "mxfp4 (w4a8)"
