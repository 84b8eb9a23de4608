"""Fused MXFP4 routed experts in Triton: W4A8 (e4m3 MMA, SM90) and W4A16 (bf16 MMA, any GPU).

Same contract as ``kernels.mxfp4_moe.moe_mxfp4_reference`` (its ``w4a8`` / ``w4a16`` modes);
graph-safe: the token-slots are sorted into BLOCK_M-aligned per-expert blocks on the device by
``kernels.moe_triton.align_slots_to_blocks`` (fixed-shape metadata, no host sync), then

1. (W4A8) x is quantized per token per 128 columns to e4m3 (one fp32 scale per span), written
   in *paired* column order (each span's even columns, then its odd ones); W4A16 pairs x's bf16
   columns with one copy. The GEMMs gather rows by token, so x is quantized once per token.
2. gate/up GEMM: per K span of 128 the program loads the packed bytes [BLOCK_N, 64] of the gate
   and of the up rows and their four E8M0 bytes, turns the low nibbles into the operand for the
   span's even columns and the high nibbles into the one for its odd columns (two K = 64 dots
   chained into one fp32 partial, so no nibble interleaving), and, for W4A8, promotes that
   partial once: ``acc += p · sa[row] · 2^(s_max[col] − 127)``. Epilogue: V4.1's clamped SwiGLU,
   times the slot's routing weight, then (W4A8) quantized per row per 128 in the same integer
   RNE as the reference (one program owns one 128-column span: BLOCK_N = 128), or rounded to
   bf16; stored in paired order so the down GEMM reads it like x.
3. down GEMM, same loop over I, y rounded to bf16 into the slot's row of [T·k, D].
4. ``kernels.moe_triton``'s per-token sum of the k rows (fp32 out, deterministic).

Nibble → operand in registers. W4A8, ``convert="lut"`` (default): the fold table row
``min(s_max − s_i, 13)`` of ``kernels.mxfp4_moe.fold_lut`` (the e4m3 bytes of the 8 magnitudes
at that shift, the reference's rounding) is looked up by PRMT, 4 packed bytes per inline-PTX call
(``kernels.mxfp4_moe.fold_bytes_lut`` is its torch mirror; integer shifts under the interpreter).
``convert="fp16"``: ``(c & 7) << 9 | (c & 8) << 12`` is the fp16 of code c times 2^−14, times
the fp16 ``2^(14 + shift)``, ``cvt.rn`` to e4m3. W4A16 widens that fp16 to fp32, multiplies by
``2^(s_i − 113)`` and converts to bf16 (exact for every scale byte ≤ 240).

Split-K and the unfused gate/up epilogue (``MXFP4MoEConfig``) write fp32 partials that fixed-order
kernels sum: results do not depend on scheduling.
"""

from __future__ import annotations

from dataclasses import replace, dataclass

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.moe_triton import align_slots_to_blocks
from kernels.mxfp4_moe import SPAN, check_mxfp4_experts, fold_lut, pair_columns

try:
    import triton
    import triton.language as tl

    from kernels.moe_triton import _sum_slots_kernel, _tile
    from kernels.mxfp8_quant_triton import e4m3_rne_bits, round_to_bf16
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

MODES = ("w4a8", "w4a16")


CONVERTS = ("lut", "fp16")


@dataclass(frozen=True)
class MXFP4MoEConfig:
    """Tiles of the two GEMMs. ``split_k`` > 1 splits the K loop of gate/up (``split_k_down``:
    of down) over that many programs writing fp32 partials, summed in a fixed order after.
    The gate/up epilogue is fused (SwiGLU, routing weight, W4A8 quantization in the GEMM) when
    ``split_k`` is 1 and, for W4A8, ``block_n`` is one 128-column span; otherwise the GEMM
    stores fp32 gate/up partials and ``_finish_gate_up_kernel`` applies it. ``convert``: W4A8's
    code → e4m3 step, ``lut`` (fold tables, PRMT) or ``fp16`` (fp16 multiply + convert)."""

    block_m: int = 16
    block_n: int = 128  # gate/up: intermediate columns per program
    block_n_down: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    split_k_down: int = 1
    convert: str = "lut"


# (max average rows per local expert, config). Decode reads weights: small M, many programs;
# prefill is bound by the MMA and the code conversion: larger M per converted weight tile.
# W4A16: the first choices (offline sm_90 compiles, Triton 3.6; registers and stacks in
# benchmarks/KERNEL_NOTES.md), which the H200 sweep kept. W4A8: the sweep's fastest correct tiles
# at V4.1-Flash shapes (T = 1, 16, 256: 16x64 tiles, 4 warps, split-K 2/2; T = 8192: 128x64
# gate/up, 128-column down); the 32-row middle row is unmeasured.
CONFIG_TABLE = (
    (16, MXFP4MoEConfig(16, 128, 128, 8, 8, 4)),
    (48, MXFP4MoEConfig(32, 128, 128, 8, 8, 4)),
    (None, MXFP4MoEConfig(64, 64, 128, 8, 8, 3)),
)
CONFIG_TABLE_A8 = (
    (16, MXFP4MoEConfig(16, 64, 64, 8, 4, 4, split_k=2, split_k_down=2)),
    (48, MXFP4MoEConfig(32, 128, 128, 8, 8, 4)),
    (None, MXFP4MoEConfig(128, 64, 128, 8, 8, 3)),
)
# W4A16 (max experts in use = min(T·k, E_local), split_k, split_k_down): at batch 1 the 6 experts
# give only 108 gate/up and 240 down programs of 16 rows for 132 SMs.
SPLIT_TABLE = ((8, 4, 2), (16, 2, 1), (None, 1, 1))


def default_config(num_slots: int, n_local: int, a8: bool = True) -> MXFP4MoEConfig:
    rows = num_slots / max(n_local, 1)
    if a8:
        return next(c for limit, c in CONFIG_TABLE_A8 if limit is None or rows <= limit)
    cfg = next(c for limit, c in CONFIG_TABLE if limit is None or rows <= limit)
    used = min(num_slots, n_local)
    _, split, split_down = next(r for r in SPLIT_TABLE if r[0] is None or used <= r[0])
    return replace(cfg, split_k=split, split_k_down=split_down)


def fused_gate_up(cfg: MXFP4MoEConfig, a8: bool) -> bool:
    """Whether the gate/up GEMM applies its epilogue itself (else fp32 partials + finisher)."""
    return cfg.split_k == 1 and (not a8 or cfg.block_n == SPAN)




if triton is not None:

    # PTX of the LUT conversion, 4 packed bytes at a time (see kernels.mxfp4_moe.fold_bytes_lut,
    # its torch mirror): $0/$1 the e4m3 of the low/high nibbles, $2 the bytes, $3 and $7 the fold
    # table words of the first of the 4 elements (all 4 share a 32-group: the bytes of one
    # row-group are contiguous per thread, 16-byte loads).
    _LUT_ASM = tl.constexpr("""
    {
    .reg .b32 s, a, b, t;
    and.b32 s, $2, 0x77777777;
    prmt.b32 a, $3, $7, s;
    shr.u32 s, s, 16;
    prmt.b32 b, $3, $7, s;
    prmt.b32 $0, a, b, 0x6420;
    prmt.b32 $1, a, b, 0x7531;
    shl.b32 t, $2, 4;
    and.b32 t, t, 0x80808080;
    or.b32 $0, $0, t;
    and.b32 t, $2, 0x80808080;
    or.b32 $1, $1, t;
    }
    """)

    @triton.jit
    def _e2m1_fp16(code):
        """int32 e2m1 codes 0..15 → fp16 values times 2^-14 (exact)."""
        bits = ((code & 7) << 9) | ((code & 8) << 12)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True)

    @triton.jit
    def _load_span(W, S, rn, n_ok, kb, stride_wn, stride_sn, BLOCK_N: tl.constexpr):
        """Packed bytes [4 groups, 16, BLOCK_N] (int8, 16 contiguous bytes per group-row) and
        E8M0 bytes [4, BLOCK_N] (int32) of span kb."""
        g = tl.arange(0, 4)
        j = tl.arange(0, 16)
        w_ptr = W + rn.to(tl.int64)[None, None, :] * stride_wn + kb * 64 + g[:, None, None] * 16 + j[None, :, None]
        b = tl.load(w_ptr, mask=n_ok[None, None, :], other=0)
        s_ptr = S + rn.to(tl.int64)[None, :] * stride_sn + kb * 4 + g[:, None]
        s = tl.load(s_ptr, mask=n_ok[None, :], other=0).to(tl.int32) & 0xFF
        return b, s

    @triton.jit
    def _lut_byte(code, tlo, thi):
        """e4m3 byte of e2m1 ``code`` (int32 0..15) from a fold table row (interpreter path)."""
        mag = code & 7
        word = tl.where(mag < 4, tlo, thi)
        return ((word >> ((mag & 3) * 8)) & 0xFF) | ((code & 8) << 4)

    @triton.jit
    def _fold_e4m3(b, s, LUT, BLOCK_N: tl.constexpr, CONVERT: tl.constexpr):
        """→ (even-column e4m3 [64, N], odd-column e4m3 [64, N], span scale fp32 [N]).

        CONVERT 0: fp16 multiply by 2^(14+shift) and ``cvt.rn`` to e4m3. 1: fold tables via
        PRMT (inline PTX, GPU). 2: the same tables in plain integer ops (interpreter)."""
        smax = tl.max(s, 0)
        if CONVERT == 0:
            bi = b.to(tl.int32) & 0xFF
            shift = tl.maximum(s - smax[None, :], -14)
            f = ((29 + shift) << 10).to(tl.uint16).to(tl.float16, bitcast=True)[:, None, :]  # 2^(14+shift)
            lo = (_e2m1_fp16(bi & 15) * f).to(tl.float8e4nv)
            hi = (_e2m1_fp16(bi >> 4) * f).to(tl.float8e4nv)
        else:
            row = tl.minimum(smax[None, :] - s, 13) * 2
            tlo = tl.load(LUT + row)[:, None, :]
            thi = tl.load(LUT + row + 1)[:, None, :]
            if CONVERT == 1:
                lo8, hi8 = tl.inline_asm_elementwise(
                    _LUT_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [b, tlo, thi], dtype=(tl.uint8, tl.uint8),
                    is_pure=True, pack=4)
            else:
                bi = b.to(tl.int32) & 0xFF
                lo8 = _lut_byte(bi & 15, tlo, thi).to(tl.uint8)
                hi8 = _lut_byte(bi >> 4, tlo, thi).to(tl.uint8)
            lo = lo8.to(tl.float8e4nv, bitcast=True)
            hi = hi8.to(tl.float8e4nv, bitcast=True)
        scale = (smax << 23).to(tl.float32, bitcast=True)  # 2^(smax-127)
        return tl.reshape(lo, (64, BLOCK_N)), tl.reshape(hi, (64, BLOCK_N)), scale

    @triton.jit
    def _fold_bf16(b, s, BLOCK_N: tl.constexpr):
        """→ (even-column bf16 [64, N], odd-column bf16 [64, N]), scales applied."""
        bi = b.to(tl.int32) & 0xFF
        f = ((tl.minimum(s, 240) + 14) << 23).to(tl.float32, bitcast=True)[:, None, :]  # 2^(s-113)
        lo = (_e2m1_fp16(bi & 15).to(tl.float32) * f).to(tl.bfloat16)
        hi = (_e2m1_fp16(bi >> 4).to(tl.float32) * f).to(tl.bfloat16)
        return tl.reshape(lo, (64, BLOCK_N)), tl.reshape(hi, (64, BLOCK_N))

    @triton.jit
    def _span_product(acc, a_lo, a_hi, sa, W, S, LUT, rn, n_ok, kb, stride_wn, stride_sn,
                      A8: tl.constexpr, BLOCK_N: tl.constexpr, CONVERT: tl.constexpr):
        """acc + the span kb's contribution of one weight matrix."""
        b, s = _load_span(W, S, rn, n_ok, kb, stride_wn, stride_sn, BLOCK_N)
        if A8:
            w_lo, w_hi, ws = _fold_e4m3(b, s, LUT, BLOCK_N, CONVERT)
            p = tl.dot(a_lo, w_lo)
            p = tl.dot(a_hi, w_hi, p)
            acc += p * sa[:, None] * ws[None, :]
        else:
            w_lo, w_hi = _fold_bf16(b, s, BLOCK_N)
            acc = tl.dot(a_lo, w_lo, acc)
            acc = tl.dot(a_hi, w_hi, acc)
        return acc

    @triton.jit
    def _paired(c):
        """Natural column c → its position in paired order."""
        return (c // 128) * 128 + (c % 2) * 64 + (c % 128) // 2

    @triton.jit
    def _quantize_rows(h, UE8M0: tl.constexpr):
        """fp32 [M, 128] → (e4m3 bytes int32, fp32 scale [M]): amax/448, IEEE division, RNE."""
        scale = tl.maximum(tl.max(tl.abs(h), 1), 1e-12) / 448.0
        if UE8M0:  # round up to a power of two from the bits (kernels.fp8.pow2_ceil)
            bits = scale.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (e << 23).to(tl.float32, bitcast=True)
        return e4m3_rne_bits(tl.clamp(tl.math.div_rn(h, scale[:, None]), -448.0, 448.0)), scale

    @triton.jit
    def _quant_pairs_kernel(X, Y, S, K, stride_xm, stride_ym, stride_sm, UE8M0: tl.constexpr,
                            SPANS: tl.constexpr):
        """Y = e4m3(X / scale) per row per 128 columns, in paired order; S the fp32 scales."""
        _quant_pairs(X, Y, S, tl.program_id(0).to(tl.int64), tl.program_id(1), K, stride_xm, stride_ym, stride_sm,
                     UE8M0, SPANS)

    @triton.jit
    def _quant_pairs(X, Y, S, row, part, K, stride_xm, stride_ym, stride_sm, UE8M0: tl.constexpr,
                     SPANS: tl.constexpr):
        """Spans part·SPANS … of one row of ``_quant_pairs_kernel``."""
        spans = part * SPANS + tl.arange(0, SPANS)
        c = spans[:, None] * 128 + tl.arange(0, 128)[None, :]
        ok = c < K
        x = tl.load(X + row * stride_xm + c, mask=ok, other=0.0).to(tl.float32)
        q, scale = _quantize_rows(x, UE8M0)
        tl.store(Y + row * stride_ym + _paired(c), q.to(tl.uint8), mask=ok)
        tl.store(S + row * stride_sm + spans, scale, mask=spans < K // 128)

    @triton.jit
    def _swiglu_store(acc_g, acc_u, rows, slot, row_ok, rn, n_ok, pid_n, TOPK_W, H, SH, limit,
                      stride_hm, stride_shm, A8: tl.constexpr, CLAMP: tl.constexpr, UE8M0: tl.constexpr):
        """H[rows] = weight · swiglu(gate, up) in paired order (W4A8: quantized, one 128-span)."""
        if CLAMP:
            acc_g = tl.minimum(acc_g, limit)
            acc_u = tl.clamp(acc_u, -limit, limit)
        wt = tl.load(TOPK_W + slot, mask=row_ok, other=0.0)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u * wt[:, None]
        # Every row of a used block is written (padding rows are zeros): the down GEMM reads them.
        h_ptr = H + rows.to(tl.int64)[:, None] * stride_hm + _paired(rn)[None, :]
        if A8:  # the columns rn are one whole 128-span
            q, scale = _quantize_rows(h, UE8M0)
            tl.store(h_ptr, q.to(tl.uint8), mask=n_ok[None, :])
            tl.store(SH + rows.to(tl.int64) * stride_shm + pid_n, scale)
        else:
            tl.store(h_ptr, round_to_bf16(h).to(tl.bfloat16), mask=n_ok[None, :])

    @triton.jit
    def _gate_up_kernel(
        A, SA, W, SW, H, SH, P, LUT, SLOTS, BLOCK_EXPERT, TOPK_W,
        n_slots, K, inter, top_k, grid_m, limit, split_k,
        stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_hm, stride_shm,
        stride_ps, stride_pm,
        A8: tl.constexpr, CLAMP: tl.constexpr, UE8M0: tl.constexpr, FUSED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, CONVERT: tl.constexpr,
    ):
        """H[r] = weight · swiglu(gateₑ · x[tok(r)], upₑ · x[tok(r)]) for one block (expert e);
        not FUSED: the fp32 gate and up products of K split program_id(1) into P instead."""
        grid_n = tl.cdiv(inter, BLOCK_N)
        pid_m, pid_n = _tile(tl.program_id(0), grid_m, grid_n, GROUP_M)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        spans = K // 128
        per_split = tl.cdiv(spans, split_k)
        kb0 = tl.program_id(1) * per_split
        kb1 = tl.minimum(kb0 + per_split, spans)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(SLOTS + rows)
        row_ok = slot < n_slots
        tok = (slot // top_k).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < inter
        a_ptr = A + tok[:, None] * stride_am + kb0 * 128 + tl.arange(0, 64)[None, :]
        wg = W + e.to(tl.int64) * stride_we
        wu = wg + inter * stride_wn
        sg = SW + e.to(tl.int64) * stride_swe
        su = sg + inter * stride_swn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sa = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kb in range(kb0, kb1):
            a_lo = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            a_hi = tl.load(a_ptr + 64, mask=row_ok[:, None], other=0.0)
            if A8:
                sa = tl.load(SA + tok * stride_sam + kb, mask=row_ok, other=0.0)
            acc_g = _span_product(acc_g, a_lo, a_hi, sa, wg, sg, LUT, rn, n_ok, kb, stride_wn, stride_swn,
                                  A8, BLOCK_N, CONVERT)
            acc_u = _span_product(acc_u, a_lo, a_hi, sa, wu, su, LUT, rn, n_ok, kb, stride_wn, stride_swn,
                                  A8, BLOCK_N, CONVERT)
            a_ptr += 128
        if FUSED:
            _swiglu_store(acc_g, acc_u, rows, slot, row_ok, rn, n_ok, pid_n, TOPK_W, H, SH, limit,
                          stride_hm, stride_shm, A8, CLAMP, UE8M0)
        else:
            p_ptr = P + tl.program_id(1) * stride_ps + rows.to(tl.int64)[:, None] * stride_pm + rn[None, :]
            ok = row_ok[:, None] & n_ok[None, :]
            tl.store(p_ptr, acc_g, mask=ok)
            tl.store(p_ptr + inter, acc_u, mask=ok)

    @triton.jit
    def _finish_gate_up_kernel(
        P, H, SH, SLOTS, TOPK_W, n_slots, inter, split_k, limit, stride_ps, stride_pm, stride_hm, stride_shm,
        A8: tl.constexpr, CLAMP: tl.constexpr, UE8M0: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """The gate/up epilogue on the fp32 partials P [split, rows, 2I] (summed in split order),
        BLOCK_M rows by one 128-column span per program."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(SLOTS + rows)
        row_ok = slot < n_slots
        rn = tl.program_id(1) * 128 + tl.arange(0, 128)
        n_ok = rn < inter
        p_ptr = P + rows.to(tl.int64)[:, None] * stride_pm + rn[None, :]
        ok = row_ok[:, None] & n_ok[None, :]
        acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        for s in range(0, split_k):
            acc_g += tl.load(p_ptr, mask=ok, other=0.0)
            acc_u += tl.load(p_ptr + inter, mask=ok, other=0.0)
            p_ptr += stride_ps
        _swiglu_store(acc_g, acc_u, rows, slot, row_ok, rn, n_ok, tl.program_id(1), TOPK_W, H, SH, limit,
                      stride_hm, stride_shm, A8, CLAMP, UE8M0)

    @triton.jit
    def _down_kernel(
        A, SA, W, SW, Y, LUT, SLOTS, BLOCK_EXPERT,
        n_slots, N, K, grid_m, split_k,
        stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_ys, stride_ym,
        A8: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr, CONVERT: tl.constexpr,
    ):
        """Y[slot(r)] = bf16(downₑ · H[r]) for the real rows r of one block; SPLIT: the fp32
        product of K split program_id(1) into Y[split, slot(r)]."""
        grid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _tile(tl.program_id(0), grid_m, grid_n, GROUP_M)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        spans = K // 128
        per_split = tl.cdiv(spans, split_k)
        kb0 = tl.program_id(1) * per_split
        kb1 = tl.minimum(kb0 + per_split, spans)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        slot = tl.load(SLOTS + rows)
        row_ok = slot < n_slots
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        a_ptr = A + rows[:, None] * stride_am + kb0 * 128 + tl.arange(0, 64)[None, :]
        w = W + e.to(tl.int64) * stride_we
        s = SW + e.to(tl.int64) * stride_swe
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sa = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kb in range(kb0, kb1):
            a_lo = tl.load(a_ptr)
            a_hi = tl.load(a_ptr + 64)
            if A8:
                sa = tl.load(SA + rows * stride_sam + kb)
            acc = _span_product(acc, a_lo, a_hi, sa, w, s, LUT, rn, n_ok, kb, stride_wn, stride_swn,
                                A8, BLOCK_N, CONVERT)
            a_ptr += 128
        y_ptr = Y + slot.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        ok = row_ok[:, None] & n_ok[None, :]
        if SPLIT:
            tl.store(y_ptr + tl.program_id(1) * stride_ys, acc, mask=ok)
        else:
            tl.store(y_ptr, round_to_bf16(acc).to(tl.bfloat16), mask=ok)

    @triton.jit
    def _sum_split_slots_kernel(
        Y, IDS, OUT, N, top_k, expert_offset, n_local, split_k, stride_ys, stride_ym, stride_om,
        BLOCK_N: tl.constexpr,
    ):
        """OUT[t] = Σ_j bf16(Σ_s Y[s, t·k + j]) over the choices j of local experts, in order."""
        t = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(0, top_k):
            e = tl.load(IDS + t * top_k + j) - expert_offset
            own = (e >= 0) & (e < n_local)
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in range(0, split_k):
                y += tl.load(Y + s * stride_ys + (t * top_k + j) * stride_ym + rn, mask=n_ok & own, other=0.0)
            acc += round_to_bf16(y)
        tl.store(OUT + t * stride_om + rn, acc, mask=n_ok)


def quantize_paired_triton(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (K % 128 == 0) → (e4m3 [T, K] in paired order, fp32 scales [T, K/128]); equals
    ``pair_columns`` of ``kernels.fp8.quantize_per_token_group(x, 128)`` byte for byte."""
    t, k = x.shape
    y = torch.empty(t, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(t, k // SPAN, dtype=torch.float32, device=x.device)
    if t:
        spans = quant_spans_per_program(k)
        xc = x if x.stride(-1) == 1 else x.contiguous()
        _quant_pairs_kernel[(t, triton.cdiv(k // SPAN, spans))](
            xc, y, s, k, xc.stride(0), y.stride(0), s.stride(0), UE8M0=ue8m0, SPANS=spans, num_warps=4)
    return y.view(FP8_DTYPE), s


def quant_spans_per_program(k: int) -> int:
    """128-column spans one program of the paired quantization handles."""
    return min(8, triton.next_power_of_2(k // SPAN))


def moe_mxfp4_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    expert_offset: int = 0,
    mode: str = "w4a8",
    config=None,
    ue8m0: bool = False,
) -> torch.Tensor:
    """Routed MXFP4 experts: x [T, D] (bf16/fp16/fp32), w13 [E, 2I, D/2] + [E, 2I, D/32],
    w2 [E, D, I/2] + [E, D, I/32] (int8 + E8M0/uint8) → fp32 [T, D]. D and I multiples of 128.

    The token-row kernels: ``config`` an ``MXFP4MoEConfig`` or None (:func:`default_config`).
    ``kernels.mxfp4_experts.moe_mxfp4_kernels`` picks between these and the W4A8 swap-AB decode
    kernels (kernels/mxfp4_moe_decode.py)."""
    if mode not in MODES:
        raise ValueError(f"unknown MXFP4 MoE mode {mode!r}; one of {', '.join(MODES)}")
    n_local, d, inter = check_kernel_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    t, k = topk_ids.shape
    n_slots = t * k
    dev = x.device
    out = torch.empty(t, d, dtype=torch.float32, device=dev)
    if t == 0:
        return out
    a8 = mode == "w4a8"
    cfg = config or default_config(n_slots, n_local, a8)
    if cfg.convert not in CONVERTS or cfg.split_k < 1 or cfg.split_k_down < 1:
        raise ValueError(f"bad MXFP4 MoE config {cfg}: convert one of {', '.join(CONVERTS)}, split_k >= 1")
    fused = fused_gate_up(cfg, a8)
    if not fused and SPAN % cfg.block_n:
        raise ValueError(f"a split or unfused gate/up GEMM needs block_n dividing {SPAN}, got {cfg.block_n}")
    slots, block_expert = align_slots_to_blocks(topk_ids, n_local, expert_offset, cfg.block_m)
    rows, grid_m = slots.shape[0], block_expert.shape[0]
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    # CONVERT: 0 fp16 multiply, 1 fold tables by PRMT (GPU), 2 the tables in integer ops (interpreter)
    convert = 0 if cfg.convert == "fp16" else (1 if dev.type == "cuda" else 2)
    lut = _lut(dev)
    if a8:
        a, sa = quantize_paired_triton(x, ue8m0)
        hid = torch.empty(rows, inter, dtype=torch.uint8, device=dev)
        sh = torch.empty(rows, inter // SPAN, dtype=torch.float32, device=dev)
    else:
        a = pair_columns(x.to(torch.bfloat16))
        sa = a  # unused scale pointers
        hid = torch.empty(rows, inter, dtype=torch.bfloat16, device=dev)
        sh = hid
    wts = topk_weights.reshape(-1).float().contiguous()
    part = hid if fused else torch.empty(cfg.split_k, rows, 2 * inter, dtype=torch.float32, device=dev)
    _gate_up_kernel[(grid_m * triton.cdiv(inter, cfg.block_n), cfg.split_k)](
        a, sa, w13, s13, hid, sh, part, lut, slots, block_expert, wts,
        n_slots, d, inter, k, grid_m, float(limit), cfg.split_k,
        a.stride(0), sa.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        hid.stride(0), sh.stride(0), part.stride(0) if not fused else 0, part.stride(-2) if not fused else 0,
        A8=a8, CLAMP=limit > 0, UE8M0=ue8m0, FUSED=fused, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m, CONVERT=convert, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fused:
        finish_gate_up(part, hid, sh, slots, wts, n_slots, limit, a8, ue8m0)
    h = hid.view(FP8_DTYPE) if a8 else hid
    split = cfg.split_k_down > 1
    y = torch.empty(cfg.split_k_down, n_slots, d, dtype=torch.float32 if split else torch.bfloat16, device=dev)
    _down_kernel[(grid_m * triton.cdiv(d, cfg.block_n_down), cfg.split_k_down)](
        h, sh, w2, s2, y, lut, slots, block_expert,
        n_slots, d, inter, grid_m, cfg.split_k_down,
        h.stride(0), sh.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), y.stride(1),
        A8=a8, SPLIT=split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, GROUP_M=cfg.group_m, CONVERT=convert,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    sum_slots(y, topk_ids, out, expert_offset, n_local)
    return out


def check_kernel_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids) -> tuple[int, int, int]:
    """(local experts, D, I) after the checks every MXFP4 MoE kernel path needs; one line naming
    the tensor otherwise."""
    if triton is None:
        raise RuntimeError("the MXFP4 MoE kernels need the triton package")
    n_local, d, inter = check_mxfp4_experts(x, w13, w13_scale, w2, w2_scale)
    if d % SPAN or inter % SPAN:
        raise ValueError(f"the MXFP4 kernels need D ({d}) and I ({inter}) to be multiples of {SPAN}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={x.shape[0]}, k]")
    for name, w in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim")
    return n_local, d, inter


def finish_gate_up(part, hid, sh, slots, wts, n_slots: int, limit: float, a8: bool, ue8m0: bool) -> None:
    """Split-K gate/up partials [splits, rows, 2I] → SwiGLU (clamped), routing weight, and h
    (e4m3 + scales for W4A8) in ``hid`` / ``sh``."""
    rows, inter = hid.shape
    fin_m = 16
    _finish_gate_up_kernel[(rows // fin_m, inter // SPAN)](
        part, hid, sh, slots, wts, n_slots, inter, part.shape[0], float(limit),
        part.stride(0), part.stride(1), hid.stride(0), sh.stride(0),
        A8=a8, CLAMP=limit > 0, UE8M0=ue8m0, BLOCK_M=fin_m, num_warps=4)


def sum_slots(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, expert_offset: int, n_local: int) -> None:
    """out [T, D] = each token's sum over its k slots of the down projections y [splits, T·k, D]
    (split partials summed first); slots of other ranks' experts add nothing."""
    t, k = topk_ids.shape
    d, splits = out.shape[1], y.shape[0]
    sum_block = min(1024, triton.next_power_of_2(d))
    ids = topk_ids.contiguous()
    if splits > 1:
        _sum_split_slots_kernel[(t, triton.cdiv(d, sum_block))](
            y, ids, out, d, k, expert_offset, n_local, splits, y.stride(0), y.stride(1), out.stride(0),
            BLOCK_N=sum_block, num_warps=4)
    else:
        _sum_slots_kernel[(t, triton.cdiv(d, sum_block))](
            y[0], ids, out, d, k, expert_offset, n_local, y.stride(1), out.stride(0), BLOCK_N=sum_block, num_warps=4)


_LUTS: dict = {}


def _lut(device: torch.device) -> torch.Tensor:
    """The fold tables (``kernels.mxfp4_moe.fold_lut``), one copy per device."""
    key = str(device)
    if key not in _LUTS:
        _LUTS[key] = fold_lut(device).reshape(-1).contiguous()
    return _LUTS[key]


__all__ = ["CONFIG_TABLE", "CONFIG_TABLE_A8", "CONVERTS", "MODES", "MXFP4MoEConfig", "SPLIT_TABLE", "default_config",
           "fused_gate_up", "moe_mxfp4_triton", "quantize_paired_triton"]
