"""Paged MLA decode in Triton for Hopper: FP8 (or bf16) query and latent cache, split-KV.

Same contract as ``kernels.mla_decode.mla_decode_reference``. Design, and why:

- A program owns ``block_h`` query rows (the flattened (query token, head) pairs of one
  request) and ``dv`` of the 512 output columns. Every K tile it reads feeds all its rows.
  The fp32 accumulator [block_h, dv] must stay under ~128 registers per thread: a
  [64, 512] accumulator on one warpgroup spills (benchmarks/KERNEL_NOTES.md), so
  the compute-bound default is 128 rows x 256 columns on 8 warps (Q·Kᵀ is recomputed by
  the two column halves; with 64 rows on 8 warps Triton instead has both warpgroups compute
  the same scores, which costs the same).
- The 576-wide key is split into the latent (512, also V) and rope (64) parts. V is loaded
  a second time through its own pointer (an L2 hit) so each shared-memory layout gets a
  plain async copy instead of a register round trip.
- FP8 cache: Q·Kᵀ runs on FP8 tensor cores (QGMMA). P·V defaults to fp16 with V widened
  (HGMMA): FP8 P·V (``pv="fp8"``) needs V transposed to K-major, which Triton does with
  byte-wise shared-memory stores and measured 2-4x slower. P is scaled per tile relative to
  the tile's own row maximum; that weight ``exp2(m_tile - m_run)`` is folded into a per-row
  accumulator scale ``c`` (acc_true = acc_stored · c), one multiply per element per tile.
- Split-KV: ``num_splits`` programs share one request's tiles and ``_combine_kernel`` merges
  them by log-sum-exp, so small batches fill the 132 SMs. The split count depends only on
  shapes (never on ``seq_lens`` values) so the call can be captured in a CUDA graph.
- Only tiles that reach the causal frontier (s_q > 1) or the ragged end take the masked path.
- ``tokens_major`` computes Sᵀ = K·Qᵀ so keys, not padded heads, fill the MMA's 64-row
  dimension (meant for few heads); it measured slower than the rows-major default here.

Measured on the H200 (B=128, S=4096, see benchmarks/KERNEL_NOTES.md): 438 µs at 128 heads (334
TFLOP/s, FlashInfer fa3 bf16: 261 µs) and 296 µs at 16 heads (1.0 TB/s); the CUDA C++ kernels
(``kernels/mla_decode_cuda.py``) are the fast FP8 path, this one the portable fallback.
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.gpu import num_sms
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_MAX = 448.0
D_ROPE = 64

PV_FP8 = 0  # P e4m3 (scaled per tile) x V e4m3
PV_FP16 = 1  # P fp16 x V upcast to fp16 (FP8 cache, 16-bit second product)
PV_16 = 2  # 16-bit cache: P in the cache dtype
PV_FP8X2 = 3  # P = P_hi + P_lo, both e4m3: two FP8 products, ~2^-8 instead of ~2^-4 error
_PV_MODES = {"fp8": PV_FP8, "fp8x2": PV_FP8X2, "fp16": PV_FP16}


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig:
    """Launch shape of the split kernel; ``None`` fields are chosen per call."""

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    dv: int = 512  # output columns per program (< kv_lora_rank: smaller accumulator, Q·Kᵀ redone)
    # FP8 Q and cache, P·V: "fp16" (V widened, ~bf16 accuracy), "fp8" (one e4m3 product:
    # fastest, but P's 3 mantissa bits cost ~3e-2 relative error), "fp8x2" (P = hi + lo)
    pv: str = "fp16"
    num_splits: int | None = None
    tokens_major: bool = False  # keys fill the MMA's M dimension (for <= 32 rows per request)


def default_config(q_dtype: torch.dtype, kv_dtype: torch.dtype, rows: int) -> MLADecodeConfig:
    """The fastest measured launch shape per regime (rows = s_q x heads of one request;
    sweep on the H200 in benchmarks/KERNEL_NOTES.md, B=128, S=4096).

    Few rows (TP-sharded heads) should be memory-bound; 4-warp programs on half the output
    columns were fastest (two fit per SM). Many rows are compute-bound: 128 rows per
    program put one 64-row MMA tile on each warpgroup (with 64 rows and 8 warps Triton
    makes both warpgroups compute the same scores), half the output columns keep the
    accumulator at 128 registers per thread.
    """
    fp8 = kv_dtype == torch.float8_e4m3fn
    if rows <= 16:
        return MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, dv=256)
    if rows <= 32:
        return MLADecodeConfig(block_h=32, block_n=32, num_warps=8, num_stages=3, dv=512)
    if rows <= 64 or not fp8:  # bf16 tiles are twice as large: 128 rows do not fit in smem
        if fp8:
            return MLADecodeConfig(block_h=64, block_n=32, num_warps=4, num_stages=2, dv=256)
        return MLADecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=2, dv=512)
    return MLADecodeConfig(block_h=128, block_n=64, num_warps=8, num_stages=2, dv=256)


def choose_num_splits(programs: int, num_sms: int, max_splits: int = 32) -> int:
    """Enough splits that about two waves of programs exist; 1 when the batch already fills."""
    if programs >= num_sms * 0.8:
        return 1
    return max(1, min(max_splits, triton.cdiv(2 * num_sms, programs)))


@triton.jit
def _load_tile(
    kv_base, v_base, bt_row, t, n, stride_kvp, stride_kvt, dv0,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D_NOPE: tl.constexpr, D_PE: tl.constexpr,
    DV: tl.constexpr, MASKED: tl.constexpr,
):
    """Token positions and the (latent, rope, value) tiles of tile ``t`` of one request."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, D_NOPE)
    offs_p = tl.arange(0, D_PE)
    offs_v = dv0 + tl.arange(0, DV)
    tok = t * BLOCK_N + offs_n
    if PAGE % BLOCK_N == 0:
        page = tl.load(bt_row + (t * BLOCK_N) // PAGE).to(tl.int64)
        off = page * stride_kvp + ((t * BLOCK_N) % PAGE + offs_n) * stride_kvt
    else:
        if MASKED:
            page = tl.load(bt_row + tok // PAGE, mask=tok < n, other=0)
        else:
            page = tl.load(bt_row + tok // PAGE)
        off = page.to(tl.int64) * stride_kvp + (tok % PAGE) * stride_kvt
    k_row = kv_base + off
    # V is the latent part of the same rows. It is loaded again through a second pointer
    # (an L2 hit) so that the compiler keeps two plain async copies, one per shared-memory
    # layout, instead of routing one load through registers into both layouts.
    v_row = v_base + off
    if MASKED:
        in_seq = (tok < n)[:, None]
        kn = tl.load(k_row[:, None] + offs_c[None, :], mask=in_seq, other=0.0)
        kp = tl.load(k_row[:, None] + D_NOPE + offs_p[None, :], mask=in_seq, other=0.0)
        v = tl.load(v_row[:, None] + offs_v[None, :], mask=in_seq, other=0.0)
    else:
        kn = tl.load(k_row[:, None] + offs_c[None, :])
        kp = tl.load(k_row[:, None] + D_NOPE + offs_p[None, :])
        v = tl.load(v_row[:, None] + offs_v[None, :])
    return tok, kn, kp, v


@triton.jit
def _online_softmax(s, m_i, l_i, c_i, AXIS: tl.constexpr, MASKED: tl.constexpr, P_SCALE: tl.constexpr):
    """Scores ``s`` (log2 units, masked entries at -1e30) reduced along ``AXIS`` (the key
    axis). Returns P relative to the tile's own row max, the new row state, and the factor
    to apply to the stored accumulator before adding P·V."""
    m_t = tl.max(s, AXIS)
    m_new = tl.maximum(m_i, m_t)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(m_t - m_new)  # the tile's weight relative to the running max, in [0, 1]
    if MASKED:
        row_live = m_t > -5.0e29
        p = tl.exp2(s - tl.expand_dims(tl.where(row_live, m_t, 0.0), AXIS))
    else:
        p = tl.exp2(s - tl.expand_dims(m_t, AXIS))
    l_new = l_i * alpha + beta * tl.sum(p, AXIS)
    # acc_true = acc * c: the tile's own scale enters through c, one multiply per element.
    c_new = tl.maximum(beta, 8.673617379884035e-19) * (1.0 / P_SCALE)  # floor 2^-60
    if MASKED:
        c_new = tl.where(row_live, c_new, c_i * alpha)
    return p, m_new, l_new, c_new, c_i * alpha / c_new


@triton.jit
def _tile_step(
    acc, m_i, l_i, c_i, q_nope, q_pe, kv_base, v_base, bt_row, t, n, q_pos, sm_scale_log2,
    stride_kvp, stride_kvt, dv0,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D_NOPE: tl.constexpr, D_PE: tl.constexpr,
    DV: tl.constexpr, MASKED: tl.constexpr, FP8_QK: tl.constexpr, PV_MODE: tl.constexpr,
    P_SCALE: tl.constexpr, TOKENS_MAJOR: tl.constexpr,
):
    """One BLOCK_N-token tile. Rows-major: S = Q·Kᵀ [rows, keys], acc [rows, DV].
    Tokens-major (few rows): Sᵀ = K·Qᵀ [keys, rows], accᵀ [DV, rows], so the MMA's
    64-wide M dimension is filled by keys rather than by padding 16 heads to 64."""
    tok, kn, kp, v = _load_tile(kv_base, v_base, bt_row, t, n, stride_kvp, stride_kvt, dv0,
                                PAGE, BLOCK_N, D_NOPE, D_PE, DV, MASKED)
    if not FP8_QK:
        kn = kn.to(q_nope.dtype)
        kp = kp.to(q_pe.dtype)
    if TOKENS_MAJOR:
        s = tl.dot(kn, tl.trans(q_nope))
        s = tl.dot(kp, tl.trans(q_pe), s) * sm_scale_log2
        if MASKED:
            s = tl.where(tok[:, None] <= q_pos[None, :], s, -1.0e30)
        p, m_i, l_i, c_i, ratio = _online_softmax(s, m_i, l_i, c_i, 0, MASKED, P_SCALE)
        acc = acc * ratio[None, :]
        if PV_MODE == 0:
            acc = tl.dot(tl.trans(v), (p * P_SCALE).to(tl.float8e4nv), acc)
        elif PV_MODE == 3:
            ps = p * P_SCALE
            p_hi = ps.to(tl.float8e4nv)
            acc = tl.dot(tl.trans(v), p_hi, acc)
            acc = tl.dot(tl.trans(v), (ps - p_hi.to(tl.float32)).to(tl.float8e4nv), acc)
        elif PV_MODE == 1:
            acc = tl.dot(tl.trans(v.to(tl.float16)), p.to(tl.float16), acc)
        else:
            acc = tl.dot(tl.trans(v), p.to(v.dtype), acc)
    else:
        s = tl.dot(q_nope, tl.trans(kn))
        s = tl.dot(q_pe, tl.trans(kp), s) * sm_scale_log2
        if MASKED:
            s = tl.where(tok[None, :] <= q_pos[:, None], s, -1.0e30)
        p, m_i, l_i, c_i, ratio = _online_softmax(s, m_i, l_i, c_i, 1, MASKED, P_SCALE)
        acc = acc * ratio[:, None]
        if PV_MODE == 0:
            acc = tl.dot((p * P_SCALE).to(tl.float8e4nv), v, acc)
        elif PV_MODE == 3:
            ps = p * P_SCALE
            p_hi = ps.to(tl.float8e4nv)
            acc = tl.dot(p_hi, v, acc)
            acc = tl.dot((ps - p_hi.to(tl.float32)).to(tl.float8e4nv), v, acc)
        elif PV_MODE == 1:
            acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i, c_i


@triton.jit
def _mla_decode_kernel(
    Q, KV, V, BT, SEQ, O, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kvp, stride_kvt, stride_btb,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls, stride_lh,
    H, S_Q, NUM_SPLITS, sm_scale_log2, out_scale,
    PAGE: tl.constexpr, D_NOPE: tl.constexpr, D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DV: tl.constexpr, SPLIT: tl.constexpr,
    FP8_QK: tl.constexpr, PV_MODE: tl.constexpr, UPCAST_Q: tl.constexpr, P_SCALE: tl.constexpr,
    TOKENS_MAJOR: tl.constexpr,
):
    """Grid (row blocks x output-column blocks, batch, KV splits).

    Each program computes DV of the D_NOPE output columns for BLOCK_H rows (all scores, so a
    DV < D_NOPE split recomputes Q·Kᵀ but halves the accumulator). With SPLIT, O/LSE are
    fp32 partials [B*S_Q*H, NUM_SPLITS, D_NOPE] / [B*S_Q*H, NUM_SPLITS].
    """
    V_SPLITS: tl.constexpr = D_NOPE // DV
    pid_r = tl.program_id(0) // V_SPLITS
    dv0 = (tl.program_id(0) % V_SPLITS) * DV
    b = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_r * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < S_Q * H
    j = rows // H
    h = rows % H
    offs_c = tl.arange(0, D_NOPE)
    offs_p = tl.arange(0, D_PE)
    offs_v = dv0 + tl.arange(0, DV)

    q_row = Q + b.to(tl.int64) * stride_qb + j * stride_qs + h * stride_qh
    q_nope = tl.load(q_row[:, None] + offs_c[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_row[:, None] + D_NOPE + offs_p[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST_Q:
        q_nope = q_nope.to(tl.bfloat16)
        q_pe = q_pe.to(tl.bfloat16)

    n = tl.load(SEQ + b)
    q_pos = n - S_Q + j  # last key position each row may see
    num_tiles = tl.cdiv(n, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t0 = pid_s * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)
    t_safe = (n - S_Q + 1) // BLOCK_N  # tiles before this one need no mask for any row
    t_mid = tl.maximum(t0, tl.minimum(t1, t_safe))

    if TOKENS_MAJOR:
        acc = tl.zeros([DV, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    c_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    for t in range(t0, t_mid):
        acc, m_i, l_i, c_i = _tile_step(
            acc, m_i, l_i, c_i, q_nope, q_pe, KV, V, bt_row, t, n, q_pos, sm_scale_log2,
            stride_kvp, stride_kvt, dv0, PAGE, BLOCK_N, D_NOPE, D_PE, DV, False, FP8_QK, PV_MODE,
            P_SCALE, TOKENS_MAJOR)
    for t in range(t_mid, t1):
        acc, m_i, l_i, c_i = _tile_step(
            acc, m_i, l_i, c_i, q_nope, q_pe, KV, V, bt_row, t, n, q_pos, sm_scale_log2,
            stride_kvp, stride_kvt, dv0, PAGE, BLOCK_N, D_NOPE, D_PE, DV, True, FP8_QK, PV_MODE,
            P_SCALE, TOKENS_MAJOR)

    has = l_i > 0.0
    inv = tl.where(has, c_i / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    lse_ok = row_ok & (dv0 == 0)
    if SPLIT:
        scale = inv
        o_row = O + ((b * S_Q * H + rows).to(tl.int64) * NUM_SPLITS + pid_s) * D_NOPE
        l_ptr = LSE + (b * S_Q * H + rows).to(tl.int64) * NUM_SPLITS + pid_s
    else:
        scale = inv * out_scale
        o_row = O + b.to(tl.int64) * stride_ob + j * stride_os + h * stride_oh
        l_ptr = LSE + b * stride_lb + j * stride_ls + h * stride_lh
    if TOKENS_MAJOR:
        out = acc * scale[None, :]
        tl.store(o_row[None, :] + offs_v[:, None], out.to(O.dtype.element_ty), mask=row_ok[None, :])
    else:
        out = acc * scale[:, None]
        tl.store(o_row[:, None] + offs_v[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(l_ptr, lse, mask=lse_ok)


@triton.jit
def _combine_kernel(
    PO, PL, O, LSE,
    H, S_Q, NUM_SPLITS, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh, out_scale,
    SPLITS_P2: tl.constexpr, D: tl.constexpr,
):
    """One program per (request, query token, head): merge the splits by their LSE."""
    flat = tl.program_id(0)
    b = flat // (S_Q * H)
    rem = flat % (S_Q * H)
    j = rem // H
    h = rem % H
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    lse = tl.load(PL + flat.to(tl.int64) * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    acc = tl.zeros([D], dtype=tl.float32)
    base = PO + flat.to(tl.int64) * NUM_SPLITS * D
    for s in range(NUM_SPLITS):
        ws = tl.sum(tl.where(offs_s == s, w, 0.0), 0)
        acc += ws * tl.load(base + s * D + offs_d)
    out = acc * (out_scale / total)
    tl.store(O + b.to(tl.int64) * stride_ob + j * stride_os + h * stride_oh + offs_d, out.to(O.dtype.element_ty))
    tl.store(LSE + b * stride_lb + j * stride_ls + h * stride_lh, m + tl.log(total))


def _check_inputs(q, kv_cache, block_tables, seq_lens, kv_lora_rank):
    if q.dim() != 4 or kv_cache.dim() != 3:
        raise ValueError(f"q must be [B, s_q, H, D] and kv_cache [blocks, page, D]; "
                         f"got {tuple(q.shape)}, {tuple(kv_cache.shape)}")
    d = q.shape[-1]
    if kv_cache.shape[-1] != d or d != kv_lora_rank + D_ROPE:
        raise ValueError(f"head dim {d} / cache dim {kv_cache.shape[-1]} must both be kv_lora_rank + {D_ROPE}")
    if kv_lora_rank & (kv_lora_rank - 1):
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must be a power of two for this kernel")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in their last dimension")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} dtype {t.dtype} unsupported (e4m3, bf16 or fp16)")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_tables and seq_lens must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError("block_tables must be [B, max_pages] and seq_lens [B]")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    if not (q.device == kv_cache.device == block_tables.device == seq_lens.device):
        raise ValueError("all inputs must be on one device")


def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    config: MLADecodeConfig | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode; returns (out [B, s_q, H, kv_lora_rank], lse [B, s_q, H] float32).

    Every request needs ``seq_lens[b] >= s_q`` (a query token with no visible key has no
    softmax). No host synchronization happens here and the launch shape depends only on
    tensor shapes, so the call can be captured in a CUDA graph; pass ``out``/``lse`` to
    write into persistent buffers.
    """
    _check_inputs(q, kv_cache, block_tables, seq_lens, kv_lora_rank)
    bsz, s_q, h, _ = q.shape
    if out_dtype is None:
        out_dtype = q.dtype if q.element_size() > 1 else torch.bfloat16
    rows = s_q * h
    cfg = config or default_config(q.dtype, kv_cache.dtype, rows)
    q8 = q.dtype == torch.float8_e4m3fn
    kv8 = kv_cache.dtype == torch.float8_e4m3fn
    if not q8 and not kv8 and q.dtype != kv_cache.dtype:
        raise TypeError(f"16-bit query {q.dtype} and cache {kv_cache.dtype} must match")
    if (q8 and not kv8 and kv_cache.dtype != torch.bfloat16) or (kv8 and not q8 and q.dtype != torch.bfloat16):
        raise TypeError("mixing an e4m3 operand with a 16-bit one needs the 16-bit one in bf16")
    if cfg.pv not in _PV_MODES:
        raise ValueError(f"pv mode {cfg.pv!r} not one of {sorted(_PV_MODES)}")
    dv = min(cfg.dv, kv_lora_rank)
    if kv_lora_rank % dv:
        raise ValueError(f"dv {cfg.dv} must divide kv_lora_rank {kv_lora_rank}")
    page = kv_cache.shape[1]
    if page % cfg.block_n and cfg.block_n % page:
        raise ValueError(f"page size {page} and block_n {cfg.block_n} must divide one another")
    fp8_qk = q8 and kv8  # otherwise the e4m3 side is widened to bf16 in the kernel
    pv_mode = _PV_MODES[cfg.pv] if fp8_qk else (PV_FP16 if kv8 else PV_16)

    col_blocks = triton.cdiv(rows, cfg.block_h) * (kv_lora_rank // dv)
    splits = cfg.num_splits or choose_num_splits(bsz * col_blocks, num_sms(q.device))
    if out is None:
        out = torch.empty(bsz, s_q, h, kv_lora_rank, dtype=out_dtype, device=q.device)
    if lse is None:
        lse = torch.empty(bsz, s_q, h, dtype=torch.float32, device=q.device)
    if out.shape != (bsz, s_q, h, kv_lora_rank) or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, s_q, H, {kv_lora_rank}] with unit last stride")
    if lse.shape != (bsz, s_q, h) or lse.dtype != torch.float32:
        raise ValueError("lse must be float32 [B, s_q, H]")
    sm_scale_log2 = float(softmax_scale) * float(q_scale) * float(k_scale) * LOG2E
    meta = dict(
        PAGE=page, D_NOPE=kv_lora_rank, D_PE=D_ROPE, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        DV=dv, SPLIT=splits > 1, FP8_QK=fp8_qk, PV_MODE=pv_mode, UPCAST_Q=q8 and not kv8,
        P_SCALE=FP8_MAX if pv_mode in (PV_FP8, PV_FP8X2) else 1.0,
        TOKENS_MAJOR=cfg.tokens_major, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    grid = (col_blocks, bsz, splits)
    q_strides = (q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0))
    if splits == 1:
        _mla_decode_kernel[grid](
            q, kv_cache, kv_cache, block_tables, seq_lens, out, lse, *q_strides,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
            h, s_q, 1, sm_scale_log2, float(k_scale), **meta)
        return out, lse
    part_o = torch.empty(bsz * rows, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    part_l = torch.empty(bsz * rows, splits, dtype=torch.float32, device=q.device)
    _mla_decode_kernel[grid](
        q, kv_cache, kv_cache, block_tables, seq_lens, part_o, part_l, *q_strides,
        0, 0, 0, 0, 0, 0, h, s_q, splits, sm_scale_log2, float(k_scale), **meta)
    _combine_kernel[(bsz * rows,)](
        part_o, part_l, out, lse, h, s_q, splits, out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), float(k_scale),
        SPLITS_P2=triton.next_power_of_2(splits), D=kv_lora_rank, num_warps=4)
    return out, lse


__all__ = ["MLADecodeConfig", "default_config", "choose_num_splits", "mla_decode_triton"]
