"""The absorbed-decode query "stage buffer": [q_nope · W_UK ‖ rope(q_pe)], optionally FP8.

The decode kernels take one [T, H, kv_lora + rope] query (docs/architecture.md, "MLA latent
cache"). Built naively that
is a bmm, a rope, a ``torch.cat`` copy and a quantization launch. Here:

- the W_UK bmm writes its [T, H, kv_lora] product straight into the output's first
  ``kv_lora`` columns (``torch.bmm(out=...)`` on a strided view: cuBLAS takes the row pitch
  as its leading dimension, no copy) — or, for an FP8 query, into a compute-dtype scratch,
  since a GEMM cannot emit e4m3 with our per-tensor scale;
- ONE Triton pass then rotates q_pe into the last ``rope`` columns and, for FP8, quantizes
  the whole row with ``q_scale``.

Rounding matches the torch composition bit for bit: the rotated q_pe is rounded to the
compute dtype first (as ``torch.cat`` of the two parts would be), then ``x / q_scale`` by IEEE
division, saturated to ±448, round-to-nearest-even. No host syncs: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_per_tensor
from kernels.rope import apply_rope_interleaved_reference

try:  # the GPU path needs Triton; the CPU reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(q_nope, w_uk, q_pe, positions, cos_sin_cache, out_dtype) -> tuple[int, int, int, int]:
    """Validate shapes and dtypes; returns (T, H, kv_lora, rope)."""
    if q_nope.dim() != 3 or w_uk.dim() != 3 or q_pe.dim() != 3:
        raise ValueError(f"need q_nope [T, H, nope], w_uk [H, nope, kv_lora], q_pe [T, H, rope]; got "
                         f"{tuple(q_nope.shape)}, {tuple(w_uk.shape)}, {tuple(q_pe.shape)}")
    t, h, nope = q_nope.shape
    if w_uk.shape[:2] != (h, nope):
        raise ValueError(f"w_uk {tuple(w_uk.shape)} does not match q_nope {tuple(q_nope.shape)}")
    if q_pe.shape[:2] != (t, h) or q_pe.shape[2] % 2:
        raise ValueError(f"q_pe must be [{t}, {h}, even rope], got {tuple(q_pe.shape)}")
    if q_nope.dtype not in COMPUTE_DTYPES or w_uk.dtype != q_nope.dtype or q_pe.dtype != q_nope.dtype:
        raise TypeError(f"q_nope, w_uk, q_pe must share one of {COMPUTE_DTYPES}; got "
                        f"{q_nope.dtype}, {w_uk.dtype}, {q_pe.dtype}")
    if out_dtype not in (q_nope.dtype, FP8_DTYPE):
        raise TypeError(f"out_dtype must be the compute dtype {q_nope.dtype} or {FP8_DTYPE}, got {out_dtype}")
    rope = q_pe.shape[2]
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope:
        raise ValueError(f"cos_sin_cache must be [max_pos, {rope}], got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [{t}], got {tuple(positions.shape)}")
    return t, h, w_uk.shape[2], rope


def stage_query_reference(
    q_nope: torch.Tensor,
    w_uk: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    q_scale: float = 1.0,
) -> torch.Tensor:
    """The spec: bmm, rope, cat, then per-tensor quantization for an FP8 ``out_dtype``."""
    out_dtype = out_dtype or q_nope.dtype
    _check(q_nope, w_uk, q_pe, positions, cos_sin_cache, out_dtype)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    stage = torch.cat([ql_nope, apply_rope_interleaved_reference(q_pe, positions, cos_sin_cache)], dim=-1)
    return quantize_per_tensor(stage, q_scale) if out_dtype == FP8_DTYPE else stage


if triton is not None:
    _SAT = tl.constexpr(FP8_MAX)  # e4m3's largest finite value

    @triton.jit
    def _stage_kernel(
        LAT, QPE, POS, CS, OUT,
        stride_lt, stride_lh, stride_pt, stride_ph, stride_cs, stride_ot, stride_oh, q_scale,
        LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_LORA: tl.constexpr, BLOCK_HALF: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        out = OUT + t * stride_ot + h * stride_oh
        if QUANT:  # the bmm's product sits in a compute-dtype scratch: quantize it over
            cols = tl.arange(0, BLOCK_LORA)
            cmask = cols < LORA
            x = tl.load(LAT + t * stride_lt + h * stride_lh + cols, mask=cmask, other=0.0).to(tl.float32)
            x = tl.clamp(tl.math.div_rn(x, q_scale), -_SAT, _SAT)
            tl.store(out + cols, x.to(OUT.dtype.element_ty), mask=cmask)
        HALF: tl.constexpr = ROPE // 2
        i = tl.arange(0, BLOCK_HALF)
        imask = i < HALF
        cs = CS + tl.load(POS + t).to(tl.int64) * stride_cs
        cos = tl.load(cs + i, mask=imask, other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF + i, mask=imask, other=0.0).to(tl.float32)
        src = QPE + t * stride_pt + h * stride_ph
        x_even = tl.load(src + 2 * i, mask=imask, other=0.0).to(tl.float32)
        x_odd = tl.load(src + 2 * i + 1, mask=imask, other=0.0).to(tl.float32)
        # Round to the compute dtype first: the value the unfused path would have quantized.
        pe_even = (x_even * cos - x_odd * sin).to(QPE.dtype.element_ty)
        pe_odd = (x_odd * cos + x_even * sin).to(QPE.dtype.element_ty)
        if QUANT:
            pe_even = tl.clamp(tl.math.div_rn(pe_even.to(tl.float32), q_scale), -_SAT, _SAT)
            pe_odd = tl.clamp(tl.math.div_rn(pe_odd.to(tl.float32), q_scale), -_SAT, _SAT)
        tl.store(out + LORA + 2 * i, pe_even.to(OUT.dtype.element_ty), mask=imask)
        tl.store(out + LORA + 2 * i + 1, pe_odd.to(OUT.dtype.element_ty), mask=imask)


def stage_query_triton(
    q_nope: torch.Tensor,
    w_uk: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    q_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch.bmm into the stage buffer + the fused rope/quant pass (CUDA, or CPU under
    TRITON_INTERPRET=1). ``out``: an optional preallocated contiguous [T, H, kv_lora+rope]."""
    if triton is None:
        raise RuntimeError("the fused query stage needs the triton package")
    out_dtype = out_dtype or q_nope.dtype
    t, h, lora, rope = _check(q_nope, w_uk, q_pe, positions, cos_sin_cache, out_dtype)
    if out is None:
        out = torch.empty(t, h, lora + rope, dtype=out_dtype, device=q_nope.device)
    elif out.shape != (t, h, lora + rope) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{t}, {h}, {lora + rope}] {out_dtype} tensor")
    if t == 0:
        return out
    quant = out_dtype == FP8_DTYPE
    latent = torch.empty(t, h, lora, dtype=q_nope.dtype, device=q_nope.device) if quant else out[..., :lora]
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=latent.transpose(0, 1))
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    block_lora = triton.next_power_of_2(lora)
    _stage_kernel[(t, h)](
        latent, q_pe, positions, cs, out,
        latent.stride(0), latent.stride(1), q_pe.stride(0), q_pe.stride(1), cs.stride(0),
        out.stride(0), out.stride(1), float(q_scale),
        LORA=lora, ROPE=rope, BLOCK_LORA=block_lora, BLOCK_HALF=triton.next_power_of_2(rope // 2),
        QUANT=quant, num_warps=4 if quant and block_lora >= 512 else 1,
        enable_fp_fusion=False,  # separate mul/sub roundings, as torch does: bit-equal rope
    )
    return out


def triton_supports(q_nope: torch.Tensor) -> bool:
    """Whether ``stage_query`` takes the fused path for this query."""
    return triton is not None and q_nope.is_cuda and q_nope.dtype in COMPUTE_DTYPES


def stage_query(
    q_nope: torch.Tensor,
    w_uk: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    q_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_stage [T, H, kv_lora+rope] = [q_nope · W_UK ‖ rope(q_pe)] in ``out_dtype`` (the
    compute dtype, or e4m3 scaled by ``q_scale``). q_pe arrives un-rotated. Fused path on
    CUDA, the torch reference otherwise (``out``, if given, is filled in both cases)."""
    if triton_supports(q_nope):
        return stage_query_triton(q_nope, w_uk, q_pe, positions, cos_sin_cache, out_dtype, q_scale, out)
    ref = stage_query_reference(q_nope, w_uk, q_pe, positions, cos_sin_cache, out_dtype, q_scale)
    if out is None:
        return ref
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise ValueError(f"out must be a {tuple(ref.shape)} {ref.dtype} tensor")
    return out.copy_(ref)


__all__ = ["stage_query", "stage_query_reference", "stage_query_triton", "triton_supports"]
