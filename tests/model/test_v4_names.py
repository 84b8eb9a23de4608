"""DeepSeek's released tensor names <-> HF names, checked against the golden checkpoints'
release_names.json (saved key -> released name) and transformers' own V4 state_dict."""

from __future__ import annotations

import json
import os

import pytest

from model.v4_names import (
    V4,
    V41,
    UnknownTensorName,
    is_mtp_name,
    is_vision_name,
    released_to_hf,
    to_released,
    v4_hf_to_released,
    v4_released_to_hf,
    v4_released_to_saved,
    v4_saved_to_released,
    v41_hf_to_released,
    v41_released_to_hf,
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def _release_names(name: str) -> dict[str, str]:
    with open(os.path.join(FIXTURES, name, "release_names.json")) as f:
        return json.load(f)


def test_v4_saved_names_map_to_released_and_back():
    names = _release_names("dev-v4-s0")
    assert len(names) == 242
    for saved, released in names.items():
        assert v4_saved_to_released(saved) == released
        assert v4_released_to_saved(released) == saved
        assert to_released(released, V4) == released  # released names pass through


def test_v41_hf_names_map_to_released_and_back():
    names = _release_names("dev-v41-s1-rel")  # the same map as dev-v41-s0's
    assert len(names) == 302
    for hf, released in names.items():
        assert v41_released_to_hf(released).name == hf
        assert v41_hf_to_released(hf) == released
        assert to_released(hf, V41) == released


def test_v4_released_names_cover_hf_state_dict_exactly():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config.from_pretrained(os.path.join(FIXTURES, "dev-v4-s0"))
    hf_names = set(transformers.DeepseekV4ForCausalLM(cfg).state_dict())
    released = set(_release_names("dev-v4-s0").values())
    assert {v4_released_to_hf(n).name for n in released} == hf_names
    back = set()
    for name in hf_names:
        back.update(v4_hf_to_released(name, num_experts=cfg.n_routed_experts))
    assert back == released


def test_v4_rename_table_entries():
    ref = v4_released_to_hf("layers.3.ffn.experts.2.w3.scale")
    assert (ref.name, ref.expert, ref.half, ref.is_scale) == ("model.layers.3.mlp.experts.gate_up_proj", 2, 1, True)
    ref = v4_released_to_hf("layers.3.ffn.experts.5.w2.weight")
    assert (ref.name, ref.expert, ref.half) == ("model.layers.3.mlp.experts.down_proj", 5, 0)
    cases = {
        "layers.0.attn.wq_a.scale": "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
        "layers.2.attn.indexer.wq_b.weight": "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.2.attn.indexer.weights_proj.weight":
            "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.2.attn.indexer.compressor.ape": "model.layers.2.self_attn.compressor.indexer.position_bias",
        "layers.4.ffn.gate.bias": "model.layers.4.mlp.gate.e_score_correction_bias",
        "layers.0.hc_ffn_scale": "model.layers.0.ffn_hc.scale",
        "hc_head_fn": "model.hc_head.hc_fn",
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
    }
    for released, hf in cases.items():
        assert v4_released_to_hf(released).name == hf
        assert released in v4_hf_to_released(hf)
    assert v41_released_to_hf("layers.1.engram.embed.scale").name == "model.layers.1.engram.embed.scale"
    assert v41_released_to_hf("embed.weight").name == "model.embed.weight"


def test_unknown_names_and_skipped_families():
    with pytest.raises(UnknownTensorName):
        v4_released_to_hf("layers.0.attn.wq_c.weight")
    with pytest.raises(UnknownTensorName):
        released_to_hf("lm_head.bias", V41)
    with pytest.raises(ValueError, match="architecture"):
        released_to_hf("embed.weight", "deepseek_v3")
    assert is_mtp_name("mtp.0.e_proj.weight") and is_mtp_name("mtp.2.markov_head.markov_w1.weight")
    assert is_vision_name("vision.blocks.0.attn.qkv.weight") and is_vision_name("aligner.fc1.weight")
    assert not is_mtp_name("layers.0.attn.wq_a.weight") and not is_vision_name("embed.weight")
