"""Weight-side codecs of DeepSeek-V4 / V4.1 checkpoints (torch references, any device).

Three stored formats, all with power-of-two scales in E8M0 bytes (``b`` means ``2**(b-127)``):

* ``fp8_block``: e4m3 values ``W[N, K]`` with one scale per ``bn x bk`` block
  (V4 128x128, V4.1 32x32; engram tables use 1x32, one scale per 32 values of a row).
  R1-style float32 scales (``weight_scale_inv``) decode through the same path.
* ``mxfp4``: routed experts. int8 bytes hold two e2m1 codes, the LOW nibble is the even
  k index; one E8M0 scale per 32 consecutive values along K (``scale[N, K/32]``).
* unquantized BF16 / F32 tensors need no codec.

A :class:`QuantizedWeight` keeps a quantized tensor in its stored form (for GPU kernels that
consume it directly) and knows how to dequantize itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight_blocks,
    pow2_ceil,
    quantize_weight_blocks,
)

E8M0_DTYPE = torch.float8_e8m0fnu
E8M0_BIAS = 127
FP4_MAX = 6.0
MXFP4_GROUP = 32
# e2m1 magnitudes by code 0..7; code | 8 is the negative.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FP8_BLOCK = "fp8_block"
MXFP4 = "mxfp4"


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode scales to float32: E8M0 (or raw uint8) bytes ``b`` give ``2**(b-127)``; float
    scales (R1's float32 ``weight_scale_inv``) pass through."""
    if scale.dtype in (E8M0_DTYPE, torch.uint8):
        b = scale.view(torch.uint8) if scale.dtype == E8M0_DTYPE else scale
        return torch.exp2(b.float() - E8M0_BIAS)
    return scale.float()


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode power-of-two float scales as E8M0 bytes (exponent + 127, clamped to 0..254)."""
    exp = torch.round(torch.log2(scale.float().clamp_min(2.0**-127)))
    return (exp + E8M0_BIAS).clamp(0, 254).to(torch.uint8).view(E8M0_DTYPE)


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int], scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 [..., N, K], scales [..., ceil(N/bn), ceil(K/bk)]).

    ``ue8m0``: scale = 2**ceil(log2(amax/448)) (:func:`kernels.fp8.round_scale_ue8m0`) stored
    as E8M0; ``float32``: amax/448 as in R1.
    """
    if scale_fmt not in ("ue8m0", "float32"):
        raise ValueError(f"unknown FP8 scale format {scale_fmt!r} (ue8m0 or float32)")
    lead = w.shape[:-2]
    flat = w.reshape(-1, *w.shape[-2:])
    pairs = [quantize_weight_blocks(m, block, ue8m0=scale_fmt == "ue8m0") for m in flat]
    q = torch.stack([p[0] for p in pairs]).reshape(w.shape)
    s = torch.stack([p[1] for p in pairs]).reshape(*lead, *pairs[0][1].shape)
    return q, (float_to_e8m0(s) if scale_fmt == "ue8m0" else s.float())


def dequantize_fp8_blocks(
    w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``w8 * scale`` broadcast over blocks; E8M0 or float32 scales; leading dims ride along."""
    return dequantize_weight_blocks(w8, e8m0_to_float(scale), block, dtype)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 (uint8) to float32 values (``E2M1_MAGNITUDES``, bit 3 the sign), decoded
    arithmetically rather than through a lookup table so that no host tensor is made: it runs
    inside CUDA-graph capture. Magnitude code m = 2e + f: 0.5·f for e = 0, else 2^(e−1)·(1 + f/2)."""
    c = codes.to(torch.int32)
    e, f = (c >> 1) & 3, (c & 1).float()
    value = torch.where(e == 0, 0.5 * f, (1 << (e - 1).clamp_min(0)).float() * (1.0 + 0.5 * f))
    return torch.where(c >= 8, -value, value)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., K/2] -> e2m1 codes uint8 [..., K]; the low nibble is the even index."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [..., K] (K even) -> int8 [..., K/2], even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).view(torch.int8)


def float_to_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale; saturated at 6) to the nearest e2m1
    code, ties to the even code as the hardware cvt does. The grid steps by 0.5 below 2, by 1
    up to 4 and by 2 up to 6, so each range is one half-to-even ``round`` of a scaled value."""
    a = x.float().abs().clamp_max(FP4_MAX)
    code = torch.where(a < 2, torch.round(a * 2),
                       torch.where(a < 4, 4 + torch.round(a - 2), 6 + torch.round((a - 4) / 2)))
    sign = (x < 0) & (code > 0)
    return (code + 8 * sign).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor, group: int = MXFP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (packed int8 [..., N, K/2], E8M0 scales [..., N, K/group]).

    scale = 2**ceil(log2(amax/6)) per group, so every scaled value fits e2m1's range."""
    k = w.shape[-1]
    if k % group:
        raise ValueError(f"MXFP4 needs K divisible by {group}, got {k}")
    g = w.float().reshape(*w.shape[:-1], k // group, group)
    amax = g.abs().amax(dim=-1).clamp_min(FP4_MAX * 2.0**-126)  # keeps amax/6 a normal float
    scale = pow2_ceil(amax / FP4_MAX).clamp_max(2.0**127)
    codes = float_to_fp4_codes(g / scale.unsqueeze(-1)).reshape(w.shape)
    return pack_fp4(codes), float_to_e8m0(scale)


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, group: int = MXFP4_GROUP, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: [..., N, K/2] bytes + [..., N, K/group] -> [..., N, K]."""
    values = fp4_codes_to_float(unpack_fp4(packed))
    k = values.shape[-1]
    if scale.shape[-1] * group != k:
        raise ValueError(f"MXFP4 scale has {scale.shape[-1]} groups for K={k} (group {group})")
    s = e8m0_to_float(scale).repeat_interleave(group, dim=-1)
    return (values * s).to(dtype)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight in its stored form: ``data`` + ``scale`` + ``format`` (+ the block shape).

    fp8_block: data e4m3 [..., N, K], scale E8M0/float32 [..., N/bn, K/bk], block (bn, bk).
    mxfp4: data int8 [..., N, K/2], scale E8M0 [..., N, K/32], block (1, 32).
    """

    data: torch.Tensor
    scale: torch.Tensor
    format: str
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        if self.format == MXFP4:
            return (*self.data.shape[:-1], self.data.shape[-1] * 2)
        return tuple(self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.format == MXFP4:
            return dequantize_mxfp4(self.data, self.scale, self.block[1], dtype)
        return dequantize_fp8_blocks(self.data, self.scale, self.block, dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.data.to(device), self.scale.to(device), self.format, self.block)


def quantize(w: torch.Tensor, format: str, block: tuple[int, int], scale_fmt: str = "ue8m0") -> QuantizedWeight:
    """Quantize ``w`` into ``format`` (``fp8_block`` with ``block``, or ``mxfp4``)."""
    if format == MXFP4:
        data, scale = quantize_mxfp4(w, block[1])
        return QuantizedWeight(data, scale, MXFP4, (1, block[1]))
    if format == FP8_BLOCK:
        data, scale = quantize_fp8_blocks(w, block, scale_fmt)
        return QuantizedWeight(data, scale, FP8_BLOCK, block)
    raise ValueError(f"unknown weight format {format!r}")


__all__ = [
    "E8M0_DTYPE",
    "FP4_MAX",
    "FP8_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "MXFP4",
    "MXFP4_GROUP",
    "QuantizedWeight",
    "dequantize_fp8_blocks",
    "dequantize_mxfp4",
    "e8m0_to_float",
    "float_to_e8m0",
    "float_to_fp4_codes",
    "fp4_codes_to_float",
    "pack_fp4",
    "quantize",
    "quantize_fp8_blocks",
    "quantize_mxfp4",
    "unpack_fp4",
]
