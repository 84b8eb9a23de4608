"""MXFP8 GEMM operands shared by the Triton and CUDA C++ kernels (kernels/mxfp8_gemm.py is the
entry point): the format checks, the exact torch reference, and the split-K planning."""

from __future__ import annotations

import functools

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.microscaling import dequantize_mxfp8
from kernels.weight_formats import dequantize_fp8_blocks

MX_BLOCK = 32


def scale_bytes(t: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales as uint8 (checkpoints may hold float8_e8m0fnu)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def check_operands(x8, xs, w8, ws, groups: int = 1) -> tuple[int, int, int]:
    """(M, N, K per group) after checking dtypes and shapes; raises naming the tensor."""
    for name, t in (("x8", x8), ("w8", w8)):
        if t.dim() != 2 or t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be a 2-D e4m3 tensor, got {tuple(t.shape)} {t.dtype}")
    m, k_total = x8.shape
    n, kg = w8.shape
    if groups < 1 or k_total != groups * kg:
        raise ValueError(f"x8 has {k_total} input features, the weight {kg} per group × {groups} groups")
    if kg % MX_BLOCK:
        raise ValueError(f"K per group ({kg}) must be a multiple of {MX_BLOCK}")
    if n % groups or (groups > 1 and (n // groups) % MX_BLOCK):
        raise ValueError(f"N ({n}) must split into {groups} groups of a multiple of {MX_BLOCK} rows")
    if tuple(xs.shape) != (m, k_total // MX_BLOCK):
        raise ValueError(f"activation scales xs {tuple(xs.shape)} != {(m, k_total // MX_BLOCK)}")
    if tuple(ws.shape) != (-(-n // MX_BLOCK), kg // MX_BLOCK):
        raise ValueError(f"weight scales ws {tuple(ws.shape)} != {(-(-n // MX_BLOCK), kg // MX_BLOCK)}")
    return m, n, kg


def mxfp8_gemm_reference(x8, xs, w8, ws, groups: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Both operands dequantized exactly, then an fp32 (block-diagonal for groups > 1) matmul."""
    m, n, kg = check_operands(x8, xs, w8, ws, groups)
    x = dequantize_mxfp8(x8, scale_bytes(xs)).reshape(m, groups, kg).transpose(0, 1)  # [g, M, Kg]
    w = dequantize_fp8_blocks(w8, ws, (MX_BLOCK, MX_BLOCK)).reshape(groups, n // groups, kg)  # [g, R, Kg]
    return torch.bmm(x, w.transpose(1, 2)).transpose(0, 1).reshape(m, n).to(out_dtype)



@functools.cache
def split_k_for(tiles: int, k_steps: int, sms: int, max_split: int = 32) -> int:
    """How many K splits fill the GPU when the output has fewer tiles than SMs (decode-sized
    M): the smallest divisor of the K steps reaching one wave, each split ≥ 2 steps."""
    if tiles >= sms:
        return 1
    divisors = [s for s in range(2, min(k_steps // 2, max_split) + 1) if k_steps % s == 0]
    for s in divisors:
        if tiles * s >= sms:
            return s
    return divisors[-1] if divisors else 1

