"""FP8 e4m3 quantization: per-tensor, per-token 1x128 groups, and 128x128 weight blocks.

Torch references; the GPU path may replace the activation quant with a fused kernel.
Scales follow DeepSeek's convention: ``x ≈ x_fp8 * scale`` (``weight_scale_inv`` in
checkpoints is this multiplier, despite its name).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = 1e-12


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(t))`` for positive normal fp32 ``t``, exact: read from the IEEE bits
    (exponent field, plus one when any mantissa bit is set), so ``log2`` rounding never
    moves a value just above a power of two down onto it."""
    bits = t.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(exponent.float())


def round_scale_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round scales up to a power of two (UE8M0: an exponent byte), as V3.1 and V4 checkpoints
    do. The one UE8M0 rule of the package: weight codecs and V4.1's fake-quant use it too."""
    return pow2_ceil(scale.clamp_min(_TINY))


def quantize_per_tensor(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to ±448 and cast to e4m3."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_per_tensor(x8: torch.Tensor, scale: float | torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (x8.float() * scale).to(dtype)


def quantize_per_token_group(
    x: torch.Tensor, group_size: int = 128, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] activations per token and per ``group_size`` channels.

    Returns (x_fp8 [..., K], scales float32 [..., ceil(K/group_size)]), scale = amax/448.
    A ragged last group is padded internally (its scale covers the remaining channels).
    """
    k = x.shape[-1]
    groups = -(-k // group_size)
    pad = groups * group_size - k
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xg = xf.reshape(*x.shape[:-1], groups, group_size)
    scale = xg.abs().amax(dim=-1).clamp_min(_TINY) / FP8_MAX
    if ue8m0:
        scale = round_scale_ue8m0(scale)
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*x.shape[:-1], groups * group_size)[..., :k]
    return q.contiguous(), scale


def dequantize_per_token_group(x8: torch.Tensor, scale: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    k = x8.shape[-1]
    s = scale.repeat_interleave(group_size, dim=-1)[..., :k]
    return x8.float() * s


def quantize_weight_blocks(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an [N, K] weight in blocks: (e4m3 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    blocks = wp.reshape(gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(_TINY) / FP8_MAX
    if ue8m0:
        scale = round_scale_ue8m0(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(gn * bn, gk * bk)[:n, :k].contiguous()
    return q, scale.contiguous()


def dequantize_weight_blocks(
    w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype=torch.float32
) -> torch.Tensor:
    """``w8 * scale_inv`` broadcast over 128x128 blocks (ragged edge blocks allowed); any
    leading dims (stacked experts [E, N, K] with scales [E, N/128, K/128]) ride along."""
    n, k = w8.shape[-2:]
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w8.float() * s).to(dtype)
