"""Load a Hugging Face–format DeepSeek checkpoint into :class:`DeepseekForCausalLM`.

Single-file or sharded safetensors (``model.safetensors.index.json``), read through
memory-mapped ``safe_open`` handles one tensor at a time, so the checkpoint never sits in
RAM twice. FP8 e4m3 weights with ``weight_scale_inv`` are either kept as FP8 + scales (for
FP8 GEMMs on GPU) or dequantized to the compute dtype as they stream in (CPU, or when the
user asks for a dtype). Every failure is a one-line :class:`CheckpointError`.

Multi-token-prediction layers (DeepSeek-V3/R1's ``num_nextn_predict_layers``, stored as
``model.layers.{L}.*`` for L >= ``num_hidden_layers``) are never read: they serve only
speculative decoding, which mlaserve does not implement, so loading them would spend GPU
memory (R1: one more full MoE layer plus a vocab-sized head) on weights no forward uses.
One log line says how many tensors and bytes were skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open
from tqdm import tqdm

from kernels.fp8 import FP8_DTYPE, dequantize_weight_blocks
from model.config import ConfigError, ModelConfig, load_model_config
from model.deepseek import DeepseekForCausalLM, ParallelContext

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded; the message names the file or tensor."""


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` = the checkpoint's dtype on GPU (bf16 for FP8 checkpoints), float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return DTYPE_NAMES[dtype]
    if device.type == "cpu":
        return torch.float32
    name = config.torch_dtype
    return torch.bfloat16 if config.is_fp8_checkpoint else DTYPE_NAMES.get(name, torch.bfloat16)


class CheckpointFiles:
    """Maps tensor names to the safetensors file holding them; opens files lazily (mmap)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            self.files = {name: os.path.join(model_dir, fn) for name, fn in weight_map.items()}
            for fn in set(self.files.values()):
                if not os.path.isfile(fn):
                    raise CheckpointError(f"checkpoint shard {os.path.basename(fn)} listed in the index is missing")
        else:
            singles = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            if not singles:
                raise CheckpointError(f"no *.safetensors weights in {model_dir!r}")
            self.files = {}
            for fn in singles:
                path = os.path.join(model_dir, fn)
                with safe_open(path, "pt") as f:
                    for name in f.keys():
                        self.files[name] = path
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        path = self.files[name]
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(path, "pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {os.path.basename(path)}: {exc}") from None
            self._handles[path] = handle
        return handle

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def slice(self, name: str):
        """The lazy safetensors slice: ``get_shape()``, ``get_dtype()`` and ``[a:b]`` reads
        only the header or the rows asked for."""
        return self._handle(name).get_slice(name)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


def load_model(
    model_dir: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    keep_fp8: bool | None = None,
    par: ParallelContext | None = None,
    progress: bool = True,
    load_format: str = "auto",
    seed: int = 0,
) -> DeepseekForCausalLM:
    """Build the model for this rank and stream the checkpoint's tensors into it.

    ``keep_fp8`` defaults to True on CUDA for FP8 checkpoints when the compute dtype is bf16,
    False elsewhere (weights are dequantized while loading).
    """
    try:
        config = load_model_config(model_dir)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(config, ModelConfig):
        raise CheckpointError(
            f"model_type {config.model_type!r} is not served yet (mlaserve serves deepseek_v3, deepseek_v2)")
    device = torch.device(device)
    compute_dtype = resolve_dtype(dtype, config, device)
    if keep_fp8 is None:
        keep_fp8 = config.is_fp8_checkpoint and device.type == "cuda" and compute_dtype == torch.bfloat16
    if load_format == "dummy":
        return _random_model(config, compute_dtype, device, keep_fp8, par, seed)
    if load_format != "auto":
        raise CheckpointError(f"--load-format: unknown format {load_format!r} (auto or dummy)")
    files = CheckpointFiles(model_dir)
    try:
        with torch.device(device):
            model = DeepseekForCausalLM(config, compute_dtype, keep_fp8=keep_fp8, par=par)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    targets = model.weight_map()
    _log_skipped_mtp(files, config, par)
    missing = [name for name in targets if name not in files]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    block = config.quantization.weight_block_size if config.quantization else (128, 128)
    try:
        for name in tqdm(targets, desc="Loading weights", unit="tensor", disable=not progress, leave=False):
            tensor = files.get(name)
            if tensor.dtype == FP8_DTYPE and not keep_fp8:
                scale_name = name + "_scale_inv"
                if scale_name not in files:
                    raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r}")
                tensor = dequantize_weight_blocks(tensor, files.get(scale_name), block, compute_dtype)
            try:
                targets[name](tensor.to(device), name)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
    finally:
        files.close()
    model.process_weights_after_loading()
    model.eval()
    return model


def mtp_tensor_names(names, num_hidden_layers: int) -> list[str]:
    """The tensors of layers past the decoder stack (``model.layers.{L}.*``, L >= num_hidden_layers)."""
    out = []
    for name in names:
        if name.startswith("model.layers."):
            index = name.split(".", 3)[2]
            if index.isdigit() and int(index) >= num_hidden_layers:
                out.append(name)
    return out


def _log_skipped_mtp(files: CheckpointFiles, config: ModelConfig, par: ParallelContext | None) -> None:
    """One line (TP rank 0 only) naming what is skipped; sizes come from the safetensors headers."""
    names = mtp_tensor_names(files.files, config.num_hidden_layers)
    if not names or (par is not None and par.tp_rank != 0):
        return
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files.files[name], []).append(name)
    nbytes = 0
    for path, in_file in by_file.items():
        with safe_open(path, "pt") as f:  # the header only: no tensor data is read
            for name in in_file:
                sl = f.get_slice(name)
                nbytes += math.prod(sl.get_shape()) * _SAFETENSORS_ITEMSIZE.get(sl.get_dtype(), 4)
    logger.info("skipped %d MTP tensors (%.1f MiB) of layers >= %d (num_nextn_predict_layers=%d): they serve "
                "speculative decoding only, which mlaserve does not run", len(names), nbytes / 2**20,
                config.num_hidden_layers, config.num_nextn_predict_layers)


_SAFETENSORS_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                         "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


@torch.no_grad()
def _random_model(config: ModelConfig, dtype, device, keep_fp8: bool, par, seed: int) -> DeepseekForCausalLM:
    """``--load-format dummy``: the real shapes with random weights made on the device (no
    files read), scaled like model/checkpoint.py's random checkpoints (1/sqrt(fan-in))."""
    with torch.device(device):
        model = DeepseekForCausalLM(config, dtype, keep_fp8=keep_fp8, par=par)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.copy_(torch.rand(p.shape, generator=gen, device=device) * 0.1)
        elif name.endswith("scale_inv"):
            p.fill_(1.0 / (64.0 * 128**0.5))  # pairs with the ±64-ish FP8 values below
        elif p.dtype == FP8_DTYPE:
            p.copy_((torch.randn(p.shape, generator=gen, device=device) * 64.0).clamp(-448, 448).to(FP8_DTYPE))
        elif p.dim() == 1:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen, device=device))
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device) / p.shape[-1] ** 0.5)
    model.process_weights_after_loading()
    model.eval()
    return model
