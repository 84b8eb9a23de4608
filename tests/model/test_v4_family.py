"""The public V4-family entry (``load_v4_family`` / ``load_deepseek_v4`` / ``load_deepseek_v41``):
dispatch on model_type, one-line errors, and a random ``make-checkpoint --fp8`` checkpoint in
DeepSeek's released format against its dequantized copy. (The golden fixtures load through the
same entries in test_v4_golden.py and test_deepseek_v41.py.)"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.weight_formats import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    e8m0_to_float,
)
from model.checkpoint import write_random_checkpoint
from model.loader import CheckpointError
from model.v4.model import DeepseekV4ForCausalLM
from model.v4_family import load_v4_family
from model.v41.model import DeepseekV41ForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def _json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _dequantized_copy(src: str, dst: str) -> str:
    """Every FP8 / MXFP4 tensor of ``src`` decoded to float32 under its released name, scales
    dropped (engram tables keep their e4m3 values and their own scale, which the model applies)."""
    cfg = _json(os.path.join(src, "config.json"))
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    cfg.pop("expert_dtype", None)
    tensors = {}
    for fn in sorted(set(_json(os.path.join(src, "model.safetensors.index.json"))["weight_map"].values())):
        with safe_open(os.path.join(src, fn), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (not a dict)
    out = {}
    for name, t in tensors.items():
        scale = tensors.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in tensors:
            if ".engram.embed." in name:
                out[name] = e8m0_to_float(t)
            continue
        if scale is None or ".engram.embed." in name:
            out[name] = t.float() if t.is_floating_point() else t
        elif t.dtype == torch.int8:
            out[name] = dequantize_mxfp4(t, scale)
        else:
            out[name] = dequantize_fp8_blocks(t, scale, block)
    os.makedirs(dst)
    for fn in os.listdir(src):
        if not fn.endswith((".safetensors", ".index.json")) and fn != "config.json":
            shutil.copy(os.path.join(src, fn), dst)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"))
    return dst


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, model.new_state())
        logits = model.compute_logits(out) if isinstance(model, DeepseekV4ForCausalLM) else out
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("preset, cls", [("tiny-v4", DeepseekV4ForCausalLM), ("tiny-v41", DeepseekV41ForCausalLM)])
def test_fp8_released_checkpoint_matches_its_dequantized_copy(preset, cls, tmp_path):
    fp8 = write_random_checkpoint(preset, str(tmp_path / "fp8"), fp8=True, seed=7)
    deq = _dequantized_copy(fp8, str(tmp_path / "deq"))
    a, b = load_v4_family(fp8, torch.bfloat16), load_v4_family(deq, torch.bfloat16)
    assert isinstance(a, cls) and isinstance(b, cls)
    ids = torch.randint(0, a.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    la, lb = _logprobs(a, ids), _logprobs(b, ids)
    assert torch.isfinite(la).all() and la.std() > 0.1
    assert (la - lb).abs().max().item() < 5e-2  # bf16 tolerance; the same weights both ways
    exact = _logprobs(load_v4_family(fp8, torch.float32), ids)
    assert (exact - _logprobs(load_v4_family(deq, torch.float32), ids)).abs().max().item() < 1e-5
    if cls is DeepseekV4ForCausalLM:  # V4.1's in-model FP4/FP8 roundings and top-k choices turn
        assert (la - exact).abs().max().item() < 5e-2  # bf16 rounding into discrete flips


def test_entry_dispatches_on_model_type_and_names_bad_directories(tmp_path):
    assert isinstance(load_v4_family(os.path.join(FIXTURES, "dev-v4-s0"), torch.float32), DeepseekV4ForCausalLM)
    v41 = load_v4_family(os.path.join(FIXTURES, "dev-v41-s0"), torch.float32)
    assert isinstance(v41, DeepseekV41ForCausalLM) and v41.hasher is not None  # tokenizer bound
    with pytest.raises(CheckpointError, match="no config.json"):
        load_v4_family(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(CheckpointError, match="model_type 'deepseek_v3'"):
        load_v4_family(str(tmp_path))
    no_tok = shutil.copytree(os.path.join(FIXTURES, "dev-v41-s0"), tmp_path / "v41",
                             ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_v4_family(str(no_tok))
