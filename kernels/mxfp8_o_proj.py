"""DeepSeek-V4.1's attention output projection with MXFP8 operands: inverse RoPE → wo_a → wo_b.

    o [T, H, 512] --inverse RoPE (last 64 dims), MXFP8--> o' [T, G·Kg]
      --wo_a (grouped, G × [R, Kg]), epilogue: bf16 z → MXFP8--> z [T, G·R]
      --wo_b [hidden, G·R]--> out [T, hidden]

Three launches (kernels/mxfp8_quant_triton.py, then kernels/mxfp8_gemm.py's default backend,
the CUDA C++ GEMM on Hopper), plus a reduce per GEMM where K is split (small token counts): z
is written once, as e4m3 + UE8M0 bytes, in the layout wo_b's GEMM reads, and never as bf16
(with split-K, wo_a's fp32 partials are summed and quantized by one launch).

Numerics against HF's V4.1 (which quantizes no activations): the weights are the checkpoint's
e4m3 × 32×32 UE8M0 blocks, used exactly (HF dequantizes them to bf16 at load, also exact);
the inverse RoPE is HF's (fp32 rotation rounded to o's dtype) and z is rounded to bf16 as HF
rounds wo_a's output. Two roundings are ours:

* o' is quantized to MXFP8 (1×32, UE8M0) before wo_a: neither HF nor DeepSeek's reference
  does this (an extra approximation, as vLLM's fused path on SM100 makes);
* z is quantized to MXFP8 before wo_b: HF does not; DeepSeek's reference does exactly this
  (1×32 UE8M0 activation quantization before every FP8 GEMM).

Tensor parallelism (heads and wo_a groups split by rank, wo_b row-parallel with a
reduce-scatter of its partial sums) is the caller's: these functions see one rank's shard.
"""

from __future__ import annotations

import torch

from kernels.microscaling import quantize_mxfp8
from kernels.mxfp8_gemm import mxfp8_gemm, mxfp8_gemm_reference, triton_interpreting
from kernels.rope import apply_rope_interleaved_reference

MXFP8Weight = tuple[torch.Tensor, torch.Tensor]  # (e4m3 [N, K], UE8M0 bytes [N/32, K/32])


def inverse_rope_reference(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """o [T, H, D] with each head's last ``2·cos.shape[-1]`` dims rotated by the negative angle."""
    rope = 2 * cos.shape[-1]
    table = torch.cat([cos, -sin], dim=-1)  # rotating by -θ: cos θ, -sin θ
    positions = torch.arange(o.shape[0], device=o.device)
    rotated = apply_rope_interleaved_reference(o[..., -rope:], positions, table)
    return torch.cat([o[..., :-rope], rotated], dim=-1)


def _check(o: torch.Tensor, wo_a: MXFP8Weight, wo_b: MXFP8Weight, groups: int) -> None:
    if o.dim() != 3:
        raise ValueError(f"o must be [T, heads, head_dim], got {tuple(o.shape)}")
    _, h, d = o.shape
    if (h * d) % groups or wo_a[0].shape[1] != h * d // groups:
        raise ValueError(f"wo_a {tuple(wo_a[0].shape)} does not take {h} heads × {d} in {groups} groups")
    if wo_b[0].shape[1] != wo_a[0].shape[0]:
        raise ValueError(f"wo_b {tuple(wo_b[0].shape)} does not take wo_a's {wo_a[0].shape[0]} outputs")


def o_proj_reference(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: MXFP8Weight,
                     wo_b: MXFP8Weight, groups: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch composition of the fused path, rounding for rounding (see the module doc)."""
    _check(o, wo_a, wo_b, groups)
    t = o.shape[0]
    o8, os_ = quantize_mxfp8(inverse_rope_reference(o, cos, sin).reshape(t, -1))
    z = mxfp8_gemm_reference(o8, os_, *wo_a, groups=groups, out_dtype=torch.bfloat16)
    return mxfp8_gemm_reference(*quantize_mxfp8(z), *wo_b, out_dtype=out_dtype or o.dtype)


def mxfp8_o_proj(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: MXFP8Weight, wo_b: MXFP8Weight,
                 groups: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [T, hidden] from the attention output o [T, H, D] (bf16/fp32) and the tokens' RoPE
    tables cos, sin [T, rope/2]: the kernels on CUDA (and on the CPU under TRITON_INTERPRET=1),
    else :func:`o_proj_reference`."""
    from kernels.mxfp8_quant_triton import inverse_rope_quantize_mxfp8_triton

    if not o.is_cuda and not triton_interpreting():
        return o_proj_reference(o, cos, sin, wo_a, wo_b, groups, out_dtype)
    _check(o, wo_a, wo_b, groups)
    o8, os_ = inverse_rope_quantize_mxfp8_triton(o, cos, sin)
    z8, zs = mxfp8_gemm(o8, os_, *wo_a, groups=groups, quantize_out=True)
    return mxfp8_gemm(z8, zs, *wo_b, out_dtype=out_dtype or o.dtype)


__all__ = ["MXFP8Weight", "inverse_rope_reference", "mxfp8_o_proj", "o_proj_reference"]
