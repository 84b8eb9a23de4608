"""Triton sparse prefill for DeepSeek-V4 / V4.1 (contract: ``kernels.v4_sparse_prefill``).

Two launches per chunk (design and numbers: benchmarks/KERNEL_NOTES.md):

1. **Picked entries** (when the layer has per-token picks): each token's own k records, the
   sparse decode kernel (kernels/v4_sparse_decode_triton.py) with the chunk as s_q = T query
   tokens of one request, writing a float32 normalized partial output and its lse (no sink).
   Picks are per token, so nothing is shared between tokens there: the decode kernel's
   program (one token × a block of heads) is the right shape.
2. **Window (+ all visible entries) and merge**: a program owns a tile of ``block_t``
   consecutive tokens × ``block_h`` heads, flattened into the M = block_t·block_h rows of its
   MMAs. The tile's window is one key range, positions (p_first − window, p_last], loaded once
   per tile in ``block_n``-key tiles and masked per row (causal + window); keys before the
   chunk come from the cached records (gathered through the ring rows), the rest from the
   chunk's own bf16 rows. V4's HCA entries (every entry visible) are one more shared range,
   masked per row by w < (p + 1) // ratio. The picks' partial is merged by its lse, the sink
   added, and the output written once in bf16.

Records are dequantized by the decode kernel's piece loader (fp16 products, fp32 softmax and
accumulators; bf16 rows for ``--kv-cache-dtype auto`` as the ``bf16`` record). Launch
shapes depend on T, H and the chunk's start only (no host reads of indices).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.v4_sparse_decode import HEAD_DIM, SparseKV, row_record_cache
from kernels.v4_sparse_decode_triton import (DATA_BYTES, FORMATS, RECORD_BYTES, LOG2E, _load_q, _piece, _qk,
                                             _softmax_pv, _zeros_acc, v4_sparse_decode_triton)
from kernels.v4_sparse_prefill import PrefillEntries, PrefillWindow, StoredRows, check_prefill_inputs

_LOG2E = tl.constexpr(LOG2E)  # a global a kernel may read
DECODE_TOKENS = 32768  # tokens per launch of the decode kernel for the picks (s_q on a 65535-wide grid axis)
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class SparsePrefillConfig:
    """Launch shape of the window kernel; ``None`` fields from :func:`default_prefill_config`."""

    block_h: int | None = None  # heads per program (a power of two; fewer heads pad)
    block_t: int | None = None  # tokens per program: M = block_t · block_h rows
    dv_split: int | None = None  # 2: each of two programs writes half the output dims
    block_n: int | None = None  # keys per tile
    num_warps: int | None = None
    num_stages: int | None = None


def default_prefill_config(heads: int) -> SparsePrefillConfig:
    """Half the output dims per program (the decode kernel's 64-head shape). Up to 16 heads:
    128 rows on 8 warps (8 heads: 16 tokens per tile; the tile's 143 keys take the 5 tiles of
    32 that an unaligned 128-key window takes anyway; the least spill offline: 176 B); more
    heads: 64 rows on 4 warps (64 heads: one token, its 128 keys exactly 4 tiles)."""
    block_h = min(triton.next_power_of_2(heads), 64)
    rows, warps = (128, 8) if block_h <= 16 else (64, 4)
    return SparsePrefillConfig(block_h=block_h, block_t=max(1, rows // block_h), dv_split=2, block_n=32,
                               num_warps=warps, num_stages=2)


def resolve_prefill_config(heads: int, config: SparsePrefillConfig | None) -> SparsePrefillConfig:
    base = default_prefill_config(heads)
    if config is None:
        return base
    return replace(config, **{k: getattr(base, k) for k in base.__dataclass_fields__ if getattr(config, k) is None})


@triton.jit
def _keys(cache, cache16, row_words, idx, from_cache, CH16, ch_st, crow, from_chunk, D0: tl.constexpr,
          W: tl.constexpr, FMT: tl.constexpr, DATA: tl.constexpr, ALIGN: tl.constexpr, HAS_CHUNK: tl.constexpr,
          BN: tl.constexpr):
    """fp16 [BN, W]: dims D0..D0+W of BN keys, each from the stored records (``from_cache``,
    flat row ``idx``, ``row_words`` words of ALIGN bytes apart) or the chunk's bf16 rows
    (``from_chunk``, row ``crow``); zeros elsewhere. The stride in words tells the compiler how
    every record is aligned (V4's 584-byte rows are no 16-byte multiple, so a byte stride gets
    no divisibility hint at all: byte loads and twice the spills)."""
    drow = idx.to(tl.int64) * row_words * ALIGN
    k = _piece(cache, cache16, drow, drow + DATA, from_cache, D0, W, FMT, BN)
    if HAS_CHUNK:
        ptr = CH16 + (crow.to(tl.int64) * ch_st)[:, None] + (D0 + tl.arange(0, W))[None, :]
        own = tl.load(ptr, mask=from_chunk[:, None], other=0.0).to(tl.float16)
        k = tl.where(from_chunk[:, None], own, k)
    return k


@triton.jit
def _tile(acc_a, acc_b, acc_c, acc_d, m_i, l_i, qa, qb, qc, qd, visible,
          cache, cache16, row_words, idx, from_cache, CH16, ch_st, crow, from_chunk, sm_log2,
          FMT: tl.constexpr, DATA: tl.constexpr, ALIGN: tl.constexpr, HAS_CHUNK: tl.constexpr, PART: tl.constexpr,
          BN: tl.constexpr):
    """One tile of BN keys for the M rows: scores, the masked online softmax, P·V into PART's
    accumulators (0: all dims, 1: 0..255, 2: 256..511)."""
    ka = _keys(cache, cache16, row_words, idx, from_cache, CH16, ch_st, crow, from_chunk, 0, 256, FMT, DATA,
               ALIGN, HAS_CHUNK, BN)
    s = _qk(ka, qa, None, False)
    kb = _keys(cache, cache16, row_words, idx, from_cache, CH16, ch_st, crow, from_chunk, 256, 128, FMT, DATA,
               ALIGN, HAS_CHUNK, BN)
    s = _qk(kb, qb, s, False)
    kc = _keys(cache, cache16, row_words, idx, from_cache, CH16, ch_st, crow, from_chunk, 384, 64, FMT, DATA,
               ALIGN, HAS_CHUNK, BN)
    s = _qk(kc, qc, s, False)
    kd = _keys(cache, cache16, row_words, idx, from_cache, CH16, ch_st, crow, from_chunk, 448, 64, FMT, DATA,
               ALIGN, HAS_CHUNK, BN)
    s = _qk(kd, qd, s, False)
    s = tl.where(visible, s * sm_log2, float("-inf"))
    return _softmax_pv(acc_a, acc_b, acc_c, acc_d, m_i, l_i, s, ka, kb, kc, kd, PART)


@triton.jit
def _merge_store(acc, alpha, beta, inv, PO, OUT, part_rows, out_rows, row_ok, D0: tl.constexpr, W: tl.constexpr,
                 HAS_PART: tl.constexpr):
    cols = D0 + tl.arange(0, W)
    if HAS_PART:
        other = tl.load(PO + part_rows[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + other * beta[:, None]
    else:
        acc = acc * alpha[:, None]
    tl.store(OUT + out_rows[:, None] + cols[None, :], (acc * inv[:, None]).to(tl.bfloat16), mask=row_ok[:, None])


@triton.jit
def _window_run(Q, q_st, q_sh, CH16, ch_st, WC, WC16, wc_rw, WR, P, EC, EC16, ec_rw, ER, N_ENT, ratio, PO, PL,
                SINK, OUT, o_st, o_sh, T, H, start, window, sm_log2, tile, hb,
                WFMT: tl.constexpr, WDATA: tl.constexpr, WALIGN: tl.constexpr, EFMT: tl.constexpr,
                EDATA: tl.constexpr, EALIGN: tl.constexpr, HAS_ENT: tl.constexpr, HAS_PART: tl.constexpr,
                HAS_SINK: tl.constexpr, PART: tl.constexpr,
                BT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    M: tl.constexpr = BT * BH
    r = tl.arange(0, M)
    tok = tile * BT + r // BH
    head = hb * BH + r % BH
    row_ok = (tok < T) & (head < H)
    pos = start + tok
    q_rows = Q + tok.to(tl.int64) * q_st + head * q_sh
    qa = _load_q(q_rows, row_ok, 0, 256, False)
    qb = _load_q(q_rows, row_ok, 256, 128, False)
    qc = _load_q(q_rows, row_ok, 384, 64, False)
    qd = _load_q(q_rows, row_ok, 448, 64, False)
    acc_a = _zeros_acc(256, M, False) if PART != 2 else tl.zeros([16, 16], dtype=tl.float32)
    acc_b = _zeros_acc(128, M, False) if PART != 1 else tl.zeros([16, 16], dtype=tl.float32)
    acc_c = _zeros_acc(64, M, False) if PART != 1 else tl.zeros([16, 16], dtype=tl.float32)
    acc_d = _zeros_acc(64, M, False) if PART != 1 else tl.zeros([16, 16], dtype=tl.float32)
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)

    p_first = start + tile * BT
    p_last = start + tl.minimum(tile * BT + BT, T) - 1
    k_lo = tl.maximum(p_first - window + 1, 0)
    cached_lo = start - P  # the position of window.rows[0]
    for k0 in range(k_lo, p_last + 1, BN):
        kpos = k0 + tl.arange(0, BN)
        key_ok = kpos <= p_last
        from_cache = key_ok & (kpos < start)
        from_chunk = key_ok & (kpos >= start)
        idx = tl.load(WR + (kpos - cached_lo), mask=from_cache, other=0)
        diff = pos[:, None] - kpos[None, :]
        visible = (diff >= 0) & (diff < window) & row_ok[:, None]
        acc_a, acc_b, acc_c, acc_d, m_i, l_i = _tile(
            acc_a, acc_b, acc_c, acc_d, m_i, l_i, qa, qb, qc, qd, visible, WC, WC16, wc_rw, idx, from_cache,
            CH16, ch_st, kpos - start, from_chunk, sm_log2, WFMT, WDATA, WALIGN, True, PART, BN)
    if HAS_ENT:  # every entry w < (p + 1) // ratio (V4's HCA)
        n_hi = tl.minimum((p_last + 1) // ratio, N_ENT)
        seen = (pos + 1) // ratio
        for w0 in range(0, n_hi, BN):
            w = w0 + tl.arange(0, BN)
            ent_ok = w < n_hi
            idx = tl.load(ER + w, mask=ent_ok, other=0)
            visible = (w[None, :] < seen[:, None]) & row_ok[:, None] & ent_ok[None, :]
            acc_a, acc_b, acc_c, acc_d, m_i, l_i = _tile(
                acc_a, acc_b, acc_c, acc_d, m_i, l_i, qa, qb, qc, qd, visible, EC, EC16, ec_rw, idx, ent_ok,
                CH16, ch_st, w, ent_ok, sm_log2, EFMT, EDATA, EALIGN, False, PART, BN)

    # merge the picks' partial (normalized, lse in natural log) and the sink; log2 units
    part_rows = (tok.to(tl.int64) * H + head) * 512
    if HAS_PART:
        lse2 = tl.load(PL + tok.to(tl.int64) * H + head, mask=row_ok, other=float("-inf")) * _LOG2E
    else:
        lse2 = tl.full([M], float("-inf"), dtype=tl.float32)
    m = tl.maximum(m_i, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)
    alpha = tl.exp2(m_i - m)
    beta = tl.exp2(lse2 - m)
    denom = l_i * alpha + beta
    if HAS_SINK:
        denom += tl.exp2(tl.load(SINK + head, mask=row_ok, other=float("-inf")) * _LOG2E - m)
    inv = tl.where(denom > 0, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
    out_rows = tok.to(tl.int64) * o_st + head * o_sh
    if PART != 2:
        _merge_store(acc_a, alpha, beta, inv, PO, OUT, part_rows, out_rows, row_ok, 0, 256, HAS_PART)
    if PART != 1:
        _merge_store(acc_b, alpha, beta, inv, PO, OUT, part_rows, out_rows, row_ok, 256, 128, HAS_PART)
        _merge_store(acc_c, alpha, beta, inv, PO, OUT, part_rows, out_rows, row_ok, 384, 64, HAS_PART)
        _merge_store(acc_d, alpha, beta, inv, PO, OUT, part_rows, out_rows, row_ok, 448, 64, HAS_PART)


@triton.jit
def _window_kernel(Q, q_st, q_sh, CH16, ch_st, WC, WC16, wc_rw, WR, P, EC, EC16, ec_rw, ER, N_ENT, ratio, PO, PL,
                   SINK, OUT, o_st, o_sh, T, H, start, window, sm_log2, tile0,
                   WFMT: tl.constexpr, WDATA: tl.constexpr, WALIGN: tl.constexpr, EFMT: tl.constexpr,
                   EDATA: tl.constexpr, EALIGN: tl.constexpr, HAS_ENT: tl.constexpr, HAS_PART: tl.constexpr,
                   HAS_SINK: tl.constexpr, DV_SPLIT: tl.constexpr,
                   BT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr):
    """Grid (head blocks · DV_SPLIT, token tiles from ``tile0``): a tile's head blocks run side
    by side (the second read of its window rows is an L2 hit)."""
    hp = tl.program_id(0)
    tile = tile0 + tl.program_id(1)
    if DV_SPLIT == 1:
        _window_run(Q, q_st, q_sh, CH16, ch_st, WC, WC16, wc_rw, WR, P, EC, EC16, ec_rw, ER, N_ENT, ratio, PO, PL,
                    SINK, OUT, o_st, o_sh, T, H, start, window, sm_log2, tile, hp,
                    WFMT, WDATA, WALIGN, EFMT, EDATA, EALIGN, HAS_ENT, HAS_PART, HAS_SINK, 0, BT, BH, BN)
    else:
        if hp % 2 == 0:
            _window_run(Q, q_st, q_sh, CH16, ch_st, WC, WC16, wc_rw, WR, P, EC, EC16, ec_rw, ER, N_ENT, ratio, PO,
                        PL, SINK, OUT, o_st, o_sh, T, H, start, window, sm_log2, tile, hp // 2,
                        WFMT, WDATA, WALIGN, EFMT, EDATA, EALIGN, HAS_ENT, HAS_PART, HAS_SINK, 1, BT, BH, BN)
        else:
            _window_run(Q, q_st, q_sh, CH16, ch_st, WC, WC16, wc_rw, WR, P, EC, EC16, ec_rw, ER, N_ENT, ratio, PO,
                        PL, SINK, OUT, o_st, o_sh, T, H, start, window, sm_log2, tile, hp // 2,
                        WFMT, WDATA, WALIGN, EFMT, EDATA, EALIGN, HAS_ENT, HAS_PART, HAS_SINK, 2, BT, BH, BN)


def record_view(stored: StoredRows) -> tuple[torch.Tensor, str]:
    """(uint8 [rows, bytes], the decode kernel's record name) of stored rows; bf16 values
    are the ``bf16`` record."""
    cache = stored.cache
    if stored.record == "rows":
        if cache.dtype != torch.bfloat16:
            raise TypeError(f"the Triton sparse prefill reads bf16 rows or packed records, got {cache.dtype} rows")
        return cache.view(torch.uint8), "bf16"
    if stored.record == "v4" and stored.rope_dims != 64:
        raise ValueError(f"the Triton sparse prefill reads V4 records with 64 RoPE dims, got {stored.rope_dims}")
    return cache, stored.record


def _check_rows(cache: torch.Tensor, record: str, what: str) -> None:
    if cache.shape[-1] != RECORD_BYTES[record] or cache.stride(-1) != 1 or cache.stride(0) % 8:
        raise ValueError(f"{what}: rows of {RECORD_BYTES[record]} contiguous bytes at an 8-byte multiple stride, got "
                         f"{tuple(cache.shape)} stride {cache.stride()}")


def v4_sparse_prefill_triton(q: torch.Tensor, start: int, window: PrefillWindow, entries: PrefillEntries | None,
                             sinks: torch.Tensor | None, softmax_scale: float,
                             config: SparsePrefillConfig | None = None, out: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """out [T, H, 512] bf16 for q [T, H, 512] (bf16 or fp16) at positions start … start + T − 1.
    The chunk's rows are read as bf16 (exact for rows after a cache rounding, or kept in bf16)."""
    check_prefill_inputs(q, start, window, entries, sinks)
    t, heads, dim = q.shape
    if dim != HEAD_DIM:
        raise ValueError(f"the Triton sparse prefill takes {HEAD_DIM}-dim heads, got {dim}")
    if q.dtype not in (torch.bfloat16, torch.float16) or not window.chunk.dtype.is_floating_point:
        raise TypeError(f"q must be bf16 or fp16 and window.chunk floating point, got {q.dtype} and "
                        f"{window.chunk.dtype}")
    cfg = resolve_prefill_config(heads, config)
    if cfg.block_h & (cfg.block_h - 1) or cfg.block_t & (cfg.block_t - 1) or cfg.block_h * cfg.block_t < 16 \
            or cfg.dv_split not in (1, 2) or cfg.block_n not in (16, 32, 64, 128):
        raise ValueError(f"config: block_h and block_t powers of two with 16+ rows, dv_split 1/2, block_n 16..128; "
                         f"got {cfg}")
    if out is None:
        out = torch.empty(t, heads, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    if out.shape != (t, heads, HEAD_DIM) or out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"out must be bf16 [{t}, {heads}, {HEAD_DIM}] with a unit last stride")
    if t == 0:
        return out
    q16 = q.to(torch.float16).contiguous()  # one pass: the products run in fp16
    chunk = window.chunk.to(torch.bfloat16).contiguous()
    wcache, wrec = record_view(window.cached)
    _check_rows(wcache, wrec, "window.cached")
    wrows = window.rows.to(torch.int32).contiguous()
    if wrows.numel() == 0:
        wrows = torch.zeros(1, dtype=torch.int32, device=q.device)  # never read: a valid pointer

    part_o = part_l = None
    ecache, erec, erows, n_ent, ratio = wcache, wrec, wrows, 0, 1
    has_ent = False
    if entries is not None and entries.rows.shape[0]:
        cache, rec = record_view(entries.stored)
        _check_rows(cache, rec, "entries.stored")
        rows = entries.rows.to(torch.int32)
        if entries.picks is not None:
            if entries.picks.shape[1]:
                picks = entries.picks.long()
                flat = torch.where(picks >= 0, rows[picks.clamp(0, rows.shape[0] - 1)], torch.full_like(rows[:1], -1))
                part_o = torch.empty(t, heads, HEAD_DIM, dtype=torch.float32, device=q.device)
                part_l = torch.empty(t, heads, dtype=torch.float32, device=q.device)
                flat = flat.to(torch.int32)
                for a in range(0, t, DECODE_TOKENS):
                    b = min(a + DECODE_TOKENS, t)
                    scope = SparseKV(row_record_cache(cache), flat[a:b].unsqueeze(0).contiguous(), rec)
                    v4_sparse_decode_triton(q16[a:b].unsqueeze(0), [scope], None, softmax_scale,
                                            partials=(part_o[a:b], part_l[a:b]))
        else:
            ecache, erec, erows, n_ent, ratio, has_ent = cache, rec, rows.contiguous(), rows.shape[0], \
                entries.ratio, True

    walign, ealign = (16 if c.stride(0) % 16 == 0 else 8 for c in (wcache, ecache))
    head_blocks = -(-heads // cfg.block_h)
    tiles, dummy = -(-t // cfg.block_t), out
    for tile0 in range(0, tiles, MAX_GRID_Y):  # grid axis 1 is 65535 wide
        _window_kernel[(head_blocks * cfg.dv_split, min(MAX_GRID_Y, tiles - tile0))](
            q16, q16.stride(0), q16.stride(1), chunk, chunk.stride(0),
            wcache, wcache.view(torch.bfloat16), wcache.stride(0) // walign, wrows, window.rows.shape[0],
            ecache, ecache.view(torch.bfloat16), ecache.stride(0) // ealign, erows, n_ent, ratio,
            part_o if part_o is not None else dummy, part_l if part_l is not None else dummy,
            sinks if sinks is not None else dummy, out, out.stride(0), out.stride(1),
            t, heads, start, window.size, float(softmax_scale) * LOG2E, tile0,
            WFMT=FORMATS[wrec], WDATA=DATA_BYTES[wrec], WALIGN=walign, EFMT=FORMATS[erec], EDATA=DATA_BYTES[erec],
            EALIGN=ealign, HAS_ENT=has_ent, HAS_PART=part_o is not None, HAS_SINK=sinks is not None,
            DV_SPLIT=cfg.dv_split, BT=cfg.block_t, BH=cfg.block_h, BN=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out
