"""MXFP8 GEMMs for DeepSeek-V4.1's linears on Hopper (Triton), with torch references; the
entry point :func:`mxfp8_gemm` also dispatches to the CUDA C++ kernel of
kernels/mxfp8_gemm_cuda.py (the default where it runs: the Triton kernel cannot overlap the
per-32 promotion with the next MMA).

Operands: activations e4m3 [M, K] with one UE8M0 byte per 32 along K ([M, K/32]); weights
e4m3 [N, K] with one UE8M0 byte per 32×32 block ([ceil(N/32), K/32]), V4.1's checkpoint
format (``kernels.weight_formats.quantize_fp8_blocks(w, (32, 32))`` makes one). A byte b
means the scale 2^(b−127); scales may be uint8 or float8_e8m0fnu.

Hopper has no block-scaled MMA, but both scales are powers of two, so the MXFP8 numerics are
kept by an FP8 MMA per 32-wide K slice: ``acc += dot(a8, b8) · 2^(ea−127) · 2^(eb−127)``, one
multiply and one FMA per accumulator element per 32 of K. The scaling itself is exact; what
rounds is the sum: inside the MMA (Hopper's FP8 MMA accumulates with fewer than fp32's bits,
so promoting into the fp32 accumulator after every 32 keeps that error to one slice's sum)
and in the fp32 accumulator, as in the reference's matmul.

``groups > 1`` is the grouped low-rank projection wo_a: x [M, groups·Kg] and weight
[groups·R, Kg], output group g = x[:, g·Kg:(g+1)·Kg] · W[g·R:(g+1)·R]ᵀ (a block-diagonal
GEMM, R a multiple of the N tile). ``quantize_out`` gives the GEMM an MXFP8 epilogue: it
rounds the fp32 tile to bf16, takes the amax of each 32 output columns and writes e4m3 +
UE8M0 bytes ([M, N/32]) with the same helpers as ``quantize_mxfp8_triton``, so the next
MXFP8 GEMM reads bytes identical to quantizing the bf16 output separately. With split-K the
reducing launch quantizes instead (:func:`split_sum`), by the same rules.
"""

from __future__ import annotations

import torch

from kernels.mxfp8_gemm_triton import default_config, mxfp8_gemm_triton, split_sum
from kernels.mxfp8_operands import MX_BLOCK, check_operands, mxfp8_gemm_reference, split_k_for


def mxfp8_gemm(
    x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, groups: int = 1,
    out_dtype: torch.dtype = torch.bfloat16, quantize_out: bool = False, config: dict | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x8 e4m3 [M, groups·K] + xs uint8 [M, groups·K/32] times w8 e4m3 [N, K] + ws [ceil(N/32), K/32].

    Returns [M, N] in ``out_dtype``, or with ``quantize_out`` (N a multiple of 32) the output
    as MXFP8: (e4m3 [M, N], uint8 [M, N/32]) of its bf16 rounding.

    ``backend``: ``"cuda"`` (kernels/mxfp8_gemm_cuda.py, Hopper), ``"triton"`` (this module),
    or None: CUDA where it runs and takes the operands, else Triton. ``config`` is the chosen
    backend's (see :func:`default_config` and ``default_cuda_config``).
    """
    if backend not in (None, "cuda", "triton"):
        raise ValueError(f"unknown MXFP8 GEMM backend {backend!r}; 'cuda', 'triton' or None")
    if backend != "triton":
        from kernels.mxfp8_gemm_cuda import cuda_gemm_available, mxfp8_gemm_cuda, unsupported_reason

        use_cuda = backend == "cuda"
        if backend is None and x8.is_cuda and cuda_gemm_available(x8.device.index or 0):
            m, n, kg = check_operands(x8, xs, w8, ws, groups)
            use_cuda = (unsupported_reason(x8, xs, w8, ws, m, n, kg, groups) is None
                        and (quantize_out or out_dtype in (torch.bfloat16, torch.float32)))
        if use_cuda:
            return mxfp8_gemm_cuda(x8, xs, w8, ws, groups, out_dtype, quantize_out, config)
    return mxfp8_gemm_triton(x8, xs, w8, ws, groups, out_dtype, quantize_out, config)


def mxfp8_linear(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype | None = None,
                 ) -> torch.Tensor:
    """x [..., K] → [..., N]: the fused MXFP8 activation quantization, then the MXFP8 GEMM."""
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    lead, k = x.shape[:-1], x.shape[-1]
    x8, xs = quantize_mxfp8_triton(x.reshape(-1, k))
    return mxfp8_gemm(x8, xs, w8, ws, out_dtype=out_dtype or x.dtype).reshape(*lead, w8.shape[0])


__all__ = [
    "MX_BLOCK",
    "check_operands",
    "default_config",
    "mxfp8_gemm",
    "mxfp8_gemm_reference",
    "mxfp8_linear",
    "split_k_for",
    "split_sum",
]
