"""Triton lightning-indexer scores for DeepSeek-V4.1 (contract and reference: kernels/v4_indexer.py).

Design (the expected numbers: benchmarks/KERNEL_NOTES.md):

- A program owns ``block_q`` queries of one request (decode: 1; a prefill chunk: 4, so the
  MMA's N is 4 × 32 heads = 128; heads pad to a power of two ≥ 16) and a run of ``TILES``
  tiles of ``block_n`` keys.
  Keys fill the MMA's M: Sᵀ [block_n, block_q·heads] = K·Qᵀ.
- Each 32-dim block is one FP8 MMA (K = 32): the record's 16 bytes of e2m1 pairs become e4m3
  bytes by PRMT byte lookups (e2m1 → e4m3 is exact; 14 instructions per 8 codes, plain
  integer ops under the interpreter), the query block is e4m3 already; the
  product of two e2m1 vectors of 32 is exact in the fp32 accumulator, and the two power-of-two
  scales multiply it exactly. Only the sum over the d/32 blocks and the head sum round.
- ReLU, the head weights (H^-½ folded in), the d^-½ scale, the visibility mask and V4.1's
  candidate mask are applied on the tile, which stores scores or (``keys_out``, the model's
  path) the int64 keys of the ordered top-k (kernels/topk.py), so the selection is one select;
  the candidate source also gets the max of every block of ``block_size`` keys (the input of
  the block top-k) from the same tile.
- Tiles past a program's largest visible count store −inf without reading keys or running
  MMAs (causal prefill does half the work; decode at fixed graph widths skips the padding):
  two loops, the live tiles' trip count from the counts, so the first stays branch-free and
  Triton pipelines its key loads (cp.async, ``num_stages``). The grid depends on shapes only
  (never on counts): capturable in a CUDA graph.
- The memory roofline at decode: every visible key's 68 bytes once per request (and per
  query block in a prefill); 8 kFLOP per key and request (32 heads × 128 dims), so ~120
  FLOP per byte — under the FP8 ridge of an H200, a bandwidth-bound kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.v4_indexer import check_inputs


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


@triton.jit
def _unpack_keys(packed, PRMT: tl.constexpr):
    """Packed e2m1 pairs uint8 [BN, 16] → e4m3 [BN, 32] (even dims from the low nibbles)."""
    if PRMT:
        lo, hi = tl.inline_asm_elementwise(_E2M1_TO_E4M3_ASM, "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8),
                                           is_pure=True, pack=4)
    else:  # the interpreter
        lo = _e2m1_to_e4m3(packed & 15)
        hi = _e2m1_to_e4m3(packed >> 4)
    return tl.reshape(tl.join(lo, hi), [packed.shape[0], 32]).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _e2m1_to_e4m3(n):
    """e2m1 codes (uint8 0..15) → the bytes of the same values in e4m3, exactly: magnitude
    codes 2..7 (1 … 6) are ``(code << 2) + 0x30``, code 1 (0.5) is 0x30, code 0 is zero."""
    mag = n & 7
    bits = tl.where(mag >= 2, (mag << 2) + 0x30, tl.where(mag == 1, 0x30, 0)).to(tl.uint8)
    return bits | ((n & 8) << 4).to(tl.uint8)


@triton.jit
def _index_scores_kernel(
    Q8, QS, W, KEYS, PT, pt_stride, page_rows, VIS, ALLOWED, al_stride, OUT, out_stride, BMAX, bm_stride,
    num_q, num_keys, q_per_req, softmax_scale, TILES: tl.constexpr,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, REC: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr,
    BS: tl.constexpr, HAS_ALLOWED: tl.constexpr, WANT_BMAX: tl.constexpr, SKIP: tl.constexpr, PRMT: tl.constexpr,
    KEYS_OUT: tl.constexpr,
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
    vis = tl.load(VIS + qj, mask=qj_ok, other=0)
    vis_max = tl.max(vis, 0)
    cols = tl.arange(0, 32)
    k_first = tl.program_id(1) * TILES * BN
    # tiles with a visible key for some query of the program, then the rest (−inf, no reads)
    live = tl.minimum(tl.maximum(tl.cdiv(vis_max - k_first, BN), 0), TILES) if SKIP else TILES
    for t in range(0, live):
        offs = k_first + t * BN + tl.arange(0, BN)
        valid = (offs < vis_max) & (offs < num_keys)
        page = tl.load(PT + req * pt_stride + offs // page_rows, mask=valid, other=0).to(tl.int64)
        # byte offsets as page · (page_rows · REC) + slot · REC, not (page · page_rows + slot) · REC:
        # Triton's alignment analysis takes the sum of a masked load and a contiguous range for a
        # multiple of 16 at every element and would issue 16-byte loads at 4-aligned records
        rec = KEYS + page * (page_rows * REC) + (offs % page_rows) * REC
        acc = tl.zeros([BN, M], dtype=tl.float32)
        for b in tl.static_range(NB):
            packed = tl.load(rec[:, None] + (b * 16 + tl.arange(0, 16))[None, :], mask=valid[:, None], other=0)
            k8 = _unpack_keys(packed, PRMT)
            e = tl.load(rec + D // 2 + b, mask=valid, other=127)
            k_scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            q8 = tl.load(Q8 + (qi64 * H + head)[:, None] * D + b * 32 + cols[None, :], mask=q_ok[:, None],
                         other=0).to(tl.float8e4nv, bitcast=True)
            q_scale = tl.load(QS + (qi64 * H + head) * NB + b, mask=q_ok, other=0.0)
            part = tl.dot(k8, tl.trans(q8))  # [BN, M], exact
            acc += part * k_scale[:, None] * q_scale[None, :]
        s = tl.maximum(acc, 0.0) * softmax_scale * w[None, :]
        s = tl.sum(tl.reshape(s, [BN, BQ, HP]), 2)  # [BN, BQ]
        keep = offs[:, None] < vis[None, :]
        if HAS_ALLOWED:
            ok = tl.load(ALLOWED + qj.to(tl.int64)[None, :] * al_stride + (offs // BS)[:, None],
                         mask=keep & qj_ok[None, :], other=0)
            keep = keep & (ok != 0)
        _store_tile(tl.where(keep, s, float("-inf")), OUT, out_stride, BMAX, bm_stride, qj, qj_ok, k_first + t * BN,
                    num_keys, BN, BQ, BS, WANT_BMAX, KEYS_OUT)
    for t in range(live, TILES):
        _store_tile(tl.full([BN, BQ], float("-inf"), dtype=tl.float32), OUT, out_stride, BMAX, bm_stride, qj, qj_ok,
                    k_first + t * BN, num_keys, BN, BQ, BS, WANT_BMAX, KEYS_OUT)


@triton.jit
def _store_tile(s, OUT, out_stride, BMAX, bm_stride, qj, qj_ok, first, num_keys, BN: tl.constexpr, BQ: tl.constexpr,
                BS: tl.constexpr, WANT_BMAX: tl.constexpr, KEYS_OUT: tl.constexpr):
    """Scores s [BN, BQ] of keys first … first + BN − 1, or (KEYS_OUT) their int64 top-k keys
    (kernels/topk.py's ``order_keys``); WANT_BMAX: their block maxima too."""
    offs = first + tl.arange(0, BN)
    dst = OUT + qj.to(tl.int64)[None, :] * out_stride + offs[:, None]
    ok = (offs < num_keys)[:, None] & qj_ok[None, :]
    if KEYS_OUT:
        bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # −0.0 is 0.0
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        tl.store(dst, (ordered << 32) | (0xFFFFFFFF - offs.to(tl.int64))[:, None], mask=ok)
    else:
        tl.store(dst, s, mask=ok)
    if WANT_BMAX:
        bmax = tl.max(tl.reshape(s, [BN // BS, BS, BQ]), 1)  # [BN / BS, BQ]
        blocks = first // BS + tl.arange(0, BN // BS)
        tl.store(BMAX + qj.to(tl.int64)[None, :] * bm_stride + blocks[:, None], bmax,
                 mask=(blocks[:, None] * BS < num_keys) & qj_ok[None, :])


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def default_shape(queries_per_request: int) -> tuple[int, int, int, int]:
    """(block_n, block_q, num_warps, num_stages): decode 128 keys × 1 query on 4 warps, 3
    stages (the MMA's N = the heads); a prefill 64 keys × 4 queries on 8 warps, 2 stages (N =
    128 query heads; 128-key tiles, 4 warps or 3 stages spill on sm_90 at 32 heads × 128)."""
    return (128, 1, 4, 3) if queries_per_request == 1 else (64, 4, 8, 2)


def launch_shape(num_q: int, num_keys: int, block_q: int, block_n: int, sms: int) -> tuple[int, int]:
    """(query programs, tiles per program): about four programs per SM, at most 16 tiles each;
    from shapes only."""
    q_programs = -(-num_q // block_q)
    tiles = -(-num_keys // block_n)
    per_program = max(1, min(16, q_programs * tiles // (4 * sms)))
    return q_programs, per_program


def index_scores_triton(
    q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, page_table: torch.Tensor,
    page_rows: int, visible: torch.Tensor, num_keys: int, softmax_scale: float, queries_per_request: int = 1,
    allowed: torch.Tensor | None = None, block_size: int = 8, want_block_max: bool = False, keys_out: bool = False,
    block_n: int | None = None, block_q: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, skip_dead_tiles: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kernels.v4_indexer.index_scores_reference` as one launch; no host sync. Launch
    shape (None: :func:`default_shape`): ``block_n`` keys per tile, ``block_q`` queries per
    program, ``num_warps``, ``num_stages``; ``skip_dead_tiles`` False computes the tiles past
    every query's count too (masked loads read nothing)."""
    check_inputs(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys, queries_per_request, allowed,
                 block_size)
    nq, heads, d = q8.shape
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
    q_programs, per_program = launch_shape(nq, num_keys, block_q, block_n, num_sms(device))
    grid = (q_programs, -(-num_keys // (per_program * block_n)))
    vis = visible.to(torch.int32)
    al = allowed.view(torch.uint8) if allowed is not None else vis
    _index_scores_kernel[grid](
        q8.contiguous().view(torch.uint8), q_scale.contiguous(), weights.contiguous(), keys, page_table,
        page_table.stride(0), page_rows, vis, al, al.stride(0) if allowed is not None else 0,
        scores, scores.stride(0), bmax if bmax is not None else scores, bmax.stride(0) if bmax is not None else 0,
        nq, num_keys, nq + block_q if one_request else queries_per_request, float(softmax_scale), TILES=per_program,
        H=heads, HP=max(16, triton.next_power_of_2(heads)), D=d, REC=keys.shape[1], BQ=block_q, BN=block_n,
        BS=block_size,
        HAS_ALLOWED=allowed is not None, WANT_BMAX=want_block_max, SKIP=skip_dead_tiles,
        PRMT=device.type == "cuda", KEYS_OUT=keys_out, num_warps=num_warps,
        num_stages=num_stages,
    )
    return scores, bmax
