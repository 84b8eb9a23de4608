"""Exact top-k selection over rows of float32 scores in Triton, graph-safe (fixed launches, no
host sync): the indexer's picks and V4.1's candidate blocks without a ``torch.topk``.

References (the semantics, kept bit for bit): :func:`kernels.v4_indexer.topk_picks` for
:func:`topk_rows_triton` — the top ``min(k, n)`` of a row by score, ties to the lower index
(:mod:`kernels.topk`), largest first, −1 where fewer than ``k`` scores are finite — and
:func:`kernels.v4_indexer.candidate_blocks` for :func:`candidate_blocks_triton` — a mask of the
``k`` best blocks with each row's newest block pinned. Only entries below a row's ``visible``
count are read: the rest are −inf by contract, so a row padded to a graph's width costs its
live part only.

Picks, as three launches after the scores (kernels/v4_indexer_triton.py writes the scores
and the first histogram itself, so its chain skips :func:`histogram_rows_triton`):

1. histogram: per row, counts of its finite scores by the top 11 bits of their ordered bits
   (``kernels.topk.order_keys``' high word: sign, exponent, two mantissa bits — four bins an
   octave), ``NUM_BINS`` int32 + a slot counter per row, zeroed by whoever launches first;
2. collect, (row, chunk) programs: from the histogram the bin ``t`` holding the k-th largest
   score; every entry in a bin ≥ ``t`` is written as its int64 order key (score bits << 32 |
   2^32 − 1 − index) to the row's candidate buffer (``CAP`` slots, positions from an atomic
   counter: any order, the keys are unique);
3. finish, one program per row: the top-k of the candidates by ``tl.topk`` (a bitonic select
   of ``SMALL`` or ``CAP`` keys), whose order is ``kernels.topk``'s exactly. A row whose bins
   ≥ ``t`` hold more than ``CAP`` entries (a crowded threshold bin, or mass ties) takes the
   exact path instead: radix levels over the remaining 21 bits by ``tl.histogram`` (256 bins,
   no atomics) find the k-th score ``T``, then one scan in index order keeps every score above
   ``T`` and the lowest-index ties at ``T`` — the same set, so the same sorted picks.

Candidate blocks (one program per row, the row in registers): the newest visible block set to
+inf, the k-th largest ordered value by a 32-step bisection of counts, then the same
"above, then the lowest-index ties" rule as a mask.
"""

from __future__ import annotations

import torch

from kernels.gpu import num_sms

try:  # the CPU reference does not need Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

NUM_BINS = 2048  # level-1 bins: ordered score bits >> 21, shifted to 0 … 2047
HIST_STRIDE = NUM_BINS + 16  # + the slot counter (column NUM_BINS); rows stay 64-byte aligned
MAX_K = 2048  # the largest k the candidate buffers are sized for
INT64_MIN = -(2**63)


def selection_sizes(k: int) -> tuple[int, int, int]:
    """(KP, SMALL, CAP): ``k`` rounded up to a power of two (the bitonic select's output), the
    smaller and the larger candidate buffer sorted by the finish step."""
    kp = triton.next_power_of_2(max(k, 2))  # tl.topk keeps at least 2
    return kp, max(2 * kp, 1024), max(8 * kp, 4096)


if triton is not None:

    @triton.jit
    def ordered_bits(s):
        """int32 whose signed order is the float order of fp32 ``s`` (−0.0 taken as 0.0):
        the high word of ``kernels.topk.order_keys``."""
        bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def level1_bin(o):
        """Histogram bin 0 … 2047 of ordered bits ``o``: their top 11 bits."""
        return (o >> 21) + 1024

    @triton.jit
    def order_key(o, j):
        """int64 ``kernels.topk.order_keys`` key of ordered bits ``o`` at index ``j``."""
        return (o.to(tl.int64) << 32) | (0xFFFFFFFF - j.to(tl.int64))

    @triton.jit
    def _suffix_threshold(h, need, NB: tl.constexpr):
        """(t, above, at_t) of a histogram h [NB] and a count ``need``: ``t`` the highest bin
        whose suffix (bins ≥ t) holds ≥ need entries (−1: all of h holds fewer), ``above`` the
        entries in bins > t, ``at_t`` those in bin t."""
        b = tl.arange(0, NB)
        suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h
        t = tl.max(tl.where(suffix >= need, b, -1), 0)
        return t, tl.sum(tl.where(b > t, h, 0), 0), tl.sum(tl.where(b == t, h, 0), 0)

    @triton.jit
    def _row_threshold(HIST, row, k, NB: tl.constexpr, STRIDE: tl.constexpr):
        h = tl.load(HIST + row * STRIDE + tl.arange(0, NB), cache_modifier=".cg")
        return _suffix_threshold(h, k, NB)

    @triton.jit
    def _histogram_kernel(S, s_stride, VIS, HIST, CHUNK: tl.constexpr, NB: tl.constexpr, STRIDE: tl.constexpr):
        """Level-1 histogram of rows whose scores came from elsewhere (grid: rows × chunks)."""
        row = tl.program_id(0)
        j = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        m = j < tl.load(VIS + row).to(tl.int32)
        s = tl.load(S + row.to(tl.int64) * s_stride + j, mask=m, other=float("-inf"))
        tl.atomic_add(HIST + row * STRIDE + level1_bin(ordered_bits(s)), 1, mask=m & (s > float("-inf")),
                      sem="relaxed")

    @triton.jit
    def _collect_kernel(S, s_stride, VIS, HIST, CAND, k, CAP: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, NB: tl.constexpr, STRIDE: tl.constexpr):
        """Every finite score of the program's chunk in a bin ≥ the row's threshold bin, as
        order keys into the row's candidate buffer; nothing when they would not all fit."""
        row = tl.program_id(0)
        start = tl.program_id(1) * CHUNK
        vis = tl.load(VIS + row).to(tl.int32)
        t, above, at_t = _row_threshold(HIST, row, k, NB, STRIDE)
        if (start < vis) & (above + at_t <= CAP):
            end = tl.minimum(start + CHUNK, vis)
            for i in range(start, end, BLOCK):
                j = i + tl.arange(0, BLOCK)
                m = j < end
                s = tl.load(S + row.to(tl.int64) * s_stride + j, mask=m, other=float("-inf"))
                o = ordered_bits(s)
                sel = (m & (s > float("-inf")) & (level1_bin(o) >= t)).to(tl.int32)
                base = tl.atomic_add(HIST + row * STRIDE + NB, tl.sum(sel, 0), sem="relaxed")
                pos = base + tl.cumsum(sel, 0) - 1
                tl.store(CAND + row.to(tl.int64) * CAP + pos, order_key(o, j), mask=sel != 0)

    @triton.jit
    def _radix_level(S, s_stride, row, vis, prefix, need, PREFIX_SHIFT: tl.constexpr, SHIFT: tl.constexpr,
                     BITS: tl.constexpr, BLOCK: tl.constexpr):
        """One exact-path level: among finite scores whose ``o >> PREFIX_SHIFT`` is
        ``prefix``, the histogram of the next ``BITS`` bits → (the longer prefix ``o >> SHIFT``
        of the ``need``-th largest, how many entries of the old prefix lie above it)."""
        counts = tl.zeros([1 << BITS], dtype=tl.int32)
        for i in range(0, vis, BLOCK):
            j = i + tl.arange(0, BLOCK)
            s = tl.load(S + row.to(tl.int64) * s_stride + j, mask=j < vis, other=float("-inf"))
            o = ordered_bits(s)
            hit = (j < vis) & (s > float("-inf")) & ((o >> PREFIX_SHIFT) == prefix)
            counts += tl.histogram((o >> SHIFT) & ((1 << BITS) - 1), 1 << BITS, mask=hit)
        t, above, _ = _suffix_threshold(counts, need, 1 << BITS)
        return (prefix << BITS) | t, above

    @triton.jit
    def _exact_select(S, s_stride, row, vis, t, above, k, CAND, CAP: tl.constexpr, BLOCK: tl.constexpr):
        """The exact path of one row: the k-th largest ordered value T (its top 11 bits are
        bin ``t``, with ``above`` entries in higher bins), then in index order every entry
        above T and the first ties at T, k keys in all, to the candidate buffer."""
        need = k - above
        p, a2 = _radix_level(S, s_stride, row, vis, t - 1024, need, 21, 13, 8, BLOCK)
        p, a3 = _radix_level(S, s_stride, row, vis, p, need - a2, 13, 5, 8, BLOCK)
        big_t, a4 = _radix_level(S, s_stride, row, vis, p, need - a2 - a3, 5, 0, 5, BLOCK)
        ties = need - a2 - a3 - a4  # entries equal to T to keep, lowest index first
        pos = 0
        seen = 0
        for i in range(0, vis, BLOCK):
            j = i + tl.arange(0, BLOCK)
            s = tl.load(S + row.to(tl.int64) * s_stride + j, mask=j < vis, other=float("-inf"))
            o = ordered_bits(s)
            fin = (j < vis) & (s > float("-inf"))
            eq = (fin & (o == big_t)).to(tl.int32)
            take = ((fin & (o > big_t)) | ((eq != 0) & (seen + tl.cumsum(eq, 0) - 1 < ties))).to(tl.int32)
            tl.store(CAND + row.to(tl.int64) * CAP + pos + tl.cumsum(take, 0) - 1, order_key(o, j), mask=take != 0)
            pos += tl.sum(take, 0)
            seen += tl.sum(eq, 0)

    @triton.jit
    def _sorted_top(CAND, row, n, SIZE: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr):
        i = tl.arange(0, SIZE)
        keys = tl.load(CAND + row.to(tl.int64) * CAP + i, mask=i < n, other=-9223372036854775808,
                       cache_modifier=".cg")
        return tl.topk(keys, KP)

    @triton.jit
    def _finish_kernel(S, s_stride, VIS, HIST, CAND, PICKS, p_stride, MAP, map_stride, k, width, KP: tl.constexpr,
                       SMALL: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                       STRIDE: tl.constexpr, MAP_BLOCK: tl.constexpr):
        """The row's picks from its candidates (or from the exact path): sorted, −1 past the
        finite scores, ``width`` columns; MAP_BLOCK > 0: column c is entry
        ``MAP[row, c // MAP_BLOCK] · MAP_BLOCK + c % MAP_BLOCK``."""
        row = tl.program_id(0)
        t, above, at_t = _row_threshold(HIST, row, k, NB, STRIDE)
        n = above + at_t
        if n > CAP:
            _exact_select(S, s_stride, row, tl.load(VIS + row).to(tl.int32), t, above, k, CAND, CAP, BLOCK)
            tl.debug_barrier()
            n = k
        if n <= SMALL:
            top = _sorted_top(CAND, row, n, SMALL, CAP, KP)
        else:
            top = _sorted_top(CAND, row, n, CAP, CAP, KP)
        r = tl.arange(0, KP)
        picks = 0xFFFFFFFF - (top & 0xFFFFFFFF)
        if MAP_BLOCK > 0:
            blk = tl.load(MAP + row.to(tl.int64) * map_stride + picks // MAP_BLOCK, mask=r < n, other=0)
            picks = blk.to(tl.int64) * MAP_BLOCK + picks % MAP_BLOCK
        picks = tl.where(r < n, picks, -1)
        tl.store(PICKS + row.to(tl.int64) * p_stride + r, picks, mask=r < width)

    @triton.jit
    def _block_mask_kernel(BM, bm_stride, VIS, MASK, m_stride, num_blocks, k, BS: tl.constexpr,
                           ROW: tl.constexpr):
        """Candidate blocks of one row (``num_blocks`` ≤ ROW): the k best block maxima among
        the visible ones, the newest block pinned at +inf, ties to the lower block."""
        row = tl.program_id(0)
        vis = tl.load(VIS + row).to(tl.int32)
        b = tl.arange(0, ROW)
        live = b < (vis + BS - 1) // BS
        x = tl.load(BM + row.to(tl.int64) * bm_stride + b, mask=live, other=float("-inf"))
        newest = tl.where(vis > 0, (tl.maximum(vis, 1) - 1) // BS, -1)
        x = tl.where(b == newest, float("inf"), x)
        valid = live & (x > float("-inf"))
        o = ordered_bits(x)
        sel = valid
        if tl.sum(valid.to(tl.int32), 0) > k:
            # bisection on the unsigned offset o + 2^31: the largest T with ≥ k values ≥ T
            tau = tl.zeros([], dtype=tl.int64)
            for it in range(32):
                cand = tau + (tl.full([], 1, tl.int64) << (31 - it))
                c = tl.sum((valid & (o >= (cand - 2147483648).to(tl.int32))).to(tl.int32), 0)
                tau = tl.where(c >= k, cand, tau)
            big_t = (tau - 2147483648).to(tl.int32)
            ties = k - tl.sum((valid & (o > big_t)).to(tl.int32), 0)
            eq = (valid & (o == big_t)).to(tl.int32)
            sel = valid & ((o > big_t) | ((eq != 0) & (tl.cumsum(eq, 0) - 1 < ties)))
        tl.store(MASK + row.to(tl.int64) * m_stride + b, sel.to(tl.int8), mask=b < num_blocks)


def _rows_check(scores: torch.Tensor, visible: torch.Tensor) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(f"scores must be float32 [rows, n] with unit column stride, got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if tuple(visible.shape) != (scores.shape[0],):
        raise ValueError(f"visible must be [{scores.shape[0]}], got {tuple(visible.shape)}")


def new_histogram(rows: int, device: torch.device) -> torch.Tensor:
    """A level-1 histogram workspace [rows, HIST_STRIDE] int32 (the caller zeroes it)."""
    return torch.empty(rows, HIST_STRIDE, dtype=torch.int32, device=device)


def histogram_rows_triton(scores: torch.Tensor, visible: torch.Tensor, hist: torch.Tensor) -> None:
    """Fill a zeroed ``hist`` from scores [rows, n] (entries below ``visible`` only)."""
    rows, n = scores.shape
    chunk = 1024
    if rows and n:
        _histogram_kernel[(rows, triton.cdiv(n, chunk))](scores, scores.stride(0), visible, hist, CHUNK=chunk,
                                                          NB=NUM_BINS, STRIDE=HIST_STRIDE, num_warps=4)


def collect_chunk(rows: int, n: int, sms: int) -> int:
    """Scores per collect program: about two programs per SM, 1024 … 8192 (shapes only)."""
    return max(1024, min(8192, triton.next_power_of_2(max(1, rows * n // (2 * sms)))))


def topk_rows_triton(scores: torch.Tensor, visible: torch.Tensor, k: int, hist: torch.Tensor | None = None,
                     small: int | None = None, cap: int | None = None, index_map: torch.Tensor | None = None,
                     map_block: int = 1, width: int | None = None) -> torch.Tensor:
    """:func:`kernels.v4_indexer.topk_picks` of scores [rows, n] float32 whose entries at and
    past ``visible`` [rows] are −inf (never read): picks [rows, min(k, n)] int64.
    ``hist``: the rows' level-1 histogram when the scores' producer built it (zeroed, then
    filled; its counter column zero), else built here. ``small``/``cap``: the two candidate
    buffer sizes (powers of two; None: :func:`selection_sizes`). ``index_map`` [rows, m]:
    column c of the scores is entry ``index_map[row, c // map_block] · map_block + c %
    map_block`` (compacted scores; picks in entries, ``width`` columns, −1 padded)."""
    _rows_check(scores, visible)
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in 1 … {MAX_K}, got {k}")
    rows, n = scores.shape
    kp, default_small, default_cap = selection_sizes(k)
    small, cap = small or default_small, cap or default_cap
    if small < kp or cap < small or small & (small - 1) or cap & (cap - 1):
        raise ValueError(f"candidate buffers must be powers of two with {kp} ≤ small ≤ cap, got {small}, {cap}")
    picks = torch.empty(rows, min(k, n) if width is None else width, dtype=torch.int64, device=scores.device)
    if rows == 0 or n == 0:
        return picks.fill_(-1)
    vis = visible
    if hist is None:
        hist = new_histogram(rows, scores.device).zero_()
        histogram_rows_triton(scores, vis, hist)
    cand = torch.empty(rows, cap, dtype=torch.int64, device=scores.device)
    sms = num_sms(scores.device)
    chunk = collect_chunk(rows, n, sms)
    _collect_kernel[(rows, triton.cdiv(n, chunk))](scores, scores.stride(0), vis, hist, cand, k, CAP=cap, CHUNK=chunk,
                                                    BLOCK=1024, NB=NUM_BINS, STRIDE=HIST_STRIDE, num_warps=4)
    mapped = index_map is not None
    _finish_kernel[(rows,)](scores, scores.stride(0), vis, hist, cand, picks, picks.stride(0),
                            index_map if mapped else picks, index_map.stride(0) if mapped else 0, k, picks.shape[1],
                            KP=kp, SMALL=small, CAP=cap, BLOCK=1024, NB=NUM_BINS, STRIDE=HIST_STRIDE,
                            MAP_BLOCK=map_block if mapped else 0, num_warps=8)
    return picks


MAX_MASK_BLOCKS = 16384  # candidate rows held in registers by one program


def candidate_blocks_triton(block_scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """:func:`kernels.v4_indexer.candidate_blocks` of block maxima [rows, blocks] float32
    (blocks past ``ceil(visible / block_size)`` never read): bool [rows, blocks]."""
    _rows_check(block_scores, visible)
    rows, blocks = block_scores.shape
    if blocks > MAX_MASK_BLOCKS:
        raise ValueError(f"at most {MAX_MASK_BLOCKS} candidate blocks a row, got {blocks}")
    mask = torch.empty(rows, blocks, dtype=torch.bool, device=block_scores.device)
    if rows and blocks:
        _block_mask_kernel[(rows,)](block_scores, block_scores.stride(0), visible, mask.view(torch.int8),
                                    mask.stride(0), blocks, min(topk_blocks, blocks), BS=block_size,
                                    ROW=max(16, triton.next_power_of_2(blocks)), num_warps=8)
    return mask
