"""Triton lightning-indexer scores for DeepSeek-V4.1 (contract and reference: kernels/v4_indexer.py).

Design (the expected numbers: benchmarks/KERNEL_NOTES.md):

- A program owns ``block_q`` queries of one request (decode: 1; a prefill chunk: 4, so the
  MMA's N is 4 × 32 heads = 128; heads pad to a power of two ≥ 16) and a run of ``tiles``
  tiles of ``block_n`` keys. Keys fill the MMA's M: Sᵀ [block_n, block_q·heads] = K·Qᵀ.
- Each 32-dim block is one FP8 MMA (K = 32): the record's 16 bytes of e2m1 pairs become e4m3
  bytes by PRMT byte lookups (e2m1 → e4m3 is exact; 14 instructions per 8 codes, plain
  integer ops under the interpreter), the query block is e4m3 already; the product of two
  e2m1 vectors of 32 is exact in the fp32 accumulator, and the two power-of-two scales
  multiply it exactly. Only the sum over the d/32 blocks and the head sum round.
- Loads: the codes go through Triton's cp.async pipeline (they feed the MMA); a key's d/32
  scale bytes are one word (4 bytes at d = 128, aligned as the record), which Triton would
  load synchronously (it feeds no MMA), so the kernel loads it a tile ahead itself, from page
  numbers loaded two tiles ahead; the candidate mask bytes likewise. The program's query
  blocks and scales are loaded once, before the tile loop (d ≤ 128: four blocks).
- Within a 32-dim block the MMA's K order is 0, 2, …, 30, 1, 3, …, 31 (:func:`mma_order`): a
  thread's four code bytes are then its wgmma A registers as they come out of the PRMTs, and
  the queries are stored in that order (the sum of a block's 32 exact products does not
  depend on it).
- ReLU, the head weights (H^-½ folded in), the d^-½ scale, the visibility mask and V4.1's
  candidate mask are applied on the tile, which stores float32 scores or (``keys_out``) the
  int64 keys of the ordered top-k (kernels/topk.py); the candidate source also gets the max of
  every block of ``block_size`` keys from the same tile. With a histogram the tile also adds
  its finite scores to the rows' level-1 histogram of the selection (kernels/topk_triton.py,
  one relaxed atomic per score), so :func:`index_picks_triton` selects without another pass
  over the scores.
- Tiles past a program's largest visible count are not computed; they store −inf (the
  contract's full width) or nothing (the picks' chain, which reads visible entries only). The
  grid depends on shapes only (never on counts): capturable in a CUDA graph.
- The memory roofline at decode: every visible key's 68 bytes once per request (and per
  query block in a prefill); 8 kFLOP per key and request (32 heads × 128 dims), so ~120
  FLOP per byte — under the FP8 ridge of an H200; the fp32 work per key × head (four block
  scalings, ReLU, weights, head sum) keeps the issue rate close to that floor at decode and
  above it in a prefill.

:func:`quantize_queries_triton` is ``kernels.v4_indexer.quantize_index_queries`` as one launch
(it also zeroes the selection's histogram rows), :func:`index_picks_triton` the whole chain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import num_sms
from kernels.mxfp8_quant_triton import pow2_from_byte
from kernels.topk_triton import (HIST_STRIDE, MAX_K, MAX_MASK_BLOCKS, candidate_blocks_triton, histogram_rows_triton,
                                 level1_bin, new_histogram, ordered_bits, topk_rows_triton)
from kernels.v4_indexer import SCALE_BLOCK, candidate_blocks, check_inputs, topk_picks
from kernels.v4_kv_write_triton import _fp4_code

# e2m1 → e4m3 of 4 packed bytes (8 codes) per call on the GPU: two PRMT lookups of the
# magnitudes 0..7 in a byte table (0, 0.5, 1, 1.5 | 2, 3, 4, 6 as e4m3), two PRMTs that sort
# the low and high nibbles' bytes apart, the sign bits moved in: 14 instructions per 8 codes
# where the integer path below takes ~10 per code. $0 / $1: the e4m3 of the low / high nibbles.
_E2M1_TO_E4M3_ASM = tl.constexpr("""
{
.reg .b32 s, a, b, t, tlo, thi;
mov.b32 tlo, 0x3C383000;
mov.b32 thi, 0x4C484440;
and.b32 s, $2, 0x7777;
prmt.b32 a, tlo, thi, s;
shr.u32 s, $2, 16;
and.b32 s, s, 0x7777;
prmt.b32 b, tlo, thi, s;
prmt.b32 $0, a, b, 0x6420;
prmt.b32 $1, a, b, 0x7531;
shl.b32 t, $2, 4;
and.b32 t, t, 0x80808080;
or.b32 $0, $0, t;
and.b32 t, $2, 0x80808080;
or.b32 $1, $1, t;
}
""")

SCALE_WORDS = (1, 2, 4)  # d/32 scale bytes (d = 32, 64, 128): one aligned integer, one query block each


@triton.jit
def _unpack_keys(packed, PRMT: tl.constexpr):
    """Packed e2m1 pairs uint8 [BN, 16] → e4m3 [BN, 32] in MMA column order (:func:`mma_order`)."""
    if PRMT:
        lo, hi = tl.inline_asm_elementwise(_E2M1_TO_E4M3_ASM, "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8),
                                           is_pure=True, pack=4)
    else:  # the interpreter
        lo = _e2m1_to_e4m3(packed & 15)
        hi = _e2m1_to_e4m3(packed >> 4)
    # MMA column c < 16 is dim 2c (byte c's low nibble), 16 + c is dim 2c + 1: a thread's four
    # code bytes then feed its MMA registers as they are (the queries come in that order too)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [packed.shape[0], 32]).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _e2m1_to_e4m3(n):
    """e2m1 codes (uint8 0..15) → the bytes of the same values in e4m3, exactly: magnitude
    codes 2..7 (1 … 6) are ``(code << 2) + 0x30``, code 1 (0.5) is 0x30, code 0 is zero."""
    mag = n & 7
    bits = tl.where(mag >= 2, (mag << 2) + 0x30, tl.where(mag == 1, 0x30, 0)).to(tl.uint8)
    return bits | ((n & 8) << 4).to(tl.uint8)


@triton.jit
def _quantize_queries_kernel(Q, q_stride, Q8, QS, ZERO, zero_stride, zero_n, H: tl.constexpr, HP: tl.constexpr,
                             D: tl.constexpr, ZP: tl.constexpr):
    """One query: e2m1 codes as e4m3 bytes and their UE8M0 scales per 32 dims, the rounding of
    ``quantize_index_queries`` (``kernels.v4_kv_write_triton``'s key encoding, with IEEE
    division by the power of two); then zeroes ``ZERO[q, :zero_n]``."""
    NB: tl.constexpr = D // 32
    q = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)[:, None, None]
    col = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    ok = h < H
    x = tl.load(Q + q * q_stride + h * D + col, mask=ok, other=0.0).to(tl.float32)
    t = tl.maximum(tl.max(tl.abs(x), 2), 7.052966104933725e-38) * 0.16666666666666666  # max(amax, 6·2^-126)·fp32(1/6)
    tb = t.to(tl.int32, bitcast=True)
    scale = pow2_from_byte(((tb >> 23) & 0xFF) + ((tb & 0x7FFFFF) != 0).to(tl.int32))  # [HP, NB]
    y = tl.clamp(tl.math.div_rn(x, tl.broadcast_to(scale[:, :, None], x.shape)), -6.0, 6.0)
    mma_col = (col // 32) * 32 + (col % 2) * 16 + (col % 32) // 2  # stored in MMA column order
    tl.store(Q8 + (q * H + h) * D + mma_col, _e2m1_to_e4m3(_fp4_code(y).to(tl.uint8)), mask=ok)
    hh = tl.arange(0, HP)[:, None]
    tl.store(QS + (q * H + hh) * NB + tl.arange(0, NB)[None, :], scale, mask=hh < H)
    if ZP > 0:
        z = tl.arange(0, ZP)
        tl.store(ZERO + q * zero_stride + z, tl.zeros([ZP], dtype=ZERO.dtype.element_ty), mask=z < zero_n)


@triton.jit
def _tile_pages(PT, req, pt_stride, page_rows, first, limit, BN: tl.constexpr):
    """(pages of the keys first … first + BN − 1, which of them are below ``limit``)."""
    offs = first + tl.arange(0, BN)
    valid = offs < limit
    return tl.load(PT + req * pt_stride + offs // page_rows, mask=valid, other=0).to(tl.int64), valid


@triton.jit
def _record(KEYS, page, offs, page_rows, REC: tl.constexpr):
    # byte offsets as page · (page_rows · REC) + slot · REC, not (page · page_rows + slot) · REC:
    # Triton's alignment analysis takes the sum of a masked load and a contiguous range for a
    # multiple of 16 at every element and would issue 16-byte loads at 4-aligned records
    return KEYS + page * (page_rows * REC) + (offs % page_rows) * REC


@triton.jit
def _scale_words(KEYS, page, first, valid, page_rows, REC: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
    """Each key's d/32 scale bytes (byte b: block b's UE8M0 exponent) as one integer."""
    NB: tl.constexpr = D // 32
    rec = _record(KEYS, page, first + tl.arange(0, BN), page_rows, REC) + D // 2
    if NB == 1:
        word = rec
    elif NB == 2:
        word = rec.to(tl.pointer_type(tl.uint16))
    else:
        word = rec.to(tl.pointer_type(tl.int32))
    return tl.load(word, mask=valid, other=0)


@triton.jit
def _allowed_flags(ALLOWED, al_stride, qj, qj_ok, first, valid, BS: tl.constexpr, BN: tl.constexpr):
    offs = first + tl.arange(0, BN)
    return tl.load(ALLOWED + qj.to(tl.int64)[None, :] * al_stride + (offs // BS)[:, None],
                   mask=valid[:, None] & qj_ok[None, :], other=0)


@triton.jit
def _query_block(Q8, QS, qi64, head, q_ok, cols, b: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    NB: tl.constexpr = D // 32
    ok = q_ok & (b < NB)
    q8 = tl.load(Q8 + (qi64 * H + head)[:, None] * D + b * 32 + cols[None, :], mask=ok[:, None],
                 other=0).to(tl.float8e4nv, bitcast=True)
    return q8, tl.load(QS + (qi64 * H + head) * NB + b, mask=ok, other=0.0)


@triton.jit
def _index_scores_kernel(
    Q8, QS, W, KEYS, PT, pt_stride, page_rows, VIS, ALLOWED, al_stride, OUT, out_stride, BMAX, bm_stride, HIST,
    num_q, num_keys, q_per_req, tiles, softmax_scale,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, REC: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr,
    BS: tl.constexpr, HAS_ALLOWED: tl.constexpr, WANT_BMAX: tl.constexpr, SKIP: tl.constexpr, PRMT: tl.constexpr,
    KEYS_OUT: tl.constexpr, HISTOGRAM: tl.constexpr, HSTRIDE: tl.constexpr, WRITE_DEAD: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    NB: tl.constexpr = D // 32
    M: tl.constexpr = BQ * HP  # heads padded to HP (≥ 16 rows for the MMA; padded heads weigh 0)
    q0 = tl.program_id(0) * BQ
    req = (q0 // q_per_req).to(tl.int64)
    rows_m = tl.arange(0, M)  # query-head rows of the MMA's N
    qi = q0 + rows_m // HP
    head = rows_m % HP
    q_ok = (qi < num_q) & (head < H)
    qi64 = qi.to(tl.int64)
    w = tl.load(W + qi64 * H + head, mask=q_ok, other=0.0)
    qj = q0 + tl.arange(0, BQ)  # the tile's queries
    qj_ok = qj < num_q
    vis = tl.load(VIS + qj, mask=qj_ok, other=0).to(tl.int32)
    vis_max = tl.max(vis, 0)
    cols = tl.arange(0, 32)
    k_first = tl.program_id(1) * tiles * BN
    # tiles with a visible key for some query of the program, then the rest (−inf, no reads)
    live = tl.minimum(tl.maximum(tl.cdiv(vis_max - k_first, BN), 0), tiles) if SKIP else tiles
    limit = tl.minimum(vis_max, num_keys)
    k_last = k_first + live * BN  # the program's live keys end here
    pages_next, valid_next = _tile_pages(PT, req, pt_stride, page_rows, k_first, limit, BN)
    words_next = _scale_words(KEYS, pages_next, k_first, valid_next, page_rows, REC, D, BN)
    flags_next = _allowed_flags(ALLOWED, al_stride, qj, qj_ok, k_first, valid_next, BS, BN) if HAS_ALLOWED else 0
    pages_next, valid_next = _tile_pages(PT, req, pt_stride, page_rows, k_first + BN,
                                         tl.minimum(limit, k_last), BN)
    q8_0, qs_0 = _query_block(Q8, QS, qi64, head, q_ok, cols, 0, H, D)
    q8_1, qs_1 = _query_block(Q8, QS, qi64, head, q_ok, cols, 1, H, D)
    q8_2, qs_2 = _query_block(Q8, QS, qi64, head, q_ok, cols, 2, H, D)
    q8_3, qs_3 = _query_block(Q8, QS, qi64, head, q_ok, cols, 3, H, D)
    for t in range(0, live):
        first = k_first + t * BN
        offs = first + tl.arange(0, BN)
        valid = offs < limit
        page = tl.load(PT + req * pt_stride + offs // page_rows, mask=valid, other=0).to(tl.int64)
        rec = _record(KEYS, page, offs, page_rows, REC)
        if PREFETCH:  # this tile's words were loaded last iteration; now the next tile's, and pages for the one after
            words = words_next
            flags = flags_next
            words_next = _scale_words(KEYS, pages_next, first + BN, valid_next, page_rows, REC, D, BN)
            if HAS_ALLOWED:
                flags_next = _allowed_flags(ALLOWED, al_stride, qj, qj_ok, first + BN, valid_next, BS, BN)
            pages_next, valid_next = _tile_pages(PT, req, pt_stride, page_rows, first + 2 * BN,
                                                 tl.minimum(limit, k_last), BN)
        else:
            words = _scale_words(KEYS, page, first, valid, page_rows, REC, D, BN)
            flags = _allowed_flags(ALLOWED, al_stride, qj, qj_ok, first, valid, BS, BN) if HAS_ALLOWED else 0
        acc = tl.zeros([BN, M], dtype=tl.float32)
        for b in tl.static_range(NB):
            packed = tl.load(rec[:, None] + (b * 16 + tl.arange(0, 16))[None, :], mask=valid[:, None], other=0)
            k8 = _unpack_keys(packed, PRMT)
            k_scale = (((words >> (8 * b)) & 0xFF).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            if b == 0:
                q8, q_scale = q8_0, qs_0
            elif b == 1:
                q8, q_scale = q8_1, qs_1
            elif b == 2:
                q8, q_scale = q8_2, qs_2
            else:
                q8, q_scale = q8_3, qs_3
            part = tl.dot(k8, tl.trans(q8))  # [BN, M], exact
            acc += part * k_scale[:, None] * q_scale[None, :]
        s = tl.maximum(acc, 0.0) * softmax_scale * w[None, :]
        s = tl.sum(tl.reshape(s, [BN, BQ, HP]), 2)  # [BN, BQ]
        keep = offs[:, None] < vis[None, :]
        if HAS_ALLOWED:
            keep = keep & (flags != 0)
        s = tl.where(keep, s, float("-inf"))
        _store_tile(s, OUT, out_stride, BMAX, bm_stride, qj, qj_ok, first, num_keys, BN, BQ, BS, WANT_BMAX, KEYS_OUT)
        if HISTOGRAM:
            hit = keep & (s > float("-inf")) & (offs < num_keys)[:, None] & qj_ok[None, :]  # what collect counts
            tl.atomic_add(HIST + qj[None, :] * HSTRIDE + level1_bin(ordered_bits(s)), 1, mask=hit, sem="relaxed")
    if WRITE_DEAD:
        for t in range(live, tiles):
            _store_tile(tl.full([BN, BQ], float("-inf"), dtype=tl.float32), OUT, out_stride, BMAX, bm_stride, qj,
                        qj_ok, k_first + t * BN, num_keys, BN, BQ, BS, WANT_BMAX, KEYS_OUT)


@triton.jit
def _store_tile(s, OUT, out_stride, BMAX, bm_stride, qj, qj_ok, first, num_keys, BN: tl.constexpr, BQ: tl.constexpr,
                BS: tl.constexpr, WANT_BMAX: tl.constexpr, KEYS_OUT: tl.constexpr):
    """Scores s [BN, BQ] of keys first … first + BN − 1, or (KEYS_OUT) their int64 top-k keys
    (kernels/topk.py's ``order_keys``); WANT_BMAX: their block maxima too."""
    offs = first + tl.arange(0, BN)
    dst = OUT + qj.to(tl.int64)[None, :] * out_stride + offs[:, None]
    ok = (offs < num_keys)[:, None] & qj_ok[None, :]
    if KEYS_OUT:
        ordered = ordered_bits(s).to(tl.int64)
        tl.store(dst, (ordered << 32) | (0xFFFFFFFF - offs.to(tl.int64))[:, None], mask=ok)
    else:
        tl.store(dst, s, mask=ok)
    if WANT_BMAX:
        bmax = tl.max(tl.reshape(s, [BN // BS, BS, BQ]), 1)  # [BN / BS, BQ]
        blocks = first // BS + tl.arange(0, BN // BS)
        tl.store(BMAX + qj.to(tl.int64)[None, :] * bm_stride + blocks[:, None], bmax,
                 mask=(blocks[:, None] * BS < num_keys) & qj_ok[None, :])


@triton.jit
def _compact_blocks_kernel(ALLOWED, al_stride, VIS, PT, pt_stride, q_per_req, VPT, BLIST, VIS_C, nblocks, width,
                           BS: tl.constexpr, BPP: tl.constexpr, ROW: tl.constexpr):
    """Query q's allowed visible blocks in index order (at most ``width``): their ids
    (BLIST[q, i]), a page table of one block a page (VPT[q, i]: block i's first pool row / BS)
    and the compacted keys' visible count (VIS_C[q]: only the last block can be partial)."""
    q = tl.program_id(0)
    vis = tl.load(VIS + q).to(tl.int32)
    b = tl.arange(0, ROW)
    ok = (tl.load(ALLOWED + q.to(tl.int64) * al_stride + b, mask=(b < nblocks) & (b * BS < vis), other=0) != 0)
    pos = tl.cumsum(ok.to(tl.int32), 0) - 1
    keep = ok & (pos < width)
    page = tl.load(PT + (q // q_per_req).to(tl.int64) * pt_stride + b // BPP, mask=keep, other=0).to(tl.int64)
    tl.store(BLIST + q.to(tl.int64) * width + pos, b, mask=keep)
    tl.store(VPT + q.to(tl.int64) * width + pos, page * BPP + b % BPP, mask=keep)
    count = tl.sum(keep.to(tl.int32), 0)
    last = tl.max(tl.where(keep, b, -1), 0)
    tl.store(VIS_C + q, tl.where(count > 0, (count - 1) * BS + tl.minimum(vis - last * BS, BS), 0))


def compact_allowed_blocks(allowed: torch.Tensor, page_table: torch.Tensor, page_rows: int, visible: torch.Tensor,
                           queries_per_request: int, width: int, block_size: int):
    """(page table [Q, width] of one ``block_size``-key block a page, block ids [Q, width], the
    compacted keys' visible counts [Q]) of each query's allowed visible blocks in index order:
    the records of :func:`index_scores_triton`'s restricted scores, read as dense keys."""
    nq, nblocks = allowed.shape
    vpt = torch.empty(nq, width, dtype=torch.int64, device=allowed.device)
    blist = torch.empty(nq, width, dtype=torch.int32, device=allowed.device)
    vis_c = torch.empty(nq, dtype=torch.int32, device=allowed.device)
    if nq:
        _compact_blocks_kernel[(nq,)](allowed.view(torch.uint8), allowed.stride(0), visible, page_table,
                                      page_table.stride(0), queries_per_request if page_table.shape[0] > 1 else nq + 1,
                                      vpt, blist, vis_c, nblocks, width, BS=block_size, BPP=page_rows // block_size,
                                      ROW=max(16, triton.next_power_of_2(nblocks)), num_warps=8)
    return vpt, blist, vis_c


def default_shape(queries_per_request: int) -> tuple[int, int, int, int]:
    """(block_n, block_q, num_warps, num_stages): decode 128 keys × 1 query on 4 warps, 3
    stages (the MMA's N = the heads); a prefill 64 keys × 4 queries on 8 warps, 2 stages (N =
    128 query heads; 128-key tiles, 4 warps or 3 stages spill on sm_90 at 32 heads × 128)."""
    return (128, 1, 4, 3) if queries_per_request == 1 else (64, 4, 8, 2)


def launch_shape(num_q: int, num_keys: int, block_q: int, block_n: int, sms: int,
                 programs_per_sm: int = 2) -> tuple[int, int]:
    """(query programs, tiles per program): about ``programs_per_sm`` programs per SM (a
    single wave where the work allows: small batches split each request's keys over many
    programs), at most 16 tiles each; from shapes only."""
    q_programs = -(-num_q // block_q)
    tiles = -(-num_keys // block_n)
    per_program = max(1, min(16, -(-q_programs * tiles // (programs_per_sm * sms))))
    return q_programs, per_program


def mma_order(q8: torch.Tensor) -> torch.Tensor:
    """e4m3 queries [..., d] with each 32-dim block's dims in the kernel's MMA column order
    (0, 2, …, 30, 1, 3, …, 31: :func:`_unpack_keys`'s)."""
    d = q8.shape[-1]
    return q8.reshape(*q8.shape[:-1], d // 32, 16, 2).transpose(-1, -2).reshape(q8.shape)


def supported_head_dim(d: int) -> bool:
    """Head dims whose d/32 scale bytes are one aligned word of the record."""
    return d % SCALE_BLOCK == 0 and d // SCALE_BLOCK in SCALE_WORDS


def _launch_scores(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys, softmax_scale,
                   queries_per_request, allowed, block_size, want_block_max, keys_out, hist, write_dead,
                   block_n=None, block_q=None, num_warps=None, num_stages=None, skip_dead_tiles=True,
                   programs_per_sm=2, prefetch=True):
    """The scoring launch on queries q8 in :func:`mma_order` (inputs checked by the caller)."""
    nq, heads, d = q8.shape
    if not supported_head_dim(d):
        raise ValueError(f"the Triton indexer reads index_head_dim 32, 64 or 128, got {d}")
    default_n, default_q, default_warps, default_stages = default_shape(queries_per_request)
    block_n, block_q = block_n or default_n, block_q or default_q
    num_warps, num_stages = num_warps or default_warps, num_stages or default_stages
    if block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    if keys.stride(1) != 1 or keys.stride(0) != keys.shape[1]:
        raise ValueError("keys must be contiguous records")
    one_request = page_table.shape[0] == 1
    if queries_per_request % block_q and not one_request:
        raise ValueError(f"block_q {block_q} must divide the {queries_per_request} queries per request")
    if block_n % block_size or block_n & (block_n - 1) or block_size & (block_size - 1):
        raise ValueError(f"block_n {block_n} must be a power of two and a multiple of block_size {block_size}")
    device = q8.device
    scores = torch.empty(nq, num_keys, dtype=torch.int64 if keys_out else torch.float32, device=device)
    bmax = (torch.empty(nq, -(-num_keys // block_size), dtype=torch.float32, device=device)
            if want_block_max else None)
    if nq == 0 or num_keys == 0:
        return scores, bmax
    q_programs, per_program = launch_shape(nq, num_keys, block_q, block_n, num_sms(device), programs_per_sm)
    grid = (q_programs, -(-num_keys // (per_program * block_n)))
    al = allowed.view(torch.uint8) if allowed is not None else visible
    _index_scores_kernel[grid](
        q8.contiguous().view(torch.uint8), q_scale.contiguous(), weights.contiguous(), keys, page_table,
        page_table.stride(0), page_rows, visible, al, al.stride(0) if allowed is not None else 0,
        scores, scores.stride(0), bmax if bmax is not None else scores, bmax.stride(0) if bmax is not None else 0,
        hist if hist is not None else visible,
        nq, num_keys, nq + block_q if one_request else queries_per_request, per_program, float(softmax_scale),
        H=heads, HP=max(16, triton.next_power_of_2(heads)), D=d, REC=keys.shape[1], BQ=block_q, BN=block_n,
        BS=block_size, HAS_ALLOWED=allowed is not None, WANT_BMAX=want_block_max, SKIP=skip_dead_tiles,
        PRMT=device.type == "cuda", KEYS_OUT=keys_out, HISTOGRAM=hist is not None, HSTRIDE=HIST_STRIDE,
        WRITE_DEAD=write_dead,
        PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages,
    )
    return scores, bmax


def index_scores_triton(
    q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, page_table: torch.Tensor,
    page_rows: int, visible: torch.Tensor, num_keys: int, softmax_scale: float, queries_per_request: int = 1,
    allowed: torch.Tensor | None = None, block_size: int = 8, want_block_max: bool = False, keys_out: bool = False,
    hist: torch.Tensor | None = None, mma_ordered: bool = False, **shape,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kernels.v4_indexer.index_scores_reference` as one launch; no host sync.

    ``hist``: a zeroed level-1 histogram (kernels/topk_triton.py) the launch fills, as in the
    picks chain, whose launch also leaves the tiles past every query's count unwritten;
    ``mma_ordered``: q8 is already in :func:`mma_order` (:func:`quantize_queries_triton`'s).
    Launch shape (None: :func:`default_shape`): ``block_n`` keys per tile, ``block_q`` queries
    per program, ``num_warps``, ``num_stages``, ``programs_per_sm`` (:func:`launch_shape`);
    ``skip_dead_tiles`` False computes the tiles past every query's count too (masked loads
    read nothing); ``prefetch`` False loads each tile's scale words in its own iteration."""
    check_inputs(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys, queries_per_request, allowed,
                 block_size)
    return _launch_scores(q8 if mma_ordered else mma_order(q8), q_scale, weights, keys, page_table, page_rows, visible,
                          num_keys, softmax_scale, queries_per_request, allowed, block_size, want_block_max, keys_out,
                          hist, hist is None, **shape)


def quantize_queries_triton(q: torch.Tensor, zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.v4_indexer.quantize_index_queries` of q [Q, heads, d] (any float dtype)
    as one launch, the values in the scoring kernel's order (:func:`mma_order` of the
    reference's); ``zero`` [Q, n] (optional) is zeroed by the same programs."""
    nq, heads, d = q.shape
    if d % SCALE_BLOCK or d & (d - 1):
        raise ValueError(f"q must be [Q, heads, d] with d a power of two ≥ {SCALE_BLOCK}, got {tuple(q.shape)}")
    q = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    q8 = torch.empty(nq, heads, d, dtype=torch.uint8, device=q.device)
    scale = torch.empty(nq, heads, d // SCALE_BLOCK, dtype=torch.float32, device=q.device)
    if zero is not None and tuple(zero.shape[:1]) != (nq,):
        raise ValueError(f"zero must have {nq} rows, got {tuple(zero.shape)}")
    if nq:
        zn = zero.shape[1] if zero is not None else 0
        zp = triton.next_power_of_2(zn) if zn else 0
        _quantize_queries_kernel[(nq,)](q, q.stride(0), q8, scale, zero if zero is not None else scale,
                                        zero.stride(0) if zero is not None else 0, zn, H=heads,
                                        HP=triton.next_power_of_2(heads), D=d, ZP=zp, num_warps=4)
    return q8.view(torch.float8_e4m3fn), scale


def index_picks_triton(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, page_table: torch.Tensor, page_rows: int,
    visible: torch.Tensor, num_keys: int, softmax_scale: float, index_topk: int, queries_per_request: int = 1,
    allowed: torch.Tensor | None = None, block_size: int = 8, topk_blocks: int | None = None,
    allowed_blocks: int | None = None, select_buffers: tuple[int, int] | None = None, fused_histogram: bool = True,
    **shape,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kernels.v4_indexer.index_picks_reference` in five launches, graph-safe: the
    queries' quantization (zeroing the histogram), the scores with the level-1 histogram
    (float32, live tiles only), the selection's collect and finish
    (kernels/topk_triton.py), and with ``topk_blocks`` the candidate block mask (torch for
    ``index_topk`` above ``MAX_K`` or rows of more than ``MAX_MASK_BLOCKS`` blocks).
    ``allowed_blocks``: at most this many blocks of any row of ``allowed`` are allowed (the
    candidate source's top-k: the model's restricted layers), so the chain scores only those,
    as dense keys through :func:`compact_allowed_blocks` (one launch more, ~4× less to read
    and multiply at V4.1's 2048 of 8192 blocks). ``select_buffers``: the selection's (small,
    cap) candidate buffers; ``fused_histogram`` False: the histogram by its own pass over the
    scores instead of the scoring launch's atomics; ``shape``: the scoring launch's
    (:func:`index_scores_triton`)."""
    hist = new_histogram(q.shape[0], q.device)
    q8, q_scale = quantize_queries_triton(q, zero=hist)
    check_inputs(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys, queries_per_request, allowed,
                 block_size)
    width, blist = min(index_topk, num_keys), None
    if (allowed is not None and allowed_blocks is not None and topk_blocks is None and page_rows % block_size == 0
            and allowed.shape[1] <= MAX_MASK_BLOCKS):
        page_table, blist, visible = compact_allowed_blocks(allowed, page_table, page_rows, visible,
                                                            queries_per_request, allowed_blocks, block_size)
        page_rows, num_keys, queries_per_request, allowed = block_size, allowed_blocks * block_size, 1, None
    scores, bmax = _launch_scores(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys, softmax_scale,
                                  queries_per_request, allowed, block_size, topk_blocks is not None, False,
                                  hist if fused_histogram else None, False, **shape)
    if not fused_histogram:
        histogram_rows_triton(scores, visible, hist)
    if index_topk <= MAX_K:
        picks = topk_rows_triton(scores, visible, index_topk, hist, *(select_buffers or (None, None)), index_map=blist,
                                 map_block=block_size, width=width)
    else:  # beyond the candidate buffers: torch.topk on the live scores
        picks = topk_picks(_live(scores, visible, 1), index_topk)
        if blist is not None:
            picks = _mapped(picks, blist, block_size, width)
    if topk_blocks is None:
        return picks, None
    if bmax.shape[1] <= MAX_MASK_BLOCKS:
        return picks, candidate_blocks_triton(bmax, visible, topk_blocks, block_size)
    return picks, candidate_blocks(_live(bmax, visible, block_size), visible.view(-1, 1), topk_blocks, block_size)


def _mapped(picks: torch.Tensor, blist: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Compacted picks → key indices (−1 kept), padded with −1 to ``width`` columns."""
    blocks = blist.gather(1, (picks.clamp_min(0) // block_size).to(torch.int64)).to(torch.int64)
    keys = torch.where(picks >= 0, blocks * block_size + picks % block_size, -1)
    return torch.nn.functional.pad(keys, (0, width - keys.shape[1]), value=-1)


def _live(values: torch.Tensor, visible: torch.Tensor, per: int) -> torch.Tensor:
    """values [Q, n] with −inf past each row's ``ceil(visible / per)`` entries (never written there)."""
    live = (visible.view(-1, 1) + per - 1) // per
    return values.masked_fill(torch.arange(values.shape[1], device=values.device) >= live, float("-inf"))
