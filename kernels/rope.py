"""Rotary position embedding for MLA's 64 rope dims: YaRN frequencies, cos/sin cache, apply.

DeepSeek rotates *interleaved* pairs (x0, x1), (x2, x3), ... (GPT-J style, not NeoX halves)
and keeps the interleaved layout in its output, as DeepSeek's reference does. (HF writes the
rotated pairs de-interleaved; q and k are permuted alike, so attention scores agree.)

``apply_rope_inplace`` rotates the trailing rope dims of a [T, H, D] tensor where they lie:
MLA's prefill query is q_proj's output [T, H, nope + rope] with only its last 64 dims to
rotate, so rotating them in place gives the attention input without a ``torch.cat`` copy. On
CUDA one Triton pass does it (FMA contraction off: the same roundings as the torch
reference, bit for bit); elsewhere the torch reference writes the rotated slice back.
"""

from __future__ import annotations

import math

import torch

from kernels.fused_glue import HAS_TRITON, glue_kernels_apply

if HAS_TRITON:  # the GPU path needs Triton; the CPU reference does not
    import triton
    import triton.language as tl


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


def _check_inplace(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> int:
    """Validate; returns the rope width."""
    rope = cos_sin.shape[-1]
    if x.dim() != 3 or cos_sin.dim() != 2 or rope % 2 or not 0 < rope <= x.shape[-1]:
        raise ValueError(f"need x [T, H, D] and cos_sin [max_pos, rope <= D] with an even rope; got "
                         f"{tuple(x.shape)} and {tuple(cos_sin.shape)}")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be [{x.shape[0]}], got {tuple(positions.shape)}")
    return rope


def apply_rope_inplace_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``cos_sin.shape[-1]`` dims of x [T, H, D] in place; returns x."""
    rope = _check_inplace(x, positions, cos_sin)
    tail = x[..., x.shape[-1] - rope :]
    tail.copy_(apply_rope_interleaved_reference(tail, positions, cos_sin))
    return x


if HAS_TRITON:

    @triton.jit
    def _rope_inplace_kernel(
        X, POS, CS, n_heads, stride_t, stride_h, stride_cs,
        OFFSET: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        i = tl.arange(0, BLOCK_HALF)
        imask = i < HALF
        cs = CS + tl.load(POS + t).to(tl.int64) * stride_cs
        cos = tl.load(cs + i, mask=imask, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(cs + HALF + i, mask=imask, other=0.0).to(tl.float32)[None, :]
        base = X + t * stride_t + heads.to(tl.int64)[:, None] * stride_h + OFFSET + 2 * i[None, :]
        mask = (heads < n_heads)[:, None] & imask[None, :]
        x_even = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        x_odd = tl.load(base + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(base, (x_even * cos - x_odd * sin).to(X.dtype.element_ty), mask=mask)
        tl.store(base + 1, (x_odd * cos + x_even * sin).to(X.dtype.element_ty), mask=mask)


def apply_rope_inplace_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """The Triton pass (CUDA, or CPU under TRITON_INTERPRET=1); same contract as the reference.
    x needs a unit stride along its last dim (any row and head strides)."""
    if not HAS_TRITON:
        raise RuntimeError("the in-place RoPE kernel needs the triton package")
    rope = _check_inplace(x, positions, cos_sin)
    if x.stride(-1) != 1:
        raise ValueError("the in-place RoPE kernel needs x with a unit stride along its last dim")
    t, h, d = x.shape
    if t == 0 or h == 0:
        return x
    cs = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    block_h = min(triton.next_power_of_2(h), 16)
    _rope_inplace_kernel[(t, triton.cdiv(h, block_h))](
        x, positions, cs, h, x.stride(0), x.stride(1), cs.stride(0),
        OFFSET=d - rope, HALF=rope // 2, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(rope // 2),
        num_warps=2, enable_fp_fusion=False,  # separate mul/sub roundings, as torch does
    )
    return x


def apply_rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``cos_sin.shape[-1]`` dims of x [T, H, D] at ``positions`` in place and
    return x: the Triton pass on CUDA, the torch reference otherwise (same bits)."""
    if glue_kernels_apply(x) and x.stride(-1) == 1:
        return apply_rope_inplace_triton(x, positions, cos_sin)
    return apply_rope_inplace_reference(x, positions, cos_sin)


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
