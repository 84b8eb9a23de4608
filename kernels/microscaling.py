"""Microscaling fake-quantization (quantize then dequantize) as DeepSeek-V4.1 trains with it.

V4.1's quantization-aware training makes these roundings part of the model, so an
unquantized (fp32/bf16) run must apply them too, at the same places:

* window K=V rows: FP8 e4m3 in blocks of 32 channels, one UE8M0 (power-of-two) scale per
  block, the RoPE dims included (:func:`fake_quant_fp8_ue8m0`);
* compressed KV entries: FP4 e2m1 in blocks of 16 with an e4m3 scale per block
  (:func:`fake_quant_fp4`, ``scale_format="e4m3"``);
* indexer queries and keys: FP4 e2m1 in blocks of 32 with UE8M0 scales
  (:func:`fake_quant_fp4`, ``scale_format="ue8m0"``).

:func:`quantize_mxfp8` is the same FP8 rounding with its two outputs kept apart (e4m3 values
and one UE8M0 exponent byte per 32), the operand format of the MXFP8 GEMMs
(kernels/mxfp8_gemm.py); :func:`fake_quant_fp8_ue8m0` is its round trip.

A power-of-two scale is ``2^ceil(log2(amax / qmax))``, exact from the fp32 bits
(:func:`kernels.fp8.pow2_ceil`, the rule the weight codecs use); the e2m1 grid and its
rounding are :mod:`kernels.weight_formats`'. A last dimension that is not a multiple of the
block is returned unchanged: the trained model has no such shapes, and tiny test models keep the rule.
The functions are torch references; they work on any device and return the input dtype.
Under autograd they are straight-through estimators (value = quantized, gradient =
identity), so a training forward can backpropagate through them; the value is bit-identical.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_MAX, pow2_ceil
from kernels.weight_formats import FP4_MAX, e8m0_to_float, float_to_e8m0, float_to_fp4_codes, fp4_codes_to_float

# Smallest amax each quantizer accepts, so an all-zero block gets a finite, normal scale.
_FP8_MIN_AMAX = 1e-4
_FP4_UE8M0_MIN_AMAX = FP4_MAX * 2.0**-126
_FP4_E4M3_MIN_AMAX = FP4_MAX * 2.0**-9


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values already inside [-6, 6] to the nearest e2m1 value, ties to the even code
    (0.25 → 0, 0.75 → 1.0, 2.5 → 2, 3.5 → 4, 5 → 4): the weight codec's rounding, decoded."""
    return fp4_codes_to_float(float_to_fp4_codes(x))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def quantize_mxfp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (e4m3 [..., K], UE8M0 bytes uint8 [..., K/block]) with ``x ≈ q · 2^(byte−127)``.

    The scale is ``pow2_ceil(max(amax, 1e-4) / 448)``: an all-zero block gets byte 105
    (2^-22) and zero values, never a zero or subnormal scale.
    """
    if x.shape[-1] % block:
        raise ValueError(f"MXFP8 needs the last dim ({x.shape[-1]}) to be a multiple of {block}")
    b = _blocks(x, block)
    scale = pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(_FP8_MIN_AMAX) * (1.0 / FP8_MAX))
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), float_to_e8m0(scale.squeeze(-1)).view(torch.uint8)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp32 ``q · 2^(byte−127)`` for e4m3 ``q`` [..., K] and UE8M0 bytes [..., K/block]."""
    return (_blocks(q, block) * e8m0_to_float(scale).unsqueeze(-1)).reshape(q.shape)


class _StraightThrough(torch.autograd.Function):
    """Forward: ``fn(x, *args)``; backward: the incoming gradient unchanged."""

    @staticmethod
    def forward(ctx, x, fn, *args):
        ctx.num_extra = len(args)
        return fn(x, *args)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None) + (None,) * ctx.num_extra


def _straight_through(fn, x: torch.Tensor, *args) -> torch.Tensor:
    if not (x.requires_grad and torch.is_grad_enabled()):
        return fn(x, *args)
    return _StraightThrough.apply(x, fn, *args)


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 with one power-of-two scale per ``block`` channels; returns dequantized ``x``."""
    if x.shape[-1] % block:
        return x
    return _straight_through(_fp8_ue8m0, x, block)


def _fp8_ue8m0(x: torch.Tensor, block: int) -> torch.Tensor:
    return dequantize_mxfp8(*quantize_mxfp8(x, block), block).to(x.dtype)


def fake_quant_fp4(x: torch.Tensor, block: int, scale_format: str) -> torch.Tensor:
    """FP4 e2m1 with one scale per ``block`` channels; returns dequantized ``x``.

    ``scale_format`` is ``"ue8m0"`` (power of two ≥ amax/6) or ``"e4m3"`` (amax/6 rounded
    to the nearest e4m3 value, so a block's largest element may land slightly off 6).
    """
    if x.shape[-1] % block:
        return x
    if scale_format not in ("ue8m0", "e4m3"):
        raise ValueError(f"unknown FP4 scale format {scale_format!r} (expected 'ue8m0' or 'e4m3')")
    return _straight_through(_fp4, x, block, scale_format)


def quantize_fp4_blocks(x: torch.Tensor, block: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (e2m1 codes uint8 [..., K], float32 scales [..., K/block]) with
    ``x ≈ decode(code) · scale``: the rounding of :func:`fake_quant_fp4` with its parts kept
    apart (what a packed cache stores)."""
    if scale_format not in ("ue8m0", "e4m3"):
        raise ValueError(f"unknown FP4 scale format {scale_format!r} (expected 'ue8m0' or 'e4m3')")
    b = _blocks(x, block)
    amax = b.abs().amax(-1, keepdim=True)
    if scale_format == "ue8m0":
        scale = pow2_ceil(amax.clamp_min(_FP4_UE8M0_MIN_AMAX) * (1.0 / FP4_MAX))
    else:
        # times fp32(1/6), not a division: CUDA torch turns a division by a Python scalar into
        # that product (CPU torch divides), so only the product has the same bits everywhere
        scale = (amax.clamp_min(_FP4_E4M3_MIN_AMAX) * (1.0 / FP4_MAX)).to(torch.float8_e4m3fn).float()
    codes = float_to_fp4_codes((b / scale).clamp(-FP4_MAX, FP4_MAX))
    return codes.reshape(x.shape), scale.squeeze(-1)


def dequantize_fp4_blocks(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """float32 ``decode(code) · scale`` for e2m1 codes [..., K] and float32 scales [..., K/block]."""
    return (_blocks(fp4_codes_to_float(codes), block) * scale.unsqueeze(-1)).reshape(codes.shape)


def _fp4(x: torch.Tensor, block: int, scale_format: str) -> torch.Tensor:
    return dequantize_fp4_blocks(*quantize_fp4_blocks(x, block, scale_format), block).to(x.dtype)
