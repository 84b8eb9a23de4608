"""Fused MoE experts in Triton (Hopper): bf16/fp16 experts and DeepSeek block-FP8 experts.

Same contract as ``kernels.moe.moe_experts_reference``; graph-safe (no host sync, every shape
a function of T, k, E_local and the block sizes). Four steps:

1. ``align_slots_to_blocks`` (``kernels/moe_align.py``: two small Triton launches on CUDA): the
   T·k token-slots are sorted by local expert into a padded layout where each BLOCK_M-row
   block belongs to one expert. Its size is bounded statically by
   ``T·k + min(E_local, T·k)·(BLOCK_M-1)`` rows (at most that many experts are non-empty, each
   wastes < BLOCK_M rows); unused blocks are marked -1 and their programs exit at once.
   Choices of other ranks' experts are left out of the layout.
2. gate_up GEMM fused with silu(gate)·up → the intermediate [padded rows, I] in x's dtype, or,
   for FP8, already quantized per row per 128 columns (e4m3 + fp32 scales) in the epilogue:
   each program owns exactly one 128-column group (BLOCK_N = 128), so the group amax is local
   and no separate quantization pass over the intermediate is needed. The formula is the one
   of ``kernels.fp8.quantize_per_token_group`` (amax/448, IEEE division, saturate); the tests
   check it against that reference.
3. down GEMM, scaled by each slot's routing weight, written to its own row of y [T·k, H].
4. a sum over the k rows of each token (skipping foreign experts' rows, which no program wrote)
   into the output in x's dtype.

Why per-slot rows + a sum rather than fp32 atomics into the output: deterministic results
(atomic float adds commute in arbitrary order, so batch results would vary run to run), no
zero-fill of an fp32 [T, H] buffer, and the final cast is fused into the sum. The cost is one
write + read of T·k·H values in x's dtype, small next to the weights at decode sizes.

FP8 (w8a8, the standard block-scaled scheme): x is quantized per token per 128 columns by the
existing fused kernel (``kernels.fp8_quant_triton``) once per token, not per slot; weights
are read as e4m3 with their [N/128, K/128] ``scale_inv``; BLOCK_K = 128 so each K step
multiplies the fp32 partial product by one activation scale per row and one weight scale per
column (as ``kernels.fp8_gemm``'s Triton GEMM does).

Block sizes (``default_config``): the regime is the average number of rows per local expert,
r = T·k / E_local. Small r (decode, ≤ 32): BLOCK_M = 16 (mma.sync; less padding, the kernel is
bound by reading weights, so wider M only wastes rows) with BLOCK_N = 64 for bf16 to give more
programs per expert (FP8's gate_up must stay at 128, one quantization group). Large r:
BLOCK_M = 64 (one Hopper warpgroup MMA along M) and BLOCK_N = 128. BLOCK_K = 128 for FP8
(scale granularity), 64 for bf16. Under expert parallelism r overestimates the real rows per
expert by the EP degree (slots are spread over all experts); the padded layout keeps the waste
bounded anyway. These are first choices made without a device; ``benchmarks/bench_moe.py``
measures them. Compiled offline for sm_90 (Triton 3.6, 16-divisible strides as at run time):
no register spills in any table config; BLOCK_M = 64 issues HGMMA/QGMMA (wgmma), and needs 8
warps for the FP8 gate_up (4 warps spill 80 B: two fp32 accumulators plus the scaled partial
products); BLOCK_M = 16 uses mma.sync, where FP8 operands are widened to fp16 first.

A config with ``tma=True`` runs steps 2-3 on ``kernels/moe_triton_tma.py`` instead (weights
through TMA descriptors; with ``tma_a=False`` x's rows are gathered inside gate_up as here) where
``tma_applies``; elsewhere the same tiles run here. The many-rows row takes it: 1.07-1.13x the
pointer loads at V2-Lite and R1-EP8 prefill sizes on the H100 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.moe_align import FP8_GROUP, align_slots_to_blocks, padded_rows
from kernels.moe_triton_tma import expert_rows_tma, tma_applies

try:  # the kernels need Triton; the alignment (torch ops) does not
    import triton
    import triton.language as tl

    from kernels.moe_align import grouped_tile as _tile
    from kernels.moe_align import store_swiglu_rows
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None



def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MoEConfig:
    block_m: int = 16
    block_n: int = 64  # gate_up: columns of the intermediate per program (FP8: must be 128)
    block_n_down: int = 128  # down: output columns per program
    block_k: int = 64  # bf16 only; FP8 steps K by 128
    group_m: int = 8  # programs grouped along M so weight tiles are reused from L2
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # both GEMMs' operands through TMA descriptors (kernels/moe_triton_tma.py)
    persistent: bool = False  # TMA only: one program per SM walking the tiles
    tma_a: bool = True  # TMA only: x's rows gathered once, then TMA loads (False: gathered in gate_up)


# (max rows per local expert, bf16 config, fp8 config); the last row catches everything.
# Prefill sizes (V2-Lite, 8192 tokens = 768 rows per expert, H200): bf16 with 128-row tiles
# 1.20x the 64-row ones; FP8 with 128-row tiles 2.4x slower (benchmarks/RESULTS.md).
CONFIG_TABLE = (
    (32, MoEConfig(16, 64, 128, 128, 8, 4, 4), MoEConfig(16, 128, 128, 128, 8, 4, 4)),
    (255, MoEConfig(64, 128, 128, 64, 8, 8, 3), MoEConfig(64, 128, 128, 128, 8, 8, 3)),
    (None, MoEConfig(128, 128, 128, 64, 8, 8, 3, tma=True, tma_a=False),
     MoEConfig(64, 128, 128, 128, 8, 8, 3, tma=True, tma_a=False)),
)


def default_config(num_slots: int, n_local: int, fp8: bool) -> MoEConfig:
    rows = num_slots / max(n_local, 1)
    for limit, bf16_cfg, fp8_cfg in CONFIG_TABLE:
        if limit is None or rows <= limit:
            return fp8_cfg if fp8 else bf16_cfg
    raise AssertionError("unreachable")


if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        X, SX, W, SW, Hd, SH, SLOTS, BLOCK_EXPERT,
        n_slots, K, inter, top_k, grid_m,
        stride_xm, stride_sxm, stride_we, stride_wn, stride_swe, stride_swn, stride_hm, stride_shm,
        FP8: tl.constexpr, UE8M0: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """Hd[r, n] = silu(x[tok(r)] · gateₑ[n]) · (x[tok(r)] · upₑ[n]) for the rows r of one block
        (expert e); FP8: stored as e4m3 with SH[r, n // 128] (one group per program)."""
        grid_n = tl.cdiv(inter, BLOCK_N)
        pid_m, pid_n = _tile(tl.program_id(0), grid_m, grid_n, GROUP_M)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(SLOTS + rows)
        row_ok = slot < n_slots
        tok = (slot // top_k).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < inter
        rk = tl.arange(0, BLOCK_K)
        a_ptr = X + tok[:, None] * stride_xm + rk[None, :]
        g_ptr = W + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
        u_ptr = g_ptr + inter * stride_wn
        sw_base = SW + e.to(tl.int64) * stride_swe
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = (kb * BLOCK_K + rk) < K
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                sa = tl.load(SX + tok * stride_sxm + kb, mask=row_ok, other=0.0)
                sg = tl.load(sw_base + (rn // 128) * stride_swn + kb, mask=n_ok, other=0.0)
                su = tl.load(sw_base + ((rn + inter) // 128) * stride_swn + kb, mask=n_ok, other=0.0)
                acc_g += tl.dot(a, g) * sa[:, None] * sg[None, :]
                acc_u += tl.dot(a, u) * sa[:, None] * su[None, :]
            else:
                acc_g = tl.dot(a, g, acc_g)
                acc_u = tl.dot(a, u, acc_u)
            a_ptr += BLOCK_K
            g_ptr += BLOCK_K
            u_ptr += BLOCK_K
        # FP8: BLOCK_N == 128 and inter % 128 == 0, so this program owns one whole group.
        store_swiglu_rows(acc_g, acc_u, Hd, SH, rows, rn, n_ok, pid_n, stride_hm, stride_shm, FP8, UE8M0)

    @triton.jit
    def _down_kernel(
        A, SA, W, SW, Y, SLOTS, BLOCK_EXPERT, TOPK_W,
        n_slots, N, K, grid_m,
        stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_ym,
        FP8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """Y[slot(r), n] = weight(slot) · (A[r] · downₑ[n]) for the real rows r of one block."""
        grid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = _tile(tl.program_id(0), grid_m, grid_n, GROUP_M)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(SLOTS + rows)
        row_ok = slot < n_slots
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        a_ptr = A + rows.to(tl.int64)[:, None] * stride_am + rk[None, :]
        b_ptr = W + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
        sa_ptr = SA + rows.to(tl.int64) * stride_sam
        sb_ptr = SW + e.to(tl.int64) * stride_swe + (rn // 128) * stride_swn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = (kb * BLOCK_K + rk) < K
            a = tl.load(a_ptr, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                sa = tl.load(sa_ptr + kb)
                sb = tl.load(sb_ptr + kb, mask=n_ok, other=0.0)
                acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
            else:
                acc = tl.dot(a, b, acc)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
        wt = tl.load(TOPK_W + slot, mask=row_ok, other=0.0)
        acc = acc * wt[:, None]
        y_ptr = Y + slot.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _sum_slots_kernel(
        Y, IDS, OUT, N, top_k, expert_offset, n_local, stride_ym, stride_om, BLOCK_N: tl.constexpr,
    ):
        """OUT[t] = Σ_j Y[t·k + j] over the choices j of local experts (others were not written)."""
        t = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(0, top_k):
            e = tl.load(IDS + t * top_k + j) - expert_offset
            own = (e >= 0) & (e < n_local)
            y = tl.load(Y + (t * top_k + j) * stride_ym + rn, mask=n_ok & own, other=0.0)
            acc += y.to(tl.float32)
        tl.store(OUT + t * stride_om + rn, acc.to(OUT.dtype.element_ty), mask=n_ok)


def _check_routing(x, topk_weights, topk_ids):
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={x.shape[0]}, k]")


def _check_weights(x, w13, w2):
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("w13 must be [E, 2I, H] and w2 [E, H, I]")
    e, two_i, h = w13.shape
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2) or x.shape[1] != h:
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous along their input dim")


def _run(x, x8, sx, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, cfg, fp8, ue8m0=False):
    t, k = topk_ids.shape
    n_local, two_i, h = w13.shape
    inter = two_i // 2
    n_slots = t * k
    dev = x.device
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    if t == 0:
        return out
    slots, block_expert = align_slots_to_blocks(topk_ids, n_local, expert_offset, cfg.block_m)
    wts = topk_weights.reshape(-1).float().contiguous()
    a, sa = (x8, sx) if fp8 else (x, x)
    if cfg.tma and tma_applies(x, w13, w2, cfg.block_m):
        y = expert_rows_tma(a, sa, w13, s13, w2, s2, wts, slots, block_expert, k, cfg, fp8, ue8m0, x.dtype)
        return _sum_slots(y, topk_ids, out, expert_offset, n_local)
    rows = slots.shape[0]
    grid_m = block_expert.shape[0]
    bk = FP8_GROUP if fp8 else cfg.block_k
    if fp8:
        hid = torch.empty(rows, inter, dtype=FP8_DTYPE, device=dev)
        sh = torch.empty(rows, inter // FP8_GROUP, dtype=torch.float32, device=dev)
    else:
        hid = torch.empty(rows, inter, dtype=x.dtype, device=dev)
        sh = hid  # unused placeholders for the scale pointers
        s13, s2 = w13, w2
    _gate_up_kernel[(grid_m * triton.cdiv(inter, cfg.block_n),)](
        a, sa, w13, s13, hid, sh, slots, block_expert,
        n_slots, h, inter, k, grid_m,
        a.stride(0), sa.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        hid.stride(0), sh.stride(0),
        FP8=fp8, UE8M0=ue8m0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    y = torch.empty(n_slots, h, dtype=x.dtype, device=dev)
    _down_kernel[(grid_m * triton.cdiv(h, cfg.block_n_down),)](
        hid, sh, w2, s2, y, slots, block_expert, wts,
        n_slots, h, inter, grid_m,
        hid.stride(0), sh.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        FP8=fp8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=bk, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _sum_slots(y, topk_ids, out, expert_offset, n_local)


def _sum_slots(y, topk_ids, out, expert_offset, n_local):
    t, k = topk_ids.shape
    h = out.shape[1]
    sum_block = min(1024, triton.next_power_of_2(h))
    _sum_slots_kernel[(t, triton.cdiv(h, sum_block))](
        y, topk_ids.contiguous(), out, h, k, expert_offset, n_local, y.stride(0), out.stride(0), BLOCK_N=sum_block,
        num_warps=4)
    return out


def moe_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """bf16/fp16 experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (x's dtype) → [T, H]."""
    if triton is None:
        raise RuntimeError("the Triton MoE kernels need the triton package")
    _check_routing(x, topk_weights, topk_ids)
    _check_weights(x, w13, w2)
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"the Triton MoE takes bf16/fp16 x and weights of the same dtype, got "
                        f"{x.dtype}, {w13.dtype}, {w2.dtype}")
    cfg = config or default_config(topk_ids.numel(), w13.shape[0], fp8=False)
    return _run(x.contiguous(), None, None, w13, None, w2, None, topk_weights, topk_ids, expert_offset, cfg, False)


def moe_experts_fp8_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    config: MoEConfig | None = None,
    ue8m0: bool = False,
) -> torch.Tensor:
    """Block-FP8 experts read as e4m3: w13 [E, 2I, H] with scale_inv [E, 2I/128, ⌈H/128⌉],
    w2 [E, H, I] with scale_inv [E, ⌈H/128⌉, I/128]; I a multiple of 128. x (any float dtype)
    is quantized per token per 128 columns; the output has x's dtype."""
    if triton is None:
        raise RuntimeError("the Triton MoE kernels need the triton package")
    _check_routing(x, topk_weights, topk_ids)
    _check_weights(x, w13, w2)
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise TypeError(f"FP8 experts must be e4m3, got {w13.dtype}, {w2.dtype}")
    e, two_i, h = w13.shape
    inter = two_i // 2
    if inter % FP8_GROUP:
        raise ValueError(f"FP8 experts need the intermediate size ({inter}) to be a multiple of {FP8_GROUP}")
    g = FP8_GROUP
    if (tuple(w13_scale_inv.shape) != (e, two_i // g, _cdiv(h, g))
            or tuple(w2_scale_inv.shape) != (e, _cdiv(h, g), inter // g)):
        raise ValueError(f"scale_inv shapes {tuple(w13_scale_inv.shape)}, {tuple(w2_scale_inv.shape)} do not match "
                         f"128x128 blocks of w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    cfg = config or default_config(topk_ids.numel(), e, fp8=True)
    if cfg.block_n != FP8_GROUP:
        raise ValueError(f"the FP8 gate_up kernel quantizes one 128-column group per program: block_n must be {g}")
    from kernels.fp8_quant_triton import quantize_per_token_group_triton

    x8, sx = quantize_per_token_group_triton(x, FP8_GROUP, ue8m0=ue8m0)
    s13 = w13_scale_inv.float().contiguous()
    s2 = w2_scale_inv.float().contiguous()
    return _run(x, x8, sx, w13, s13, w2, s2, topk_weights, topk_ids, expert_offset, cfg, True, ue8m0)


__all__ = ["MoEConfig", "CONFIG_TABLE", "default_config", "padded_rows", "align_slots_to_blocks",
           "moe_experts_triton", "moe_experts_fp8_triton"]
