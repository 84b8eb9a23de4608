"""Random checkpoints (make-checkpoint), FP8 block checkpoints, and clear errors on bad ones."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.checkpoint import write_random_checkpoint
from model.config import ConfigError, load_model_config
from model.loader import CheckpointError, load_model


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    bf16 = write_random_checkpoint("tiny-v3", str(base / "bf16"), fp8=False, seed=7)
    fp8 = write_random_checkpoint("tiny-v3", str(base / "fp8"), fp8=True, seed=7)
    return bf16, fp8


def _tensors(path):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    out = {}
    for name, fn in wm.items():
        with safe_open(os.path.join(path, fn), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_fp8_checkpoint_has_r1_format(fp8_pair):
    _, fp8 = fp8_pair
    cfg = json.load(open(os.path.join(fp8, "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    t = _tensors(fp8)
    w = t["model.layers.1.mlp.experts.3.gate_proj.weight"]
    s = t["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    q_b = t["model.layers.0.self_attn.q_b_proj.weight"]
    assert t["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (-(-q_b.shape[0] // 128), 1)
    # norms, embeddings, router and lm_head stay unquantized, as in R1
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert t[name].dtype != torch.float8_e4m3fn and name + "_scale_inv" not in t
    # MTP layer written as model.layers.{num_hidden_layers}
    assert "model.layers.3.eh_proj.weight" in t
    # a sharded index + tokenizer files, like a real checkpoint
    for fn in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(fp8, fn))


def test_fp8_checkpoint_logits_match_dequantized_copy(fp8_pair, tmp_path):
    _, fp8 = fp8_pair
    # The dequantized copy: same tensors, w8 * scale_inv written in float32, no quantization_config.
    t = _tensors(fp8)
    from kernels.fp8 import dequantize_weight_blocks

    deq = {}
    for name, w in t.items():
        if name.endswith("_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            w = dequantize_weight_blocks(w, t[name + "_scale_inv"], (128, 128), torch.float32)
        deq[name] = w.float().contiguous()
    out = tmp_path / "deq"
    out.mkdir()
    save_file(deq, str(out / "model.safetensors"))
    cfg = json.load(open(os.path.join(fp8, "config.json")))
    cfg.pop("quantization_config")
    json.dump(cfg, open(out / "config.json", "w"))
    a = load_model(fp8, dtype="bfloat16", progress=False)
    b = load_model(str(out), dtype="bfloat16", progress=False)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la = torch.log_softmax(a.compute_logits(a(ids, torch.arange(24))), -1)
        lb = torch.log_softmax(b.compute_logits(b(ids, torch.arange(24))), -1)
    assert (la - lb).abs().max().item() < 5e-2  # bf16 tolerance; same weights both ways


def test_fp8_checkpoint_close_to_unquantized_original(fp8_pair):
    bf16, fp8 = fp8_pair
    a = load_model(bf16, dtype="float32", progress=False)
    b = load_model(fp8, dtype="float32", progress=False)
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la = torch.log_softmax(a.compute_logits(a(ids, torch.arange(16))), -1)
        lb = torch.log_softmax(b.compute_logits(b(ids, torch.arange(16))), -1)
    kl = (la.exp() * (la - lb)).sum(-1).mean()
    assert kl < 0.05  # block quantization noise only


def test_missing_tensor_is_named(fp8_pair, tmp_path):
    bf16, _ = fp8_pair
    t = _tensors(bf16)
    del t["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    json.dump(json.load(open(os.path.join(bf16, "config.json"))), open(tmp_path / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.self_attn.kv_b_proj.weight'"):
        load_model(str(tmp_path), progress=False)


def test_wrong_shape_is_named(fp8_pair, tmp_path):
    bf16, _ = fp8_pair
    t = _tensors(bf16)
    t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 90)
    save_file(t, str(tmp_path / "model.safetensors"))
    json.dump(json.load(open(os.path.join(bf16, "config.json"))), open(tmp_path / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.o_proj.weight.*\(64, 96\).*\(64, 90\)"):
        load_model(str(tmp_path), progress=False)


def test_unknown_model_type_and_missing_field(tmp_path):
    cfg = json.load(open(os.path.join(os.path.dirname(__file__), "../../configs/tiny-v3.json")))
    bad = dict(cfg, model_type="llama")
    json.dump(bad, open(tmp_path / "config.json", "w"))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_model_config(tmp_path)
    bad = dict(cfg)
    del bad["kv_lora_rank"]
    json.dump(bad, open(tmp_path / "config.json", "w"))
    with pytest.raises(ConfigError, match="missing required field 'kv_lora_rank'"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_model_config(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path / "nowhere"), progress=False)


def test_sharded_checkpoint_loads_across_files(tmp_path):
    out = write_random_checkpoint("tiny-v2", str(tmp_path / "v2"), seed=3, shard_bytes=200_000)
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(shards) > 1
    m = load_model(out, dtype="float32", progress=False)
    with torch.no_grad():
        h = m(torch.tensor([1, 2, 3]), torch.arange(3))
    assert torch.isfinite(m.compute_logits(h)).all()


def test_dummy_load_format_needs_no_weights(tmp_path):
    """--load-format dummy: the real shapes from config.json, random weights, no safetensors."""
    from model.checkpoint import load_config_dict, write_checkpoint_metadata

    write_checkpoint_metadata(load_config_dict("tiny-v3"), str(tmp_path))
    assert not any(f.endswith(".safetensors") for f in os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(str(tmp_path), progress=False)
    m = load_model(str(tmp_path), dtype="float32", load_format="dummy", progress=False)
    with torch.no_grad():
        logits = m.compute_logits(m(torch.tensor([3, 4, 5]), torch.arange(3)))
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert m.layers[1].mlp.e_score_correction_bias.min() >= 0


def test_kept_fp8_weights_on_cpu_match_dequantized(tmp_path):
    """keep_fp8: FP8 weights + block scales stay in the model (the GPU layout); on CPU the FP8
    linears and experts run through the dequantizing references and equal the dequantized load.
    Kept FP8 experts need 128-aligned dims, hence this small R1-layout config."""
    from model.checkpoint import load_config_dict

    cfg = dict(load_config_dict("tiny-v3"), hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
               q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
               num_attention_heads=2, num_key_value_heads=2)
    fp8 = write_random_checkpoint(cfg, str(tmp_path / "r1ish"), fp8=True, seed=9)
    kept = load_model(fp8, dtype="float32", keep_fp8=True, progress=False)
    deq = load_model(fp8, dtype="float32", keep_fp8=False, progress=False)
    assert kept.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert kept.layers[1].mlp.experts.w13_scale_inv.shape == (8, 2, 2)
    assert kept.layers[1].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = kept.compute_logits(kept(ids, torch.arange(12)))
        b = deq.compute_logits(deq(ids, torch.arange(12)))
    assert (a - b).abs().max().item() < 1e-3


def test_mtp_layers_are_skipped_with_one_log_line(fp8_pair, caplog):
    """tiny-v3 has num_nextn_predict_layers=1: make-checkpoint writes model.layers.3.* (the
    MTP layer); loading reads none of it, keeps none of it, and says so once."""
    import logging

    from model.loader import mtp_tensor_names

    bf16, _ = fp8_pair
    t = _tensors(bf16)
    mtp = mtp_tensor_names(t, 3)
    assert "model.layers.3.eh_proj.weight" in mtp and "model.layers.3.shared_head.head.weight" in mtp
    assert not any(n.startswith(("model.layers.0.", "model.layers.2.", "lm_head")) for n in mtp)
    with caplog.at_level(logging.INFO, logger="model.loader"):
        m = load_model(bf16, dtype="float32", progress=False)
    lines = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(lines) == 1, lines
    nbytes = sum(t[n].numel() * t[n].element_size() for n in mtp)
    assert lines[0].startswith(f"skipped {len(mtp)} MTP tensors ({nbytes / 2**20:.1f} MiB) of layers >= 3")
    assert len(m.layers) == 3
    assert not any(".3." in n or "eh_proj" in n or "shared_head" in n for n, _ in m.named_parameters())
    # The parameters hold exactly the elements of the checkpoint's non-MTP tensors.
    assert sum(p.numel() for p in m.parameters()) == sum(t[n].numel() for n in t if n not in mtp)
