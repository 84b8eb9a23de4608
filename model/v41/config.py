"""DeepSeek-V4.1 configuration: the composite ``deepseek_v41`` config.json (or a bare
``deepseek_v41_text`` one) parsed into one frozen dataclass.

The released config nests the text backbone under ``text_config`` beside a
``vision_config`` (not implemented here) and keeps ``quantization_config`` at the top
level. Defaults, derived schedules and validation follow the released checkpoint's
semantics: only ``kv_source_layer_ids`` own a compressor, every layer with a ratio > 0
reads the nearest KV source at or before it and the top-k of the nearest index source
at or before it. Errors are :class:`~model.config.ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model.config_json import ConfigError
from model.config_json import get_or_default as _get
from model.v4.rope import RopeSpec, YarnParams

_RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20
_RELEASED_KV_SOURCES = [2, 8, 14, 20]
_RELEASED_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]


@dataclass(frozen=True)
class V41QuantizationConfig:
    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None
    expert_dtype: str | None = None


@dataclass(frozen=True)
class V41Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # backbone layers only
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # < 0: no two-level top-k
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    main_rope: RopeSpec
    compress_rope: RopeSpec
    max_position_embeddings: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    gate_temp: float
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_vocab_size: int
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int  # DSpark draft blocks (not built; their weights are skipped)
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    image_token_id: int | None
    quantization: V41QuantizationConfig | None
    torch_dtype: str
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- layer schedule --------------------------------------------------------------
    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose compressed cache ``layer`` reads (None for window-only layers)."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose top-k ``layer`` uses (itself when it is one): the nearest one
        at or before it that reads the same KV source. None: its compressed entries stay masked."""
        if self.compress_ratios[layer] == 0:
            return None
        source = self.kv_source_of(layer)
        earlier = [s for s in self.index_source_layer_ids if source <= s <= layer]
        return max(earlier) if earlier else None

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def is_fp8_checkpoint(self) -> bool:
        return self.quantization is not None


def _rope_specs(t: dict) -> tuple[RopeSpec, RopeSpec]:
    rp = t.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_raw, comp_raw = rp["main"], rp["compress"]
    else:
        yarn = {k: v for k, v in (t.get("rope_scaling") or {}).items() if k not in ("main", "compress")}
        main_raw = {"rope_type": "default", "rope_theta": _get(t, "rope_theta", 10000.0)}
        comp_raw = {**yarn, "rope_theta": _get(t, "compress_rope_theta", 160000.0)}
    specs = []
    for name, raw in (("main", main_raw), ("compress", comp_raw)):
        kind = raw.get("rope_type", raw.get("type", "default"))
        if kind in (None, "default"):
            specs.append(RopeSpec(theta=float(raw["rope_theta"])))
        elif kind == "yarn":
            if float(_get(raw, "attention_factor", 1.0)) != 1.0:
                raise ConfigError(f"rope_parameters.{name}.attention_factor must be 1.0 (V4.1 applies no mscale)")
            if raw.get("truncate", True) is False:
                raise ConfigError(f"rope_parameters.{name}.truncate=false is not supported (DeepSeek truncates)")
            yarn = YarnParams(
                factor=float(raw["factor"]),
                original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
                beta_fast=float(_get(raw, "beta_fast", 32.0)),
                beta_slow=float(_get(raw, "beta_slow", 1.0)),
            )
            specs.append(RopeSpec(theta=float(raw["rope_theta"]), yarn=yarn))
        else:
            raise ConfigError(f"unsupported rope type {kind!r} for the {name} rope (default or yarn)")
    return specs[0], specs[1]


def _schedule(t: dict, n: int, n_nextn: int) -> tuple[list[int], list[int], list[int], int]:
    ratios = t.get("compress_ratios")
    if ratios is None:
        if n == len(_RELEASED_RATIOS):
            ratios = list(_RELEASED_RATIOS)
        else:
            n_slide = min(2, n)
            n_enc = max(0, (n - n_slide + 1) // 2)
            ratios = [0] * n_slide + [2] * n_enc + [1] * max(0, n - n_slide - n_enc)
    ratios = [int(r) for r in ratios]
    if len(ratios) < n or len(ratios) > n + n_nextn:
        raise ConfigError(
            f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers ({n}) "
            f"up to num_hidden_layers + num_nextn_predict_layers ({n + n_nextn})"
        )
    backbone = ratios[:n]
    if any(r < 0 for r in backbone):
        raise ConfigError(f"compress_ratios entries must be >= 0, got {backbone}")
    kv = t.get("kv_source_layer_ids")
    if kv is None:
        if backbone == _RELEASED_RATIOS[:n]:
            kv = list(_RELEASED_KV_SOURCES)
        else:
            kv = [i for i in range(n) if backbone[i] > 0 and (i == 0 or backbone[i - 1] != backbone[i])]
    kv = [int(i) for i in kv]
    idx = t.get("index_source_layer_ids")
    if idx is None:
        idx = list(_RELEASED_INDEX_SOURCES) if kv == _RELEASED_KV_SOURCES else list(kv)
    idx = [int(i) for i in idx]
    if any(i < 0 or i >= n for i in kv + idx):
        raise ConfigError(f"kv_source_layer_ids/index_source_layer_ids out of range [0, {n}): {kv} / {idx}")
    if any(backbone[i] == 0 for i in kv + idx):
        raise ConfigError("kv_source_layer_ids and index_source_layer_ids must have compress_ratios[i] > 0")
    for i in range(n):
        if backbone[i] > 0 and not any(s <= i for s in kv):
            raise ConfigError(f"layer {i} has compress_ratios > 0 but no kv_source_layer_ids entry at or before it")
    for i in idx:
        src = max(s for s in kv if s <= i)
        if backbone[src] != backbone[i]:
            raise ConfigError(f"index source {i} has ratio {backbone[i]} but its KV source {src} has {backbone[src]}")
    cand = t.get("candidate_source_layer_id")
    cand = (kv[-1] if kv else -1) if cand is None else int(cand)
    if cand >= 0 and cand not in idx:
        raise ConfigError(f"candidate_source_layer_id ({cand}) must be one of index_source_layer_ids {idx}")
    return backbone, kv, idx, cand


def parse_v41_config(d: dict[str, Any]) -> V41Config:
    """Parse a composite ``deepseek_v41`` or a bare ``deepseek_v41_text`` config dict."""
    top = d
    if d.get("model_type") == "deepseek_v41":
        t = d.get("text_config")
        if not isinstance(t, dict):
            raise ConfigError("config.json (model_type deepseek_v41) is missing its 'text_config' object")
    else:
        t = d
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if t.get(key) is None:
            raise ConfigError(f"config.json is missing required field text_config.{key!r}")
    n = int(t["num_hidden_layers"])
    n_nextn = int(_get(t, "num_nextn_predict_layers", 3))
    ratios, kv, idx, cand = _schedule(t, n, n_nextn)
    main_rope, compress_rope = _rope_specs(t)

    quant = None
    q = top.get("quantization_config") or t.get("quantization_config")
    if q:
        if q.get("quant_method") != "fp8":
            raise ConfigError(f"unsupported quantization_config.quant_method {q.get('quant_method')!r} (only 'fp8')")
        block = q.get("weight_block_size") or [128, 128]
        quant = V41QuantizationConfig(
            quant_method="fp8",
            weight_block_size=(int(block[0]), int(block[1])),
            scale_fmt=q.get("scale_fmt"),
            expert_dtype=q.get("expert_dtype", top.get("expert_dtype")),
        )
    scoring = _get(t, "scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"unsupported scoring_func {scoring!r} (DeepSeek-V4.1 uses 'sqrtsoftplus')")
    if int(_get(t, "num_key_value_heads", 1)) != 1:
        raise ConfigError("DeepSeek-V4.1 has one shared K=V head: num_key_value_heads must be 1")
    if _get(t, "hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {t.get('hidden_act')!r} (DeepSeek uses 'silu')")
    engram_layers = [int(i) for i in _get(t, "engram_layer_ids", [])]
    engram_rows = [int(i) for i in _get(t, "engram_num_embeddings", [0] * len(engram_layers))]
    if len(engram_rows) != len(engram_layers):
        raise ConfigError("engram_num_embeddings must have one entry per engram_layer_ids entry")

    cfg = V41Config(
        model_type="deepseek_v41",
        vocab_size=int(t["vocab_size"]),
        hidden_size=int(t["hidden_size"]),
        num_hidden_layers=n,
        num_attention_heads=int(t["num_attention_heads"]),
        head_dim=int(_get(t, "head_dim", 512)),
        q_lora_rank=int(_get(t, "q_lora_rank", 1280)),
        qk_rope_head_dim=int(_get(t, "qk_rope_head_dim", 64)),
        o_groups=int(_get(t, "o_groups", 8)),
        o_lora_rank=int(_get(t, "o_lora_rank", 1024)),
        sliding_window=int(_get(t, "sliding_window", 128)),
        compress_ratios=tuple(ratios),
        kv_source_layer_ids=tuple(kv),
        index_source_layer_ids=tuple(idx),
        candidate_source_layer_id=cand,
        candidate_topk_blocks=int(_get(t, "candidate_topk_blocks", 2048)),
        candidate_block_size=int(_get(t, "candidate_block_size", 8)),
        index_n_heads=int(_get(t, "index_n_heads", 32)),
        index_head_dim=int(_get(t, "index_head_dim", 128)),
        index_topk=int(_get(t, "index_topk", 512)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position_embeddings=int(_get(t, "max_position_embeddings", 1048576)),
        moe_intermediate_size=int(_get(t, "moe_intermediate_size", 2304)),
        n_routed_experts=int(_get(t, "n_routed_experts", 384)),
        n_shared_experts=int(_get(t, "n_shared_experts", 1)),
        num_experts_per_tok=int(_get(t, "num_experts_per_tok", 6)),
        gate_temp=float(_get(t, "gate_temp", 1.0)),
        norm_topk_prob=bool(_get(t, "norm_topk_prob", True)),
        routed_scaling_factor=float(_get(t, "routed_scaling_factor", 1.5)),
        swiglu_limit=float(_get(t, "swiglu_limit", 10.0)),
        hc_mult=int(_get(t, "hc_mult", 4)),
        hc_sinkhorn_iters=int(_get(t, "hc_sinkhorn_iters", 20)),
        hc_eps=float(_get(t, "hc_eps", 1e-6)),
        engram_layer_ids=tuple(engram_layers),
        engram_vocab_size=int(_get(t, "engram_vocab_size", 16000000)),
        engram_num_embeddings=tuple(engram_rows),
        engram_max_ngram_size=int(_get(t, "engram_max_ngram_size", 4)),
        engram_n_heads=int(_get(t, "engram_n_heads", 8)),
        engram_head_dim=int(_get(t, "engram_head_dim", 256)),
        # The released config spells it engram_pad_token_id.
        engram_pad_id=int(_get(t, "engram_pad_id", _get(t, "engram_pad_token_id", 2))),
        engram_compressed_vocab_size=int(_get(t, "engram_compressed_vocab_size", 99092)),
        num_nextn_predict_layers=n_nextn,
        rms_norm_eps=float(_get(t, "rms_norm_eps", 1e-20)),
        tie_word_embeddings=bool(_get(t, "tie_word_embeddings", False)),
        bos_token_id=t.get("bos_token_id", top.get("bos_token_id")),
        eos_token_id=t.get("eos_token_id", top.get("eos_token_id", 1)),
        image_token_id=top.get("image_token_id"),
        quantization=quant,
        torch_dtype=str(_get(t, "torch_dtype", _get(t, "dtype", _get(top, "torch_dtype", "bfloat16")))),
        raw=dict(d),
    )
    _validate(cfg)
    return cfg


def _validate(c: V41Config) -> None:
    if c.qk_rope_head_dim % 2 or c.qk_rope_head_dim > c.head_dim:
        raise ConfigError("qk_rope_head_dim must be even and at most head_dim")
    if c.qk_rope_head_dim > c.index_head_dim:
        raise ConfigError("qk_rope_head_dim must be at most index_head_dim (the indexer rotates its tail)")
    if (c.num_attention_heads * c.head_dim) % c.o_groups:
        raise ConfigError("num_attention_heads * head_dim must be divisible by o_groups")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError("num_experts_per_tok must not exceed n_routed_experts")
    if c.n_shared_experts != 1:
        raise ConfigError("n_shared_experts must be 1 (DeepSeek-V4.1 has one shared expert per MoE layer)")
    if any(i < 0 or i >= c.num_hidden_layers for i in c.engram_layer_ids):
        raise ConfigError(f"engram_layer_ids out of range [0, {c.num_hidden_layers}): {list(c.engram_layer_ids)}")
