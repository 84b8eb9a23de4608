"""DeepSeek V2/V3 model configuration read from a Hugging Face ``config.json``.

One dataclass holds every field the architecture uses, so layers never look at raw JSON.
Errors are raised as :class:`ConfigError` with one line naming the offending field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from model.config_json import ConfigError
from model.config_json import get_or_default as _get

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (``rope_scaling`` in config.json). ``factor == 1`` means plain RoPE."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class QuantizationConfig:
    """FP8 block quantization of a checkpoint (``quantization_config``)."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    scale_fmt: str | None = None  # "ue8m0" for power-of-two scales (V3.1+)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # MLA
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    n_routed_experts: int | None
    n_shared_experts: int | None
    num_experts_per_tok: int | None
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    topk_method: str
    scoring_func: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # misc
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    num_nextn_predict_layers: int
    quantization: QuantizationConfig | None
    torch_dtype: str
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_entry_dim(self) -> int:
        """Values cached per token per layer: the latent kv_c followed by the rotated k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 when YaRN stretches the context (as HF/vLLM)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs.factor > 1.0 and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def is_fp8_checkpoint(self) -> bool:
        return self.quantization is not None

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            bool(self.n_routed_experts)
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def parse_model_config(d: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the parsed JSON of a HF ``config.json``.

    ``deepseek_v4`` configs are parsed into a :class:`model.v4.config.V4Config` and DeepSeek-V4.1
    (``deepseek_v41``/``deepseek_v41_text``) into a :class:`model.v41.config.V41Config` instead.
    """
    model_type = d.get("model_type")
    if model_type == "deepseek_v4":
        from model.v4.config import parse_v4_config

        return parse_v4_config(d)
    if model_type in V41_MODEL_TYPES:
        from model.v41.config import parse_v41_config

        return parse_v41_config(d)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r} in config.json "
            f"(mlaserve implements {', '.join(SUPPORTED_MODEL_TYPES + ('deepseek_v4',) + V41_MODEL_TYPES)})"
        )
    for key in _REQUIRED:
        if d.get(key) is None:
            raise ConfigError(f"config.json is missing required field {key!r}")
    is_v3 = model_type == "deepseek_v3"

    rope_raw = d.get("rope_scaling") or d.get("rope_parameters") or {}
    rope_theta = float(_get(d, "rope_theta", _get(rope_raw, "rope_theta", 10000.0)))
    rope_type = rope_raw.get("rope_type", rope_raw.get("type", "default"))
    if rope_type in (None, "default") or not rope_raw.get("factor"):
        rope_scaling = RopeScaling()
    elif rope_type in ("yarn", "deepseek_yarn"):
        rope_scaling = RopeScaling(
            factor=float(rope_raw["factor"]),
            original_max_position_embeddings=int(
                rope_raw.get("original_max_position_embeddings", 4096)
            ),
            beta_fast=float(_get(rope_raw, "beta_fast", 32.0)),
            beta_slow=float(_get(rope_raw, "beta_slow", 1.0)),
            mscale=float(_get(rope_raw, "mscale", 1.0)),
            mscale_all_dim=float(_get(rope_raw, "mscale_all_dim", 0.0)),
        )
    else:
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r} (only 'yarn' is implemented)")

    quant = None
    q = d.get("quantization_config")
    if q:
        method = q.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"unsupported quantization_config.quant_method {method!r} (only 'fp8')")
        block = q.get("weight_block_size") or [128, 128]
        if len(block) != 2:
            raise ConfigError("quantization_config.weight_block_size must have two entries")
        quant = QuantizationConfig(
            quant_method="fp8",
            weight_block_size=(int(block[0]), int(block[1])),
            activation_scheme=q.get("activation_scheme", "dynamic"),
            scale_fmt=q.get("scale_fmt"),
        )

    n_routed = d.get("n_routed_experts")
    topk_method = _get(d, "topk_method", "noaux_tc" if is_v3 else "greedy")
    if topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ConfigError(f"unsupported topk_method {topk_method!r}")
    scoring = _get(d, "scoring_func", "sigmoid" if is_v3 else "softmax")
    if scoring not in ("sigmoid", "softmax"):
        raise ConfigError(f"unsupported scoring_func {scoring!r}")
    if n_routed:
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if d.get(key) is None:
                raise ConfigError(f"config.json is missing required field {key!r} (model has routed experts)")
    hidden_act = _get(d, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"unsupported hidden_act {hidden_act!r} (DeepSeek uses 'silu')")

    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=int(d["num_attention_heads"]),
        kv_lora_rank=int(d["kv_lora_rank"]),
        q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        n_routed_experts=int(n_routed) if n_routed else None,
        n_shared_experts=int(d["n_shared_experts"]) if d.get("n_shared_experts") else None,
        num_experts_per_tok=int(d["num_experts_per_tok"]) if n_routed else None,
        moe_intermediate_size=int(_get(d, "moe_intermediate_size", 0)),
        first_k_dense_replace=int(_get(d, "first_k_dense_replace", 0)),
        moe_layer_freq=int(_get(d, "moe_layer_freq", 1)),
        topk_method=topk_method,
        scoring_func=scoring,
        n_group=int(_get(d, "n_group", 1)),
        topk_group=int(_get(d, "topk_group", 1)),
        norm_topk_prob=bool(_get(d, "norm_topk_prob", False)),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor", 1.0)),
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_get(d, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
        hidden_act=hidden_act,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        num_nextn_predict_layers=int(_get(d, "num_nextn_predict_layers", 0)),
        quantization=quant,
        torch_dtype=str(_get(d, "torch_dtype", _get(d, "dtype", "bfloat16"))),
        raw=dict(d),
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError("qk_rope_head_dim must be even (RoPE rotates pairs)")
    if cfg.n_routed_experts:
        if cfg.n_routed_experts % cfg.n_group:
            raise ConfigError("n_routed_experts must be divisible by n_group")
        if cfg.topk_group > cfg.n_group:
            raise ConfigError("topk_group must not exceed n_group")
        if cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise ConfigError("num_experts_per_tok must not exceed n_routed_experts")


def load_model_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Read ``<model_dir>/config.json``; every failure is a one-line :class:`ConfigError`."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {os.fspath(model_dir)!r}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return parse_model_config(data)
