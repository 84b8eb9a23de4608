"""deepseek_v4 config.json parsing: DeepSeek's released vocabulary and HF's give one config."""

from __future__ import annotations

import json
import os

import pytest

from model.config import ConfigError, parse_model_config
from model.v4.config import V4Config
from model.v4.rope import YarnParams

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dev-v4-s0", "config.json")


def hf_dict() -> dict:
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def release_dict() -> dict:
    """The fixture's model in the released config.json vocabulary (one extra MTP ratio entry)."""
    d = {k: v for k, v in hf_dict().items()
         if k not in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor")}
    d.update(compress_ratios=[0, 4, 8, 4, 8, 4, 0], num_hash_layers=2, rope_theta=10000.0,
             compress_rope_theta=160000.0, num_nextn_predict_layers=1,
             rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                           "beta_fast": 32, "beta_slow": 1})
    return d


def test_hf_and_release_vocabularies_agree():
    hf, rel = parse_model_config(hf_dict()), parse_model_config(release_dict())
    assert isinstance(hf, V4Config)
    for f in ("layer_kinds", "compress_ratios", "hash_layers", "main_rope", "compress_rope", "qk_rope_head_dim"):
        assert getattr(hf, f) == getattr(rel, f), f
    assert hf.layer_kinds == ("sliding", "csa", "hca", "csa", "hca", "csa")
    assert hf.compress_ratios == (0, 4, 8, 4, 8, 4)
    assert hf.hash_layers == (True, True, False, False, False, False)
    assert hf.compress_rope.yarn == YarnParams(16.0, 64, 32.0, 1.0) and hf.compress_rope.attention_factor == 1.0
    assert hf.main_rope.yarn is None and hf.main_rope.theta == 10000.0 and hf.compress_rope.theta == 160000.0
    assert rel.num_nextn_predict_layers == 1


def test_v4_flash_schedule():
    d = release_dict()
    d.update(num_hidden_layers=43, compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0], num_hash_layers=3,
             head_dim=512, qk_rope_head_dim=64, index_head_dim=128, num_attention_heads=64, o_groups=8)
    c = parse_model_config(d)
    assert c.layer_kinds.count("csa") == 21 and c.layer_kinds.count("hca") == 20
    assert c.layer_kinds[:2] == ("sliding",) * 2
    assert c.compress_ratios[2:4] == (4, 128) and c.hash_layers.count(True) == 3
    assert c.quantization is None
    d.update(expert_dtype="fp4", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert parse_model_config(d).quantization["expert_dtype"] == "fp4"


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, "unsupported layer_types entry 'full_attention'"),
    ({"mlp_layer_types": ["moe"] * 3}, "mlp_layer_types has 3 entries"),
    ({"scoring_func": "softmax"}, "unsupported scoring_func 'softmax'"),
    ({"o_groups": 3}, "divisible by o_groups"),
    ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
    ({"q_lora_rank": None}, "missing required field 'q_lora_rank'"),
])
def test_bad_configs_give_one_line_errors(change, message):
    d = hf_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=message) as info:
        parse_model_config(d)
    assert "\n" not in str(info.value)


V4_FLASH = {  # DeepSeek-V4-Flash's released config.json fields that shape the model
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "num_hash_layers": 3, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
}


def test_v4_flash_config_builds_hf_state_dict_shapes_and_rope():
    """At full V4-Flash size (on the meta device) our model has HF's exact tensor names and shapes."""
    import torch

    hf_mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    from model.v4.model import DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(**{k: v for k, v in V4_FLASH.items() if k != "model_type"})
    ours_cfg = parse_model_config(V4_FLASH)
    with torch.device("meta"):
        hf = hf_mod.DeepseekV4ForCausalLM(hf_cfg)
        ours = DeepseekV4ForCausalLM(ours_cfg, dtype=torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in hf.state_dict().items()}
    rotary = hf_mod.DeepseekV4RotaryEmbedding(hf_cfg)
    torch.testing.assert_close(ours.compress_rope.inv_freq, rotary.compress_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(ours.main_rope.inv_freq, rotary.main_inv_freq, rtol=0, atol=0)
    assert rotary.compress_attention_scaling == ours.compress_rope.spec.attention_factor == 1.0
