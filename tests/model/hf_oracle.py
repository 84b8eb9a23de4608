"""Build tiny HF transformers DeepSeek models (the oracle) from our tiny config presets."""

from __future__ import annotations

import json
import os

import torch

from model.checkpoint import random_tensor

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def tiny_config_dict(name: str) -> dict:
    with open(os.path.join(CONFIGS, f"{name}.json"), encoding="utf-8") as f:
        return json.load(f)


def build_hf_model(cfg: dict, seed: int = 0):
    """A transformers DeepseekV3/V2ForCausalLM with well-conditioned random weights, fp32."""
    import transformers

    d = dict(cfg)
    d.pop("architectures", None)
    d.pop("torch_dtype", None)
    kind = d.pop("model_type")
    if kind == "deepseek_v3":
        hf_cfg = transformers.DeepseekV3Config(**d)
        model = transformers.DeepseekV3ForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.DeepseekV2Config(**d)
        model = transformers.DeepseekV2ForCausalLM(hf_cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(random_tensor(name, tuple(t.shape), gen).to(t.dtype))
    return model.float().eval()


def save_hf_model(model, out_dir: str) -> str:
    model.save_pretrained(out_dir)
    return out_dir
