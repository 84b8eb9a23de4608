"""Loading V4 / V4.1 checkpoints into a model's expected tensors: golden checkpoints under both
name spellings, one-line errors, skipped MTP/vision tensors, tensor-parallel cuts."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.loader import CheckpointError
from model.v4_layout import released_tensor_specs, stored_tensors
from model.v4_loader import ShardSpec, load_v4_weights, plan_v4_checkpoint
from model.v4_names import v4_released_to_saved, v41_hf_to_released, v41_released_to_hf
from model.v4_sharding import VOCAB_ROWS, local_shape, shard, sharding_rule

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
V4_DIR = os.path.join(FIXTURES, "dev-v4-s0")
V41_HF_DIR = os.path.join(FIXTURES, "dev-v41-s0")
V41_REL_DIR = os.path.join(FIXTURES, "dev-v41-s1-rel")


def _json(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_all(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _expected_like(tensors: dict[str, torch.Tensor]) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}


def _rewrite(src_dir: str, dst, tensors: dict[str, torch.Tensor]) -> str:
    dst = str(dst)
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src_dir, "config.json"), dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def v41_expected():
    return _expected_like(_read_all(V41_HF_DIR))


def test_v4_golden_loads_into_hf_state_dict():
    transformers = pytest.importorskip("transformers")
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(V4_DIR).state_dict()
    got = load_v4_weights(V4_DIR, ref)  # 5.24's saved (hybrid) names -> HF state_dict names
    assert set(got) == set(ref)
    for name, value in ref.items():
        assert torch.equal(got[name], value), name


def test_v4_released_names_load_the_same(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config.from_pretrained(V4_DIR)
    expected = transformers.DeepseekV4ForCausalLM(cfg).state_dict()
    names = _json(os.path.join(V4_DIR, "release_names.json"))
    saved = _read_all(V4_DIR)
    released = _rewrite(V4_DIR, tmp_path / "rel", {names[k]: v for k, v in saved.items()})
    a, b = load_v4_weights(V4_DIR, expected), load_v4_weights(released, expected)
    assert all(torch.equal(a[k], b[k]) for k in expected)
    assert v4_released_to_saved("layers.0.attn.kv_norm.weight") in saved


def test_v41_released_and_hf_names_give_identical_tensors(v41_expected, tmp_path):
    hf = load_v4_weights(V41_HF_DIR, v41_expected)
    assert set(hf) == set(v41_expected)
    raw = _read_all(V41_HF_DIR)
    assert all(torch.equal(hf[k], raw[k]) for k in raw)
    # the same tensors under DeepSeek's released names load identically
    released = _rewrite(V41_HF_DIR, tmp_path / "rel", {v41_hf_to_released(k): v for k, v in raw.items()})
    again = load_v4_weights(released, v41_expected)
    assert all(torch.equal(again[k], hf[k]) for k in hf)
    # and the golden released-name checkpoint (another seed) loads under the same HF names
    rel = load_v4_weights(V41_REL_DIR, v41_expected)
    rel_raw = _read_all(V41_REL_DIR)
    assert set(rel) == set(hf)
    assert all(torch.equal(rel[k], rel_raw[v41_hf_to_released(k)]) for k in rel)


def test_layout_from_config_matches_golden_checkpoints():
    for name in ("dev-v4-s0", "dev-v41-s1-rel"):  # saved names (V4 hybrid) / released names (V4.1)
        cfg = _json(os.path.join(FIXTURES, name, "config.json"))
        names = _json(os.path.join(FIXTURES, name, "release_names.json"))
        released = set(names.values())
        stored = _read_all(os.path.join(FIXTURES, name))
        want = {k if k in released else names[k]: tuple(v.shape) for k, v in stored.items()}
        got = {n: tuple(s) for spec in released_tensor_specs(cfg) for n, s, _ in stored_tensors(spec, False, (32, 32))}
        assert got == want, name


def _one_line_error(path, expected, match: str) -> str:
    with pytest.raises(CheckpointError) as info:
        plan_v4_checkpoint(path, expected)
    msg = str(info.value)
    assert "\n" not in msg and match in msg, msg
    return msg


def test_missing_extra_and_misshaped_tensors_are_one_line(v41_expected, tmp_path):
    raw = _read_all(V41_REL_DIR)
    missing = dict(raw)
    del missing["layers.3.attn.wq_a.weight"]
    msg = _one_line_error(_rewrite(V41_REL_DIR, tmp_path / "m", missing), v41_expected, "missing tensor")
    assert "'layers.3.attn.wq_a.weight'" in msg and "model.layers.3.attn.wq_a.weight" in msg

    extra = dict(raw, **{"layers.0.attn.wq_c.weight": torch.zeros(2, 2)})
    msg = _one_line_error(_rewrite(V41_REL_DIR, tmp_path / "e", extra), v41_expected, "unexpected tensor")
    assert "'layers.0.attn.wq_c.weight'" in msg

    bad = dict(raw, **{"layers.2.attn.wq_b.weight": torch.zeros(255, 32)})
    msg = _one_line_error(_rewrite(V41_REL_DIR, tmp_path / "s", bad), v41_expected, "expected shape [256, 32]")
    assert "found [255, 32]" in msg and "layers.2.attn.wq_b.weight" in msg

    fp8_no_scale = dict(raw, **{"layers.0.attn.wq_a.weight": raw["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)})
    _one_line_error(_rewrite(V41_REL_DIR, tmp_path / "q", fp8_no_scale), v41_expected, "has no scale tensor")


def test_missing_v4_expert_names_its_released_tensor(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config.from_pretrained(V4_DIR)
    expected = transformers.DeepseekV4ForCausalLM(cfg).state_dict()
    saved = _read_all(V4_DIR)
    del saved["model.layers.1.ffn.experts.2.w3.weight"]
    msg = _one_line_error(_rewrite(V4_DIR, tmp_path / "x", saved), expected, "missing tensor")
    assert "'layers.1.ffn.experts.2.w3.weight'" in msg and "mlp.experts.gate_up_proj" in msg
    for part in ("w1", "w2", "w3"):  # the last expert gone entirely
        del saved[f"model.layers.4.ffn.experts.3.{part}.weight"]
    msg = _one_line_error(_rewrite(V4_DIR, tmp_path / "y", saved), expected, "missing tensor")
    assert ("'layers.1.ffn.experts.2.w3.weight' (model tensor 'model.layers.1.mlp.experts.gate_up_proj') "
            "(and 3 more)") in msg


def test_mtp_dspark_and_vision_tensors_are_skipped_with_one_line(v41_expected, tmp_path, caplog):
    raw = _read_all(V41_REL_DIR)
    raw.update({"mtp.0.main_proj.weight": torch.zeros(8, 16), "mtp.2.markov_head.markov_w1.weight": torch.zeros(4, 4),
                "vision.blocks.0.qkv.weight": torch.zeros(4, 4), "aligner.fc.weight": torch.zeros(2, 2)})
    path = _rewrite(V41_REL_DIR, tmp_path / "mm", raw)
    with caplog.at_level(logging.INFO, logger="model.v4_loader"):
        got = load_v4_weights(path, v41_expected)
    assert set(got) == set(v41_expected)
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert lines == ["skipping 2 MTP/DSpark tensors (0.0 MB): not part of the backbone",
                     "skipping 2 vision tensors (0.0 MB): not part of the backbone"]


def test_tensor_parallel_cuts_reassemble_the_full_tensors(v41_expected):
    full = load_v4_weights(V41_HF_DIR, v41_expected)
    ranks = []
    for r in range(2):
        local = {k: (local_shape(k, s, 2), d) for k, (s, d) in v41_expected.items()}
        ranks.append(load_v4_weights(V41_HF_DIR, local, shard_spec=ShardSpec(r, 2)))
    cut = {k for k in v41_expected if sharding_rule(k)}
    assert {"model.layers.0.attn.wq_b.weight", "model.layers.0.attn.attn_sink", "model.layers.0.attn.wo_a.weight",
            "model.layers.0.attn.wo_b.weight", "model.layers.0.ffn.experts.1.w2.weight", "model.embed.weight",
            "model.layers.1.engram.embed.weight", "model.layers.1.engram.embed.scale"} <= cut
    assert sharding_rule("model.layers.1.attn.indexer.wq_b.weight") is None  # the indexer is replicated
    for name, value in full.items():
        a, b = ranks[0][name], ranks[1][name]
        assert (a.shape != value.shape) == (name in cut), name
        if a.shape == value.shape:
            assert torch.equal(a, value) and torch.equal(b, value), name
            continue
        dim = next(i for i in range(value.dim()) if a.shape[i] != value.shape[i])
        assert torch.equal(torch.cat([a, b], dim), value), name


def test_vocab_rows_are_padded_when_they_do_not_divide():
    t = torch.arange(10.0).reshape(5, 2)
    assert sharding_rule("lm_head.weight") == VOCAB_ROWS
    parts = [shard(t, "lm_head.weight", (3, 2), r, 2) for r in range(2)]
    assert torch.equal(parts[0], t[:3]) and torch.equal(parts[1], torch.cat([t[3:], torch.zeros(1, 2)]))
    with pytest.raises(ValueError, match="expected shape"):
        shard(t, "model.layers.0.input_layernorm.weight", (2, 2), 0, 2)


def test_sharded_index_and_hf_v41_names_from_layout(tmp_path, v41_expected):
    # split the released checkpoint into two files + index, the way real checkpoints ship
    raw = _read_all(V41_REL_DIR)
    names = sorted(raw)
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(os.path.join(V41_REL_DIR, "config.json"), out)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: raw[k] for k in part}, str(out / fn))
        weight_map.update({k: fn for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = load_v4_weights(str(out), v41_expected)
    assert all(torch.equal(got[v41_released_to_hf(k).name], v) for k, v in raw.items())


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_v4_stacked_experts_cut_by_expert_or_intermediate(expert_parallel):
    transformers = pytest.importorskip("transformers")
    expected = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config.from_pretrained(V4_DIR)).state_dict()
    full = load_v4_weights(V4_DIR, expected)
    ranks = [load_v4_weights(V4_DIR, {k: (local_shape(k, tuple(v.shape), 2, expert_parallel), v.dtype)
                                      for k, v in expected.items()}, shard_spec=ShardSpec(r, 2)) for r in range(2)]
    gate_up, down = "model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"
    if expert_parallel:  # whole experts: 0-1 on rank 0, 2-3 on rank 1
        assert torch.equal(ranks[1][gate_up], full[gate_up][2:]) and torch.equal(ranks[0][down], full[down][:2])
    else:  # rank r holds its rows of w1 and of w3, and its columns of w2
        i = full[gate_up].shape[1] // 2
        w1, w3 = full[gate_up][:, :i], full[gate_up][:, i:]
        assert torch.equal(ranks[1][gate_up], torch.cat([w1[:, i // 2:], w3[:, i // 2:]], 1))
        assert torch.equal(torch.cat([ranks[0][down], ranks[1][down]], 2), full[down])


def test_v4_golden_in_released_names_matches_golden_logprobs(tmp_path):
    """dev-v4-s0 rewritten to DeepSeek's released names, loaded by load_deepseek_v4."""
    from model.v4.model import load_deepseek_v4

    names = _json(os.path.join(V4_DIR, "release_names.json"))
    released = _rewrite(V4_DIR, tmp_path / "rel", {names[k]: v for k, v in _read_all(V4_DIR).items()})
    model = load_deepseek_v4(released, torch.float32)
    golden = _json(os.path.join(V4_DIR, "golden.json"))
    ids = torch.tensor(golden["prompt_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(model.compute_logits(model(ids, model.new_state())), dim=-1)
    got = logprobs[:-1].gather(1, ids[1:, None])[:, 0]
    assert (got - torch.tensor(golden["prompt_logprobs"])).abs().max().item() < 2e-3
