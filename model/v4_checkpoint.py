"""Random-weight DeepSeek-V4 / V4.1 checkpoints in DeepSeek's released format (make-checkpoint).

Released tensor names; with ``fp8=True`` the released storage: FP8 e4m3 linears with E8M0
block scales (V4 128x128, V4.1 32x32, from ``quantization_config``), MXFP4 routed experts
(int8 bytes + E8M0 per 32 along K), engram tables as FP8 rows with per-row 1x32 E8M0 scales;
BF16 / F32 / I64 for the rest. Without ``fp8`` every quantized tensor is BF16 (engram scales
stay, as ones). Layer, expert and engram-row cuts rewrite config.json so it describes the slice.
"""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import torch

from kernels.weight_formats import FP8_BLOCK, MXFP4, quantize
from model.shard_writer import ShardWriter, write_generation_config
from model.v4_layout import (
    BF16,
    ENGRAM,
    F32,
    FP4,
    FP8,
    I64,
    TensorSpec,
    architecture,
    quantization_block,
    released_tensor_specs,
    scale_name,
    text_config,
)
from model.v4_names import V4, V41


def engram_table_rows(vocab_size: int, n_layers: int, n_heads: int, max_ngram: int) -> list[int]:
    """Rows of each engram layer's table: one prime-sized bucket per (n-gram order, head), the
    primes as the V4.1 model's hasher draws them (distinct, from ``engram_vocab_size`` up)."""
    from model.v41.engram import engram_primes

    sizes = SimpleNamespace(engram_layer_ids=list(range(n_layers)), engram_max_ngram_size=max_ngram,
                            engram_vocab_size=vocab_size, engram_n_heads=n_heads)
    return [sum(sum(row) for row in layer) for layer in engram_primes(sizes)]


def slice_config(cfg: dict, num_layers: int | None = None, num_experts: int | None = None,
                 engram_rows: int | None = None, with_mtp: bool = True) -> dict:
    """config.json of a cut of ``cfg``: the first ``num_layers`` layers, ``num_experts`` routed
    experts, engram tables of at most ``engram_rows`` rows (a smaller ``engram_vocab_size``
    so the hashing still addresses exactly the rows written). V4.1 DSpark blocks are dropped."""
    out = copy.deepcopy(cfg)
    c = text_config(out)
    arch = architecture(cfg)
    full_layers = int(c["num_hidden_layers"])
    layers = full_layers if num_layers is None else int(num_layers)
    if not 1 <= layers <= full_layers:
        raise ValueError(f"--num-layers must be between 1 and {full_layers}, got {layers}")
    if engram_rows is not None and arch != V41:
        raise ValueError("--engram-rows applies to DeepSeek-V4.1 (engram tables) only")
    mtp = int(c.get("num_nextn_predict_layers") or 0) if (with_mtp and arch == V4) else 0
    c["num_hidden_layers"] = layers
    c["num_nextn_predict_layers"] = mtp
    if c.get("compress_ratios") is not None:
        r = list(c["compress_ratios"])
        c["compress_ratios"] = r[:layers] + r[full_layers:full_layers + mtp]
    for key in ("layer_types", "mlp_layer_types"):
        if c.get(key) is not None:
            c[key] = list(c[key])[:layers]
    if c.get("num_hash_layers") is not None:
        c["num_hash_layers"] = min(int(c["num_hash_layers"]), layers)
    if num_experts is not None:
        if num_experts < 1:
            raise ValueError(f"--num-experts must be >= 1, got {num_experts}")
        c["n_routed_experts"] = int(num_experts)
        c["num_experts_per_tok"] = min(int(c["num_experts_per_tok"]), int(num_experts))
    if arch == V41:
        for key in ("kv_source_layer_ids", "index_source_layer_ids", "dspark_target_layer_ids"):
            c[key] = [i for i in c.get(key) or [] if i < layers]
        if int(c.get("candidate_source_layer_id", -1)) >= layers:
            c["candidate_source_layer_id"] = -1
        if any(r for r in c.get("compress_ratios", [])[:layers]) and not c["kv_source_layer_ids"]:
            raise ValueError(f"a {layers}-layer slice has compressed layers but no KV source layer")
        keep = [i for i, layer in enumerate(c.get("engram_layer_ids") or []) if layer < layers]
        c["engram_layer_ids"] = [c["engram_layer_ids"][i] for i in keep]
        c["engram_num_embeddings"] = [c["engram_num_embeddings"][i] for i in keep]
        if engram_rows is not None and keep:
            _cap_engram(c, int(engram_rows))
    return out


def _cap_engram(c: dict, cap: int) -> None:
    heads, n = int(c["engram_n_heads"]), int(c["engram_max_ngram_size"])
    layers = len(c["engram_layer_ids"])
    if max(c["engram_num_embeddings"]) <= cap:
        return
    vocab = cap // (heads * (n - 1))
    while vocab > 1:
        rows = engram_table_rows(vocab, layers, heads, n)
        if max(rows) <= cap:
            c["engram_vocab_size"], c["engram_num_embeddings"] = vocab, rows
            return
        vocab = int(vocab * cap / max(rows)) - 1
    raise ValueError(f"--engram-rows {cap} is too small for {heads} heads x {n - 1} n-gram orders")


def random_value(spec: TensorSpec, cfg: dict, gen: torch.Generator, rows: int | None = None) -> torch.Tensor:
    """Small, well-conditioned values (float32; int64 for tid2eid) so logits stay finite.
    ``rows``: only that many leading rows (a chunk of a large tensor)."""
    name = spec.name
    shape = spec.shape if rows is None else (rows, *spec.shape[1:])
    if spec.kind == I64:
        return torch.randint(0, int(text_config(cfg)["n_routed_experts"]), shape, generator=gen)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return torch.rand(shape, generator=gen) * 0.1
    randn = torch.randn(shape, generator=gen)
    if name.endswith("attn_sink"):
        return randn * 0.5
    if name.endswith("_fn"):  # mHC mixing weights
        return randn * 0.02
    if name.endswith("_base"):
        return randn * 0.1
    if name.endswith("_scale"):
        return 0.5 + 0.1 * randn
    if name.endswith(".ape"):
        return randn * 0.1
    if name == "embed.weight" or spec.kind == ENGRAM:
        return randn
    if len(shape) == 1 or name.endswith(("q_weight", "k_weight")):
        return 1.0 + 0.1 * randn
    return randn / shape[-1] ** 0.5


_CHUNK_ELEMENTS = 1 << 24
_CHUNK_ROW_ALIGN = 128  # a multiple of every block height (128, 32, 1)


def random_pieces(spec: TensorSpec, cfg: dict, gen: torch.Generator, fp8: bool, block: tuple[int, int],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored tensors of a random ``spec``; large tensors are made and quantized in row
    chunks, so memory stays near their stored size (the chunks depend only on the shape)."""
    numel = 1
    for d in spec.shape:
        numel *= d
    if len(spec.shape) < 2 or numel <= _CHUNK_ELEMENTS:
        return stored_pieces(spec, random_value(spec, cfg, gen), fp8, block, dtype)
    per_row = numel // spec.shape[0]
    step = max(_CHUNK_ROW_ALIGN, _CHUNK_ELEMENTS // per_row // _CHUNK_ROW_ALIGN * _CHUNK_ROW_ALIGN)
    chunks = []
    for start in range(0, spec.shape[0], step):
        part = TensorSpec(spec.name, (min(step, spec.shape[0] - start), *spec.shape[1:]), spec.kind)
        chunks.append(stored_pieces(part, random_value(part, cfg, gen), fp8, block, dtype))
    return {k: _cat_rows([c[k] for c in chunks]) for k in chunks[0]}


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    if parts[0].element_size() == 1 and parts[0].is_floating_point():  # fp8 / e8m0: cat the bytes
        return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)
    return torch.cat(parts)


def stored_pieces(spec: TensorSpec, value: torch.Tensor, fp8: bool, block: tuple[int, int],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored tensors of ``spec`` (weight, and its scale when quantized)."""
    if spec.kind == ENGRAM:
        if not fp8:
            rows, k = spec.shape
            return {spec.name: value.to(dtype), scale_name(spec.name): torch.ones(rows, k // 32)}
        q = quantize(value, FP8_BLOCK, (1, 32))
        return {spec.name: q.data, scale_name(spec.name): q.scale}
    if fp8 and spec.kind in (FP8, FP4):
        q = quantize(value, MXFP4, (1, 32)) if spec.kind == FP4 else quantize(value, FP8_BLOCK, block)
        return {spec.name: q.data, scale_name(spec.name): q.scale}
    if spec.kind == F32:
        return {spec.name: value.float()}
    if spec.kind == I64:
        return {spec.name: value}
    assert spec.kind in (BF16, FP8, FP4)
    return {spec.name: value.to(dtype)}


def _quantization_config(arch: str) -> dict:
    block = [32, 32] if arch == V41 else [128, 128]
    q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
         "weight_block_size": block}
    if arch == V41:
        q["expert_dtype"] = "fp4"
    return q


def write_random_v4_checkpoint(
    cfg: dict,
    out_dir: str,
    fp8: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 1024 * 1024 * 1024,
    with_mtp: bool = True,
    num_layers: int | None = None,
    num_experts: int | None = None,
    engram_rows: int | None = None,
    progress: bool = False,
) -> str:
    """Write a random V4/V4.1 checkpoint (released names) to ``out_dir``; returns ``out_dir``.

    The same seed gives the same pre-quantization values with and without ``fp8``."""
    arch = architecture(cfg)
    out_cfg = slice_config(cfg, num_layers, num_experts, engram_rows, with_mtp)
    if fp8:
        out_cfg["quantization_config"] = _quantization_config(arch)
        if arch == V4:
            out_cfg["expert_dtype"] = "fp4"
    else:
        out_cfg.pop("quantization_config", None)
        out_cfg.pop("expert_dtype", None)
    out_cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    block = quantization_block(out_cfg)
    os.makedirs(out_dir, exist_ok=True)
    _write_metadata(out_cfg, out_dir)
    gen = torch.Generator().manual_seed(seed)
    specs = released_tensor_specs(out_cfg, with_mtp=with_mtp)
    if progress:
        from tqdm import tqdm

        specs = tqdm(specs, desc="Writing tensors", unit="tensor")
    writer = ShardWriter(out_dir, shard_bytes)
    for spec in specs:
        writer.add(random_pieces(spec, out_cfg, gen, fp8, block, dtype))
    writer.close()
    return out_dir


def _write_metadata(cfg: dict, out_dir: str) -> None:
    """config.json, generation_config.json and a test tokenizer. V4.1's engram compressed
    vocabulary is counted from that tokenizer, so the config matches the files written."""
    from model.tokenizer_builder import build_test_tokenizer

    c = text_config(cfg)
    build_test_tokenizer(min(int(c["vocab_size"]), 1024), out_dir)
    if c.get("engram_layer_ids"):
        from model.v41.engram import build_compressed_token_map

        c["engram_compressed_vocab_size"] = build_compressed_token_map(os.path.join(out_dir, "tokenizer.json"))[1]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    write_generation_config(out_dir, c.get("bos_token_id", 0), c.get("eos_token_id", 1))
