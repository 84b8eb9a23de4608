"""DeepSeek-V4.1 pieces on their own: config parsing/schedule, compressor v2, candidate blocks,
indexer visibility, router, and a bf16 smoke run (the golden comparison is test_deepseek_v41.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

from model.config import ConfigError, parse_model_config
from model.v41.compressor import Compressor
from model.v41.config import parse_v41_config
from model.v41.indexer import Indexer, blocks_to_entries, select_candidate_blocks
from model.v41.model import DeepseekV41ForCausalLM
from model.v41.moe import Router

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "dev-v41-s0")


def _fixture_config() -> dict:
    with open(os.path.join(FIXTURE, "config.json")) as f:
        return json.load(f)


def _released_like() -> dict:
    """The released V4.1-Flash config.json's shape (values from its published text_config)."""
    return {
        "model_type": "deepseek_v41",
        "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "expert_dtype": "fp4"},
        "text_config": {
            "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
            "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
            "o_groups": 8, "o_lora_rank": 1024, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
            "num_nextn_predict_layers": 3, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
            "engram_pad_token_id": 2, "rms_norm_eps": 1e-20, "n_routed_experts": 384,
        },
        "vision_config": {"model_type": "deepseek_v41_vision"},
    }


def test_fixture_config_parses_through_the_dispatch():
    cfg = parse_model_config(_fixture_config())
    assert cfg.model_type == "deepseek_v41"
    assert cfg.compress_ratios == (0, 2, 2, 2, 1, 1, 1, 1)
    assert [cfg.kv_source_of(i) for i in range(8)] == [None, 1, 1, 1, 4, 4, 4, 4]
    assert [cfg.index_source_of(i) for i in range(8)] == [None, 1, 1, 3, 4, 4, 6, 6]
    assert cfg.candidate_source_layer_id == 4 and cfg.rms_norm_eps == 1e-20
    assert cfg.compress_rope.yarn.factor == 16.0 and cfg.main_rope.yarn is None
    bare = parse_model_config(_fixture_config()["text_config"])
    assert bare.image_token_id is None and cfg.image_token_id == 129264
    assert dataclasses.replace(bare, image_token_id=129264) == cfg


def test_released_config_defaults_and_schedule():
    cfg = parse_v41_config(_released_like())
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20)
    assert cfg.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert cfg.candidate_source_layer_id == 20
    assert len(cfg.compress_ratios) == 40  # DSpark entries are not backbone layers
    assert cfg.kv_source_of(13) == 8 and cfg.index_source_of(27) == 24 and cfg.kv_source_of(39) == 20
    assert cfg.index_source_of(1) is None and cfg.index_source_of(19) == 14
    assert cfg.engram_pad_id == 2 and cfg.image_token_id == 129264
    assert cfg.quantization.weight_block_size == (32, 32) and cfg.quantization.expert_dtype == "fp4"
    assert cfg.compress_rope.theta == 160000.0 and cfg.compress_rope.yarn.original_max_position_embeddings == 65536
    assert cfg.compress_rope.attention_factor == 1.0


def test_a_kv_source_without_an_index_source_masks_its_entries():
    d = copy.deepcopy(_fixture_config())
    d["text_config"].update(index_source_layer_ids=[1, 3], candidate_source_layer_id=-1)
    cfg = parse_model_config(d)
    assert [cfg.index_source_of(i) for i in range(8)] == [None, 1, 1, 3, None, None, None, None]
    from safetensors.torch import load_file

    model = DeepseekV41ForCausalLM(cfg, torch.float32)
    tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
    model.load_weights({k: v for k, v in tensors.items() if k in model.state_dict()})
    model.bind_tokenizer(os.path.join(FIXTURE, "tokenizer.json"))
    ids = torch.arange(3, 23)
    one_shot = model(ids, model.new_state())
    state = model.new_state()
    chunked = torch.cat([model(ids[:7], state), model(ids[7:], state)])
    assert torch.isfinite(one_shot).all() and (chunked - one_shot).abs().max() < 1e-4


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.pop("text_config"), "text_config"),
    (lambda d: d["text_config"].update(kv_source_layer_ids=[4]), "no kv_source_layer_ids entry"),
    (lambda d: d["text_config"].update(candidate_source_layer_id=5), "candidate_source_layer_id"),
    (lambda d: d["text_config"].update(kv_source_layer_ids=[1]), "index source 4 has ratio 1"),
    (lambda d: d["text_config"].update(compress_ratios=[0, 2]), "compress_ratios has 2 entries"),
    (lambda d: d["text_config"].update(scoring_func="sigmoid"), "scoring_func"),
    (lambda d: d["text_config"]["rope_parameters"]["compress"].update(attention_factor=1.3), "mscale"),
    (lambda d: d["text_config"].update(num_key_value_heads=2), "num_key_value_heads"),
])
def test_bad_configs_are_one_line_errors(edit, match):
    d = copy.deepcopy(_fixture_config())
    edit(d)
    with pytest.raises(ConfigError, match=match):
        parse_model_config(d)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5


def test_compressor_ratio2_pools_with_a_per_channel_softmax_and_carries_open_groups():
    cfg = parse_v41_config(_fixture_config())
    comp = Compressor(cfg, 1, torch.float32)
    _randomize(comp, 0)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    one_shot, first, pending, _ = comp(x, 0)
    kv, gate = x @ comp.wkv.weight.T, x @ comp.wgate.weight.T
    w = gate[:6].view(3, 2, -1).softmax(dim=1)
    want = comp.norm((kv[:6].view(3, 2, -1) * w).sum(1))
    assert first == 0 and one_shot.shape == (3, cfg.head_dim) and pending.shape == (1, cfg.head_dim)
    torch.testing.assert_close(one_shot, want, atol=1e-5, rtol=1e-5)
    parts, start, kv, gate = [], 0, None, None
    for chunk in (x[:3], x[3:4], x[4:7]):
        latent, first, kv, gate = comp(chunk, start, kv, gate)
        assert first == sum(p.shape[0] for p in parts) * 2
        if latent is not None:
            parts.append(latent)
        start += chunk.shape[0]
    assert kv.shape[0] == gate.shape[0] == 1
    torch.testing.assert_close(torch.cat(parts), one_shot, atol=1e-6, rtol=0)


def test_compressor_ratio1_is_norm_of_wkv():
    cfg = parse_v41_config(_fixture_config())
    comp = Compressor(cfg, 4, torch.float32)
    _randomize(comp, 2)
    assert comp.wgate is None
    x = torch.randn(3, cfg.hidden_size)
    latent, first, _, _ = comp(x, 0)
    assert first == 0
    torch.testing.assert_close(latent, comp.norm(comp.wkv(x)))


def test_candidate_blocks_pin_the_newest_block_and_keep_the_best():
    scores = torch.tensor([[5.0, 0.1, 0.2, 0.3, 4.0, 0.0, -1.0, float("-inf")]])
    # blocks of 2: maxima [5, 0.3, 4, -1]; newest visible entry 6 -> block 3 pinned.
    keep = select_candidate_blocks(scores, torch.tensor([[7]]), topk_blocks=2, block_size=2)
    assert keep.tolist() == [[True, False, False, True]]
    assert blocks_to_entries(keep, 2, 7).tolist() == [[True, True, False, False, False, False, True]]
    # Fewer reachable blocks than topk_blocks: unreachable ones stay out.
    few = torch.tensor([[1.0, 2.0, float("-inf"), float("-inf")]])
    keep = select_candidate_blocks(few, torch.tensor([[2]]), topk_blocks=4, block_size=1)
    assert keep.tolist() == [[True, True, False, False]]
    # The newest block is kept even when every older block outscores it.
    keep = select_candidate_blocks(torch.tensor([[9.0, 8.0, 7.0, 0.0]]), torch.tensor([[4]]), 1, 1)
    assert keep.tolist() == [[False, False, False, True]]


def test_indexer_never_picks_invisible_entries():
    cfg = parse_v41_config(_fixture_config())
    idx = Indexer(cfg, 1, torch.float32)
    _randomize(idx, 3)
    g = torch.Generator().manual_seed(4)
    t, n = 9, 4
    x, q_res = torch.randn(t, cfg.hidden_size, generator=g), torch.randn(t, cfg.q_lora_rank, generator=g)
    keys = torch.randn(n, cfg.index_head_dim, generator=g)
    positions = torch.arange(t)
    cos = torch.ones(t, cfg.qk_rope_head_dim // 2)
    sin = torch.zeros_like(cos)
    picks = idx.topk_picks(x, q_res, keys, positions, cos, sin, {})
    assert picks.shape == (t, min(cfg.index_topk, n))
    visible = (positions + 1) // 2
    for row in range(t):
        picked = [p for p in picks[row].tolist() if p >= 0]
        assert all(e < visible[row] for e in picked) and len(set(picked)) == len(picked)
        assert len(picked) == min(int(visible[row]), cfg.index_topk, n)


def test_query_blocks_do_not_change_the_result(monkeypatch):
    from safetensors.torch import load_file

    from model.v41 import attention, indexer

    cfg = parse_v41_config(_fixture_config())
    model = DeepseekV41ForCausalLM(cfg, torch.float32)
    model.load_weights(load_file(os.path.join(FIXTURE, "model.safetensors")))
    model.bind_tokenizer(os.path.join(FIXTURE, "tokenizer.json"))
    ids = torch.arange(3, 33)
    whole = model(ids, model.new_state())
    monkeypatch.setattr(attention, "QUERY_BLOCK", 3)
    monkeypatch.setattr(indexer, "QUERY_BLOCK", 3)
    state = model.new_state()
    blocked = torch.cat([model(ids[:11], state), model(ids[11:], state)])
    assert (blocked - whole).abs().max() < 1e-4


def test_router_bias_selects_and_bias_vl_is_for_image_tokens_only():
    cfg = parse_v41_config(_fixture_config())
    r = Router(cfg, torch.float32)
    _randomize(r, 5)
    x = torch.randn(6, cfg.hidden_size)
    with torch.no_grad():
        r.bias.zero_()
        r.bias_vl.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    w_text, ids_text = r(x)
    w_none, ids_none = r(x, torch.zeros(6, dtype=torch.bool))
    assert torch.equal(ids_text, ids_none) and torch.equal(w_text, w_none)
    torch.testing.assert_close(w_text.sum(-1), torch.full((6,), cfg.routed_scaling_factor))
    image = torch.tensor([True, False, True, False, False, False])
    _, ids_img = r(x, image)
    assert sorted(ids_img[0].tolist()) == [0, 1] and sorted(ids_img[2].tolist()) == [0, 1]
    assert torch.equal(ids_img[1], ids_text[1])


def test_engram_table_applies_block_scales_to_fp8_or_float_values():
    from model.v41.engram import EngramEmbedding

    emb = EngramEmbedding(5, 64, torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(6)
    values = (torch.randn(5, 64, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-4, 4, (5, 2), generator=g).float())
    emb.weight.data, emb.scale.data = values, scale
    ids = torch.tensor([[4, 0], [2, 2]])
    want = (values.float().view(5, 2, 32) * scale[..., None]).view(5, 64)[ids]
    assert torch.equal(emb(ids), want)
    f32 = EngramEmbedding(5, 64, torch.float32)
    f32.weight.data, f32.scale.data = values.float(), scale
    assert torch.equal(f32(ids), want)


def test_bf16_model_runs_and_tracks_fp32():
    from safetensors.torch import load_file

    cfg = parse_v41_config(_fixture_config())
    tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
    with open(os.path.join(FIXTURE, "golden.json")) as f:
        ids = torch.tensor(json.load(f)["prompt_ids"][:16])
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = DeepseekV41ForCausalLM(cfg, dtype)
        m.load_weights(tensors)
        m.bind_tokenizer(os.path.join(FIXTURE, "tokenizer.json"))
        out[dtype] = torch.log_softmax(m(ids, m.new_state()), -1)
    assert torch.isfinite(out[torch.bfloat16]).all()
    assert (out[torch.bfloat16] - out[torch.float32]).abs().max() < 1.0


def test_flash_sized_model_has_the_released_tensor_shapes():
    """V4.1-Flash dimensions (with 8 instead of 384 experts, to build quickly) on the meta device:
    HF-V4.1 names and the released checkpoint's (dequantized) shapes."""
    d = _released_like()
    d["text_config"]["n_routed_experts"] = 8
    cfg = parse_v41_config(d)
    with torch.device("meta"):
        sd = DeepseekV41ForCausalLM(cfg, torch.bfloat16).state_dict()
    want = {
        "model.embed.weight": (129280, 5120), "lm_head.weight": (129280, 5120), "model.norm.weight": (5120,),
        "model.layers.5.attn.wq_a.weight": (1280, 5120), "model.layers.5.attn.wq_b.weight": (32768, 1280),
        "model.layers.5.attn.wkv.weight": (512, 5120), "model.layers.5.attn.wo_a.weight": (8192, 4096),
        "model.layers.5.attn.wo_b.weight": (5120, 8192), "model.layers.5.attn.attn_sink": (64,),
        "model.layers.5.ffn.gate.weight": (8, 5120), "model.layers.5.ffn.gate.bias_vl": (8,),
        "model.layers.5.ffn.experts.7.w1.weight": (2304, 5120), "model.layers.5.ffn.experts.7.w2.weight": (5120, 2304),
        "model.layers.5.ffn.shared_experts.w3.weight": (2304, 5120), "model.layers.5.hc_attn_fn": (24, 20480),
        "model.layers.2.attn.compressor.wkv.weight": (512, 5120),
        "model.layers.2.attn.compressor.wgate.weight": (512, 5120),
        "model.layers.2.attn.compressor.norm.weight": (512,), "model.layers.2.attn.indexer.wk.weight": (128, 512),
        "model.layers.2.attn.indexer.k_norm.weight": (128,), "model.layers.2.attn.indexer.wq_b.weight": (4096, 1280),
        "model.layers.2.attn.indexer.weights_proj.weight": (32, 5120),
        "model.layers.20.attn.compressor.wkv.weight": (512, 5120),
        "model.layers.24.attn.indexer.wq_b.weight": (4096, 1280),
        "model.layers.1.engram.embed.weight": (384006168, 256), "model.layers.1.engram.embed.scale": (384006168, 8),
        "model.layers.14.engram.wkv.weight": (25600, 6144), "model.layers.14.engram.q_weight": (4, 5120),
    }
    for name, shape in want.items():
        assert tuple(sd[name].shape) == shape, name
    absent = ["model.layers.0.attn.compressor.wkv.weight", "model.layers.20.attn.compressor.wgate.weight",
              "model.layers.24.attn.indexer.wk.weight", "model.layers.5.attn.indexer.wq_b.weight",
              "model.layers.2.engram.wkv.weight", "model.layers.3.attn.compressor.wkv.weight"]
    assert not [n for n in absent if n in sd]
    assert sum(n.endswith("compressor.wkv.weight") for n in sd) == 4
    assert sum(n.endswith("indexer.wq_b.weight") for n in sd) == 8
