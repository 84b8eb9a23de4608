"""SiLU-gated activation of the dense MLPs (shared experts, first dense layers): [..., 2I]
(gate ‖ up) → silu(gate) · up. Torch reference, one fused Triton pass, and the dispatch.

Unfused it is two launches: ``silu`` over the strided gate half (its own output round trip)
and the ``mul``; the kernel reads gate and up once and writes the product once. Rounding
follows torch: silu(g) = g / (1 + e^-g) in fp32 (IEEE division) rounded to x's dtype, then
the product in fp32 rounded once. Only e^-g may differ from torch's by an fp32 ulp, which
moves a result by at most one ulp of its dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fused_glue import HAS_TRITON, glue_kernels_apply

if HAS_TRITON:  # the GPU path needs Triton; the CPU reference does not
    import triton
    import triton.language as tl

FUSED_DTYPES = (torch.bfloat16, torch.float16)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate ‖ up) → silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(X, OUT, inter, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (s * u).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """The fused pass (CUDA, or CPU under TRITON_INTERPRET=1); same contract as the reference."""
    if not HAS_TRITON:
        raise RuntimeError("the fused SiLU·mul needs the triton package")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate ‖ up), got {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out.view(*x.shape[:-1], inter)


def triton_supports(x: torch.Tensor) -> bool:
    """Whether ``silu_and_mul`` takes the fused pass for ``x``."""
    return glue_kernels_apply(x) and x.dtype in FUSED_DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate ‖ up) → silu(gate) * up: fused on CUDA (16-bit), torch otherwise."""
    if triton_supports(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


__all__ = ["silu_and_mul", "silu_and_mul_reference", "silu_and_mul_triton", "triton_supports"]
