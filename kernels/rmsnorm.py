"""RMSNorm: torch reference (fp32 math, result cast back to the input dtype), the fused Triton
kernel (residual add + norm in one pass over the row) and the dispatch between them.

Unfused, a prefill-sized norm is about nine launches (add, to fp32, pow, mean, add, rsqrt,
two muls, to bf16) and five round trips of the [T, hidden] activations in fp32; the kernel
reads x (and the residual) once and writes the normed row (and the new residual) once.

Rounding follows the torch composition: the residual sum is rounded to x's dtype (what
``x + residual`` gives) and *that* value is normalized; statistics in fp32 by IEEE division
and square root; ``weight · (x · 1/rms)`` in fp32, rounded once. Only the fp32 sum order of
the mean differs from torch, so a result may differ from the reference by one ulp of its dtype.
"""

from __future__ import annotations

import torch

from kernels.fused_glue import HAS_TRITON, glue_kernels_apply

if HAS_TRITON:  # the GPU path needs Triton; the CPU reference does not
    import triton
    import triton.language as tl

FUSED_DTYPES = (torch.bfloat16, torch.float16)  # fp32 norms (V4's) stay on the reference
MAX_FUSED_WIDTH = 32768  # one row per program, held in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_after_cast_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4.1's rounding: ``x / rms(x)`` (float32 statistic) cast to x's dtype first, then
    times ``weight`` in the weight's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); with no residual, (norm(x), x)."""
    if residual is not None:
        x = x + residual
    return rms_norm_reference(x, weight, eps), x


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        X, R, W, OUT, RES_OUT, stride_x, stride_r, stride_o, stride_ro, eps,
        N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # the sum rounded to x's dtype, as torch's x + residual
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
            tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
        mean_sq = tl.math.div_rn(tl.sum(xf * xf, 0), N * 1.0)
        inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (w * (xf * inv_rms)).to(OUT.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, N] with unit column stride (a copy only when no such view exists)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel (CUDA, or CPU under TRITON_INTERPRET=1); same contract as the reference."""
    if not HAS_TRITON:
        raise RuntimeError("the fused RMSNorm needs the triton package")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    x2, weight = _rows(x), weight.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), float(eps),
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
            enable_fp_fusion=False,
        )
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if residual is not None else x)


def triton_supports(x: torch.Tensor) -> bool:
    """Whether ``rms_norm`` / ``add_rms_norm`` take the fused kernel for ``x``."""
    return glue_kernels_apply(x) and x.dtype in FUSED_DTYPES and 0 < x.shape[-1] <= MAX_FUSED_WIDTH


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in float32 like HF's DeepseekV3RMSNorm."""
    if triton_supports(x):
        return add_rms_norm_triton(x, None, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + norm: returns (norm(x + residual), x + residual); with no
    residual, (norm(x), x)."""
    if triton_supports(x) and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape)):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_triton", "rms_norm", "rms_norm_after_cast_reference",
           "rms_norm_reference", "triton_supports"]
