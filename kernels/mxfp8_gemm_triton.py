"""The Triton MXFP8 GEMM (kernels/mxfp8_gemm.py dispatches to it where the CUDA C++ kernel does
not run) and the split-K reducing launch both kernels share: it sums fp32 partials in split
order and, for an MXFP8 output, quantizes the bf16 sum by the GEMM epilogue's rules."""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.gpu import num_sms
from kernels.mxfp8_operands import MX_BLOCK, check_operands, scale_bytes, split_k_for

try:  # the GPU paths need Triton; the CPU references do not
    import triton
    import triton.language as tl

    from kernels.mxfp8_quant_triton import (
        pow2_from_byte,
        quantize_blocks,
        round_to_bf16,
        ue8m0_byte,
    )
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


if triton is not None:

    @triton.jit
    def _mxfp8_gemm_kernel(
        A, SA, B, SB, C, SC, M, N, K_GROUP, N_GROUP, K_STEPS,
        stride_am, stride_sam, stride_bn, stride_sbn, stride_cm, stride_scm, stride_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        QUANT_OUT: tl.constexpr, OUT_BF16: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """C = (A8 · 2^SA) (B8 · 2^SB)ᵀ, the scales applied per 32-wide K slice; the N tile's
        group g reads A's K columns [g·K_GROUP, (g+1)·K_GROUP). Program (pid, s) covers K
        steps [s·K_STEPS, (s+1)·K_STEPS); with SPLIT it writes fp32 partials to C[s]."""
        pid = tl.program_id(0)
        k_first = tl.program_id(1) * K_STEPS * BLOCK_K
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, 32)
        m_ok = rm < M
        n_ok = rn < N
        k0 = (pid_n * BLOCK_N // N_GROUP) * K_GROUP + k_first  # this tile's group's K columns of A
        a_ptr = A + rm.to(tl.int64)[:, None] * stride_am + k0 + rk[None, :]
        b_ptr = B + rn.to(tl.int64)[:, None] * stride_bn + rk[None, :]
        sa_ptr = SA + rm.to(tl.int64) * stride_sam + k0 // 32
        b_ptr += k_first
        sb_ptr = SB + (rn // 32).to(tl.int64) * stride_sbn + k_first // 32
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(K_STEPS):
            for j in tl.static_range(BLOCK_K // 32):
                a = tl.load(a_ptr + j * 32, mask=m_ok[:, None], other=0.0)
                b = tl.load(b_ptr + j * 32, mask=n_ok[:, None], other=0.0)
                sa = pow2_from_byte(tl.load(sa_ptr + j, mask=m_ok, other=0))
                sb = pow2_from_byte(tl.load(sb_ptr + j, mask=n_ok, other=0))
                part = tl.dot(a, tl.trans(b))  # one 32-wide slice, promoted at once
                acc += part * (sa[:, None] * sb[None, :])
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
            sa_ptr += BLOCK_K // 32
            sb_ptr += BLOCK_K // 32
        ok = m_ok[:, None] & n_ok[None, :]
        c_offs = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        if SPLIT:
            tl.store(C + tl.program_id(1).to(tl.int64) * stride_split + c_offs, acc, mask=ok)
        elif QUANT_OUT:
            z = tl.reshape(round_to_bf16(acc), (BLOCK_M, BLOCK_N // 32, 32))
            byte = ue8m0_byte(tl.max(tl.abs(z), 2))  # [BLOCK_M, BLOCK_N / 32]
            q = tl.reshape(quantize_blocks(z, pow2_from_byte(254 - byte)[:, :, None]), (BLOCK_M, BLOCK_N))
            tl.store(C + c_offs, q.to(tl.uint8), mask=ok)
            rb = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            s_ok = m_ok[:, None] & (rb < N // 32)[None, :]
            tl.store(SC + rm.to(tl.int64)[:, None] * stride_scm + rb[None, :], byte.to(tl.uint8), mask=s_ok)
        elif OUT_BF16:
            tl.store(C + c_offs, round_to_bf16(acc).to(tl.bfloat16), mask=ok)
        else:
            tl.store(C + c_offs, acc.to(C.dtype.element_ty), mask=ok)


    @triton.jit
    def _split_sum_kernel(W, C, MN, SPLITS, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
        """C = Σ_s W[s] in a fixed order (deterministic), W fp32 [SPLITS, M·N] contiguous."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(SPLITS):
            acc += tl.load(W + s * MN + offs, mask=ok, other=0.0)
        if OUT_BF16:
            tl.store(C + offs, round_to_bf16(acc).to(tl.bfloat16), mask=ok)
        else:
            tl.store(C + offs, acc.to(C.dtype.element_ty), mask=ok)

    @triton.jit
    def _split_sum_quant_kernel(W, Q, S, M, N, SPLITS, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr):
        """Q, S = MXFP8 of bf16(Σ_s W[s]), W fp32 [SPLITS, M, N] contiguous: the split sum in
        the order of ``_split_sum_kernel``, then the GEMM epilogue's quantization rules."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BLOCKS, 32]
        ok = (rm < M)[:, None, None] & (cols < N)[None, :, :]
        offs = rm.to(tl.int64)[:, None, None] * N + cols[None, :, :]
        acc = tl.zeros([BLOCK_M, BLOCKS, 32], dtype=tl.float32)
        for s in range(SPLITS):
            acc += tl.load(W + s * M * N + offs, mask=ok, other=0.0)
        z = round_to_bf16(acc)
        byte = ue8m0_byte(tl.max(tl.abs(z), 2))  # [BLOCK_M, BLOCKS]
        q = quantize_blocks(z, pow2_from_byte(254 - byte)[:, :, None])
        tl.store(Q + offs, q.to(tl.uint8), mask=ok)
        s_ok = (rm < M)[:, None] & (blocks < N // 32)[None, :]
        tl.store(S + rm.to(tl.int64)[:, None] * (N // 32) + blocks[None, :], byte.to(tl.uint8), mask=s_ok)



def split_sum(partials: torch.Tensor, out: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """out = Σ_s partials[s] (fp32 [splits, M, N], in split order), written as ``out``'s dtype,
    or with ``scales`` as MXFP8 (``out`` uint8 [M, N], ``scales`` uint8 [M, N/32]) of its bf16
    rounding: the same bytes as quantizing the bf16 sum separately."""
    splits, m, n = partials.shape
    if scales is None:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](partials, out, m * n, splits, BLOCK=block,
                                                        OUT_BF16=out.dtype == torch.bfloat16, num_warps=4)
    else:
        blocks = min(triton.next_power_of_2(n // MX_BLOCK), 8)
        block_m = max(1, min(16, 2048 // (blocks * MX_BLOCK)))
        grid = (triton.cdiv(m, block_m), triton.cdiv(n // MX_BLOCK, blocks))
        _split_sum_quant_kernel[grid](partials, out, scales, m, n, splits, BLOCK_M=block_m, BLOCKS=blocks,
                                      num_warps=4)



def default_config(m: int, n: int, k_group: int, groups: int = 1, sms: int = 132, quantize_out: bool = False,
                   ) -> dict:
    """Tile sizes: 64 rows × 128-wide K steps up to M = 64 (decode), 128 rows × 32-wide K steps
    beyond, 8 warps; the N tile must divide a group's rows when groups > 1 (V4.1's wo_a has
    1024). Compiled offline for sm_90 these use wgmma and do not spill (128 × 128 × 128 does:
    four 32-slice partials live at once). Split-K where the tiles alone do not fill ``sms``
    SMs (with ``quantize_out`` the split sum is quantized by the reducing launch)."""
    block_m = 64 if m <= 64 else 128
    rows = n // groups
    block_n = 128 if groups == 1 or rows % 128 == 0 else (64 if rows % 64 == 0 else 32)
    block_k = 128 if block_m == 64 and k_group % 128 == 0 else 32
    tiles = -(-m // block_m) * -(-n // block_n)
    # the fp32 partials (split · M · N · 4 bytes) must stay below the weight's N · K bytes
    split = split_k_for(tiles, k_group // block_k, sms, min(32, k_group // (4 * max(m, 1))))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8,
            "num_warps": 8, "num_stages": 3, "SPLIT_K": split}



def mxfp8_gemm_triton(
    x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, groups: int = 1,
    out_dtype: torch.dtype = torch.bfloat16, quantize_out: bool = False, config: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.mxfp8_gemm.mxfp8_gemm` on the Triton kernel (``config``: :func:`default_config`'s keys)."""
    if triton is None:
        raise RuntimeError("the MXFP8 GEMM needs the triton package")
    m, n, kg = check_operands(x8, xs, w8, ws, groups)
    if quantize_out and n % MX_BLOCK:
        raise ValueError(f"quantize_out needs N ({n}) to be a multiple of {MX_BLOCK}")
    if x8.stride(-1) != 1 or w8.stride(-1) != 1 or xs.stride(-1) != 1 or ws.stride(-1) != 1:
        raise ValueError("x8, xs, w8 and ws must be contiguous in K")
    xs, ws = scale_bytes(xs), scale_bytes(ws)
    sms = num_sms(x8.device)
    cfg = dict(config or default_config(m, n, kg, groups, sms, quantize_out))
    split = cfg.pop("SPLIT_K", 1)
    if split > 1 and (kg // cfg["BLOCK_K"]) % split:
        raise ValueError(f"SPLIT_K {split} must divide the K steps ({kg // cfg['BLOCK_K']})")
    if groups > 1 and (n // groups) % cfg["BLOCK_N"]:
        raise ValueError(f"BLOCK_N {cfg['BLOCK_N']} must divide the group's {n // groups} rows")
    if kg % cfg["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} must divide K ({kg})")
    if quantize_out:
        c = torch.empty(m, n, dtype=torch.uint8, device=x8.device)
        sc = torch.empty(m, n // MX_BLOCK, dtype=torch.uint8, device=x8.device)
    else:
        c = torch.empty(m, n, dtype=out_dtype, device=x8.device)
        sc = c  # unused
    if m:
        # split-K partials go to an fp32 workspace, summed in order by a second launch
        dst = torch.empty(split, m, n, dtype=torch.float32, device=x8.device) if split > 1 else c
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
        _mxfp8_gemm_kernel[grid](
            x8, xs, w8, ws, dst, sc, m, n, kg, n // groups if groups > 1 else n, kg // cfg["BLOCK_K"] // split,
            x8.stride(0), xs.stride(0), w8.stride(0), ws.stride(0), dst.stride(-2), sc.stride(0),
            dst.stride(0) if split > 1 else 0,
            QUANT_OUT=quantize_out, OUT_BF16=c.dtype == torch.bfloat16, SPLIT=split > 1, **cfg)
        if split > 1:
            split_sum(dst, c, sc if quantize_out else None)
    if quantize_out:
        return c.view(FP8_DTYPE), sc
    return c
