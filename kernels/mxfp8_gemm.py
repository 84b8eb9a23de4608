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

import functools

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.microscaling import dequantize_mxfp8
from kernels.weight_formats import dequantize_fp8_blocks

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

MX_BLOCK = 32


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales as uint8 (checkpoints may hold float8_e8m0fnu)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def check_operands(x8, xs, w8, ws, groups: int = 1) -> tuple[int, int, int]:
    """(M, N, K per group) after checking dtypes and shapes; raises naming the tensor."""
    for name, t in (("x8", x8), ("w8", w8)):
        if t.dim() != 2 or t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be a 2-D e4m3 tensor, got {tuple(t.shape)} {t.dtype}")
    m, k_total = x8.shape
    n, kg = w8.shape
    if groups < 1 or k_total != groups * kg:
        raise ValueError(f"x8 has {k_total} input features, the weight {kg} per group × {groups} groups")
    if kg % MX_BLOCK:
        raise ValueError(f"K per group ({kg}) must be a multiple of {MX_BLOCK}")
    if n % groups or (groups > 1 and (n // groups) % MX_BLOCK):
        raise ValueError(f"N ({n}) must split into {groups} groups of a multiple of {MX_BLOCK} rows")
    if tuple(xs.shape) != (m, k_total // MX_BLOCK):
        raise ValueError(f"activation scales xs {tuple(xs.shape)} != {(m, k_total // MX_BLOCK)}")
    if tuple(ws.shape) != (-(-n // MX_BLOCK), kg // MX_BLOCK):
        raise ValueError(f"weight scales ws {tuple(ws.shape)} != {(-(-n // MX_BLOCK), kg // MX_BLOCK)}")
    return m, n, kg


def mxfp8_gemm_reference(x8, xs, w8, ws, groups: int = 1, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Both operands dequantized exactly, then an fp32 (block-diagonal for groups > 1) matmul."""
    m, n, kg = check_operands(x8, xs, w8, ws, groups)
    x = dequantize_mxfp8(x8, _bytes(xs)).reshape(m, groups, kg).transpose(0, 1)  # [g, M, Kg]
    w = dequantize_fp8_blocks(w8, ws, (MX_BLOCK, MX_BLOCK)).reshape(groups, n // groups, kg)  # [g, R, Kg]
    return torch.bmm(x, w.transpose(1, 2)).transpose(0, 1).reshape(m, n).to(out_dtype)


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


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_for(tiles: int, k_steps: int, sms: int, max_split: int = 32) -> int:
    """How many K splits fill the GPU when the output has fewer tiles than SMs (decode-sized
    M): the smallest divisor of the K steps reaching one wave, each split ≥ 2 steps."""
    if tiles >= sms:
        return 1
    divisors = [s for s in range(2, min(k_steps // 2, max_split) + 1) if k_steps % s == 0]
    for s in divisors:
        if tiles * s >= sms:
            return s
    return divisors[-1] if divisors else 1


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
    if triton is None:
        raise RuntimeError("the MXFP8 GEMM needs the triton package")
    m, n, kg = check_operands(x8, xs, w8, ws, groups)
    if quantize_out and n % MX_BLOCK:
        raise ValueError(f"quantize_out needs N ({n}) to be a multiple of {MX_BLOCK}")
    if x8.stride(-1) != 1 or w8.stride(-1) != 1 or xs.stride(-1) != 1 or ws.stride(-1) != 1:
        raise ValueError("x8, xs, w8 and ws must be contiguous in K")
    xs, ws = _bytes(xs), _bytes(ws)
    sms = _sm_count(x8.device.index or 0) if x8.is_cuda else 132
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


def mxfp8_linear(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype | None = None,
                 ) -> torch.Tensor:
    """x [..., K] → [..., N]: the fused MXFP8 activation quantization, then the MXFP8 GEMM."""
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    lead, k = x.shape[:-1], x.shape[-1]
    x8, xs = quantize_mxfp8_triton(x.reshape(-1, k))
    return mxfp8_gemm(x8, xs, w8, ws, out_dtype=out_dtype or x.dtype).reshape(*lead, w8.shape[0])


__all__ = [
    "check_operands",
    "default_config",
    "mxfp8_gemm",
    "mxfp8_gemm_reference",
    "mxfp8_linear",
    "split_k_for",
    "split_sum",
]
