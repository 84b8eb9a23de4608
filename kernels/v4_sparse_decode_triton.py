"""Triton sparse decode for DeepSeek-V4 / V4.1 (contract: ``kernels.v4_sparse_decode``).

Design (why, and the numbers it is expected to reach: benchmarks/KERNEL_NOTES.md):

- A program owns one query token of one request, ``block_h`` of its heads (M of the MMAs;
  fewer heads pad to 16) and one split of its tiles of ``block_n`` picked records (the window
  scope's tiles first, then the entries'). A token's head blocks sit side by side on grid axis
  0, so the second gather of a record is an L2 hit. All heads in one program is not possible
  past 64: a [128, 512] fp32 accumulator is the whole register file.
- Records are gathered by pointer (any page size); with ``num_stages`` > 1 Triton turns the
  index and record loads into cp.async stages in shared memory (what keeps HBM busy at 8-16
  heads). Each of the four pieces (256 | 128 | 64 | 64 dims, the last the V4 record's bf16
  rotated dims) is dequantized and handed to its Q·Kᵀ MMA before the next, so one piece's
  registers are live at a time; with wgmma the piece's shared-memory copy also feeds P·V.
- Products in fp16: an e4m3 byte pair is one ``cvt.f16x2.e4m3x2`` and its power-of-two scale
  one packed multiply; fp16 holds e4m3 × UE8M0 values of a latent (|x| < 65504; below 2^-24
  they flush, 2^-15 of a block's largest value). Not FP8: with q quantized per head row to
  e4m3 the output is 2.7 % off float64 (P in e4m3: 1.6 %), over the 2 % budget, and the MMAs
  are not what bounds this kernel (KERNEL_NOTES.md). q is cast bf16 → fp16 once before the
  launch (an operand read from memory goes to shared memory; a converted one stays in registers).
- ``dv_split=2`` gives each of two programs half of the output dims (Q·Kᵀ done by both): what
  fits 64 and 128 rows on wgmma. ``tokens_major`` computes Sᵀ = K·Qᵀ (records fill M); Triton
  then keeps K as a register operand of both products, so it only compiles clean at 32-record
  tiles (a sweep variant).
- Split-KV when the programs cannot fill the SMs: normalized partials + LSE, merged by
  ``_combine_kernel`` (which applies the sink). Launch shapes depend on tensor shapes only
  (never on index values or lengths): capturable in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.gpu import num_sms
from kernels.v4_cache_formats import V4_DATA_BYTES
from kernels.v4_sparse_decode import HEAD_DIM, RECORD_BYTES, SparseKV, check_inputs

LOG2E = 1.4426950408889634
FORMATS = {"v4": 0, "v41_window": 1, "v41_entry": 2, "bf16": 3}
DATA_BYTES = {"v4": V4_DATA_BYTES, "v41_window": 512, "v41_entry": 256, "bf16": 1024}  # offset of a record's scales


@dataclass(frozen=True)
class SparseDecodeConfig:
    """Launch shape; ``None`` fields are taken from :func:`default_config`."""

    block_h: int | None = None  # heads per program: 16, 32, 64 or 128 (M of the MMAs; fewer heads pad)
    dv_split: int | None = None  # 1: a program writes all 512 output dims; 2: half (Q·Kᵀ done by both)
    num_warps: int | None = None
    num_stages: int | None = None  # > 1: the index and record gathers are cp.async-pipelined
    num_splits: int | None = None
    block_n: int | None = None  # records per tile
    tokens_major: bool | None = None  # Sᵀ = K·Qᵀ: records fill the MMA's M (a sweep variant)
    heads_first: bool | None = None  # a token's head blocks on grid axis 0 (adjacent programs)


def default_config(heads: int) -> SparseDecodeConfig:
    """Per heads per GPU, the fastest shapes of the H200 sweep (``benchmarks/bench_v4_sparse_decode.py
    --sweep``, B = 128, top-k 512/2048, s_q 1/2; RESULTS.md). Up to 32 heads: 16-row programs on
    mma.sync, one stage of 32 records, a token's head blocks apart on the grid (the first
    kernel's shape: 3 pipelined stages measured 3-5 % slower); 64 heads: wgmma on 4 warps, half
    the output dims per program, 2 stages; 128 heads: 8 warps, 3 stages."""
    if heads <= 32:
        return SparseDecodeConfig(block_h=16, dv_split=1, num_warps=4, num_stages=1, block_n=32,
                                  tokens_major=False, heads_first=False)
    if heads <= 64:
        return SparseDecodeConfig(block_h=64, dv_split=2, num_warps=4, num_stages=2, block_n=32,
                                  tokens_major=False, heads_first=True)
    return SparseDecodeConfig(block_h=128, dv_split=2, num_warps=8, num_stages=3, block_n=32,
                              tokens_major=False, heads_first=True)


def resolve_config(heads: int, config: SparseDecodeConfig | None) -> SparseDecodeConfig:
    """``config`` with its ``None`` fields (but ``num_splits``) filled from :func:`default_config`."""
    base = default_config(heads)
    if config is None:
        return base
    fill = {k: getattr(base, k) for k in base.__dataclass_fields__
            if getattr(config, k) is None and k != "num_splits"}
    return replace(config, **fill)


@triton.jit
def _ue8m0_to_f16(e):
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(tl.float16)


@triton.jit
def _e2m1_to_f16(n):
    """e2m1 codes (uint8 0..15) → fp16 values: the code's bits placed in an fp16 with an
    exponent 14 short (exact, subnormal code included), times 2^14."""
    bits = ((n & 8).to(tl.uint16) << 12) | ((n & 7).to(tl.uint16) << 9)
    return bits.to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def _piece(cache, cache16, drow, srow, valid, D0: tl.constexpr, W: tl.constexpr, FMT: tl.constexpr,
           BN: tl.constexpr):
    """fp16 [BN, W]: dims D0..D0+W of the records whose data starts at byte ``drow`` and
    scales at ``srow`` (int64 [BN]); invalid records read as zeros (never loaded)."""
    m3 = valid[:, None, None]
    if FMT == 3:  # bf16 rows (--kv-cache-dtype auto), no scales
        ptr = cache16 + (drow // 2)[:, None] + (D0 + tl.arange(0, W))[None, :]
        x = tl.load(ptr, mask=valid[:, None], other=0.0).to(tl.float16)
    elif FMT == 0 and D0 >= 448:  # V4: the rotated dims, bf16 after the 448 e4m3 bytes
        ptr = cache16 + ((drow + 448) // 2)[:, None] + (D0 - 448 + tl.arange(0, W))[None, :]
        x = tl.load(ptr, mask=valid[:, None], other=0.0).to(tl.float16)
    elif FMT == 2:  # V4.1 entry: packed e2m1 pairs, an e4m3 scale per 16 values
        NB: tl.constexpr = W // 16
        nb = tl.arange(0, NB)[None, :, None]
        j = tl.arange(0, 8)[None, None, :]
        b = tl.load(cache + drow[:, None, None] + (D0 // 2 + nb * 8 + j), mask=m3, other=0)
        s = tl.load(cache + srow[:, None, None] + (D0 // 16 + nb), mask=m3, other=0)
        s = s.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        x = tl.join(_e2m1_to_f16(b & 15) * s, _e2m1_to_f16(b >> 4) * s)  # [BN, NB, 8, 2]
        x = tl.reshape(x, [BN, W])
    else:  # e4m3 with a UE8M0 exponent per 64 (V4) or 32 (V4.1 window) dims
        BLK: tl.constexpr = 64 if FMT == 0 else 32
        NB: tl.constexpr = W // BLK
        nb = tl.arange(0, NB)[None, :, None]
        j = tl.arange(0, BLK)[None, None, :]
        b = tl.load(cache + drow[:, None, None] + (D0 + nb * BLK + j), mask=m3, other=0)
        e = tl.load(cache + srow[:, None, None] + (D0 // BLK + nb), mask=m3, other=0)
        x = b.to(tl.float8e4nv, bitcast=True).to(tl.float16) * _ue8m0_to_f16(e)
        x = tl.reshape(x, [BN, W])
    return x


@triton.jit
def _qk(k, q, s, TM: tl.constexpr):
    """Scores of one piece added to ``s`` (None: the first piece): q·kᵀ, or k·qᵀ when TM."""
    if TM:
        if s is None:
            r = tl.dot(k, q)
        else:
            r = tl.dot(k, q, s)
    else:
        if s is None:
            r = tl.dot(q, tl.trans(k))
        else:
            r = tl.dot(q, tl.trans(k), s)
    return r


@triton.jit
def _attend_tile(acc_a, acc_b, acc_c, acc_d, m_i, l_i, qa, qb, qc, qd,
                 cache, cache16, page_words, page_size, idx_row, K, length, t, sm_log2,
                 FMT: tl.constexpr, REC: tl.constexpr, DATA: tl.constexpr, ALIGN: tl.constexpr, PART: tl.constexpr,
                 BN: tl.constexpr, TM: tl.constexpr):
    """One tile of BN picks of one scope: online softmax and P·V into the accumulators of PART
    (0: all dims, 1: dims 0..255, 2: dims 256..511). TM (tokens-major): q pieces, scores and
    accumulators are transposed (keys fill the MMA's M, heads its N). Pages are ``page_words``
    words of ALIGN bytes apart: the stride's alignment reaches the compiler even where the
    stride is no 16-byte multiple (one-record pages of V4's 584-byte rows)."""
    offs = t * BN + tl.arange(0, BN)
    idx = tl.load(idx_row + offs, mask=offs < K, other=-1)
    valid = (idx >= 0) & (offs < length)
    idx = tl.where(valid, idx, 0)
    page = (idx // page_size).to(tl.int64)
    slot = (idx % page_size).to(tl.int64)
    page_stride = page_words * ALIGN
    if FMT == 0:  # V4: data rows, then the page's scale rows
        drow = page * page_stride + slot * DATA
        srow = page * page_stride + slot * 8 + page_size * DATA
    else:
        drow = page * page_stride + slot * REC
        srow = drow + DATA
    # Each piece goes to shared memory (its first MMA) before the next is dequantized, so at
    # most one piece's registers are live (all four at once spill at 64-record tiles).
    ka = _piece(cache, cache16, drow, srow, valid, 0, 256, FMT, BN)
    s = _qk(ka, qa, None, TM)
    kb = _piece(cache, cache16, drow, srow, valid, 256, 128, FMT, BN)
    s = _qk(kb, qb, s, TM)
    kc = _piece(cache, cache16, drow, srow, valid, 384, 64, FMT, BN)
    s = _qk(kc, qc, s, TM)
    kd = _piece(cache, cache16, drow, srow, valid, 448, 64, FMT, BN)
    s = _qk(kd, qd, s, TM)
    if TM:  # Sᵀ [BN, BH] = K·Qᵀ; softmax down the columns; Oᵀ += Vᵀ·Pᵀ
        s = tl.where(valid[:, None], s * sm_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        p16 = p.to(tl.float16)
        if PART != 2:
            acc_a = tl.dot(tl.trans(ka), p16, acc_a * alpha[None, :])
        if PART != 1:
            acc_b = tl.dot(tl.trans(kb), p16, acc_b * alpha[None, :])
            acc_c = tl.dot(tl.trans(kc), p16, acc_c * alpha[None, :])
            acc_d = tl.dot(tl.trans(kd), p16, acc_d * alpha[None, :])
    else:
        s = tl.where(valid[None, :], s * sm_log2, float("-inf"))
        acc_a, acc_b, acc_c, acc_d, m_new, l_i = _softmax_pv(acc_a, acc_b, acc_c, acc_d, m_i, l_i, s, ka, kb, kc, kd,
                                                             PART)
    return acc_a, acc_b, acc_c, acc_d, m_new, l_i


@triton.jit
def _softmax_pv(acc_a, acc_b, acc_c, acc_d, m_i, l_i, s, ka, kb, kc, kd, PART: tl.constexpr):
    """The online softmax of one tile's scores s [M, BN] (log2 units, −inf where hidden) and
    P·V into PART's accumulators (0: all dims, 1: 0..255, 2: 256..511) of the four pieces."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p16 = p.to(tl.float16)
    if PART != 2:
        acc_a = tl.dot(p16, ka, acc_a * alpha[:, None])
    if PART != 1:
        acc_b = tl.dot(p16, kb, acc_b * alpha[:, None])
        acc_c = tl.dot(p16, kc, acc_c * alpha[:, None])
        acc_d = tl.dot(p16, kd, acc_d * alpha[:, None])
    return acc_a, acc_b, acc_c, acc_d, m_new, l_i


@triton.jit
def _store_piece(acc, scale_rows, dst, row_ok, D0: tl.constexpr, W: tl.constexpr, TO_BF16: tl.constexpr,
                 TM: tl.constexpr):
    cols = D0 + tl.arange(0, W)
    if TM:  # acc is [W, BH]
        vals = acc * scale_rows[None, :]
        if TO_BF16:
            vals = vals.to(tl.bfloat16)
        tl.store(dst[None, :] + cols[:, None], vals, mask=row_ok[None, :])
    else:
        vals = acc * scale_rows[:, None]
        if TO_BF16:
            vals = vals.to(tl.bfloat16)
        tl.store(dst[:, None] + cols[None, :], vals, mask=row_ok[:, None])


@triton.jit
def _split_kernel(
    Q, q_sb, q_ss, q_sh,
    C0, C0_16, c0_ps, c0_page, I0, i0_sb, i0_ss, L0, K0,
    C1, C1_16, c1_ps, c1_page, I1, i1_sb, i1_ss, L1, K1,
    SINK, OUT, o_sb, o_ss, o_sh, LSE, l_sb, l_ss, l_sh, PO, PL,
    S_Q, H, num_splits, tiles_per_split, sm_log2,
    FMT0: tl.constexpr, REC0: tl.constexpr, DATA0: tl.constexpr, ALIGN0: tl.constexpr, HAS_L0: tl.constexpr,
    FMT1: tl.constexpr, REC1: tl.constexpr, DATA1: tl.constexpr, ALIGN1: tl.constexpr, HAS_L1: tl.constexpr,
    HAS_SCOPE1: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, DV_SPLIT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    TM: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    if HEADS_FIRST:  # a token's head blocks run side by side: the second gather of a record hits L2
        hb = tl.program_id(0)
        bt = tl.program_id(1)
    else:
        hb = tl.program_id(1)
        bt = tl.program_id(0)
    b = bt // S_Q
    tq = bt % S_Q
    split = tl.program_id(2)
    if DV_SPLIT == 1:
        heads = hb * BH + tl.arange(0, BH)
        row_ok = heads < H
        _run(Q, q_sb, q_ss, q_sh, C0, C0_16, c0_ps, c0_page, I0, i0_sb, i0_ss, L0, K0,
             C1, C1_16, c1_ps, c1_page, I1, i1_sb, i1_ss, L1, K1, SINK, OUT, o_sb, o_ss, o_sh, LSE, l_sb, l_ss,
             l_sh, PO, PL, S_Q, H, num_splits, tiles_per_split, sm_log2, b, tq, bt, split, heads, row_ok,
             FMT0, REC0, DATA0, ALIGN0, HAS_L0,
             FMT1, REC1, DATA1, ALIGN1, HAS_L1, HAS_SCOPE1, HAS_SINK, SPLIT, 0, BH, BN, TM)
    else:
        heads = (hb // 2) * BH + tl.arange(0, BH)
        row_ok = heads < H
        if hb % 2 == 0:
            _run(Q, q_sb, q_ss, q_sh, C0, C0_16, c0_ps, c0_page, I0, i0_sb, i0_ss, L0, K0,
                 C1, C1_16, c1_ps, c1_page, I1, i1_sb, i1_ss, L1, K1, SINK, OUT, o_sb, o_ss, o_sh, LSE, l_sb, l_ss,
                 l_sh, PO, PL, S_Q, H, num_splits, tiles_per_split, sm_log2, b, tq, bt, split, heads, row_ok,
                 FMT0, REC0, DATA0, ALIGN0, HAS_L0,
                 FMT1, REC1, DATA1, ALIGN1, HAS_L1, HAS_SCOPE1, HAS_SINK, SPLIT, 1, BH, BN, TM)
        else:
            _run(Q, q_sb, q_ss, q_sh, C0, C0_16, c0_ps, c0_page, I0, i0_sb, i0_ss, L0, K0,
                 C1, C1_16, c1_ps, c1_page, I1, i1_sb, i1_ss, L1, K1, SINK, OUT, o_sb, o_ss, o_sh, LSE, l_sb, l_ss,
                 l_sh, PO, PL, S_Q, H, num_splits, tiles_per_split, sm_log2, b, tq, bt, split, heads, row_ok,
                 FMT0, REC0, DATA0, ALIGN0, HAS_L0,
                 FMT1, REC1, DATA1, ALIGN1, HAS_L1, HAS_SCOPE1, HAS_SINK, SPLIT, 2, BH, BN, TM)


@triton.jit
def _load_q(q_rows, qm, D0: tl.constexpr, W: tl.constexpr, TM: tl.constexpr):
    """fp16 q piece as stored (a converted operand would stay in registers); [W, BH] when TM."""
    if TM:
        x = tl.load(q_rows[None, :] + (D0 + tl.arange(0, W))[:, None], mask=qm[None, :], other=0.0)
    else:
        x = tl.load(q_rows[:, None] + (D0 + tl.arange(0, W))[None, :], mask=qm[:, None], other=0.0)
    return x


@triton.jit
def _zeros_acc(W: tl.constexpr, BH: tl.constexpr, TM: tl.constexpr):
    if TM:
        x = tl.zeros([W, BH], dtype=tl.float32)
    else:
        x = tl.zeros([BH, W], dtype=tl.float32)
    return x


@triton.jit
def _run(Q, q_sb, q_ss, q_sh, C0, C0_16, c0_ps, c0_page, I0, i0_sb, i0_ss, L0, K0,
         C1, C1_16, c1_ps, c1_page, I1, i1_sb, i1_ss, L1, K1, SINK, OUT, o_sb, o_ss, o_sh, LSE, l_sb, l_ss, l_sh,
         PO, PL, S_Q, H, num_splits, tiles_per_split, sm_log2, b, tq, bt, split, heads, row_ok,
         FMT0: tl.constexpr, REC0: tl.constexpr, DATA0: tl.constexpr, ALIGN0: tl.constexpr, HAS_L0: tl.constexpr,
         FMT1: tl.constexpr, REC1: tl.constexpr, DATA1: tl.constexpr, ALIGN1: tl.constexpr, HAS_L1: tl.constexpr,
         HAS_SCOPE1: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, PART: tl.constexpr,
         BH: tl.constexpr, BN: tl.constexpr, TM: tl.constexpr):
    """One program's work for output PART (see _attend_tile)."""
    q_rows = Q + b.to(tl.int64) * q_sb + tq * q_ss + heads * q_sh
    qa = _load_q(q_rows, row_ok, 0, 256, TM)
    qb = _load_q(q_rows, row_ok, 256, 128, TM)
    qc = _load_q(q_rows, row_ok, 384, 64, TM)
    qd = _load_q(q_rows, row_ok, 448, 64, TM)
    # the accumulators another PART owns are [16, 16] placeholders (never touched)
    acc_a = _zeros_acc(256, BH, TM) if PART != 2 else tl.zeros([16, 16], dtype=tl.float32)
    acc_b = _zeros_acc(128, BH, TM) if PART != 1 else tl.zeros([16, 16], dtype=tl.float32)
    acc_c = _zeros_acc(64, BH, TM) if PART != 1 else tl.zeros([16, 16], dtype=tl.float32)
    acc_d = _zeros_acc(64, BH, TM) if PART != 1 else tl.zeros([16, 16], dtype=tl.float32)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)

    tiles0 = tl.cdiv(K0, BN)
    t_begin = split * tiles_per_split
    t_end = t_begin + tiles_per_split
    if HAS_L0:
        len0 = tl.load(L0 + b)
    else:
        len0 = K0
    idx0 = I0 + b.to(tl.int64) * i0_sb + tq * i0_ss
    for t in range(t_begin, tl.minimum(t_end, tiles0)):
        acc_a, acc_b, acc_c, acc_d, m_i, l_i = _attend_tile(
            acc_a, acc_b, acc_c, acc_d, m_i, l_i, qa, qb, qc, qd, C0, C0_16, c0_ps, c0_page, idx0, K0, len0, t,
            sm_log2, FMT0, REC0, DATA0, ALIGN0, PART, BN, TM)
    if HAS_SCOPE1:
        tiles1 = tl.cdiv(K1, BN)
        if HAS_L1:
            len1 = tl.load(L1 + b)
        else:
            len1 = K1
        idx1 = I1 + b.to(tl.int64) * i1_sb + tq * i1_ss
        for t in range(tl.maximum(t_begin, tiles0) - tiles0, tl.minimum(t_end - tiles0, tiles1)):
            acc_a, acc_b, acc_c, acc_d, m_i, l_i = _attend_tile(
                acc_a, acc_b, acc_c, acc_d, m_i, l_i, qa, qb, qc, qd, C1, C1_16, c1_ps, c1_page, idx1, K1, len1, t,
                sm_log2, FMT1, REC1, DATA1, ALIGN1, PART, BN, TM)

    lonely = l_i == 0.0
    lse = tl.where(lonely, float("-inf"), (m_i + tl.log2(tl.where(lonely, 1.0, l_i))) * 0.6931471805599453)
    inv = tl.where(lonely, 0.0, 1.0 / tl.where(lonely, 1.0, l_i))
    if SPLIT:  # normalized partials; the combine applies the sink
        flat = bt.to(tl.int64) * num_splits + split
        dst = PO + (flat * H + heads) * 512
        if PART != 1:
            tl.store(PL + flat * H + heads, lse, mask=row_ok)
    else:
        if HAS_SINK:
            sink = tl.load(SINK + heads, mask=row_ok, other=float("-inf"))
            inv = inv / (1.0 + tl.exp(sink - lse))
        dst = OUT + b.to(tl.int64) * o_sb + tq * o_ss + heads * o_sh
        if PART != 1:
            tl.store(LSE + b * l_sb + tq * l_ss + heads * l_sh, tl.where(lonely, float("inf"), lse), mask=row_ok)
    if PART != 2:
        _store_piece(acc_a, inv, dst, row_ok, 0, 256, not SPLIT, TM)
    if PART != 1:
        _store_piece(acc_b, inv, dst, row_ok, 256, 128, not SPLIT, TM)
        _store_piece(acc_c, inv, dst, row_ok, 384, 64, not SPLIT, TM)
        _store_piece(acc_d, inv, dst, row_ok, 448, 64, not SPLIT, TM)


@triton.jit
def _combine_kernel(PO, PL, SINK, OUT, o_sb, o_ss, o_sh, LSE, l_sb, l_ss, l_sh, S_Q, H, num_splits,
                    HAS_SINK: tl.constexpr, SPLITS_P2: tl.constexpr, BH: tl.constexpr):
    """One program per (request, query token, head block): merge the splits by their LSE,
    apply the sink, write bf16 out and lse (+inf for a query with no valid key)."""
    bt = tl.program_id(0)
    b, tq = bt // S_Q, bt % S_Q
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = heads < H
    sp = tl.arange(0, SPLITS_P2)
    base = bt.to(tl.int64) * num_splits
    lses = tl.load(PL + (base + sp[None, :]) * H + heads[:, None], mask=ok[:, None] & (sp[None, :] < num_splits),
                   other=float("-inf"))  # [BH, SPLITS_P2]
    m = tl.max(lses, 1)
    lonely = m == float("-inf")
    m = tl.where(lonely, 0.0, m)
    w = tl.exp(lses - m[:, None])
    total = tl.sum(w, 1)
    lse = m + tl.log(tl.where(lonely, 1.0, total))
    scale = tl.where(lonely, 0.0, 1.0 / tl.where(lonely, 1.0, total))
    if HAS_SINK:
        sink = tl.load(SINK + heads, mask=ok, other=float("-inf"))
        scale = scale / (1.0 + tl.exp(sink - lse))
    d = tl.arange(0, 512)
    acc = tl.zeros([BH, 512], dtype=tl.float32)
    for s in range(num_splits):
        ws = tl.sum(tl.where(sp[None, :] == s, w, 0.0), 1)
        acc += ws[:, None] * tl.load(PO + ((base + s) * H + heads[:, None]) * 512 + d[None, :], mask=ok[:, None],
                                     other=0.0)
    out = (acc * scale[:, None]).to(tl.bfloat16)
    tl.store(OUT + b.to(tl.int64) * o_sb + tq * o_ss + heads[:, None] * o_sh + d[None, :], out, mask=ok[:, None])
    tl.store(LSE + b * l_sb + tq * l_ss + heads * l_sh, tl.where(lonely, float("inf"), lse), mask=ok)


def page_align(cache: torch.Tensor) -> int:
    """16 or 8: the bytes every page start is a multiple of (the caller checked 8). A byte
    stride that is no 16-byte multiple (584-byte one-record pages) carries no alignment to the
    compiler, so the kernel gets the stride in words of this many bytes."""
    return 16 if cache.stride(0) % 16 == 0 and cache.data_ptr() % 16 == 0 else 8


def choose_num_splits(programs: int, tiles: int, sms: int, num_warps: int = 4) -> int:
    """Enough programs to fill the SMs once at the residency the configs reach (two 4-warp
    programs per SM, one 8-warp program); from shapes only (never index values)."""
    per_sm = 2 if num_warps <= 4 else 1
    return max(1, min(tiles, (per_sm * sms) // max(programs, 1), 32))


def v4_sparse_decode_triton(
    q: torch.Tensor, scopes: Sequence[SparseKV], sinks: torch.Tensor | None, softmax_scale: float,
    config: SparseDecodeConfig | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, s_q, H, 512] bf16, lse [B, s_q, H] float32); no host sync (CUDA-graph safe
    with ``out``/``lse`` passed in). ``partials``: float32 [B·s_q, H, 512] and [B·s_q, H] that
    take the normalized output and the lse (−inf: no valid key) of one split over all keys,
    without the sink, in place of ``out``/``lse`` (for a caller that merges more keys: the
    sparse prefill, kernels/v4_sparse_prefill_triton.py); returns them."""
    check_inputs(q, scopes, sinks)
    for i, sc in enumerate(scopes):
        # the record gathers assume 8-byte pages (what the pools allocate); a cache shifted to
        # 4 mod 16 read wrong values on an H200 instead of failing, so refuse it here
        if sc.cache.data_ptr() % 8 or sc.cache.stride(0) % 8:
            raise ValueError(f"scopes[{i}].cache: pages must start on 8 bytes (at {sc.cache.data_ptr() % 16} "
                             f"mod 16, page stride {sc.cache.stride(0)})")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q must be bf16 or fp16, got {q.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q must have a unit last stride")
    q = q.to(torch.float16)  # one pass over q (the products run in fp16: module docstring)
    bsz, s_q, heads, _ = q.shape
    cfg = resolve_config(heads, config)
    block_h, dv_split, bn = cfg.block_h, cfg.dv_split, cfg.block_n
    if block_h not in (16, 32, 64, 128) or dv_split not in (1, 2) or bn not in (16, 32, 64, 128):
        raise ValueError(f"config: block_h must be 16/32/64/128, dv_split 1/2, block_n 16..128, got {cfg}")
    if partials is not None:
        part_o, part_l = partials
        if (part_o.shape != (bsz * s_q, heads, HEAD_DIM) or part_l.shape != (bsz * s_q, heads)
                or part_o.dtype != torch.float32 or part_l.dtype != torch.float32
                or not part_o.is_contiguous() or not part_l.is_contiguous()):
            raise ValueError(f"partials must be contiguous float32 [{bsz * s_q}, {heads}, {HEAD_DIM}] and "
                             f"[{bsz * s_q}, {heads}]")
        out, lse = part_o.view(bsz, s_q, heads, HEAD_DIM), part_l.view(bsz, s_q, heads)  # never written
    if out is None:
        out = torch.empty(bsz, s_q, heads, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(bsz, s_q, heads, dtype=torch.float32, device=q.device)
    if partials is None and (out.shape != (bsz, s_q, heads, HEAD_DIM) or out.dtype != torch.bfloat16
                             or out.stride(-1) != 1):
        raise ValueError(f"out must be bf16 [{bsz}, {s_q}, {heads}, {HEAD_DIM}] with a unit last stride")
    if lse.shape != (bsz, s_q, heads) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 [{bsz}, {s_q}, {heads}]")
    if bsz == 0:
        return out, lse
    sc = list(scopes)
    tiles = sum(-(-s.indices.shape[-1] // bn) for s in sc)
    head_blocks = -(-heads // block_h)
    programs = bsz * s_q * head_blocks * dv_split
    splits = cfg.num_splits or choose_num_splits(programs, tiles, num_sms(q.device), cfg.num_warps)
    splits = 1 if partials is not None else max(1, min(splits, tiles))
    tiles_per_split = max(1, -(-tiles // splits))
    splits = max(1, -(-tiles // tiles_per_split))  # no empty trailing split
    if partials is None:
        part_o = part_l = None
        if splits > 1:
            part_o = torch.empty(bsz * s_q * splits, heads, HEAD_DIM, dtype=torch.float32, device=q.device)
            part_l = torch.empty(bsz * s_q * splits, heads, dtype=torch.float32, device=q.device)

    def scope_args(s: SparseKV | None):
        if s is None:  # a second scope that is absent: any valid pointers, never read
            return (q, q, 0, 1, q, 0, 0, q, 0)
        c = s.cache
        return (c, c.view(torch.bfloat16), c.stride(0) // page_align(c), c.shape[1], s.indices, s.indices.stride(0),
                s.indices.stride(1), s.lengths if s.lengths is not None else s.indices, s.indices.shape[-1])

    def scope_consts(s: SparseKV | None):
        if s is None:
            return dict(FMT=0, REC=584, DATA=576, ALIGN=16, HAS_L=False)
        return dict(FMT=FORMATS[s.record], REC=RECORD_BYTES[s.record], DATA=DATA_BYTES[s.record],
                    ALIGN=page_align(s.cache), HAS_L=s.lengths is not None)

    for s in sc:
        if s.indices.stride(-1) != 1:
            raise ValueError("indices must have a unit last stride")
    s0, s1 = sc[0], (sc[1] if len(sc) > 1 else None)
    k0, k1 = scope_consts(s0), scope_consts(s1)
    dummy = lse
    grid = (head_blocks * dv_split, bsz * s_q, splits) if cfg.heads_first else (bsz * s_q, head_blocks * dv_split,
                                                                                  splits)
    _split_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2),
        *scope_args(s0), *scope_args(s1),
        sinks if sinks is not None else dummy, out, out.stride(0), out.stride(1), out.stride(2),
        lse, lse.stride(0), lse.stride(1), lse.stride(2),
        part_o if part_o is not None else dummy, part_l if part_l is not None else dummy,
        s_q, heads, splits, tiles_per_split, float(softmax_scale) * LOG2E,
        FMT0=k0["FMT"], REC0=k0["REC"], DATA0=k0["DATA"], ALIGN0=k0["ALIGN"], HAS_L0=k0["HAS_L"],
        FMT1=k1["FMT"], REC1=k1["REC"], DATA1=k1["DATA"], ALIGN1=k1["ALIGN"], HAS_L1=k1["HAS_L"],
        HAS_SCOPE1=s1 is not None,
        HAS_SINK=sinks is not None, SPLIT=part_o is not None, DV_SPLIT=dv_split, BH=block_h, BN=bn,
        TM=bool(cfg.tokens_major), HEADS_FIRST=bool(cfg.heads_first), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if partials is not None:
        return partials
    if splits > 1:
        ch = 16
        _combine_kernel[(bsz * s_q, -(-heads // ch))](
            part_o, part_l, sinks if sinks is not None else dummy, out, out.stride(0), out.stride(1), out.stride(2),
            lse, lse.stride(0), lse.stride(1), lse.stride(2), s_q, heads, splits,
            HAS_SINK=sinks is not None, SPLITS_P2=triton.next_power_of_2(splits), BH=ch, num_warps=4,
        )
    return out, lse
