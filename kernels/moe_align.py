"""The MoE kernels' slot layout: the T·k token-slots sorted by local expert into BLOCK_M-row
blocks, each block owned by one expert (``align_slots_to_blocks``). A torch reference and two
Triton launches, chosen by ``kernels/fused_glue.py``'s switch on CUDA.

The reference is about forty small device ops (compares, a histogram by scatter_add, a stable
argsort, cumsums, gathers, a scatter, a searchsorted); every MoE layer runs it, at prefill and
in every decode graph. The Triton form gives the same two tensors bit for bit:

1. one program counts each expert's slots (``tl.histogram``), rounds the counts up to whole
   blocks, takes their prefix sum (each expert's first row), writes every block's expert and
   fills the rows past the used blocks with the padding mark;
2. one program per local expert scans the slots in order and writes its own slots' ids to
   consecutive rows from its first row (a prefix sum over its matches: the stable order of
   the reference's argsort), then marks the rest of its last block as padding.

No host synchronization and every shape a function of T, k, E_local and BLOCK_M: graph-safe.

It also holds the two Triton pieces the MoE GEMM kernels over this layout share
(``kernels/moe_triton.py``, ``kernels/moe_triton_tma.py``): the program → block order and the
gate/up epilogue.
"""

from __future__ import annotations

import torch

from kernels.fused_glue import HAS_TRITON, glue_kernels_apply

if HAS_TRITON:  # the GPU path needs Triton; the reference does not
    import triton
    import triton.language as tl


FP8_GROUP = 128  # FP8 experts: activation group width = weight block edge (the gate/up epilogue's group)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_rows(num_slots: int, n_local: int, block_m: int) -> int:
    """Static bound on the padded, expert-sorted layout (a multiple of block_m)."""
    return _cdiv(num_slots + min(n_local, num_slots) * (block_m - 1), block_m) * block_m


def align_slots_to_blocks_reference(
    topk_ids: torch.Tensor, n_local: int, expert_offset: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T·k slots (slot = token·k + j) by local expert into BLOCK_M-aligned segments.

    Returns ``sorted_slots`` int32 [padded_rows] (slot ids; T·k marks padding) and
    ``block_expert`` int32 [padded_rows / block_m] (the local expert of each block, -1 for
    blocks past the used ones). Device ops only: no host synchronization.
    """
    if n_local < 1:
        raise ValueError("need at least one local expert")
    t, k = topk_ids.shape
    n_slots = t * k
    dev = topk_ids.device
    rows = padded_rows(n_slots, n_local, block_m)
    local = topk_ids.reshape(-1).long() - expert_offset
    owned = (local >= 0) & (local < n_local)
    group = torch.where(owned, local, n_local)  # foreign slots form a last, dropped group
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, group, torch.ones_like(group))
    order = torch.argsort(group, stable=True)
    g_sorted = group[order]
    start = torch.cumsum(counts, 0) - counts  # unpadded start of each group in `order`
    padded_counts = (counts[:n_local] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    padded_start = torch.cat([padded_end - padded_counts, padded_end.new_full((1,), rows)])
    rank = torch.arange(n_slots, device=dev) - start[g_sorted]
    dest = torch.where(g_sorted < n_local, padded_start[g_sorted] + rank, rows)  # foreign → dump row
    sorted_slots = torch.full((rows + 1,), n_slots, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < n_local, block_expert, -1).to(torch.int32)
    return sorted_slots[:rows], block_expert


if HAS_TRITON:

    @triton.jit
    def grouped_tile(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
        """Program id → (M block, N block) of a GEMM over the layout's blocks: GROUP_M blocks of M
        at a time across all N, so consecutive programs share A blocks and one expert's weights."""
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        return first_m + (pid % width) % size_m, (pid % width) // size_m

    @triton.jit
    def store_swiglu_rows(acc_g, acc_u, Hd, SH, rows, rn, n_ok, pid_n, stride_hm, stride_shm,
                          FP8: tl.constexpr, UE8M0: tl.constexpr):
        """The gate/up GEMMs' epilogue: silu(gate)·up of the block's rows into the intermediate,
        in its dtype, or for FP8 quantized per row over this program's 128 columns (one whole
        group: amax/448, IEEE division, saturate; UE8M0 rounds the scale up to a power of two)
        with the scale at SH[row, pid_n]. Every row of a used block is written (padding rows
        are exact zeros), so the down GEMM never reads uninitialized memory."""
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        h_ptr = Hd + rows.to(tl.int64)[:, None] * stride_hm + rn[None, :]
        if FP8:
            amax = tl.max(tl.abs(h), 1)
            scale = tl.maximum(amax, 1e-12) / 448.0
            if UE8M0:
                scale = tl.exp2(tl.ceil(tl.log2(scale)))
            q = tl.clamp(tl.math.div_rn(h, scale[:, None]), -448.0, 448.0)
            tl.store(h_ptr, q.to(Hd.dtype.element_ty), mask=n_ok[None, :])
            tl.store(SH + rows.to(tl.int64) * stride_shm + pid_n, scale)
        else:
            tl.store(h_ptr, h.to(Hd.dtype.element_ty), mask=n_ok[None, :])

    @triton.jit
    def _count_kernel(
        IDS, STARTS, SLOTS, BLOCK_EXPERT, n_slots, n_local, expert_offset, rows, n_blocks,
        BLOCK_M: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
    ):
        """STARTS[e] = expert e's first row; BLOCK_EXPERT; padding marks past the used blocks."""
        counts = tl.zeros([BINS], dtype=tl.int32)
        for s0 in range(0, n_slots, BLOCK):
            i = s0 + tl.arange(0, BLOCK)
            e = (tl.load(IDS + i, mask=i < n_slots, other=0) - expert_offset).to(tl.int32)
            own = (i < n_slots) & (e >= 0) & (e < n_local)
            counts += tl.histogram(tl.where(own, e, n_local), BINS)  # bin n_local: not counted
        bins = tl.arange(0, BINS)
        padded = tl.where(bins < n_local, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        end = tl.cumsum(padded, 0)
        tl.store(STARTS + bins, end - padded, mask=bins < n_local)
        end_or_big = tl.where(bins < n_local, end, 2147483647)
        for b0 in range(0, n_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            expert = tl.sum((end_or_big[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)
            tl.store(BLOCK_EXPERT + b, tl.where(expert < n_local, expert, -1), mask=b < n_blocks)
        used = tl.sum(padded, 0)
        for r0 in range(used, rows, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            tl.store(SLOTS + r, tl.full([BLOCK], 0, tl.int32) + n_slots, mask=r < rows)

    @triton.jit
    def _scatter_kernel(
        IDS, STARTS, SLOTS, n_slots, expert_offset,
        BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Expert e's slot ids, in slot order, from its first row; then its last block's padding."""
        e = tl.program_id(0)
        row = tl.load(STARTS + e)
        for s0 in range(0, n_slots, BLOCK):
            i = s0 + tl.arange(0, BLOCK)
            hit = (i < n_slots) & ((tl.load(IDS + i, mask=i < n_slots, other=0) - expert_offset) == e)
            hit32 = hit.to(tl.int32)
            rank = tl.cumsum(hit32, 0) - hit32
            tl.store(SLOTS + row + rank, i.to(tl.int32), mask=hit)
            row += tl.sum(hit32, 0)
        pad = tl.arange(0, BLOCK_M)
        tail = (BLOCK_M - row % BLOCK_M) % BLOCK_M
        tl.store(SLOTS + row + pad, tl.full([BLOCK_M], 0, tl.int32) + n_slots, mask=pad < tail)


def align_slots_to_blocks_triton(
    topk_ids: torch.Tensor, n_local: int, expert_offset: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two Triton launches (CUDA, or CPU under TRITON_INTERPRET=1); the reference's result."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton slot alignment needs the triton package")
    if n_local < 1:
        raise ValueError("need at least one local expert")
    if block_m & (block_m - 1):
        raise ValueError(f"the Triton slot alignment needs a power-of-two block_m, got {block_m}")
    t, k = topk_ids.shape
    n_slots = t * k
    rows = padded_rows(n_slots, n_local, block_m)
    dev = topk_ids.device
    slots = torch.empty(rows, dtype=torch.int32, device=dev)
    n_blocks = rows // block_m
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    if n_slots == 0:
        return slots, block_expert
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    starts = torch.empty(n_local, dtype=torch.int32, device=dev)
    bins = triton.next_power_of_2(n_local + 1)
    block = min(4096, triton.next_power_of_2(n_slots))
    _count_kernel[(1,)](
        ids, starts, slots, block_expert, n_slots, n_local, expert_offset, rows, n_blocks,
        BLOCK_M=block_m, BINS=bins, BLOCK=block, BLOCK_B=max(16, min(256, 16384 // bins)), num_warps=4)
    _scatter_kernel[(n_local,)](ids, starts, slots, n_slots, expert_offset, BLOCK_M=block_m, BLOCK=block,
                                num_warps=4)
    return slots, block_expert


def align_slots_to_blocks(
    topk_ids: torch.Tensor, n_local: int, expert_offset: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of ``align_slots_to_blocks_reference``: the Triton launches on CUDA (power-of-two
    block_m, int32/int64 ids), the torch ops otherwise."""
    if (glue_kernels_apply(topk_ids) and topk_ids.dtype in (torch.int32, torch.int64) and block_m > 0
            and not block_m & (block_m - 1) and topk_ids.numel()):
        return align_slots_to_blocks_triton(topk_ids, n_local, expert_offset, block_m)
    return align_slots_to_blocks_reference(topk_ids, n_local, expert_offset, block_m)


__all__ = ["align_slots_to_blocks", "align_slots_to_blocks_reference", "align_slots_to_blocks_triton", "padded_rows"]
