"""Which MXFP4 routed-expert path runs (kernels.mxfp4_moe: references; kernels.mxfp4_moe_triton:
the W4A8 / W4A16 token-row kernels; kernels.mxfp4_moe_decode: W4A8 swap-AB at decode sizes),
and the one entry point the model calls."""

from __future__ import annotations

import importlib.util

import torch

from kernels.mxfp4_moe import SPAN, moe_mxfp4_reference, moe_mxfp4_reference_every_expert
from kernels.mxfp4_moe_decode import SwapABConfig, moe_mxfp4_w4a8_swap_ab, use_swap_ab
from kernels.mxfp4_moe_triton import moe_mxfp4_triton

BACKENDS = ("auto", "w4a8", "w4a16", "reference")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def mxfp4_backend(device: torch.device, inter: int, dim: int, backend: str = "auto") -> str:
    """``auto``: ``w4a8`` on SM90 (FP8 tensor cores), ``w4a16`` on other CUDA GPUs, the torch
    ``reference`` on CPU or without Triton, or when D or I is not a multiple of 128."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown MXFP4 MoE backend {backend!r}; one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if device.type != "cuda" or not _HAS_TRITON or inter % SPAN or dim % SPAN:
        return "reference"
    return "w4a8" if torch.cuda.get_device_capability(device)[0] == 9 else "w4a16"


def moe_experts_mxfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    expert_offset: int = 0,
    backend: str = "auto",
    sync_free: bool | None = None,
) -> torch.Tensor:
    """Routed MXFP4 experts → fp32 [T, D] (the caller adds the shared expert and casts).

    The Triton paths have no host syncs (fixed-shape token grouping), so CUDA graphs capture
    them as they are; the reference groups tokens on the host, so with ``sync_free`` (default:
    while the current CUDA stream is capturing) it runs every local expert on every row."""
    path = mxfp4_backend(x.device, w13.shape[1] // 2, x.shape[-1], backend)
    if sync_free is None:
        sync_free = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if path == "reference" and sync_free:
        return moe_mxfp4_reference_every_expert(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit,
                                                expert_offset)
    if path == "reference":
        return moe_mxfp4_reference(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit,
                                   "w4a16", expert_offset)
    return moe_mxfp4_kernels(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit,
                             expert_offset, mode=path)


def moe_mxfp4_kernels(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit: float, expert_offset: int = 0,
                      mode: str = "w4a8", config=None, ue8m0: bool = False) -> torch.Tensor:
    """The Triton MXFP4 experts: W4A8 at decode sizes (``use_swap_ab``: few token-slots per
    expert) or with a ``SwapABConfig`` on the swap-AB kernels, the rest on the token-row
    kernels (``config`` an ``MXFP4MoEConfig`` or None)."""
    # w13's leading dim is the local expert count; the chosen path checks every shape itself
    if isinstance(config, SwapABConfig) or (config is None and mode == "w4a8" and topk_ids.dim() == 2
                                            and use_swap_ab(topk_ids.numel(), w13.shape[0])):
        if mode != "w4a8":
            raise ValueError("the swap-AB decode kernels are W4A8 only")
        return moe_mxfp4_w4a8_swap_ab(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit,
                                      expert_offset, config, ue8m0)
    return moe_mxfp4_triton(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit, expert_offset,
                            mode=mode, config=config, ue8m0=ue8m0)


__all__ = ["BACKENDS", "moe_experts_mxfp4", "moe_mxfp4_kernels", "mxfp4_backend"]
