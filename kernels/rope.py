"""Rotary position embedding for MLA's 64 rope dims: YaRN frequencies, cos/sin cache, apply.

DeepSeek rotates *interleaved* pairs (x0, x1), (x2, x3), ... (GPT-J style, not NeoX halves)
and keeps the interleaved layout in its output, as DeepSeek's reference does. (HF writes the
rotated pairs de-interleaved; q and k are permuted alike, so attention scores agree.)
"""

from __future__ import annotations

import math

import torch


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(
    rot_dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """YaRN inverse frequencies: interpolate low frequencies, keep high ones (linear ramp)."""
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    extrapolation = 1.0 / pos_freqs
    if factor <= 1.0:
        return extrapolation
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (rot_dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1.0 - ramp
    return interpolation * (1.0 - keep_extrapolated) + extrapolation * keep_extrapolated


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """Scale applied to cos/sin (HF/vLLM convention); 1.0 for DeepSeek's configs."""
    if factor <= 1.0:
        return 1.0
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0) -> torch.Tensor:
    """[max_positions, rot_dim] float32: cos of each pair's angle, then sin (halves)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def apply_rope_interleaved_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, ..., rot_dim] at ``positions`` [T]; pairs are adjacent (even, odd)."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions.long()]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[..., :half].reshape(shape), cs[..., half:].reshape(shape)
    xf = x.float()
    x_even, x_odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    return apply_rope_interleaved_reference(x, positions, cos_sin)


def apply_trailing_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of the last ``2·cos.shape[-1]`` dims of x [N, ..., d].

    cos/sin are [N, r/2] and broadcast over the middle dims (heads). The rotation runs in
    float32 and the result is cast back to x's dtype; the leading (nope) dims pass through.
    ``inverse`` rotates by the negative angle (the conjugate).
    """
    half = cos.shape[-1]
    rot = 2 * half
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.reshape(shape).float()
    s = sin.reshape(shape).float()
    if inverse:
        s = -s
    r = x[..., -rot:].float()
    even, odd = r[..., 0::2], r[..., 1::2]
    rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rot], rotated], dim=-1)
