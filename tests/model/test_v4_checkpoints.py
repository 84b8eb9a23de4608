"""make-checkpoint for DeepSeek-V4 / V4.1 in DeepSeek's released format: presets, slices,
FP8/MXFP4 round trips against the pre-quantization copy, and real-shape headers."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from safetensors import safe_open

from kernels.weight_formats import E8M0_DTYPE, QuantizedWeight
from model.checkpoint import load_config_dict, write_random_checkpoint
from model.v4_checkpoint import engram_table_rows, slice_config
from model.v4_layout import released_tensor_specs, stored_tensors, text_config
from model.v4_loader import load_v4_weights
from model.v4_names import v41_released_to_hf

FP8 = torch.float8_e4m3fn


def _json(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _headers(path: str) -> dict[str, tuple[list[int], str]]:
    wm = _json(os.path.join(path, "model.safetensors.index.json"))["weight_map"]
    out = {}
    for fn in set(wm.values()):
        with safe_open(os.path.join(path, fn), "pt") as f:
            out.update({k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()})  # noqa: SIM118
    return out


def _v41_expected(path: str) -> dict:
    """HF-V4.1 names and shapes of the model a V4.1 checkpoint describes."""
    cfg = _json(os.path.join(path, "config.json"))
    return {v41_released_to_hf(n).name: (shape, torch.float32)
            for spec in released_tensor_specs(cfg) for n, shape, _ in stored_tensors(spec, False, (32, 32))}


def _v4_model(path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config.from_pretrained(path))


def _assert_close_to_prequantization(quant: dict, exact: dict) -> None:
    """FP8 blocks: |err| <= |x|/16 + a block's subnormal step; MXFP4: <= amax/3 of the tensor's rows."""
    kinds = set()
    for name, ref in exact.items():
        got = quant[name]
        if not ref.is_floating_point():
            assert torch.equal(got, ref), name
            continue
        err = (got.float() - ref.float()).abs()
        if ".experts." in name and "shared" not in name:
            kinds.add("fp4")
            assert (err <= ref.abs().amax(dim=-1, keepdim=True) / 3 + 1e-6).all(), name
            assert err.mean() < 0.2 * ref.abs().mean(), name
        elif err.max() > 0:
            kinds.add("fp8")
            assert (err <= ref.abs() / 16 + ref.abs().max() * 2.0**-8).all(), name
    assert kinds == {"fp4", "fp8"}


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory):
    base = tmp_path_factory.mktemp("v41")
    q = write_random_checkpoint("tiny-v41", str(base / "fp8"), fp8=True, seed=3)
    f = write_random_checkpoint("tiny-v41", str(base / "f32"), fp8=False, seed=3, dtype=torch.float32)
    return q, f


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    base = tmp_path_factory.mktemp("v4")
    q = write_random_checkpoint("tiny-v4", str(base / "fp8"), fp8=True, seed=5, shard_bytes=200_000)
    f = write_random_checkpoint("tiny-v4", str(base / "f32"), fp8=False, seed=5, dtype=torch.float32)
    return q, f


def test_tiny_v41_fp8_is_in_released_format(tiny_v41):
    q, _ = tiny_v41
    cfg = _json(os.path.join(q, "config.json"))
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32]
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["quantization_config"]["expert_dtype"] == "fp4"
    assert cfg["text_config"]["num_nextn_predict_layers"] == 0  # DSpark blocks are not written
    h = _headers(q)
    assert h["layers.2.attn.wq_b.weight"] == ([256, 32], "F8_E4M3")
    assert h["layers.2.attn.wq_b.scale"] == ([8, 1], "F8_E8M0")
    assert h["layers.2.ffn.experts.1.w1.weight"] == ([32, 32], "I8")  # 64 FP4 values per row
    assert h["layers.2.ffn.experts.1.w1.scale"] == ([32, 2], "F8_E8M0")
    assert h["layers.1.engram.embed.weight"] == ([384, 32], "F8_E4M3")
    assert h["layers.1.engram.embed.scale"] == ([384, 1], "F8_E8M0")
    assert h["layers.1.ffn.gate.bias_vl"] == ([4], "F32") and h["embed.weight"] == ([320, 64], "BF16")
    assert not any(k.startswith(("model.", "mtp.")) for k in h)


def test_tiny_v41_fp8_loads_back_close_to_prequantization_copy(tiny_v41):
    q, f = tiny_v41
    expected = _v41_expected(f)
    quant, exact = load_v4_weights(q, expected), load_v4_weights(f, expected)
    scale = "model.layers.1.engram.embed.scale"  # the model applies the engram scale itself
    assert torch.equal(quant[scale], torch.exp2(torch.round(torch.log2(quant[scale]))))
    quant["model.layers.1.engram.embed.weight"] = quant["model.layers.1.engram.embed.weight"] * quant[scale]
    quant["model.layers.5.engram.embed.weight"] *= quant["model.layers.5.engram.embed.scale"]
    exact = {k: v for k, v in exact.items() if not k.endswith("engram.embed.scale")}
    _assert_close_to_prequantization(quant, exact)
    kept = load_v4_weights(q, expected, keep_quantized=True)
    w = kept["model.layers.3.ffn.experts.0.w2.weight"]
    assert isinstance(w, QuantizedWeight) and w.format == "mxfp4" and w.data.shape == (64, 16)
    assert torch.equal(w.dequantize(), quant["model.layers.3.ffn.experts.0.w2.weight"])
    assert kept["model.layers.1.engram.embed.weight"].dtype == FP8
    assert kept["model.layers.1.engram.embed.scale"].dtype == E8M0_DTYPE


def test_tiny_v4_fp8_loads_into_hf_model_with_finite_logits(tiny_v4):
    q, f = tiny_v4
    assert len({v for v in _json(os.path.join(q, "model.safetensors.index.json"))["weight_map"].values()}) > 1
    h = _headers(q)
    assert h["layers.1.attn.wq_a.scale"] == ([1, 1], "F8_E8M0")  # 128x128 blocks
    assert h["layers.1.ffn.experts.3.w2.weight"] == ([64, 16], "I8") and "mtp.0.e_proj.scale" in h
    model = _v4_model(q)
    expected = model.state_dict()
    quant, exact = load_v4_weights(q, expected), load_v4_weights(f, expected)
    _assert_close_to_prequantization(quant, exact)
    kept = load_v4_weights(q, expected, keep_quantized=True)
    stack = kept["model.layers.2.mlp.experts.gate_up_proj"]
    assert stack.format == "mxfp4" and stack.data.shape == (4, 64, 32) and stack.scale.shape == (4, 64, 2)
    assert torch.equal(stack.dequantize(), quant["model.layers.2.mlp.experts.gate_up_proj"])
    model.load_state_dict(quant)
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and 0.1 < logits.std() < 100


def test_tiny_v4_fp8_loads_into_mlaserve_v4_model_like_hf(tiny_v4):
    from model.v4.config import parse_v4_config
    from model.v4.model import DeepseekV4ForCausalLM
    from model.v4_loader import iter_v4_weights

    q, _ = tiny_v4
    ours = DeepseekV4ForCausalLM(parse_v4_config(_json(os.path.join(q, "config.json"))), torch.float32)
    ours.load_weights(iter_v4_weights(q, ours.state_dict()))
    hf = _v4_model(q)
    hf.load_state_dict(load_v4_weights(q, hf.state_dict()))
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, ours.new_state()))
        want = hf(ids[None]).logits[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)


def test_tiny_v41_fp8_loads_into_mlaserve_v41_model(tiny_v41):
    from model.v41.config import parse_v41_config
    from model.v41.model import DeepseekV41ForCausalLM

    q, _ = tiny_v41
    model = DeepseekV41ForCausalLM(parse_v41_config(_json(os.path.join(q, "config.json"))), torch.float32)
    model.bind_tokenizer(os.path.join(q, "tokenizer.json"))  # the config's engram vocabulary fits it
    own = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    assert {k: s for k, (s, _) in own.items()} == {k: tuple(s) for k, (s, _) in _v41_expected(q).items()}
    model.load_weights(load_v4_weights(q, own))
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(2))
    logits = model(ids, model.new_state())
    assert torch.isfinite(logits).all() and 0.1 < logits.std() < 100


def test_v4_flash_preset_matches_transformers_reading():
    transformers = pytest.importorskip("transformers")
    cfg = load_config_dict("deepseek-v4-flash")
    hf = transformers.DeepseekV4Config(**cfg)
    assert hf.layer_types.count("compressed_sparse_attention") == 21
    assert hf.layer_types.count("heavily_compressed_attention") == 20
    assert hf.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert len(cfg["compress_ratios"]) == 44 and cfg["quantization_config"]["weight_block_size"] == [128, 128]


def test_real_v41_slice_header_has_released_shapes():
    """4 layers of V4.1-Flash, checked from the layout (the same list make-checkpoint writes):
    the real slice is several GB (embed + head alone 2.6 GB), too big to write in a test."""
    cfg = slice_config(load_config_dict("deepseek-v41-flash"), num_layers=4, engram_rows=5000)
    c = text_config(cfg)
    assert c["compress_ratios"] == [0, 0, 2, 2]
    assert c["kv_source_layer_ids"] == [2] and c["index_source_layer_ids"] == [2]
    assert c["candidate_source_layer_id"] == -1 and c["engram_layer_ids"] == [1] and c["num_nextn_predict_layers"] == 0
    assert c["engram_num_embeddings"][0] <= 5000
    assert c["engram_num_embeddings"] == engram_table_rows(c["engram_vocab_size"], 1, 8, 4)
    h = {n: (list(s), d) for spec in released_tensor_specs(cfg) for n, s, d in stored_tensors(spec, True, (32, 32))}
    f8, e8, i8, bf, f32 = FP8, E8M0_DTYPE, torch.int8, torch.bfloat16, torch.float32
    want = {
        "layers.3.attn.wq_a.weight": ([1280, 5120], f8), "layers.3.attn.wq_a.scale": ([40, 160], e8),
        "layers.3.attn.wq_b.scale": ([1024, 40], e8), "layers.3.attn.wkv.scale": ([16, 160], e8),
        "layers.3.attn.wo_a.weight": ([8192, 4096], f8), "layers.3.attn.wo_a.scale": ([256, 128], e8),
        "layers.3.attn.wo_b.weight": ([5120, 8192], f8), "layers.3.attn.wo_b.scale": ([160, 256], e8),
        "layers.3.ffn.experts.383.w1.weight": ([2304, 2560], i8),
        "layers.3.ffn.experts.383.w1.scale": ([2304, 160], e8),
        "layers.3.ffn.experts.0.w2.weight": ([5120, 1152], i8), "layers.3.ffn.experts.0.w2.scale": ([5120, 72], e8),
        "layers.3.ffn.gate.weight": ([384, 5120], bf), "layers.3.ffn.gate.bias_vl": ([384], f32),
        "layers.3.hc_attn_fn": ([24, 20480], f32),
        "layers.2.attn.compressor.wkv.weight": ([512, 5120], bf),
        "layers.2.attn.compressor.wgate.weight": ([512, 5120], bf),
        "layers.2.attn.indexer.wk.weight": ([128, 512], bf), "layers.2.attn.indexer.k_norm.weight": ([128], bf),
        "layers.2.attn.indexer.wq_b.weight": ([4096, 1280], f8),
        "layers.2.attn.indexer.weights_proj.weight": ([32, 5120], bf),
        "layers.1.engram.embed.weight": ([c["engram_num_embeddings"][0], 256], f8),
        "layers.1.engram.embed.scale": ([c["engram_num_embeddings"][0], 8], e8),
        "layers.1.engram.wkv.weight": ([25600, 6144], f8), "layers.1.engram.wkv.scale": ([800, 192], e8),
        "layers.1.engram.q_weight": ([4, 5120], bf), "embed.weight": ([129280, 5120], bf),
    }
    for name, value in want.items():
        assert h[name] == value, name
    assert "layers.3.attn.compressor.wkv.weight" not in h and "layers.3.attn.indexer.wq_b.weight" not in h
    assert sum(1 for n in h if n.startswith("layers.2.ffn.experts.") and n.endswith(".weight")) == 3 * 384


def test_real_v4_slice_header_has_released_shapes():
    cfg = slice_config(load_config_dict("deepseek-v4-flash"), num_layers=4)
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 0] and cfg["num_nextn_predict_layers"] == 1
    h = {n: (list(s), d) for spec in released_tensor_specs(cfg) for n, s, d in stored_tensors(spec, True, (128, 128))}
    f8, e8, i8, bf, f32 = FP8, E8M0_DTYPE, torch.int8, torch.bfloat16, torch.float32
    want = {
        "layers.2.attn.wq_a.scale": ([8, 32], e8), "layers.2.attn.wq_b.scale": ([256, 8], e8),
        "layers.2.attn.wo_a.scale": ([64, 32], e8), "layers.2.attn.wo_b.scale": ([32, 64], e8),
        "layers.2.attn.compressor.wkv.weight": ([1024, 4096], bf),
        "layers.3.attn.compressor.wkv.weight": ([512, 4096], bf),
        "layers.2.attn.compressor.ape": ([4, 1024], f32), "layers.3.attn.compressor.ape": ([128, 512], f32),
        "layers.2.attn.indexer.compressor.wgate.weight": ([256, 4096], bf),
        "layers.2.attn.indexer.wq_b.scale": ([64, 8], e8),
        "layers.2.ffn.experts.0.w1.weight": ([2048, 2048], i8), "layers.2.ffn.experts.0.w1.scale": ([2048, 128], e8),
        "layers.2.ffn.experts.255.w2.weight": ([4096, 1024], i8), "layers.2.ffn.experts.255.w2.scale": ([4096, 64], e8),
        "layers.2.ffn.shared_experts.w1.scale": ([16, 32], e8), "layers.2.ffn.shared_experts.w2.scale": ([32, 16], e8),
        "layers.0.ffn.gate.tid2eid": ([129280, 6], torch.int64), "layers.3.ffn.gate.bias": ([256], f32),
        "layers.3.hc_ffn_fn": ([24, 16384], f32), "hc_head_fn": ([4, 16384], f32),
        "mtp.0.e_proj.weight": ([4096, 4096], f8), "head.weight": ([129280, 4096], bf),
    }
    for name, value in want.items():
        assert h[name] == value, name
    assert "layers.3.attn.indexer.wq_b.weight" not in h and "layers.3.ffn.gate.tid2eid" not in h


def test_engram_table_rows_reproduce_the_released_sizes():
    assert engram_table_rows(16_000_000, 2, 8, 4) == [384006168, 384016682]
    assert engram_table_rows(50, 2, 2, 4) == [384, 552]  # the tiny golden checkpoints


def test_cli_flags_and_one_line_errors(tmp_path, capsys):
    from server.cli_make_checkpoint import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "slice"
    assert run(p.parse_args(["--config", "tiny-v41", "--num-layers", "4", "--fp8", "--num-experts", "2",
                             "--engram-rows", "300", "--out", str(out)])) == 0
    c = _json(out / "config.json")["text_config"]
    assert c["num_hidden_layers"] == 4 and c["n_routed_experts"] == 2 and c["kv_source_layer_ids"] == [1]
    assert c["engram_layer_ids"] == [1] and c["engram_num_embeddings"][0] <= 300
    assert _headers(str(out))["layers.1.engram.embed.weight"][0] == [c["engram_num_embeddings"][0], 32]
    assert len(load_v4_weights(str(out), _v41_expected(str(out)))) == len(_v41_expected(str(out)))
    assert run(p.parse_args(["--config", "tiny-v41", "--num-layers", "99", "--out", str(tmp_path / "x")])) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --num-layers must be between 1 and 8, got 99"
    assert run(p.parse_args(["--config", "tiny-v3", "--engram-rows", "5", "--out", str(tmp_path / "y")])) == 1
    assert "apply to DeepSeek-V4 / V4.1 configs only" in capsys.readouterr().err
    assert run(p.parse_args(["--config", "tiny-v4", "--engram-rows", "5", "--out", str(tmp_path / "z")])) == 1
    assert capsys.readouterr().err.strip() == "error: --engram-rows applies to DeepSeek-V4.1 (engram tables) only"


def test_tensor_parallel_load_of_fp8_checkpoint(tiny_v41):
    from model.v4_loader import ShardSpec
    from model.v4_sharding import local_shape

    q, _ = tiny_v41
    expected = _v41_expected(q)
    full = load_v4_weights(q, expected)
    local = [{k: (local_shape(k, s, 2), d) for k, (s, d) in expected.items()}
             for r in range(2)]
    ranks = [load_v4_weights(q, local[r], shard_spec=ShardSpec(r, 2)) for r in range(2)]
    for name in ("model.layers.1.engram.embed.weight", "model.layers.1.engram.embed.scale", "model.embed.weight",
                 "model.layers.2.attn.wq_b.weight", "model.layers.2.attn.wo_b.weight",
                 "model.layers.2.ffn.experts.1.w2.weight"):
        a, b = ranks[0][name], ranks[1][name]
        assert a.shape != full[name].shape, (name, a.shape)
        dim = next(i for i in range(a.dim()) if a.shape[i] != full[name].shape[i])
        assert torch.equal(torch.cat([a, b], dim), full[name]), name
    # kept quantized, a cut must fall on the 32x32 scale blocks: wo_a's 32 rows cannot be halved
    from model.loader import CheckpointError

    with pytest.raises(CheckpointError, match="does not fall on its 32-wide scale blocks"):
        load_v4_weights(q, local[1], shard_spec=ShardSpec(1, 2), keep_quantized=True)


def test_large_tensors_are_made_in_row_chunks(monkeypatch):
    import model.v4_checkpoint as v4c
    from kernels.weight_formats import dequantize_fp8_blocks, dequantize_mxfp4
    from model.v4_layout import FP4, FP8, TensorSpec

    monkeypatch.setattr(v4c, "_CHUNK_ELEMENTS", 1000)  # 300 rows -> chunks of 128, 128, 44
    for kind, block in ((FP8, (128, 128)), (FP8, (32, 32)), (FP4, (1, 32))):
        spec = TensorSpec("layers.0.attn.wq_b.weight", (300, 64), kind)
        q = v4c.random_pieces(spec, {}, torch.Generator().manual_seed(0), True, block, torch.bfloat16)
        ref = v4c.random_pieces(spec, {}, torch.Generator().manual_seed(0), False, block, torch.float32)[spec.name]
        assert [(tuple(v.shape), v.dtype) for v in q.values()] == [
            (tuple(s), d) for _, s, d in stored_tensors(spec, True, block)]
        w, s = q.values()
        back = dequantize_mxfp4(w, s) if kind == FP4 else dequantize_fp8_blocks(w, s, block)
        assert (back - ref).abs().max() <= ref.abs().max() / (3 if kind == FP4 else 16)


def test_model_that_keeps_fp8_params_gets_weights_and_scales_in_stored_form(tiny_v4, tiny_v41):
    """A GPU model may list FP8 weights and their scales as its own tensors (either spelling)."""
    q4, _ = tiny_v4
    expected = {k: (tuple(v.shape), v.dtype) for k, v in _v4_model(q4).state_dict().items()}
    name = "model.layers.1.self_attn.q_b_proj.weight"
    expected[name] = (expected[name][0], FP8)
    expected[name + "_scale_inv"] = ((2, 1), E8M0_DTYPE)
    got = load_v4_weights(q4, expected)
    assert got[name].dtype == FP8 and got[name + "_scale_inv"].dtype == E8M0_DTYPE
    wanted = {k: v for k, v in expected.items() if not k.endswith("_scale_inv")}
    full = load_v4_weights(q4, wanted | {name: (expected[name][0], torch.float32)})
    from kernels.weight_formats import dequantize_fp8_blocks

    assert torch.equal(dequantize_fp8_blocks(got[name], got[name + "_scale_inv"], (128, 128)), full[name])
    q41, _ = tiny_v41
    exp41 = _v41_expected(q41)
    w = "model.layers.2.attn.wq_b.weight"
    exp41[w] = (exp41[w][0], FP8)
    exp41["model.layers.2.attn.wq_b.scale"] = ((8, 1), torch.float32)  # decoded to float on request
    got = load_v4_weights(q41, exp41)
    assert got[w].dtype == FP8 and got["model.layers.2.attn.wq_b.scale"].dtype == torch.float32
