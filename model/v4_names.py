"""Tensor names of DeepSeek-V4 and V4.1 checkpoints: DeepSeek's released names <-> HF names.

Three spellings exist:

* **released** (DeepSeek's own files): ``layers.N.attn.wq_a.weight`` / ``.scale``,
  ``layers.N.ffn.experts.E.w1.weight``, ``hc_head_fn``, ``embed.weight``, ``head.weight``, ``mtp.K.*``.
* **HF V4** (transformers 5.24 ``DeepseekV4ForCausalLM.state_dict()``): ``model.layers.N.self_attn.q_a_proj.weight``,
  experts stacked as ``mlp.experts.gate_up_proj`` [E, 2I, D] (w1 rows, then w3 rows) and ``down_proj``
  [E, D, I]; ``.scale`` becomes ``.weight_scale_inv``. Its ``save_pretrained`` writes a *hybrid*
  (``model.layers.N.attn.wq_a.weight``, ``model.layers.N.attn.norm.weight``, ``model.embed_tokens.weight``,
  ``model.hc_head.hc_fn``, ``head.weight``), also accepted here.
* **HF V4.1** keeps the released names; only ``layers.`` -> ``model.layers.``, ``embed`` -> ``model.embed``,
  ``norm`` -> ``model.norm`` and ``head`` -> ``lm_head``.

``released_to_hf`` returns an :class:`HFRef`: the HF tensor plus, for a V4 routed expert, which
slice of the stacked tensor the released tensor fills.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

V4 = "deepseek_v4"
V41 = "deepseek_v41"

# Released -> HF names of V4 layer modules (the leaf ``.weight`` / ``.scale`` is appended).
_V4_MODULES = {
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Released -> HF names of V4 bare layer parameters (no leaf).
_V4_PARAMS = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    **{f"hc_{site}_{p}": f"{site}_hc.{p}" for site in ("attn", "ffn") for p in ("fn", "base", "scale")},
}
_V4_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_V41_TOP = {"embed.weight": "model.embed.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight"}

_EXPERT_PARTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")

_V4_MODULES_INV = {v: k for k, v in _V4_MODULES.items()}
_V4_PARAMS_INV = {v: k for k, v in _V4_PARAMS.items()}
_V4_TOP_INV = {v: k for k, v in _V4_TOP.items()}
_V41_TOP_INV = {v: k for k, v in _V41_TOP.items()}


@dataclass(frozen=True)
class HFRef:
    """Where a released tensor goes: HF tensor ``name``; for a V4 routed expert also the expert
    index and ``half`` (0 = w1 / down rows, 1 = w3: the second half of gate_up_proj's rows)."""

    name: str
    expert: int | None = None
    half: int = 0
    is_scale: bool = False


class UnknownTensorName(KeyError):
    """A name that is neither a released nor an HF tensor name of the architecture."""


def is_mtp_name(released: str) -> bool:
    """V4 MTP / V4.1 DSpark blocks (``mtp.K.*``), which the backbone does not use."""
    return released.startswith(("mtp.", "model.mtp.", "dspark.", "model.dspark."))


def is_vision_name(released: str) -> bool:
    return released.startswith(("vision.", "aligner.", "model.vision.", "model.aligner.", "vision_model."))


def _split_leaf(local: str) -> tuple[str, str | None]:
    for leaf in ("weight", "scale"):
        if local.endswith("." + leaf):
            return local[: -len(leaf) - 1], leaf
    return local, None


# ---- V4 ---------------------------------------------------------------------------------------
def v4_released_to_hf(name: str) -> HFRef:
    if name in _V4_TOP:
        return HFRef(_V4_TOP[name])
    m = _LAYER.match(name)
    if not m:
        raise UnknownTensorName(name)
    layer, local = m.groups()
    prefix = f"model.layers.{layer}."
    e = _EXPERT.match(local)
    if e:
        expert, part, leaf = e.groups()
        stacked, half = _EXPERT_PARTS[part]
        return HFRef(prefix + "mlp.experts." + stacked, int(expert), half, leaf == "scale")
    if local in _V4_PARAMS:
        return HFRef(prefix + _V4_PARAMS[local])
    module, leaf = _split_leaf(local)
    if module in _V4_MODULES and leaf:
        hf = prefix + _V4_MODULES[module]
        return HFRef(hf + (".weight_scale_inv" if leaf == "scale" else ".weight"), is_scale=leaf == "scale")
    raise UnknownTensorName(name)


def v4_hf_to_released(name: str, num_experts: int | None = None) -> list[str]:
    """The released tensor(s) an HF V4 tensor is made of (2E for gate_up_proj, E for down_proj)."""
    if name in _V4_TOP_INV:
        return [_V4_TOP_INV[name]]
    m = _HF_LAYER.match(name)
    if not m:
        raise UnknownTensorName(name)
    layer, local = m.groups()
    prefix = f"layers.{layer}."
    for stacked, parts in (("mlp.experts.gate_up_proj", ("w1", "w3")), ("mlp.experts.down_proj", ("w2",))):
        for suffix, leaf in (("", "weight"), ("_scale_inv", "scale")):
            if local == stacked + suffix:
                if num_experts is None:
                    raise ValueError(f"{name}: the number of experts is needed to name its released tensors")
                return [f"{prefix}ffn.experts.{e}.{p}.{leaf}" for e in range(num_experts) for p in parts]
    if local in _V4_PARAMS_INV:
        return [prefix + _V4_PARAMS_INV[local]]
    for hf_leaf, leaf in ((".weight_scale_inv", "scale"), (".weight", "weight")):
        if local.endswith(hf_leaf) and local[: -len(hf_leaf)] in _V4_MODULES_INV:
            return [f"{prefix}{_V4_MODULES_INV[local[: -len(hf_leaf)]]}.{leaf}"]
    raise UnknownTensorName(name)


def v4_saved_to_released(name: str) -> str:
    """transformers 5.24's ``save_pretrained`` names (a hybrid) -> released names.
    Released names pass through unchanged."""
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    if name == "lm_head.weight":
        return "head.weight"
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name[len("model.hc_head.hc_"):]
    if name.startswith("model.layers."):
        name = name[len("model."):]
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", name)


def v4_released_to_saved(name: str) -> str:
    """Released -> transformers 5.24 ``save_pretrained`` names (inverse of :func:`v4_saved_to_released`)."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name.startswith("hc_head_"):
        return "model.hc_head.hc_" + name[len("hc_head_"):]
    if name.startswith("layers."):
        return "model." + re.sub(r"^(layers\.\d+\.attn)\.kv_norm\.", r"\1.norm.", name)
    return name


# ---- V4.1 -------------------------------------------------------------------------------------
def v41_released_to_hf(name: str) -> HFRef:
    if name in _V41_TOP:
        return HFRef(_V41_TOP[name])
    if name.startswith("layers."):
        return HFRef("model." + name, is_scale=name.endswith(".scale"))
    raise UnknownTensorName(name)


def v41_hf_to_released(name: str) -> str:
    if name in _V41_TOP_INV:
        return _V41_TOP_INV[name]
    if name.startswith("model.layers."):
        return name[len("model."):]
    raise UnknownTensorName(name)


# ---- either -----------------------------------------------------------------------------------
def to_released(name: str, arch: str) -> str:
    """Any accepted spelling of a checkpoint key -> its released name (V4 hybrid or HF-V4.1)."""
    if arch == V4:
        return v4_saved_to_released(name)
    if name in _V41_TOP_INV or name.startswith("model.layers."):
        return v41_hf_to_released(name)
    return name


def released_to_hf(name: str, arch: str) -> HFRef:
    if arch == V4:
        return v4_released_to_hf(name)
    if arch == V41:
        return v41_released_to_hf(name)
    raise ValueError(f"unknown DeepSeek-V4 architecture {arch!r} ({V4} or {V41})")
