"""DeepSeek-V4 configuration (``model_type: deepseek_v4``) parsed from a ``config.json``.

Both vocabularies are accepted: DeepSeek's released one (``compress_ratios`` with one entry
per layer plus MTP entries, ``num_hash_layers``, flat ``rope_scaling`` + ``compress_rope_theta``,
``qk_rope_head_dim``) and Hugging Face's (``layer_types`` + ``compress_rates``,
``mlp_layer_types``, nested ``rope_parameters`` {main, compress}, ``partial_rotary_factor``).
Per layer the result holds the attention kind (``sliding`` / ``csa`` / ``hca``), its compress
ratio m (0 for sliding) and whether its MoE is hash-routed. In the released vocabulary a
ratio of 4 means CSA (overlapping windows + indexer) and any other positive ratio HCA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model.config_json import ConfigError
from model.config_json import get_or_default as _get
from model.v4.rope import RopeSpec, YarnParams

HF_LAYER_KINDS = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class V4Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    hash_layers: tuple[bool, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeSpec
    compress_rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    num_nextn_predict_layers: int
    quantization: dict | None
    torch_dtype: str
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
             "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def _layer_schedule(d: dict, n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if d.get("layer_types") is not None:
        rates = dict(DEFAULT_COMPRESS_RATES)
        rates.update(d.get("compress_rates") or {})
        for legacy, key in (("compress_rate_csa", "compressed_sparse_attention"),
                            ("compress_rate_hca", "heavily_compressed_attention")):
            if d.get(legacy) is not None:
                rates[key] = d[legacy]
        types = list(d["layer_types"])
        if len(types) < n:
            raise ConfigError(f"layer_types has {len(types)} entries, num_hidden_layers is {n}")
        kinds, ratios = [], []
        for t in types[:n]:
            if t not in HF_LAYER_KINDS:
                raise ConfigError(f"unsupported layer_types entry {t!r} (expected one of {sorted(HF_LAYER_KINDS)})")
            kinds.append(HF_LAYER_KINDS[t])
            ratios.append(0 if t == "sliding_attention" else int(rates[t]))
        return tuple(kinds), tuple(ratios)
    if d.get("compress_ratios") is not None:
        raw = [int(r) for r in d["compress_ratios"]]
        if len(raw) < n:
            raise ConfigError(f"compress_ratios has {len(raw)} entries, num_hidden_layers is {n}")
        raw = raw[:n]  # the extra entries belong to the MTP layers
        if any(r < 0 for r in raw):
            raise ConfigError("compress_ratios entries must be >= 0")
        kinds = tuple("sliding" if r == 0 else "csa" if r == 4 else "hca" for r in raw)
        return kinds, tuple(raw)
    # HF's default schedule: two HCA layers, then CSA/HCA alternating.
    kinds = ["hca"] * min(n, 2) + ["csa" if i % 2 else "hca" for i in range(max(n - 2, 0))]
    return tuple(kinds), tuple(DEFAULT_COMPRESS_RATES[
        "compressed_sparse_attention" if k == "csa" else "heavily_compressed_attention"] for k in kinds)


def _hash_schedule(d: dict, n: int) -> tuple[bool, ...]:
    if d.get("mlp_layer_types") is not None:
        types = list(d["mlp_layer_types"])
        if len(types) < n:
            raise ConfigError(f"mlp_layer_types has {len(types)} entries, num_hidden_layers is {n}")
        bad = [t for t in types[:n] if t not in ("hash_moe", "moe")]
        if bad:
            raise ConfigError(f"unsupported mlp_layer_types entry {bad[0]!r} (expected 'hash_moe' or 'moe')")
        return tuple(t == "hash_moe" for t in types[:n])
    n_hash = int(_get(d, "num_hash_layers", 3))
    return tuple(i < n_hash for i in range(n))


def _rope_spec(p: dict, theta: float, what: str) -> RopeSpec:
    rope_type = p.get("rope_type", p.get("type", "default")) or "default"
    if rope_type == "default" or not p.get("factor"):
        return RopeSpec(float(_get(p, "rope_theta", theta)))
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"unsupported {what} rope type {rope_type!r} (only 'yarn' is implemented)")
    if p.get("original_max_position_embeddings") is None:
        raise ConfigError(f"{what} YaRN parameters need original_max_position_embeddings")
    yarn = YarnParams(float(p["factor"]), int(p["original_max_position_embeddings"]),
                      float(_get(p, "beta_fast", 32.0)), float(_get(p, "beta_slow", 1.0)))
    # DeepSeek-V4 leaves cos/sin unscaled (no YaRN mscale); only an explicit factor changes that.
    return RopeSpec(float(_get(p, "rope_theta", theta)), yarn, float(_get(p, "attention_factor", 1.0)))


def _rope_specs(d: dict) -> tuple[RopeSpec, RopeSpec]:
    theta = float(_get(d, "rope_theta", 10000.0))
    compress_theta = float(_get(d, "compress_rope_theta", 160000.0))
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return _rope_spec(rp["main"], theta, "main"), _rope_spec(rp["compress"], compress_theta, "compress")
    flat = {k: v for k, v in (d.get("rope_scaling") or rp).items() if k not in ("main", "compress", "rope_theta")}
    return RopeSpec(theta), _rope_spec(flat, compress_theta, "compress")


def _quantization(d: dict) -> dict | None:
    """``quantization_config`` as given, with a top-level ``expert_dtype`` (V4's place) moved inside."""
    q = d.get("quantization_config")
    if not q:
        return None
    q = dict(q)
    if d.get("expert_dtype") is not None:
        q.setdefault("expert_dtype", d["expert_dtype"])
    return q


def parse_v4_config(d: dict[str, Any]) -> V4Config:
    """Build a :class:`V4Config` from a ``deepseek_v4`` config.json (either vocabulary)."""
    if d.get("model_type") != "deepseek_v4":
        raise ConfigError(f"expected model_type 'deepseek_v4', got {d.get('model_type')!r}")
    for key in _REQUIRED:
        if d.get(key) is None:
            raise ConfigError(f"config.json is missing required field {key!r}")
    n = int(d["num_hidden_layers"])
    head_dim = int(d["head_dim"])
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = int(d["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * float(_get(d, "partial_rotary_factor", 64 / 512)))
    kinds, ratios = _layer_schedule(d, n)
    main_rope, compress_rope = _rope_specs(d)
    scoring = _get(d, "scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"unsupported scoring_func {scoring!r} for deepseek_v4 (only 'sqrtsoftplus')")
    hidden_act = _get(d, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"unsupported hidden_act {hidden_act!r} (DeepSeek uses 'silu')")
    if int(_get(d, "num_key_value_heads", 1)) != 1:
        raise ConfigError("deepseek_v4 has one shared K=V head: num_key_value_heads must be 1")
    cfg = V4Config(
        model_type="deepseek_v4",
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        num_hidden_layers=n,
        num_attention_heads=int(d["num_attention_heads"]),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=int(d["q_lora_rank"]),
        o_groups=int(d["o_groups"]),
        o_lora_rank=int(d["o_lora_rank"]),
        sliding_window=int(_get(d, "sliding_window", 128)),
        layer_kinds=kinds,
        compress_ratios=ratios,
        hash_layers=_hash_schedule(d, n),
        index_n_heads=int(_get(d, "index_n_heads", 64)),
        index_head_dim=int(_get(d, "index_head_dim", 128)),
        index_topk=int(_get(d, "index_topk", 512)),
        n_routed_experts=int(d["n_routed_experts"]),
        n_shared_experts=int(_get(d, "n_shared_experts", 1)),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor", 1.5)),
        swiglu_limit=float(_get(d, "swiglu_limit", 10.0)),
        hc_mult=int(_get(d, "hc_mult", 4)),
        hc_sinkhorn_iters=int(_get(d, "hc_sinkhorn_iters", 20)),
        hc_eps=float(_get(d, "hc_eps", 1e-6)),
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position_embeddings=int(_get(d, "max_position_embeddings", 1048576)),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        num_nextn_predict_layers=int(_get(d, "num_nextn_predict_layers", 0)),
        quantization=_quantization(d),
        torch_dtype=str(_get(d, "torch_dtype", _get(d, "dtype", "bfloat16"))),
        raw=dict(d),
    )
    _validate(cfg)
    return cfg


def _validate(c: V4Config) -> None:
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= min(c.head_dim, c.index_head_dim):
        raise ConfigError("qk_rope_head_dim must be even, positive and at most head_dim and index_head_dim")
    if (c.num_attention_heads * c.head_dim) % c.o_groups:
        raise ConfigError("num_attention_heads * head_dim must be divisible by o_groups")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError("num_experts_per_tok must not exceed n_routed_experts")
    if c.sliding_window < 1 or c.hc_mult < 1 or c.hc_sinkhorn_iters < 1:
        raise ConfigError("sliding_window, hc_mult and hc_sinkhorn_iters must be >= 1")
    for i, (kind, m) in enumerate(zip(c.layer_kinds, c.compress_ratios)):
        if kind != "sliding" and m < 1:
            raise ConfigError(f"layer {i} ({kind}) needs a compress ratio >= 1, got {m}")
