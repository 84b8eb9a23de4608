"""Block-FP8 linear layers (DeepSeek R1/V3 checkpoints): y = x · dequant(w8)ᵀ (+ bias).

Weights are e4m3 [N, K] with fp32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]
(docs/architecture.md, "FP8 block weights"). Paths, chosen by ``fp8_block_linear``:

- ``torch`` (CPU, or asked for): dequantize the weight and matmul in fp32 — the reference.
- ``scaled_mm`` (CUDA, N and K multiples of 128): per-token 1x128 activation quantization
  by the fused Triton kernel, then ``torch._scaled_mm`` in its blockwise mode. That mode
  accepts exactly one layout (measured, torch 2.11 / cuBLAS 13): activation scales
  [M, K/128] outer-dim-major, weight scales [N/128, K/128] contiguous passed transposed.
- ``triton`` (CUDA, any N/K, e.g. kv_a_proj's N = 576): the same activation quantization
  and a Triton GEMM that applies both block scales per 128-wide K step.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_DTYPE, dequantize_weight_blocks

try:  # the GPU paths need Triton; the CPU reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

BACKENDS = ("auto", "torch", "scaled_mm", "triton")
SCALE_BLOCK = 128
SCALE_PAD_M = 16  # rows padded to a multiple of this for cuBLAS' blockwise mode


def _check(x: torch.Tensor, w8: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int]):
    if w8.dim() != 2 or w8.dtype != FP8_DTYPE:
        raise TypeError(f"w8 must be a 2-D e4m3 tensor, got {tuple(w8.shape)} {w8.dtype}")
    n, k = w8.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(w_scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv shape {tuple(w_scale_inv.shape)} != {want} for block {block}")


# Measured on the H200 (torch 2.11, cuBLAS 13, 2026-11-29): blockwise _scaled_mm returns wrong
# results (relative error 0.7 to 7) when K has fewer than 4 scale blocks (K = 256, 384), and is
# right (1.7e-3) from K = 512 on. Such shapes (e.g. a 256-wide q_lora or moe_intermediate)
# take the Triton GEMM instead.
SCALED_MM_MIN_K = 512


def scaled_mm_supports(n: int, k: int, block: tuple[int, int]) -> bool:
    """Whether cuBLAS' blockwise ``_scaled_mm`` takes this weight (else the Triton GEMM)."""
    return (tuple(block) == (SCALE_BLOCK, SCALE_BLOCK) and n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0
            and k >= SCALED_MM_MIN_K)


def choose_backend(on_cuda: bool, n: int, k: int, block: tuple[int, int], backend: str = "auto") -> str:
    """The path ``fp8_block_linear`` takes: CPU → torch; CUDA → scaled_mm where it applies,
    the Triton GEMM where it does not, torch for scale blocks other than 128x128."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 GEMM backend {backend!r}; one of {BACKENDS}")
    if backend == "torch" or not on_cuda:
        return "torch"
    square = tuple(block) == (SCALE_BLOCK, SCALE_BLOCK)
    if backend == "scaled_mm" and not scaled_mm_supports(n, k, block):
        raise ValueError(
            f"_scaled_mm blockwise needs N, K multiples of 128 and block (128, 128); got N={n} K={k} {block}")
    if backend == "triton" and not square:
        raise ValueError(f"the Triton block GEMM needs 128x128 weight blocks, got {block}")
    if backend != "auto":
        return backend
    if not square:
        return "torch"
    return "scaled_mm" if scaled_mm_supports(n, k, block) else "triton"


def fp8_block_linear_reference(
    x: torch.Tensor, w8: torch.Tensor, w_scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    w = dequantize_weight_blocks(w8, w_scale_inv, block, dtype=torch.float32)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def fp8_block_linear(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    ue8m0: bool = False,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) · block-FP8 weight [N, K] → [..., N] in ``out_dtype``
    (default: x's dtype). ``ue8m0`` rounds activation scales to powers of two (V3.1)."""
    _check(x, w8, w_scale_inv, block)
    out_dtype = out_dtype or x.dtype
    path = choose_backend(x.is_cuda, *w8.shape, block, backend)
    if path == "torch":
        return fp8_block_linear_reference(x, w8, w_scale_inv, block, bias, out_dtype)

    from kernels.fp8_quant_triton import quantize_per_token_group_triton

    n, k = w8.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return torch.empty(*lead, n, dtype=out_dtype, device=x.device)
    sw = w_scale_inv.float().contiguous()
    if path == "scaled_mm":
        m = x2.shape[0]
        pad = -m % SCALE_PAD_M
        if pad:  # cuBLAS refused M = 1 ("NOT_SUPPORTED"); zero rows quantize to zeros
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        x8, sx = quantize_per_token_group_triton(x2, SCALE_BLOCK, ue8m0=ue8m0, column_major_scales=True)
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(), out_dtype=out_dtype)[:m]
    else:
        x8, sx = quantize_per_token_group_triton(x2, SCALE_BLOCK, ue8m0=ue8m0)
        y = fp8_block_gemm_triton(x8, sx, w8, sw, out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, n)


if triton is not None:

    @triton.jit
    def _block_fp8_gemm_kernel(
        A, SA, B, SB, C, M, N, K,
        stride_am, stride_sam, stride_bn, stride_sbn, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """C[M, N] = (A8 · SA) (B8 · SB)ᵀ with 128x128 weight blocks and 1x128 activation
        groups; BLOCK_K == 128 so each K step has one weight scale per 128-row N block."""
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        group = pid // width
        first_m = group * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        a_ptr = A + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
        b_ptr = B + rn.to(tl.int64)[:, None] * stride_bn + rk[None, :]
        sa_ptr = SA + rm.to(tl.int64) * stride_sam
        sb_ptr = SB + (rn // 128) * stride_sbn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = (kb * BLOCK_K + rk) < K
            a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            sa = tl.load(sa_ptr + kb, mask=m_ok, other=0.0)
            sb = tl.load(sb_ptr + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
        c_ptr = C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_gemm_triton(
    x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """x8 [M, K] e4m3 with sx [M, ceil(K/128)], w8 [N, K] e4m3 with sw [ceil(N/128), ceil(K/128)]."""
    if triton is None:
        raise RuntimeError("the Triton block-FP8 GEMM needs the triton package")
    m, k = x8.shape
    n = w8.shape[0]
    if w8.stride(-1) != 1 or x8.stride(-1) != 1:
        raise ValueError("x8 and w8 must be contiguous in K")
    c = torch.empty(m, n, dtype=out_dtype, device=x8.device)
    block_m = 64 if m <= 64 else 128
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, 128),)
    _block_fp8_gemm_kernel[grid](
        x8, sx, w8, sw, c, m, n, k, x8.stride(0), sx.stride(0), w8.stride(0), sw.stride(0), c.stride(0),
        BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8 if block_m == 128 else 4, num_stages=3)
    return c
