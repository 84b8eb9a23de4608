"""Which MXFP4 routed-expert path runs (kernels.mxfp4_moe: references; kernels.mxfp4_moe_triton:
the W4A8 / W4A16 kernels), and the one entry point the model calls."""

from __future__ import annotations

import importlib.util

import torch

from kernels.mxfp4_moe import SPAN, moe_mxfp4_reference, moe_mxfp4_reference_every_expert
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
    return moe_mxfp4_triton(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, limit,
                            expert_offset, mode=path)


__all__ = ["BACKENDS", "moe_experts_mxfp4", "mxfp4_backend"]
