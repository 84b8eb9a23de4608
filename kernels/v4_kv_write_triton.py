"""Fused DeepSeek-V4 / V4.1 decode KV writes (Triton): one launch per pool write, one program per request.

:func:`write_rows_triton` — a window row, V4.1's ratio-1 entry or its indexer key: load the
raw row, RMSNorm (V4: weight in float32; V4.1: cast first), RoPE on the trailing dims,
encode to the pool's format and store it at its ring row, or at its paged row when the token
closes a window (else nothing). :func:`compress_step_triton` — a compressor: store the new raw
kv / gate rows in their rings, and where the token closes a window, pool the window's slots
(float32 softmax per channel over the m, or V4 CSA's 2m, slots of gate + position bias; the
new token's slot read from the input, not the ring it was just written to), then the same
norm / RoPE / encode / store. Tokens that close nothing skip the pooling (masked loads), so
HCA's 128-slot windows cost their reads once per 128 steps.

Each program holds its row as (even, odd) dims in [blocks, block/2] tiles: the RoPE pairs
are (even, odd) and every quantization block is a tile row. Encodings (``FORMATS``, the
pools' ``RowCodec.format``): ``plain`` (the model dtype), V4.1's fake-quantized values
(``fake_v41_*``) and records (``v41_window`` 528 B, ``v41_entry`` 288 B, ``v41_key`` 68 B at
d = 512 / 128), V4's MODEL1 row (``v4_row``, 584 B) and index key (``v4_key``). Every
rounding is the reference's (kernels/v4_kv_write.py over kernels/v4_cache_formats.py): IEEE
division and square root, no FMA contraction, bf16 and e4m3 rounding on the integer bits
(kernels/mxfp8_quant_triton.py), e2m1 ties-to-even by the 2^23 trick, scales times fp32(1/448)
or fp32(1/6) (the product CUDA torch computes for a division by a Python scalar), and the
softmax's exp CUDA's ``expf`` on the GPU (libdevice, as torch's softmax; ``tl.exp`` under the
interpreter). Where the norm's and the softmax's float32 sums see the same values in any
order, the records equal the reference's byte for byte; otherwise only those sums differ, in
the last fp32 bit. Each program touches only its request's ring rows and target row, so the
programs of a launch commute (the test replays them in reversed order).

Fixed launch shapes (B programs), masks instead of branches, no host sync: CUDA-graph safe.
"""

from __future__ import annotations

import os

import torch

from kernels.mxfp8_quant_triton import e4m3_rne_bits, pow2_from_byte, quantize_blocks, round_to_bf16, ue8m0_byte
from kernels.v4_kv_write import RowNorm, RowStore, RowTarget

try:  # the CPU reference does not need Triton
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

# encoding name → (kernel code, quantization block; 0: set from the row, see _layout)
FORMATS = {
    "plain": (0, 0),
    "fake_v41_window": (1, 32), "fake_v41_entry": (2, 16), "fake_v41_key": (3, 32),
    "v41_window": (4, 32), "v41_entry": (5, 16), "v41_key": (6, 32),
    "v4_row": (7, 0), "v4_key": (8, 0),
}
ROW_DTYPES = (torch.bfloat16, torch.float32)


def _layout(fmt: str, dim: int, rope_dims: int) -> tuple[int, int]:
    """(kernel code, block) of encoding ``fmt`` for rows of ``dim`` values."""
    code, block = FORMATS[fmt]
    if fmt == "v4_row":
        block = min(dim - rope_dims, 64)
    elif block == 0 or dim % block:  # plain / one scale per key; fake quant leaves such widths unchanged
        code, block = (0 if code in (1, 2, 3) else code), dim
    return code, block


def supports(x: torch.Tensor, store: RowStore) -> bool:
    """Whether the fused kernels take rows ``x`` into ``store``."""
    return (triton is not None and x.is_cuda and store.flat.is_cuda and x.dtype in ROW_DTYPES
            and store.fmt in FORMATS and store.flat.is_contiguous())


if triton is not None:

    @triton.jit
    def _round(x, BF16: tl.constexpr):
        if BF16:
            return round_to_bf16(x)
        return x

    @triton.jit
    def _e4m3_value(bits):
        """fp32 value of e4m3 bytes (int32 0..255, never the NaN code)."""
        e = (bits >> 3) & 0xF
        m = bits & 0x7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m · 2^-9
        return tl.where((bits & 0x80) != 0, -v, v)

    @triton.jit
    def _exp(x, PRECISE: tl.constexpr):
        """exp of fp32 x: CUDA's ``expf`` (libdevice, what torch's softmax calls) when PRECISE;
        else ``tl.exp`` (an ``ex2.approx`` on the GPU; the interpreter has no libdevice)."""
        if PRECISE:
            return libdevice.exp(x)
        return tl.exp(x)

    @triton.jit
    def _fp4_code(y):
        """e2m1 code (int32 0..15) of fp32 ``y`` in [-6, 6], ties to the even code."""
        a = tl.minimum(tl.abs(y), 6.0)
        lo = (a * 2.0 + 8388608.0) - 8388608.0  # round half to even below 2^22
        mid = 4.0 + ((a - 2.0 + 8388608.0) - 8388608.0)
        hi = 6.0 + (((a - 4.0) * 0.5 + 8388608.0) - 8388608.0)
        code = tl.where(a < 2.0, lo, tl.where(a < 4.0, mid, hi)).to(tl.int32)
        return code + 8 * ((y < 0) & (code > 0)).to(tl.int32)

    @triton.jit
    def _fp4_value(code):
        c = code & 7
        v = tl.where(c < 4, c.to(tl.float32) * 0.5, tl.where(c < 6, (c - 2).to(tl.float32), (2 * c - 8).to(tl.float32)))
        return tl.where((code & 8) != 0, -v, v)

    @triton.jit
    def _store_pair(DST, e, o, col, mask):
        tl.store(DST + col, e.to(DST.dtype.element_ty), mask=mask)
        tl.store(DST + col + 1, o.to(DST.dtype.element_ty), mask=mask)

    @triton.jit
    def _bf16_bytes(DST, v, off, mask):
        bits = round_to_bf16(v).to(tl.int32, bitcast=True) >> 16
        tl.store(DST + off, (bits & 0xFF).to(tl.uint8), mask=mask)
        tl.store(DST + off + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=mask)

    @triton.jit
    def _encode_store(ve, vo, col, ok, DST, write, D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr,
                      BLOCK: tl.constexpr, NB: tl.constexpr, WIDTH: tl.constexpr):
        """Encode the row (even / odd values [NB, BH], fp32) as FMT and store it at DST (its row)."""
        mask = ok & write
        blk = tl.arange(0, NB)
        amax = tl.max(tl.maximum(tl.abs(ve), tl.abs(vo)), 1)  # [NB]
        if FMT == 0:
            _store_pair(DST, ve, vo, col, mask)
        elif FMT == 1 or FMT == 4:  # e4m3, ue8m0 per 32
            byte = ue8m0_byte(amax)
            inv = pow2_from_byte(254 - byte)[:, None]
            qe, qo = quantize_blocks(ve, inv), quantize_blocks(vo, inv)
            if FMT == 1:
                sc = pow2_from_byte(byte)[:, None]
                _store_pair(DST, _e4m3_value(qe) * sc, _e4m3_value(qo) * sc, col, mask)
            else:
                _store_pair(DST, qe.to(tl.uint8), qo.to(tl.uint8), col, mask)
                tl.store(DST + D + blk, byte.to(tl.uint8), mask=(blk < D // BLOCK) & write)
        elif FMT == 7:  # V4 MODEL1 row: e4m3 no-RoPE dims per tile, bf16 RoPE dims, scales, zero pad
            NOPE: tl.constexpr = D - ROPE
            nope = col < NOPE
            amax = tl.max(tl.where(nope, tl.maximum(tl.abs(ve), tl.abs(vo)), 0.0), 1)
            byte = ue8m0_byte(amax)
            inv = pow2_from_byte(254 - byte)[:, None]
            _store_pair(DST, quantize_blocks(ve, inv).to(tl.uint8), quantize_blocks(vo, inv).to(tl.uint8), col,
                        mask & nope)
            rope_off = NOPE + 2 * (col - NOPE)
            _bf16_bytes(DST, ve, rope_off, mask & ~nope)
            _bf16_bytes(DST, vo, rope_off + 2, mask & ~nope)
            tl.store(DST + NOPE + 2 * ROPE + blk, byte.to(tl.uint8), mask=(blk < NOPE // BLOCK) & write)
            pad = NOPE + 2 * ROPE + NOPE // BLOCK + tl.arange(0, 8)
            tl.store(DST + pad, tl.zeros([8], dtype=tl.uint8), mask=(pad < WIDTH) & write)
        elif FMT == 8:  # V4 index key: e4m3 with one fp32 scale amax · fp32(1/448)
            scale = (tl.maximum(amax, 1e-4) * 0.002232142857142857)[:, None]  # times fp32(1/448), as the reference
            scale = tl.broadcast_to(scale, ve.shape)
            qe = e4m3_rne_bits(tl.clamp(tl.math.div_rn(ve, scale), -448.0, 448.0))
            qo = e4m3_rne_bits(tl.clamp(tl.math.div_rn(vo, scale), -448.0, 448.0))
            _store_pair(DST, qe.to(tl.uint8), qo.to(tl.uint8), col, mask)
            bits = tl.max(scale, 1).to(tl.int32, bitcast=True)  # [1]
            shift = tl.arange(0, 4)
            tl.store(DST + D + shift, ((bits >> (8 * shift)) & 0xFF).to(tl.uint8), mask=(shift < 4) & write)
        else:  # e2m1 pairs: e4m3 scale per 16 (2, 5) or ue8m0 per 32 (3, 6)
            if FMT == 2 or FMT == 5:
                q = tl.maximum(amax, 0.01171875) * 0.16666666666666666  # times fp32(1/6), as the reference
                sbyte = e4m3_rne_bits(tl.minimum(q, 448.0))
                scale = _e4m3_value(sbyte)
            else:
                t = tl.maximum(amax, 7.052966104933725e-38) * 0.16666666666666666  # max(amax, 6·2^-126) · fp32(1/6)
                tb = t.to(tl.int32, bitcast=True)
                sbyte = ((tb >> 23) & 0xFF) + ((tb & 0x7FFFFF) != 0).to(tl.int32)
                scale = pow2_from_byte(sbyte)
            scale = tl.broadcast_to(scale[:, None], ve.shape)
            ce = _fp4_code(tl.clamp(tl.math.div_rn(ve, scale), -6.0, 6.0))
            co = _fp4_code(tl.clamp(tl.math.div_rn(vo, scale), -6.0, 6.0))
            if FMT == 2 or FMT == 3:
                _store_pair(DST, _fp4_value(ce) * scale, _fp4_value(co) * scale, col, mask)
            else:
                tl.store(DST + col // 2, (ce | (co << 4)).to(tl.uint8), mask=mask)
                tl.store(DST + D // 2 + blk, sbyte.to(tl.uint8), mask=(blk < D // BLOCK) & write)

    @triton.jit
    def _finish(e, o, col, ok, W, eps, CS_COS, CS_SIN, DST, LAT, write, D: tl.constexpr, ROPE: tl.constexpr,
                FMT: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, WIDTH: tl.constexpr,
                AFTER_CAST: tl.constexpr, BF16: tl.constexpr, LATENT: tl.constexpr):
        """RMSNorm → (latent) → RoPE → encode → store, for a row held as (even, odd) fp32 values."""
        ss = tl.sum(tl.sum(e * e + o * o, 1), 0)
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, D * 1.0) + eps))
        w_e = tl.load(W + col, mask=ok, other=0.0).to(tl.float32)
        w_o = tl.load(W + col + 1, mask=ok, other=0.0).to(tl.float32)
        if AFTER_CAST:
            ne, no = _round(w_e * _round(e * rstd, BF16), BF16), _round(w_o * _round(o * rstd, BF16), BF16)
        else:
            ne, no = _round(w_e * (e * rstd), BF16), _round(w_o * (o * rstd), BF16)
        if LATENT:
            _store_pair(LAT, ne, no, col, ok)
        in_rope = col >= D - ROPE
        i = tl.where(in_rope, (col - (D - ROPE)) // 2, 0)
        c = tl.load(CS_COS + i, mask=ok & in_rope, other=0.0).to(tl.float32)
        s = tl.load(CS_SIN + i, mask=ok & in_rope, other=0.0).to(tl.float32)
        ve = tl.where(in_rope, _round(ne * c - no * s, BF16), ne)
        vo = tl.where(in_rope, _round(no * c + ne * s, BF16), no)
        _encode_store(ve, vo, col, ok, DST, write, D, ROPE, FMT, BLOCK, NB, WIDTH)

    @triton.jit
    def _target_row(b, p, BASE, TABLE, stride_t, rows, ratio, RING: tl.constexpr):
        """(flat row, whether to write) of request b's new row at position p."""
        if RING:
            return tl.load(BASE + b) + p % rows, p >= 0
        index = tl.maximum((p + 1) // ratio - 1, 0)
        page = tl.load(TABLE + b * stride_t + index // rows)
        return page * rows + index % rows, (p + 1) % ratio == 0

    @triton.jit
    def _tile(D: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, BH: tl.constexpr):
        j = tl.arange(0, BH)[None, :]
        col = tl.arange(0, NB)[:, None] * BLOCK + 2 * j  # the even dim of each pair
        return col, (2 * j < BLOCK) & (col < D)

    @triton.jit
    def _write_rows_kernel(
        X, stride_x, W, eps, COS, SIN, stride_cs, POS, BASE, TABLE, stride_t, rows, ratio, DST, LAT,
        D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
        BH: tl.constexpr, WIDTH: tl.constexpr, RING: tl.constexpr, AFTER_CAST: tl.constexpr, BF16: tl.constexpr,
        LATENT: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        p = tl.load(POS + b).to(tl.int64)
        row, write = _target_row(b, p, BASE, TABLE, stride_t, rows, ratio, RING)
        col, ok = _tile(D, BLOCK, NB, BH)
        e = tl.load(X + b * stride_x + col, mask=ok, other=0.0).to(tl.float32)
        o = tl.load(X + b * stride_x + col + 1, mask=ok, other=0.0).to(tl.float32)
        _finish(e, o, col, ok, W, eps, COS + b * stride_cs, SIN + b * stride_cs, DST + row * WIDTH, LAT + b * D,
                write, D, ROPE, FMT, BLOCK, NB, WIDTH, AFTER_CAST, BF16, LATENT)

    @triton.jit
    def _slot(s, p, closes, has_prev, M: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr):
        """Slots s [SC, 1, 1] of the window ending at p: (position, channel offset, bias row, usable)."""
        NS: tl.constexpr = 2 * M if OVERLAP else M
        if OVERLAP:  # slots 0..m-1: window w-1's first half (Ca); m..2m-1: window w's second half (Cb)
            prev = s < M
            return p + 1 - 2 * M + s, tl.where(prev, 0, D), s % M, closes & (s < NS) & (has_prev | ~prev)
        return p + 1 - M + s, s * 0, s, closes & (s < NS)

    @triton.jit
    def _load_slot(NEW, RING, b, stride_new, base, pos, p, off, col, mask, R, WR: tl.constexpr):
        """The slots' raw values (even, odd) [SC, NB, BH] as fp32: the new token's from the input,
        the others from the ring."""
        row = base + ((pos % R) + R) % R
        new = pos == p
        src_new = NEW + b * stride_new + off + col
        src_ring = RING + row * WR + off + col
        e = tl.where(new, tl.load(src_new, mask=mask & new, other=0.0),
                     tl.load(src_ring, mask=mask & ~new, other=0.0)).to(tl.float32)
        o = tl.where(new, tl.load(src_new + 1, mask=mask & new, other=0.0),
                     tl.load(src_ring + 1, mask=mask & ~new, other=0.0)).to(tl.float32)
        return e, o

    @triton.jit
    def _slot_gate(GATE, GATE_RING, BIAS, b, stride_new, gbase, s, p, closes, has_prev, col, ok, R,
                   M: tl.constexpr, D: tl.constexpr, WR: tl.constexpr, OVERLAP: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
        """Gate + position bias of slots s [SC, 1, 1] ([SC, NB, BH], −inf where unusable)."""
        pos, off, brow, usable = _slot(s, p, closes, has_prev, M, D, OVERLAP)
        mask = ok & usable
        ge, go = _load_slot(GATE, GATE_RING, b, stride_new, gbase, pos, p, off, col, mask, R, WR)
        if HAS_BIAS:
            ge += tl.load(BIAS + brow * WR + off + col, mask=mask, other=0.0)
            go += tl.load(BIAS + brow * WR + off + col + 1, mask=mask, other=0.0)
        return tl.where(usable, ge, float("-inf")), tl.where(usable, go, float("-inf")), pos, off, mask

    @triton.jit
    def _compress_kernel(
        KV, GATE, stride_new, KV_RING, GATE_RING, KV_BASE, GATE_BASE, R, BIAS, W, eps, COS, SIN, stride_cs, POS,
        TABLE, stride_t, rows, DST, LAT,
        M: tl.constexpr, WR: tl.constexpr, BLOCK_W: tl.constexpr, SC: tl.constexpr, OVERLAP: tl.constexpr,
        HAS_BIAS: tl.constexpr, RAW_BF16: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr,
        BLOCK: tl.constexpr, NB: tl.constexpr, BH: tl.constexpr, WIDTH: tl.constexpr, AFTER_CAST: tl.constexpr,
        BF16: tl.constexpr, LATENT: tl.constexpr, PRECISE_EXP: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        p = tl.load(POS + b).to(tl.int64)
        kv_base = tl.load(KV_BASE + b)
        gate_base = tl.load(GATE_BASE + b)
        # the new raw rows into their rings (the pooling below reads the new slot from the input)
        for w0 in tl.static_range(0, WR, BLOCK_W):
            cw = w0 + tl.arange(0, BLOCK_W)
            cm = cw < WR
            tl.store(KV_RING + (kv_base + p % R) * WR + cw, tl.load(KV + b * stride_new + cw, mask=cm), mask=cm)
            tl.store(GATE_RING + (gate_base + p % R) * WR + cw, tl.load(GATE + b * stride_new + cw, mask=cm),
                     mask=cm)
        closes = (p + 1) % M == 0
        has_prev = (p + 1) // M - 1 > 0
        row = _target_row(b, p, KV_BASE, TABLE, stride_t, rows, M, False)[0]
        col, ok = _tile(D, BLOCK, NB, BH)
        col3, ok3 = col[None, :, :], ok[None, :, :]
        slots = tl.arange(0, SC)[:, None, None]
        NS: tl.constexpr = 2 * M if OVERLAP else M
        # three passes over the slots, SC at a time: max, softmax denominator, weighted sum;
        # tokens that close nothing skip them (a uniform branch per program)
        mx_e = tl.full([NB, BH], float("-inf"), tl.float32)
        mx_o = tl.full([NB, BH], float("-inf"), tl.float32)
        den_e = tl.zeros([NB, BH], tl.float32)
        den_o = tl.zeros([NB, BH], tl.float32)
        acc_e = tl.zeros([NB, BH], tl.float32)
        acc_o = tl.zeros([NB, BH], tl.float32)
        if closes:
            for c in range(0, NS, SC):
                gates = _slot_gate(GATE, GATE_RING, BIAS, b, stride_new, gate_base, c + slots, p, closes,
                                   has_prev, col3, ok3, R, M, D, WR, OVERLAP, HAS_BIAS)
                mx_e, mx_o = tl.maximum(mx_e, tl.max(gates[0], 0)), tl.maximum(mx_o, tl.max(gates[1], 0))
            for c in range(0, NS, SC):
                gates = _slot_gate(GATE, GATE_RING, BIAS, b, stride_new, gate_base, c + slots, p, closes,
                                   has_prev, col3, ok3, R, M, D, WR, OVERLAP, HAS_BIAS)
                den_e += tl.sum(_exp(gates[0] - mx_e[None, :, :], PRECISE_EXP), 0)
                den_o += tl.sum(_exp(gates[1] - mx_o[None, :, :], PRECISE_EXP), 0)
            for c in range(0, NS, SC):
                ge, go, pos, off, mask = _slot_gate(GATE, GATE_RING, BIAS, b, stride_new, gate_base, c + slots, p,
                                                    closes, has_prev, col3, ok3, R, M, D, WR, OVERLAP, HAS_BIAS)
                ke, ko = _load_slot(KV, KV_RING, b, stride_new, kv_base, pos, p, off, col3, mask, R, WR)
                we = tl.math.div_rn(_exp(ge - mx_e[None, :, :], PRECISE_EXP),
                                      tl.broadcast_to(den_e[None, :, :], ge.shape))
                wo = tl.math.div_rn(_exp(go - mx_o[None, :, :], PRECISE_EXP),
                                      tl.broadcast_to(den_o[None, :, :], go.shape))
                acc_e += tl.sum(_round(ke * _round(we, RAW_BF16), RAW_BF16), 0)
                acc_o += tl.sum(_round(ko * _round(wo, RAW_BF16), RAW_BF16), 0)
        pe = _round(_round(acc_e, RAW_BF16), BF16)
        po = _round(_round(acc_o, RAW_BF16), BF16)
        _finish(pe, po, col, ok & closes, W, eps, COS + b * stride_cs, SIN + b * stride_cs, DST + row * WIDTH,
                LAT + b * D, closes, D, ROPE, FMT, BLOCK, NB, WIDTH, AFTER_CAST, BF16, LATENT)


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET), which has no libdevice."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _params(store: RowStore, dim: int, rope_dims: int) -> dict:
    code, block = _layout(store.fmt, dim, rope_dims)
    return dict(D=dim, ROPE=rope_dims, FMT=code, BLOCK=block, NB=triton.next_power_of_2(-(-dim // block)),
                BH=triton.next_power_of_2(max(block // 2, 1)), WIDTH=store.flat.shape[-1])


def _target_args(target: RowTarget, like: torch.Tensor) -> tuple:
    if target.ring_base is not None:
        return target.ring_base, like, 0, target.rows, 1, True
    table = target.page_table
    return like, table, table.stride(0), target.rows, target.ratio, False


def write_rows_triton(x: torch.Tensor, norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor, store: RowStore,
                      target: RowTarget, want_latent: bool = False) -> torch.Tensor | None:
    """:func:`kernels.v4_kv_write.write_rows_reference` in one launch; the latents only when asked."""
    b, dim = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    latent = torch.empty(b, dim, dtype=x.dtype, device=x.device) if want_latent else x
    if b:
        base, table, stride_t, rows, ratio, ring = _target_args(target, target.positions)
        _write_rows_kernel[(b,)](
            x, x.stride(0), norm.weight, float(norm.eps), cos, sin, cos.stride(0), target.positions, base, table,
            stride_t, rows, ratio, store.flat, latent, **_params(store, dim, 2 * cos.shape[-1]), RING=ring,
            AFTER_CAST=norm.weight_after_cast, BF16=x.dtype == torch.bfloat16, LATENT=want_latent, num_warps=4,
            enable_fp_fusion=False)
    return latent if want_latent else None


def compress_step_triton(kv: torch.Tensor, gate: torch.Tensor, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
                         ring: RowTarget, gate_base: torch.Tensor, ratio: int, overlap: bool,
                         position_bias: torch.Tensor | None, norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor,
                         store: RowStore, target: RowTarget, want_latent: bool = False) -> torch.Tensor | None:
    """:func:`kernels.v4_kv_write.compress_step_reference` in one launch; the latents (rows whose
    token closes a window; the others are not written) only when asked."""
    b, width = kv.shape
    dim = width // 2 if overlap else width
    slots = 2 * ratio if overlap else ratio
    if kv_ring.dtype != kv.dtype or gate_ring.dtype != gate.dtype or gate.dtype != kv.dtype:
        raise ValueError("compress_step: the rings must hold the raw rows' dtype")
    kv, gate = kv.contiguous(), gate.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    latent = torch.empty(b, dim, dtype=cos.dtype, device=kv.device) if want_latent else kv
    if b:
        bias = position_bias if position_bias is not None else kv
        _compress_kernel[(b,)](
            kv, gate, kv.stride(0), kv_ring, gate_ring, ring.ring_base, gate_base, ring.rows, bias, norm.weight,
            float(norm.eps), cos, sin, cos.stride(0), ring.positions, target.page_table, target.page_table.stride(0),
            target.rows, store.flat, latent, M=ratio, WR=width, BLOCK_W=min(triton.next_power_of_2(width), 1024),
            SC=min(triton.next_power_of_2(slots), 8), OVERLAP=overlap, HAS_BIAS=position_bias is not None,
            RAW_BF16=kv.dtype == torch.bfloat16,
            **_params(store, dim, 2 * cos.shape[-1]), AFTER_CAST=norm.weight_after_cast,
            BF16=cos.dtype == torch.bfloat16, LATENT=want_latent, PRECISE_EXP=not _interpreting(),
            num_warps=8 if slots >= 8 else 4,
            enable_fp_fusion=False)
    return latent if want_latent else None
