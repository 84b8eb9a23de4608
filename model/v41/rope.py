"""Two-base interleaved RoPE on the trailing ``qk_rope_head_dim`` channels (DeepSeek-V4/V4.1).

Window-only layers rotate with ``rope_theta`` and no scaling ("main"); every layer with a
compressed branch, its compressed entries and its indexer rotate with
``compress_rope_theta`` and YaRN frequencies ("compress"). YaRN here only reshapes the
frequencies: cos/sin are never multiplied by an mscale. Pairs are adjacent channels
(2i, 2i+1) rotated as complex numbers; :func:`apply_rope` with ``inverse=True`` applies the
conjugate rotation (used on the attention output, whose values carried the keys' RoPE).
"""

from __future__ import annotations

import math

import torch

from model.v41.config import RopeSpec


def rope_inv_freq(spec: RopeSpec, rope_dim: int) -> torch.Tensor:
    """[rope_dim // 2] fp32 inverse frequencies, YaRN-blended when ``spec.yarn``."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    if not spec.yarn:
        return 1.0 / (spec.theta**exponents)
    pos_freqs = spec.theta**exponents
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (spec.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        ctx = spec.original_max_position_embeddings
        return rope_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    return interpolated * (1 - keep) + extrapolated * keep


class Rope(torch.nn.Module):
    """cos/sin tables for one flavour, computed per call from absolute positions."""

    def __init__(self, spec: RopeSpec, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.register_buffer("inv_freq", rope_inv_freq(spec, rope_dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (int) -> (cos, sin), each [T, rope_dim // 2] fp32."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` [T, ..., D] by position.

    ``cos``/``sin`` are [T, rope_dim // 2]; they broadcast over any middle (head) axes.
    The rotation runs in fp32 and the result is cast back to ``x``'s dtype.
    """
    if inverse:
        sin = -sin
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    even, odd = tail[..., 0::2].float(), tail[..., 1::2].float()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([head, rotated.to(x.dtype)], dim=-1)
