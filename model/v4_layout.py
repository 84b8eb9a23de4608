"""Which tensors a DeepSeek-V4 / V4.1 checkpoint holds, from its config.json alone.

Lists every tensor under its *released* name with its logical shape and storage kind, and how
each kind is stored (FP8 + E8M0 block scales, MXFP4 + E8M0 group scales, BF16, F32, I64).
make-checkpoint writes from this list; tests check real-shape checkpoints against it without
writing gigabytes. The layer schedule comes from the model's own config parser, which reads
both dialects: DeepSeek's (``compress_ratios``, ``num_hash_layers``) and HF's (``layer_types``
+ ``compress_rates``, ``mlp_layer_types``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.weight_formats import E8M0_DTYPE, FP8_DTYPE, MXFP4_GROUP
from model.config_json import ConfigError
from model.v4.config import parse_v4_config
from model.v41.config import parse_v41_config
from model.v4_names import V4, V41

# Storage kinds. FP8 / FP4 / ENGRAM are quantized in an FP8 checkpoint and BF16 otherwise.
FP8 = "fp8"  # linear: e4m3 + E8M0 [N/bn, K/bk]
FP4 = "fp4"  # routed expert: MXFP4 int8 [N, K/2] + E8M0 [N, K/32]
ENGRAM = "engram"  # engram table: e4m3 rows + E8M0 [rows, K/32] (always has a .scale)
BF16 = "bf16"
F32 = "f32"
I64 = "i64"


class LayoutError(ValueError):
    """config.json cannot describe a V4/V4.1 checkpoint; the message names the field."""


@dataclass(frozen=True)
class TensorSpec:
    name: str  # released name; a quantized tensor's scale is ``<module>.scale``
    shape: tuple[int, ...]  # logical (dequantized) shape
    kind: str


def architecture(cfg: dict) -> str:
    """``deepseek_v4`` or ``deepseek_v41`` from config.json's model_type."""
    mt = cfg.get("model_type")
    if mt in (V4,):
        return V4
    if mt in (V41, "deepseek_v41_text"):
        return V41
    raise LayoutError(f"config.json: model_type {mt!r} is not a DeepSeek-V4 model ({V4}, {V41})")


def text_config(cfg: dict) -> dict:
    """The language-model fields: V4.1 nests them under ``text_config``."""
    return cfg.get("text_config") or cfg


def quantization_block(cfg: dict) -> tuple[int, int]:
    q = cfg.get("quantization_config") or text_config(cfg).get("quantization_config") or {}
    block = q.get("weight_block_size") or ([32, 32] if architecture(cfg) == V41 else [128, 128])
    return int(block[0]), int(block[1])


def _req(c: dict, key: str):
    if c.get(key) is None:
        raise LayoutError(f"config.json is missing required field {key!r}")
    return c[key]


def _parsed_config(cfg: dict, arch: str):
    """The model config's reading of the layer schedule (ratios, hash layers, KV / index
    sources, engram layers), so the checkpoint layout and the model never disagree on it."""
    try:
        return parse_v41_config(cfg) if arch == V41 else parse_v4_config(text_config(cfg))
    except ConfigError as exc:
        raise LayoutError(f"config.json: {exc}") from None


def _mtp_compress_ratio(c: dict, layer: int) -> int:
    """A V4 MTP layer's ratio: its ``compress_ratios`` entry after the backbone's; 0 (sliding
    window only) when the config has no such entry (HF's dialect describes backbone layers)."""
    ratios = c.get("compress_ratios")
    return int(ratios[layer]) if ratios is not None and layer < len(ratios) else 0


def _mhc(p: str, c: dict) -> list[TensorSpec]:
    hc, d = int(_req(c, "hc_mult")), int(_req(c, "hidden_size"))
    mix = (2 + hc) * hc
    out = []
    for site in ("attn", "ffn"):
        out += [TensorSpec(f"{p}hc_{site}_fn", (mix, hc * d), F32), TensorSpec(f"{p}hc_{site}_base", (mix,), F32),
                TensorSpec(f"{p}hc_{site}_scale", (3,), F32)]
    return out


def _attention_core(p: str, c: dict) -> list[TensorSpec]:
    d_model, heads, hd = int(c["hidden_size"]), int(c["num_attention_heads"]), int(_req(c, "head_dim"))
    ql, g, ol = int(_req(c, "q_lora_rank")), int(_req(c, "o_groups")), int(_req(c, "o_lora_rank"))
    if heads % g:
        raise LayoutError(f"config.json: num_attention_heads ({heads}) must be divisible by o_groups ({g})")
    a = p + "attn."
    return [
        TensorSpec(a + "wq_a.weight", (ql, d_model), FP8), TensorSpec(a + "q_norm.weight", (ql,), BF16),
        TensorSpec(a + "wq_b.weight", (heads * hd, ql), FP8), TensorSpec(a + "wkv.weight", (hd, d_model), FP8),
        TensorSpec(a + "kv_norm.weight", (hd,), BF16),
        TensorSpec(a + "wo_a.weight", (g * ol, heads * hd // g), FP8),
        TensorSpec(a + "wo_b.weight", (d_model, g * ol), FP8),
        TensorSpec(a + "attn_sink", (heads,), F32),
    ]


def _moe(p: str, c: dict, hash_layer: bool, v41: bool) -> list[TensorSpec]:
    d_model, e, inter = int(c["hidden_size"]), int(_req(c, "n_routed_experts")), int(_req(c, "moe_intermediate_size"))
    f = p + "ffn."
    out = [TensorSpec(f + "gate.weight", (e, d_model), BF16)]
    if hash_layer:
        out.append(TensorSpec(f + "gate.tid2eid", (int(c["vocab_size"]), int(_req(c, "num_experts_per_tok"))), I64))
    else:
        out.append(TensorSpec(f + "gate.bias", (e,), F32))
        if v41:
            out.append(TensorSpec(f + "gate.bias_vl", (e,), F32))
    for x in range(e):
        out += [TensorSpec(f"{f}experts.{x}.w1.weight", (inter, d_model), FP4),
                TensorSpec(f"{f}experts.{x}.w2.weight", (d_model, inter), FP4),
                TensorSpec(f"{f}experts.{x}.w3.weight", (inter, d_model), FP4)]
    shared = inter * int(c.get("n_shared_experts") or 0)
    if shared:
        out += [TensorSpec(f + "shared_experts.w1.weight", (shared, d_model), FP8),
                TensorSpec(f + "shared_experts.w2.weight", (d_model, shared), FP8),
                TensorSpec(f + "shared_experts.w3.weight", (shared, d_model), FP8)]
    return out


def _norms(p: str, c: dict) -> list[TensorSpec]:
    d = int(c["hidden_size"])
    return [TensorSpec(p + "attn_norm.weight", (d,), BF16), TensorSpec(p + "ffn_norm.weight", (d,), BF16)]


def _v4_layer(p: str, c: dict, ratio: int, hash_layer: bool) -> list[TensorSpec]:
    d_model, hd = int(c["hidden_size"]), int(c["head_dim"])
    out = _attention_core(p, c)
    if ratio:
        overlap = 2 if ratio == 4 else 1  # CSA pools overlapping windows: [Ca | Cb]
        cp = p + "attn.compressor."
        out += [TensorSpec(cp + "wkv.weight", (overlap * hd, d_model), BF16),
                TensorSpec(cp + "wgate.weight", (overlap * hd, d_model), BF16),
                TensorSpec(cp + "ape", (ratio, overlap * hd), F32), TensorSpec(cp + "norm.weight", (hd,), BF16)]
        if ratio == 4:
            ih, idim, ql = int(_req(c, "index_n_heads")), int(_req(c, "index_head_dim")), int(c["q_lora_rank"])
            ip = p + "attn.indexer."
            out += [TensorSpec(ip + "compressor.wkv.weight", (2 * idim, d_model), BF16),
                    TensorSpec(ip + "compressor.wgate.weight", (2 * idim, d_model), BF16),
                    TensorSpec(ip + "compressor.ape", (ratio, 2 * idim), F32),
                    TensorSpec(ip + "compressor.norm.weight", (idim,), BF16),
                    TensorSpec(ip + "wq_b.weight", (ih * idim, ql), FP8),
                    TensorSpec(ip + "weights_proj.weight", (ih, d_model), BF16)]
    return out + _moe(p, c, hash_layer, v41=False) + _norms(p, c) + _mhc(p, c)


def _v41_layer(p: str, c: dict, layer: int, sched) -> list[TensorSpec]:
    """``sched``: the parsed :class:`model.v41.config.V41Config` (ratios, sources, engram layers)."""
    d_model, hd = int(c["hidden_size"]), int(c["head_dim"])
    out = _attention_core(p, c)
    kv_sources, index_sources = sched.kv_source_layer_ids, sched.index_source_layer_ids
    if layer in kv_sources:
        ratio = sched.compress_ratios[layer]
        cp = p + "attn.compressor."
        out.append(TensorSpec(cp + "wkv.weight", (hd, d_model), BF16))
        if ratio > 1:
            out.append(TensorSpec(cp + "wgate.weight", (hd, d_model), BF16))
        out.append(TensorSpec(cp + "norm.weight", (hd,), BF16))
    if layer in index_sources:
        ih, idim, ql = int(_req(c, "index_n_heads")), int(_req(c, "index_head_dim")), int(c["q_lora_rank"])
        ip = p + "attn.indexer."
        out += [TensorSpec(ip + "wq_b.weight", (ih * idim, ql), FP8),
                TensorSpec(ip + "weights_proj.weight", (ih, d_model), BF16)]
        if layer in kv_sources:
            out += [TensorSpec(ip + "wk.weight", (idim, hd), BF16), TensorSpec(ip + "k_norm.weight", (idim,), BF16)]
    engram_layers = list(sched.engram_layer_ids)
    if layer in engram_layers:
        rows = int(sched.engram_num_embeddings[engram_layers.index(layer)])
        ehd, eh = int(_req(c, "engram_head_dim")), int(_req(c, "engram_n_heads"))
        hc, n = int(c["hc_mult"]), int(_req(c, "engram_max_ngram_size"))
        ep = p + "engram."
        out += [TensorSpec(ep + "embed.weight", (rows, ehd), ENGRAM),
                TensorSpec(ep + "wkv.weight", ((hc + 1) * d_model, eh * (n - 1) * ehd), FP8),
                TensorSpec(ep + "q_weight", (hc, d_model), BF16), TensorSpec(ep + "k_weight", (hc, d_model), BF16)]
    return out + _moe(p, c, False, v41=True) + _norms(p, c) + _mhc(p, c)


def _v4_mtp(p: str, c: dict, layer: int) -> list[TensorSpec]:
    d_model, hc = int(c["hidden_size"]), int(c["hc_mult"])
    extra = [TensorSpec(p + "e_proj.weight", (d_model, d_model), FP8),
             TensorSpec(p + "h_proj.weight", (d_model, d_model), FP8),
             TensorSpec(p + "enorm.weight", (d_model,), BF16), TensorSpec(p + "hnorm.weight", (d_model,), BF16),
             TensorSpec(p + "norm.weight", (d_model,), BF16), TensorSpec(p + "hc_head_fn", (hc, hc * d_model), F32),
             TensorSpec(p + "hc_head_base", (hc,), F32), TensorSpec(p + "hc_head_scale", (1,), F32)]
    return _v4_layer(p, c, _mtp_compress_ratio(c, layer), hash_layer=False) + extra


def released_tensor_specs(cfg: dict, with_mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of the checkpoint config.json describes, in file order (released names).

    ``with_mtp``: V4's MTP block (``mtp.0.*``). V4.1's DSpark blocks are not listed (their
    internals are not specified well enough to write them)."""
    arch = architecture(cfg)
    c = text_config(cfg)
    d_model, vocab, layers = int(_req(c, "hidden_size")), int(_req(c, "vocab_size")), int(_req(c, "num_hidden_layers"))
    sched = _parsed_config(cfg, arch)
    out = [TensorSpec("embed.weight", (vocab, d_model), BF16)]
    for i in range(layers):
        p = f"layers.{i}."
        out += (_v41_layer(p, c, i, sched) if arch == V41
                else _v4_layer(p, c, sched.compress_ratios[i], sched.hash_layers[i]))
    out.append(TensorSpec("norm.weight", (d_model,), BF16))
    out.append(TensorSpec("head.weight", (vocab, d_model), BF16))
    if arch == V4:
        hc = int(c["hc_mult"])
        out += [TensorSpec("hc_head_fn", (hc, hc * d_model), F32), TensorSpec("hc_head_base", (hc,), F32),
                TensorSpec("hc_head_scale", (1,), F32)]
        if with_mtp:
            for k in range(int(c.get("num_nextn_predict_layers") or 0)):
                out += _v4_mtp(f"mtp.{k}.", c, layers + k)
    return out


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.scale`` (the released name of its block scales)."""
    return weight_name[: -len(".weight")] + ".scale"


def stored_tensors(spec: TensorSpec, fp8: bool,
                   block: tuple[int, int]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """How ``spec`` is stored: [(name, shape, dtype)], the weight then its scale if any."""
    n, k = spec.shape[-2:] if len(spec.shape) >= 2 else (1, spec.shape[0])
    if spec.kind == ENGRAM:
        if not fp8:
            return [(spec.name, spec.shape, torch.bfloat16),
                    (scale_name(spec.name), (n, k // MXFP4_GROUP), torch.float32)]
        return [(spec.name, spec.shape, FP8_DTYPE), (scale_name(spec.name), (n, k // MXFP4_GROUP), E8M0_DTYPE)]
    if spec.kind in (FP8, FP4) and fp8:
        if spec.kind == FP4:
            return [(spec.name, (n, k // 2), torch.int8), (scale_name(spec.name), (n, k // MXFP4_GROUP), E8M0_DTYPE)]
        bn, bk = block
        return [(spec.name, spec.shape, FP8_DTYPE), (scale_name(spec.name), (-(-n // bn), -(-k // bk)), E8M0_DTYPE)]
    dtype = {F32: torch.float32, I64: torch.int64}.get(spec.kind, torch.bfloat16)
    return [(spec.name, spec.shape, dtype)]
