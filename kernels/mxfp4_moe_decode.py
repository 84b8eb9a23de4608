"""W4A8 MXFP4 routed experts at decode sizes: swap-AB on Hopper's wgmma (FP8 operands natively).

At decode an expert sees a handful of tokens, so a token-rows × features tile puts 16 mostly
padded rows on the MMA's M side, which Triton runs on mma.sync (fp8 widened to fp16 first).
Here the roles are swapped: the program's *weight* rows (output features, ``block_f`` = 64 or
128; wgmma's M is 64 rows per warpgroup) are the MMA's M side, converted from FP4 to e4m3 in
registers (the fold tables of ``kernels.mxfp4_moe_triton``, PRMT), and the expert's routed
token-slots (``block_t`` = 16 or 32) are N, read as K-major e4m3 activation rows; ``tl.dot``
then issues wgmma (``test_swap_ab_kernels_compile_for_sm90_to_wgmma``). Same contract and
the same numbers as the token-row kernels (``kernels.mxfp4_moe.moe_mxfp4_reference``,
``w4a8``): every product of a K span of 128 is promoted once by
``sa[token] · 2^(s_max[feature] − 127)``.

One call, every shape fixed by (T, k, E_local, the config), no host sync (graph-safe):

1. ``_route_quant_kernel``, one launch: program 0 sorts the T·k slots by local expert into
   ``block_t``-row blocks (a histogram, a bitonic sort of (expert, slot) keys, one scatter; the
   output of ``kernels.moe_triton.align_slots_to_blocks``, which takes ~25 torch ops), the
   other programs quantize x per token per 128 in paired column order
   (``quantize_paired_triton``'s work).
2. gate/up: program (feature block, slot block, K split) streams the gate rows and the up rows
   of its features once for all the block's tokens. ``block_f`` = 128 and no split: the epilogue
   is fused (clamped SwiGLU, routing weight, h quantized per 128 features = the program's
   span); otherwise fp32 partials of the real rows and ``_finish_gate_up_kernel``.
3. down: the same loop over I with h as the N side; bf16 y per slot (split: fp32 partials),
   then the fixed-order per-token sum. Each touched expert's bytes and scales are read once
   (a second block of one expert, more than ``block_t`` slots, reads them again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.moe_triton import padded_rows
from kernels.mxfp4_moe import SPAN

from kernels.mxfp4_moe_triton import check_kernel_inputs, finish_gate_up, sum_slots

try:
    import triton
    import triton.language as tl

    from kernels.mxfp4_moe_triton import (
        _LUT_ASM,
        _lut,
        _lut_byte,
        _quant_pairs,
        _swiglu_store,
        quant_spans_per_program,
    )
    from kernels.mxfp8_quant_triton import round_to_bf16
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

MAX_ROUTE_SLOTS = 2048  # T·k the one-program router sorts (T = 341 at top-6)


@dataclass(frozen=True)
class SwapABConfig:
    """Swap-AB tiles. ``block_f`` / ``block_f_down``: features (MMA rows) per program of gate/up
    (gate and up rows each) and of down, at least 16 per warp (a warpgroup's wgmma is 64 rows);
    ``block_t``: token-slots per expert block (MMA N); ``spans``: K spans of 128 per loop step;
    ``split_k`` / ``split_k_down``: K splits over programs (fp32 partials, fixed-order sums)."""

    block_f: int = 128
    block_f_down: int = 128
    block_t: int = 16
    spans: int = 1
    split_k: int = 1
    split_k_down: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def check(self, d: int, inter: int) -> None:
        ok = (self.block_f in (64, 128) and self.block_f_down in (64, 128) and self.block_t in (16, 32)
              and self.spans in (1, 2, 4) and self.split_k >= 1 and self.split_k_down >= 1 and self.num_stages >= 1
              and self.num_warps in (4, 8) and 16 * self.num_warps <= min(self.block_f, self.block_f_down))
        if not ok or (d // SPAN) % self.spans or (inter // SPAN) % self.spans:
            raise ValueError(f"bad swap-AB config {self}: block_f/block_f_down 64 or 128, block_t 16 or 32, "
                             f"spans 1/2/4 dividing D/128={d // SPAN} and I/128={inter // SPAN}, splits >= 1, "
                             f"4 or 8 warps of at least 16 features each")

    @property
    def fused(self) -> bool:
        """gate/up applies its epilogue itself (one program = one 128-feature span of h)."""
        return self.split_k == 1 and self.block_f == SPAN


# (max experts in use = min(T·k, E_local), config). 128 features on 4 warps: the conversion's
# fixed per-step work (scale maxima, table rows, barriers, wgmma fences) is spread over twice
# the bytes of 64 rows (offline sm_90 SASS: ~0.145 issued instructions per weight byte for
# gate/up and 0.16 for down, against 0.20 / 0.22 at 64 rows). 4 stages: 3 weight buffers;
# gate/up 165 registers and 82 KB of shared memory (2 programs per SM), down 127 registers and
# 45 KB (4 per SM). Batch 1 (6 experts: 108 gate/up programs of 128 features, 240 down) splits
# K in 2 / 2, which still fits one wave (216 of 264, 480 of 528 resident); from a dozen experts
# on the unsplit grid fills the SMs and the fused gate/up writes h directly. First choices from
# program counts and SASS (no device yet); `bench_w4a8_moe.py --sweep` measures them and prints
# rows in this form.
DECODE_TABLE = (
    (8, SwapABConfig(128, 128, 16, 1, split_k=2, split_k_down=2)),
    (None, SwapABConfig(128, 128, 16, 1)),
)
MAX_DECODE_ROWS_PER_EXPERT = 8  # average T·k / E_local up to which decode takes swap-AB


def use_swap_ab(num_slots: int, n_local: int) -> bool:
    """Decode sizes: few token-slots per expert, and few enough slots for the one-program router."""
    return num_slots <= MAX_ROUTE_SLOTS and num_slots <= MAX_DECODE_ROWS_PER_EXPERT * max(n_local, 1)


def decode_config(num_slots: int, n_local: int) -> SwapABConfig:
    used = min(num_slots, n_local)
    return next(c for limit, c in DECODE_TABLE if limit is None or used <= limit)


if triton is not None:

    @triton.jit
    def _route(IDS, SLOTS, BLOCK_EXPERT, SCRATCH, n_slots, n_local, expert_offset, n_rows, n_blocks,
               NS: tl.constexpr, NB: tl.constexpr, BLOCK_T: tl.constexpr, FILL: tl.constexpr):
        """``align_slots_to_blocks`` in one program: SLOTS [n_rows] the slots grouped by local
        expert in ascending slot order, each group padded to BLOCK_T rows (padding = n_slots),
        BLOCK_EXPERT [n_blocks] the expert of each block (−1 unused)."""
        i = tl.arange(0, NS)
        live = i < n_slots
        e = tl.load(IDS + i, mask=live, other=0).to(tl.int32) - expert_offset
        group = tl.where(live & (e >= 0) & (e < n_local), e, n_local)  # foreign/padding: last group
        for r in range(0, tl.cdiv(n_rows, FILL)):
            rr = r * FILL + tl.arange(0, FILL)
            tl.store(SLOTS + rr, tl.zeros([FILL], dtype=tl.int32) + n_slots, mask=rr < n_rows)
        for b in range(0, tl.cdiv(n_blocks, FILL)):
            bb = b * FILL + tl.arange(0, FILL)
            tl.store(BLOCK_EXPERT + bb, tl.full([FILL], -1, dtype=tl.int32), mask=bb < n_blocks)
        counts = tl.histogram(group, NB)
        bins = tl.arange(0, NB)
        padded = tl.where(bins < n_local, (counts + BLOCK_T - 1) // BLOCK_T * BLOCK_T, 0)
        # sorted position p of a slot of group g goes to row p + (padded start − unpadded start)[g]
        tl.store(SCRATCH + bins, (tl.cumsum(padded, 0) - padded) - (tl.cumsum(counts, 0) - counts))
        key = tl.sort(group * NS + i)  # stable by slot: keys are unique
        sg = key // NS
        sslot = key % NS
        tl.debug_barrier()  # the fills and SCRATCH are visible to every thread of the program
        dest = i + tl.load(SCRATCH + sg)
        own = sg < n_local
        tl.store(SLOTS + dest, sslot, mask=own)
        tl.store(BLOCK_EXPERT + dest // BLOCK_T, sg, mask=own & (dest % BLOCK_T == 0))

    @triton.jit
    def _route_quant_kernel(IDS, SLOTS, BLOCK_EXPERT, SCRATCH, X, Y, SY,
                            n_slots, n_local, expert_offset, n_rows, n_blocks, K, parts,
                            stride_xm, stride_ym, stride_sm,
                            NS: tl.constexpr, NB: tl.constexpr, BLOCK_T: tl.constexpr, FILL: tl.constexpr,
                            UE8M0: tl.constexpr, QSPANS: tl.constexpr):
        """Program 0: ``_route``; programs 1 …: ``_quant_pairs_kernel``'s work (x → paired e4m3),
        ``parts`` programs per token, so the two small steps cost one launch."""
        pid = tl.program_id(0)
        if pid == 0:
            _route(IDS, SLOTS, BLOCK_EXPERT, SCRATCH, n_slots, n_local, expert_offset, n_rows, n_blocks,
                   NS, NB, BLOCK_T, FILL)
        else:
            q = pid - 1
            _quant_pairs(X, Y, SY, (q // parts).to(tl.int64), q % parts, K, stride_xm, stride_ym, stride_sm,
                         UE8M0, QSPANS)

    @triton.jit
    def _fold_rows(W, S, LUT, rf, kb, stride_wn, stride_sn, BLOCK_F: tl.constexpr, CONVERT: tl.constexpr):
        """Rows rf of span kb → (e4m3 of the low nibbles [F, 64], of the high nibbles [F, 64],
        span scale 2^(s_max − 127) fp32 [F]). CONVERT 1: PRMT (GPU), 2: integer ops (interpreter)."""
        g = tl.arange(0, 4)
        j = tl.arange(0, 16)
        rows = rf.to(tl.int64)
        b = tl.load(W + rows[:, None, None] * stride_wn + kb * 64 + g[None, :, None] * 16 + j[None, None, :])
        # Scale bytes one by one (``one`` hides their contiguity): as 4-byte vectors they would be
        # cp.async'ed, the first level of a load chain whose second level (the table rows) then
        # leaves the weight bytes a single pipeline buffer instead of num_stages - 1.
        one = stride_sn // stride_sn
        s = tl.load(S + rows[:, None] * stride_sn + kb * 4 + g[None, :] * one).to(tl.int32) & 0xFF
        smax = tl.max(s, 1)
        row = tl.minimum(smax[:, None] - s, 13) * 2
        tlo = tl.load(LUT + row)[:, :, None]
        thi = tl.load(LUT + row + 1)[:, :, None]
        if CONVERT == 1:
            lo8, hi8 = tl.inline_asm_elementwise(
                _LUT_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [b, tlo, thi], dtype=(tl.uint8, tl.uint8),
                is_pure=True, pack=4)
        else:
            bi = b.to(tl.int32) & 0xFF
            lo8 = _lut_byte(bi & 15, tlo, thi).to(tl.uint8)
            hi8 = _lut_byte(bi >> 4, tlo, thi).to(tl.uint8)
        lo = tl.reshape(lo8.to(tl.float8e4nv, bitcast=True), (BLOCK_F, 64))
        hi = tl.reshape(hi8.to(tl.float8e4nv, bitcast=True), (BLOCK_F, 64))
        return lo, hi, (smax << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _swap_span(acc, a_lo, a_hi, sa, W, S, LUT, rf, kb, stride_wn, stride_sn,
                   BLOCK_F: tl.constexpr, CONVERT: tl.constexpr):
        """acc [F, T] + span kb of W[rf] · a (a_lo / a_hi: [64, T] e4m3, even / odd columns)."""
        w_lo, w_hi, ws = _fold_rows(W, S, LUT, rf, kb, stride_wn, stride_sn, BLOCK_F, CONVERT)
        p = tl.dot(w_lo, a_lo)
        p = tl.dot(w_hi, a_hi, p)
        return acc + p * ws[:, None] * sa[None, :]

    @triton.jit
    def _gate_up_swap_kernel(
        A, SA, W, SW, H, SH, P, LUT, SLOTS, BLOCK_EXPERT, TOPK_W,
        n_slots, K, inter, top_k, limit, split_k,
        stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_hm, stride_shm,
        stride_ps, stride_pm,
        CLAMP: tl.constexpr, UE8M0: tl.constexpr, FUSED: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_F: tl.constexpr, SPANS: tl.constexpr, CONVERT: tl.constexpr,
    ):
        """Program (feature block, slot block of expert e, K split): gateₑ / upₑ rows of the
        block's BLOCK_F features times the block's tokens; FUSED: h stored (quantized), else the
        fp32 products of the real rows into P [split, rows, 2I]."""
        pid_f = tl.program_id(0)
        pid_b = tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_b)
        if e < 0:
            return
        steps = K // (128 * SPANS)
        per_split = tl.cdiv(steps, split_k)
        st0 = tl.program_id(2) * per_split
        st1 = tl.minimum(st0 + per_split, steps)
        rows = pid_b * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = tl.load(SLOTS + rows)
        row_ok = slot < n_slots
        tok = (slot // top_k).to(tl.int64)
        rf = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        a_ptr = A + tok[None, :] * stride_am + tl.arange(0, 64)[:, None]  # [64, T], K-major rows
        wg = W + e.to(tl.int64) * stride_we
        wu = wg + inter * stride_wn
        sg = SW + e.to(tl.int64) * stride_swe
        su = sg + inter * stride_swn
        acc_g = tl.zeros([BLOCK_F, BLOCK_T], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_F, BLOCK_T], dtype=tl.float32)
        for st in range(st0, st1):
            for u in tl.static_range(SPANS):
                kb = st * SPANS + u
                a_lo = tl.load(a_ptr + kb * 128, mask=row_ok[None, :], other=0.0)
                a_hi = tl.load(a_ptr + kb * 128 + 64, mask=row_ok[None, :], other=0.0)
                sa = tl.load(SA + tok * stride_sam + kb, mask=row_ok, other=0.0)
                acc_g = _swap_span(acc_g, a_lo, a_hi, sa, wg, sg, LUT, rf, kb, stride_wn, stride_swn, BLOCK_F, CONVERT)
                acc_u = _swap_span(acc_u, a_lo, a_hi, sa, wu, su, LUT, rf, kb, stride_wn, stride_swn, BLOCK_F, CONVERT)
        if FUSED:
            _swiglu_store(tl.trans(acc_g), tl.trans(acc_u), rows, slot, row_ok, rf, rf < inter, pid_f, TOPK_W, H,
                          SH, limit, stride_hm, stride_shm, True, CLAMP, UE8M0)
        else:
            p_ptr = P + tl.program_id(2) * stride_ps + rows.to(tl.int64)[None, :] * stride_pm + rf[:, None]
            tl.store(p_ptr, acc_g, mask=row_ok[None, :])
            tl.store(p_ptr + inter, acc_u, mask=row_ok[None, :])

    @triton.jit
    def _down_swap_kernel(
        A, SA, W, SW, Y, LUT, SLOTS, BLOCK_EXPERT,
        n_slots, K, split_k,
        stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_ys, stride_ym,
        SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, SPANS: tl.constexpr,
        CONVERT: tl.constexpr,
    ):
        """Y[slot] = bf16(downₑ[features] · h[row]) for the real rows of one block; SPLIT: the
        fp32 products of K split program_id(2) into Y[split, slot]."""
        pid_f = tl.program_id(0)
        pid_b = tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_b)
        if e < 0:
            return
        steps = K // (128 * SPANS)
        per_split = tl.cdiv(steps, split_k)
        st0 = tl.program_id(2) * per_split
        st1 = tl.minimum(st0 + per_split, steps)
        rows = (pid_b * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        slot = tl.load(SLOTS + rows)
        row_ok = slot < n_slots
        rf = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        a_ptr = A + rows[None, :] * stride_am + tl.arange(0, 64)[:, None]  # every row of a used block is written
        w = W + e.to(tl.int64) * stride_we
        s = SW + e.to(tl.int64) * stride_swe
        acc = tl.zeros([BLOCK_F, BLOCK_T], dtype=tl.float32)
        for st in range(st0, st1):
            for u in tl.static_range(SPANS):
                kb = st * SPANS + u
                a_lo = tl.load(a_ptr + kb * 128)
                a_hi = tl.load(a_ptr + kb * 128 + 64)
                sa = tl.load(SA + rows * stride_sam + kb)
                acc = _swap_span(acc, a_lo, a_hi, sa, w, s, LUT, rf, kb, stride_wn, stride_swn, BLOCK_F, CONVERT)
        y_ptr = Y + slot.to(tl.int64)[None, :] * stride_ym + rf[:, None]
        if SPLIT:
            tl.store(y_ptr + tl.program_id(2) * stride_ys, acc, mask=row_ok[None, :])
        else:
            tl.store(y_ptr, round_to_bf16(acc).to(tl.bfloat16), mask=row_ok[None, :])


def route_and_quantize(topk_ids: torch.Tensor, n_local: int, expert_offset: int, block_t: int,
                       x: torch.Tensor | None = None, ue8m0: bool = False):
    """``kernels.moe_triton.align_slots_to_blocks`` (same outputs, bit for bit) for T·k ≤
    ``MAX_ROUTE_SLOTS`` and, given x, ``quantize_paired_triton(x, ue8m0)``, in one launch.
    Returns (sorted slots, block experts, e4m3 x or None, x scales or None)."""
    t, k = topk_ids.shape
    n_slots = t * k
    if n_slots > MAX_ROUTE_SLOTS:
        raise ValueError(f"the one-program router sorts at most {MAX_ROUTE_SLOTS} token-slots, got T·k={n_slots}")
    dev = topk_ids.device
    rows = padded_rows(n_slots, n_local, block_t)
    n_blocks = rows // block_t
    slots = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    nb = triton.next_power_of_2(n_local + 1)
    scratch = torch.empty(nb, dtype=torch.int32, device=dev)
    if x is None:
        xc = y = sy = scratch  # no quantization programs
        d, parts, qspans, n_quant = SPAN, 1, 1, 0
    else:
        d = x.shape[1]
        xc = x if x.stride(-1) == 1 else x.contiguous()
        y = torch.empty(t, d, dtype=torch.uint8, device=dev)
        sy = torch.empty(t, d // SPAN, dtype=torch.float32, device=dev)
        qspans = quant_spans_per_program(d)
        parts = triton.cdiv(d // SPAN, qspans)
        n_quant = t * parts
    _route_quant_kernel[(1 + n_quant,)](
        topk_ids.contiguous(), slots, block_expert, scratch, xc, y, sy,
        n_slots, n_local, expert_offset, rows, n_blocks, d, parts,
        xc.stride(0), y.stride(0), sy.stride(0),
        NS=max(16, triton.next_power_of_2(n_slots)), NB=nb, BLOCK_T=block_t, FILL=1024, UE8M0=ue8m0, QSPANS=qspans,
        num_warps=4)
    if x is None:
        return slots, block_expert, None, None
    return slots, block_expert, y.view(FP8_DTYPE), sy


def moe_mxfp4_w4a8_swap_ab(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    expert_offset: int = 0,
    config: SwapABConfig | None = None,
    ue8m0: bool = False,
) -> torch.Tensor:
    """``kernels.mxfp4_moe_triton.moe_mxfp4_triton(mode="w4a8")`` through the swap-AB kernels → fp32 [T, D]."""
    n_local, d, inter = check_kernel_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    t, k = topk_ids.shape
    n_slots = t * k
    dev = x.device
    out = torch.empty(t, d, dtype=torch.float32, device=dev)
    if t == 0:
        return out
    cfg = config or decode_config(n_slots, n_local)
    cfg.check(d, inter)
    slots, block_expert, a, sa = route_and_quantize(topk_ids, n_local, expert_offset, cfg.block_t, x, ue8m0)
    rows, n_blocks = slots.shape[0], block_expert.shape[0]
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    convert = 1 if dev.type == "cuda" else 2  # PRMT inline asm on the GPU, integer ops when interpreted
    lut = _lut(dev)
    hid = torch.empty(rows, inter, dtype=torch.uint8, device=dev)
    sh = torch.empty(rows, inter // SPAN, dtype=torch.float32, device=dev)
    wts = topk_weights.reshape(-1).float().contiguous()
    fused = cfg.fused
    part = hid if fused else torch.empty(cfg.split_k, rows, 2 * inter, dtype=torch.float32, device=dev)
    _gate_up_swap_kernel[(inter // cfg.block_f, n_blocks, cfg.split_k)](
        a, sa, w13, s13, hid, sh, part, lut, slots, block_expert, wts,
        n_slots, d, inter, k, float(limit), cfg.split_k,
        a.stride(0), sa.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        hid.stride(0), sh.stride(0), 0 if fused else part.stride(0), 0 if fused else part.stride(1),
        CLAMP=limit > 0, UE8M0=ue8m0, FUSED=fused, BLOCK_T=cfg.block_t, BLOCK_F=cfg.block_f, SPANS=cfg.spans,
        CONVERT=convert, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fused:
        finish_gate_up(part, hid, sh, slots, wts, n_slots, limit, True, ue8m0)
    h = hid.view(FP8_DTYPE)
    split = cfg.split_k_down > 1
    y = torch.empty(cfg.split_k_down, n_slots, d, dtype=torch.float32 if split else torch.bfloat16, device=dev)
    _down_swap_kernel[(d // cfg.block_f_down, n_blocks, cfg.split_k_down)](
        h, sh, w2, s2, y, lut, slots, block_expert,
        n_slots, inter, cfg.split_k_down,
        h.stride(0), sh.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), y.stride(1),
        SPLIT=split, BLOCK_T=cfg.block_t, BLOCK_F=cfg.block_f_down, SPANS=cfg.spans, CONVERT=convert,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    sum_slots(y, topk_ids, out, expert_offset, n_local)
    return out


__all__ = ["DECODE_TABLE", "MAX_DECODE_ROWS_PER_EXPERT", "MAX_ROUTE_SLOTS", "SwapABConfig", "decode_config",
           "moe_mxfp4_w4a8_swap_ab", "route_and_quantize", "use_swap_ab"]
