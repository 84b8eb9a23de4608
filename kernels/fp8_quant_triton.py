"""Fused per-token, per-128-channel FP8 activation quantization (Triton).

One pass over the activations: group amax, scale = amax / 448 (optionally rounded up to a
power of two, UE8M0), divide, saturate, cast to e4m3. Matches
``kernels.fp8.quantize_per_token_group`` bit for bit (same fp32 division). The scales can be
written column-major ("outer-dim-major", [M, G] with stride (1, M)), the layout
``torch._scaled_mm``'s blockwise mode requires, so no transpose copy follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE


@triton.jit
def _quant_groups_kernel(
    X, Y, S, M, K, stride_xm, stride_ym, stride_sm, stride_sg,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, UE8M0: tl.constexpr,
):
    row = tl.program_id(0)
    g0 = tl.program_id(1) * GROUPS_PER_PROG
    groups = g0 + tl.arange(0, GROUPS_PER_PROG)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    inside = cols < K
    x = tl.load(X + row.to(tl.int64) * stride_xm + cols, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.maximum(amax, 1e-12) / 448.0
    if UE8M0:
        scale = tl.exp2(tl.ceil(tl.log2(scale)))
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)  # IEEE division, as torch
    tl.store(Y + row.to(tl.int64) * stride_ym + cols, y.to(Y.dtype.element_ty), mask=inside)
    n_groups = tl.cdiv(K, GROUP)
    tl.store(S + row.to(tl.int64) * stride_sm + groups * stride_sg, scale, mask=groups < n_groups)


def quantize_per_token_group_triton(
    x: torch.Tensor, group_size: int = 128, ue8m0: bool = False, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (e4m3 [..., K], fp32 scales [..., ceil(K/group_size)])."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"cannot quantize {x.dtype} activations")
    if group_size & (group_size - 1):
        raise ValueError("group_size must be a power of two")
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    groups = triton.cdiv(k, group_size)
    y = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        s = torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return y.reshape(*lead, k), s.reshape(*lead, groups)
    gpp = min(triton.next_power_of_2(groups), max(1, 2048 // group_size))
    grid = (m, triton.cdiv(groups, gpp))
    _quant_groups_kernel[grid](
        x2, y, s, m, k, x2.stride(0), y.stride(0), s.stride(0), s.stride(1),
        GROUP=group_size, GROUPS_PER_PROG=gpp, UE8M0=ue8m0, num_warps=4)
    if column_major_scales:
        return y.reshape(*lead, k), s  # a 2-D [M, G] view; lead dims are flattened
    return y.reshape(*lead, k), s.reshape(*lead, groups)


__all__ = ["quantize_per_token_group_triton"]
