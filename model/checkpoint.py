"""Random-weight DeepSeek checkpoints in Hugging Face format (``mlaserve make-checkpoint``).

Tests and benchmarks build their checkpoints here instead of downloading any: config.json,
sharded safetensors + index, tokenizer files, generation_config.json. With ``fp8=True`` the
linear weights are 128×128 block-quantized exactly in DeepSeek-R1's format (e4m3 ``weight``
+ float32 ``weight_scale_inv``), with R1's ``quantization_config``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from kernels.fp8 import quantize_weight_blocks
from model.config import ConfigError, ModelConfig, parse_model_config
from model.shard_writer import ShardWriter, write_generation_config

CONFIGS_DIR = os.path.dirname(os.path.abspath(__import__("configs").__file__))

# Tensors that R1 keeps in bf16 even in its FP8 checkpoint.
_UNQUANTIZED_SUFFIXES = ("layernorm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight",
                         "gate.weight", "e_score_correction_bias", "eh_proj.weight", "head.weight")


def resolve_config_path(name_or_path: str) -> str:
    """A JSON path, a checkpoint dir, or a preset name from configs/ (``tiny-v3``, ``deepseek-r1``)."""
    if os.path.isdir(name_or_path):
        return os.path.join(name_or_path, "config.json")
    if os.path.isfile(name_or_path):
        return name_or_path
    preset = os.path.join(CONFIGS_DIR, f"{name_or_path}.json")
    if os.path.isfile(preset):
        return preset
    presets = sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))
    raise FileNotFoundError(f"no config file or preset named {name_or_path!r} (presets: {', '.join(presets)})")


def load_config_dict(name_or_path: str) -> dict:
    with open(resolve_config_path(name_or_path), encoding="utf-8") as f:
        return json.load(f)


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield f"{prefix}.gate_proj.weight", (inter, hidden)
    yield f"{prefix}.up_proj.weight", (inter, hidden)
    yield f"{prefix}.down_proj.weight", (hidden, inter)


def _layer_shapes(c: ModelConfig, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}"
    h, heads = c.hidden_size, c.num_attention_heads
    yield f"{p}.input_layernorm.weight", (h,)
    yield f"{p}.post_attention_layernorm.weight", (h,)
    a = f"{p}.self_attn"
    if c.q_lora_rank:
        yield f"{a}.q_a_proj.weight", (c.q_lora_rank, h)
        yield f"{a}.q_a_layernorm.weight", (c.q_lora_rank,)
        yield f"{a}.q_b_proj.weight", (heads * c.qk_head_dim, c.q_lora_rank)
    else:
        yield f"{a}.q_proj.weight", (heads * c.qk_head_dim, h)
    yield f"{a}.kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h)
    yield f"{a}.kv_a_layernorm.weight", (c.kv_lora_rank,)
    yield f"{a}.kv_b_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    yield f"{a}.o_proj.weight", (h, heads * c.v_head_dim)
    if c.is_moe_layer(i):
        yield f"{p}.mlp.gate.weight", (c.n_routed_experts, h)
        if c.topk_method == "noaux_tc":
            yield f"{p}.mlp.gate.e_score_correction_bias", (c.n_routed_experts,)
        for e in range(c.n_routed_experts):
            yield from _mlp_shapes(f"{p}.mlp.experts.{e}", h, c.moe_intermediate_size)
        if c.n_shared_experts:
            yield from _mlp_shapes(f"{p}.mlp.shared_experts", h, c.moe_intermediate_size * c.n_shared_experts)
    else:
        yield from _mlp_shapes(f"{p}.mlp", h, c.intermediate_size)


def checkpoint_tensor_shapes(c: ModelConfig, with_mtp: bool = True) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a HF DeepSeek checkpoint (before FP8 quantization), in file order."""
    yield "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        yield from _layer_shapes(c, i)
    yield "model.norm.weight", (c.hidden_size,)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", (c.vocab_size, c.hidden_size)
    if with_mtp:
        for k in range(c.num_nextn_predict_layers):
            i = c.num_hidden_layers + k
            p = f"model.layers.{i}"
            yield f"{p}.enorm.weight", (c.hidden_size,)
            yield f"{p}.hnorm.weight", (c.hidden_size,)
            yield f"{p}.eh_proj.weight", (c.hidden_size, 2 * c.hidden_size)
            yield from _layer_shapes(c, i)
            yield f"{p}.shared_head.norm.weight", (c.hidden_size,)
            yield f"{p}.shared_head.head.weight", (c.vocab_size, c.hidden_size)


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Well-conditioned random values: unit-ish norms, 1/sqrt(fan_in) linears, positive biases."""
    if name.endswith("e_score_correction_bias"):
        # Positive, so HF's 0-fill and DeepSeek's -inf masking of dropped groups agree.
        return torch.rand(shape, generator=gen) * 0.1
    if len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5


def is_quantized_tensor(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and not name.endswith(_UNQUANTIZED_SUFFIXES)


def write_random_checkpoint(
    config: dict | str,
    out_dir: str,
    fp8: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 64 * 1024 * 1024,
    with_mtp: bool = True,
    num_layers: int | None = None,
    progress: bool = False,
    num_experts: int | None = None,
    engram_rows: int | None = None,
) -> str:
    """Write a random checkpoint; returns ``out_dir``. ``num_layers`` truncates a preset.

    DeepSeek-V4 / V4.1 configs go to :func:`model.v4_checkpoint.write_random_v4_checkpoint`
    (released format; ``num_experts`` and ``engram_rows`` cut it further)."""
    cfg_dict = dict(load_config_dict(config) if isinstance(config, str) else config)
    if cfg_dict.get("model_type") in ("deepseek_v4", "deepseek_v41"):
        from model.v4_checkpoint import write_random_v4_checkpoint

        return write_random_v4_checkpoint(
            cfg_dict, out_dir, fp8=fp8, seed=seed, dtype=dtype, shard_bytes=shard_bytes, with_mtp=with_mtp,
            num_layers=num_layers, num_experts=num_experts, engram_rows=engram_rows, progress=progress)
    if num_experts is not None or engram_rows is not None:
        raise ConfigError("--num-experts and --engram-rows apply to DeepSeek-V4 / V4.1 configs only")
    if num_layers is not None:
        cfg_dict["num_hidden_layers"] = num_layers
    if fp8:
        cfg_dict["quantization_config"] = {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        }
    else:
        cfg_dict.pop("quantization_config", None)
    cfg_dict["torch_dtype"] = str(dtype).replace("torch.", "")
    c = parse_model_config(cfg_dict)
    os.makedirs(out_dir, exist_ok=True)
    write_checkpoint_metadata(cfg_dict, out_dir)
    gen = torch.Generator().manual_seed(seed)

    names = list(checkpoint_tensor_shapes(c, with_mtp))
    iterator = names
    if progress:
        from tqdm import tqdm

        iterator = tqdm(names, desc="Writing tensors", unit="tensor")
    writer = ShardWriter(out_dir, shard_bytes)
    for name, shape in iterator:
        t = random_tensor(name, shape, gen)
        if fp8 and is_quantized_tensor(name, shape):
            w8, scale = quantize_weight_blocks(t, (128, 128))
            pieces = {name: w8, name + "_scale_inv": scale}
        elif name.endswith(("e_score_correction_bias", "gate.weight")):
            pieces = {name: t.float()}
        else:
            pieces = {name: t.to(dtype)}
        writer.add(pieces)
    writer.close()
    return out_dir


def write_checkpoint_metadata(cfg_dict: dict, out_dir: str) -> None:
    """Everything but the weights: config.json, generation_config.json, tokenizer files.

    Alone, it is what ``--load-format dummy`` needs (random weights made on the device)."""
    c = parse_model_config(cfg_dict)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg_dict, f, indent=2)
    write_generation_config(out_dir, c.bos_token_id, c.eos_token_ids[0] if c.eos_token_ids else 1)
    from model.tokenizer_builder import build_test_tokenizer

    build_test_tokenizer(min(c.vocab_size, 1024), out_dir)
