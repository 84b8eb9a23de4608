"""The many-rows (prefill) regime of the fused Triton MoE: both GEMMs' operands through Hopper
TMA tensor descriptors. Same contract and same slot layout as ``kernels.moe_triton``
(``align_slots_to_blocks``), which routes here when its config says ``tma=True``.

Steps (between the slot sort and the final per-token sum of ``kernels.moe_triton``):

1. gather: ``xs[r] = x[slot(r) // k]`` for every row r of a used block (padding rows: zeros),
   so each BLOCK_M-row block of A is one contiguous box a descriptor can load; FP8 gathers the
   per-token-per-128 activation scales the same way. One read + write of T·k·H values.
2. gate_up: A boxes from ``xs``, gate and up boxes from w13 seen as [E·2I, H] (K-major, so
   ``tl.dot(a, b.T)``), the SiLU·up epilogue (FP8: quantized per row per 128 columns, as in
   ``kernels.moe_triton``), stored with pointer stores into the intermediate.
3. down: A boxes from the intermediate (already expert-sorted), B boxes from w2 seen as
   [E·H, I]; each row is scaled by its slot's routing weight and scattered to y[slot].

Why: the pointer-load kernels gather A rows and load masked B tiles with cp.async; at 768 rows
per expert they run ~480 TFLOP/s and no tile beat today's by more than 4 % (benchmarks/RESULTS.md),
so the load path is the limit. TMA moves each box with one instruction from one thread, frees the
registers and issue slots of the address arithmetic and zero-fills out-of-range rows and columns
(no masks: ragged K, the last N block, rows past the layout).

Descriptors are built on the host (``triton.tools.tensor_descriptor.TensorDescriptor``): the
launcher encodes each CUtensorMap into the kernel's parameters, so a captured CUDA graph
replays them by value (its tensors keep their addresses), with no device scratch, no global
allocator (``triton.set_allocator``, which device-side ``tl.make_tensor_descriptor`` needs) and
no per-program descriptor writes and proxy fences. Requirements (``tma_applies``): an sm_90+
GPU (or the interpreter), expert stacks contiguous with 16-byte rows (H and I times the element
size), 16-byte aligned bases. ``xs`` and the intermediate get row strides we choose (padded to
64 elements), so x itself has no requirement.

Memory: ``xs`` and y (the per-slot output rows) share one buffer: xs is dead once gate_up has
run and y is first written by down, later on the same stream, so the gather costs no memory
beyond today's y except the padding rows.

Persistent launch (``persistent=True``): one program per SM walks the tiles of the used blocks
(their count read on the device), and the tile loop is flattened into the K loop
(``tl.range(flatten=True)``) so the next tile's loads are in flight during the epilogue.
Otherwise one program per tile, as in ``kernels.moe_triton``. ``tma_a=False`` skips step 1:
gate_up gathers x's rows itself with pointer loads (cp.async) and only the weights come by TMA;
the alternative to the gathered copy, kept for the benchmark to decide.
"""

from __future__ import annotations

import os

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.gpu import num_sms
from kernels.moe_align import FP8_GROUP

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kernels.moe_align import grouped_tile as _tile
    from kernels.moe_align import store_swiglu_rows
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

ROW_ALIGN = 64  # elements: row stride of the buffers we allocate (16-byte TMA rows for any dtype)
GATHER_ROWS = 16  # rows per gather program (divides every TMA block_m)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # same-size integer views for the copy


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tma_rows_ok(w: torch.Tensor) -> bool:
    """An [E, N, K] stack seen as one [E·N, K] matrix with 16-byte rows and a 16-byte base."""
    e, n, k = w.shape
    return (w.stride() == (n * k, k, 1) and (k * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0)


def tma_applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, block_m: int) -> bool:
    """Whether the TMA kernels can take these tensors (else the pointer kernels run)."""
    if triton is None or block_m % GATHER_ROWS:
        return False
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif not _interpreting():
        return False
    return _tma_rows_ok(w13) and _tma_rows_ok(w2)


def _persistent_programs(device: torch.device) -> int:
    """One program per SM; under the interpreter a few programs, each walking several tiles."""
    return num_sms(device) if device.type == "cuda" else 3


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(
        SRC, DST, SLOTS, BLOCK_EXPERT, n_slots, n_cols, top_k, block_m, stride_src, stride_dst,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """DST[r] = SRC[slot(r) // k] for the rows of used blocks; padding rows get zero bits."""
        r0 = tl.program_id(0) * BLOCK_R
        if tl.load(BLOCK_EXPERT + r0 // block_m) < 0:
            return
        rows = r0 + tl.arange(0, BLOCK_R)
        slot = tl.load(SLOTS + rows)
        tok = (slot // top_k).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cols < n_cols
        v = tl.load(SRC + tok[:, None] * stride_src + cols[None, :], mask=(slot < n_slots)[:, None] & c_ok[None, :],
                    other=0)
        tl.store(DST + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], v, mask=c_ok[None, :])

    @triton.jit
    def _gate_up_tma_kernel(
        A_DESC, X, SLOTS, W_DESC, SA, SW, Hd, SH, BLOCK_EXPERT, N_USED,
        n_slots, top_k, K, inter, n_programs, stride_xm, stride_sam, stride_swe, stride_swn, stride_hm, stride_shm,
        FP8: tl.constexpr, UE8M0: tl.constexpr, FLATTEN: tl.constexpr, GATHER_A: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """Hd[r, n] = silu(x[tok(r)] · gateₑ[n]) · (x[tok(r)] · upₑ[n]) for the rows r of used blocks
        (expert e of r's block); FP8: e4m3 with SH[r, n // 128] (one group per tile). A's rows come
        from the gathered copy (A_DESC, SA per row) or, with GATHER_A, from x by pointer loads (X, SA
        per token)."""
        grid_n = tl.cdiv(inter, BLOCK_N)
        used_m = tl.load(N_USED)
        rk = tl.arange(0, BLOCK_K)
        for tile in tl.range(tl.program_id(0), used_m * grid_n, n_programs, flatten=FLATTEN):
            pid_m, pid_n = _tile(tile, used_m, grid_n, GROUP_M)
            e = tl.load(BLOCK_EXPERT + pid_m)
            row0 = pid_m * BLOCK_M
            w_row = e * 2 * inter + pid_n * BLOCK_N  # gate rows; up rows start `inter` further
            rows = row0 + tl.arange(0, BLOCK_M)
            if GATHER_A:
                slot = tl.load(SLOTS + rows)
                row_ok = slot < n_slots
                tok = (slot // top_k).to(tl.int64)
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, tl.cdiv(K, BLOCK_K)):
                if GATHER_A:
                    k_ok = (kb * BLOCK_K + rk) < K
                    a = tl.load(X + tok[:, None] * stride_xm + (kb * BLOCK_K + rk)[None, :],
                                mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                else:
                    a = A_DESC.load([row0, kb * BLOCK_K])
                g = W_DESC.load([w_row, kb * BLOCK_K])
                u = W_DESC.load([w_row + inter, kb * BLOCK_K])
                if FP8:  # BLOCK_N == 128 and inter % 128 == 0: one weight scale per tile and K step
                    if GATHER_A:
                        sa = tl.load(SA + tok * stride_sam + kb, mask=row_ok, other=0.0)
                    else:
                        sa = tl.load(SA + rows * stride_sam + kb)
                    sw = SW + e * stride_swe + kb
                    sg = tl.load(sw + (pid_n * BLOCK_N // 128) * stride_swn)
                    su = tl.load(sw + ((inter + pid_n * BLOCK_N) // 128) * stride_swn)
                    acc_g += tl.dot(a, g.T) * (sa * sg)[:, None]
                    acc_u += tl.dot(a, u.T) * (sa * su)[:, None]
                else:
                    acc_g = tl.dot(a, g.T, acc_g)
                    acc_u = tl.dot(a, u.T, acc_u)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < inter  # the last block's gate box may overlap the up rows: not stored
            store_swiglu_rows(acc_g, acc_u, Hd, SH, rows, rn, n_ok, pid_n, stride_hm, stride_shm, FP8, UE8M0)

    @triton.jit
    def _down_tma_kernel(
        A_DESC, W_DESC, SA, SW, Y, SLOTS, BLOCK_EXPERT, N_USED, TOPK_W,
        n_slots, N, K, n_programs, stride_sam, stride_swe, stride_swn, stride_ym,
        FP8: tl.constexpr, FLATTEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """Y[slot(r), n] = weight(slot) · (h[r] · downₑ[n]) for the real rows r of used blocks."""
        grid_n = tl.cdiv(N, BLOCK_N)
        used_m = tl.load(N_USED)
        for tile in tl.range(tl.program_id(0), used_m * grid_n, n_programs, flatten=FLATTEN):
            pid_m, pid_n = _tile(tile, used_m, grid_n, GROUP_M)
            e = tl.load(BLOCK_EXPERT + pid_m)
            row0 = pid_m * BLOCK_M
            w_row = e * N + pid_n * BLOCK_N
            rows = row0 + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N  # the last block's box may reach the next expert's rows: not stored
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, tl.cdiv(K, BLOCK_K)):
                a = A_DESC.load([row0, kb * BLOCK_K])
                b = W_DESC.load([w_row, kb * BLOCK_K])
                if FP8:
                    sa = tl.load(SA + rows * stride_sam + kb)
                    sb = tl.load(SW + e * stride_swe + (rn // 128) * stride_swn + kb, mask=n_ok, other=0.0)
                    acc += tl.dot(a, b.T) * sa[:, None] * sb[None, :]
                else:
                    acc = tl.dot(a, b.T, acc)
            slot = tl.load(SLOTS + rows)
            row_ok = slot < n_slots
            wt = tl.load(TOPK_W + slot, mask=row_ok, other=0.0)
            y_ptr = Y + slot.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(y_ptr, (acc * wt[:, None]).to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _padded_rows_buffer(buf: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] view of ``buf``'s bytes with a row stride of ``cols`` rounded up to ROW_ALIGN."""
    stride = _round_up(cols, ROW_ALIGN)
    flat = buf[: rows * stride * dtype.itemsize].view(dtype)
    return flat.view(rows, stride)[:, :cols]


def _gather(src, dst, slots, block_expert, n_slots, top_k, block_m):
    bits = _BITS[src.element_size()]
    n_cols = src.shape[1]
    block_c = min(512, triton.next_power_of_2(n_cols))
    _gather_rows_kernel[(dst.shape[0] // GATHER_ROWS, triton.cdiv(n_cols, block_c))](
        src.view(bits), dst.view(bits), slots, block_expert, n_slots, n_cols, top_k, block_m,
        src.stride(0), dst.stride(0), BLOCK_R=GATHER_ROWS, BLOCK_C=block_c, num_warps=4)


def _desc(t: torch.Tensor, block: list[int]):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def expert_rows_tma(a, sa, w13, s13, w2, s2, slot_weights, slots, block_expert, top_k, cfg, fp8, ue8m0, out_dtype):
    """y [T·k, H] in ``out_dtype``: each owned slot's expert output times its routing weight
    (rows of foreign slots unwritten), from the slot layout of ``align_slots_to_blocks``.

    ``a`` is x (bf16/fp16) or its e4m3 quantization with scales ``sa`` [T, ⌈H/128⌉]; the FP8
    weight scales ``s13``/``s2`` are fp32 ``scale_inv`` blocks (unused for 16-bit experts)."""
    t = a.shape[0]
    n_slots = t * top_k
    n_local, two_i, h = w13.shape
    inter = two_i // 2
    rows = slots.shape[0]
    grid_m = block_expert.shape[0]
    bm = cfg.block_m
    bk = FP8_GROUP if fp8 else cfg.block_k
    dev = a.device
    n_used = (block_expert >= 0).sum(dtype=torch.int32)  # used blocks come first in the layout
    y_bytes = n_slots * h * out_dtype.itemsize
    if cfg.tma_a:
        buf = torch.empty(max(rows * _round_up(h, ROW_ALIGN) * a.element_size(), y_bytes), dtype=torch.uint8,
                          device=dev)
        xs = _padded_rows_buffer(buf, rows, h, a.dtype)
        _gather(a, xs, slots, block_expert, n_slots, top_k, bm)
        a_desc, a_scales = _desc(xs, [bm, bk]), sa
        if fp8:
            a_scales = torch.empty(rows, sa.shape[1], dtype=torch.float32, device=dev)
            _gather(sa, a_scales, slots, block_expert, n_slots, top_k, bm)
    else:
        buf = torch.empty(y_bytes, dtype=torch.uint8, device=dev)
        a_desc, a_scales = None, sa
    if fp8:
        hid_bytes = rows * _round_up(inter, ROW_ALIGN)
        hid = _padded_rows_buffer(torch.empty(hid_bytes, dtype=torch.uint8, device=dev), rows, inter, FP8_DTYPE)
        sh = torch.empty(rows, inter // FP8_GROUP, dtype=torch.float32, device=dev)
    else:
        sh = s13 = s2 = slots  # unused placeholders for the scale pointers
        hid_bytes = rows * _round_up(inter, ROW_ALIGN) * a.element_size()
        hid = _padded_rows_buffer(torch.empty(hid_bytes, dtype=torch.uint8, device=dev), rows, inter, a.dtype)
    persistent = cfg.persistent
    sms = _persistent_programs(dev)
    grid_n = triton.cdiv(inter, cfg.block_n)
    n_prog = min(sms, grid_m * grid_n) if persistent else grid_m * grid_n
    _gate_up_tma_kernel[(n_prog,)](
        a_desc, a, slots, _desc(w13.view(n_local * two_i, h), [cfg.block_n, bk]), a_scales, s13, hid, sh,
        block_expert, n_used, n_slots, top_k, h, inter, n_prog, a.stride(0), a_scales.stride(0), s13.stride(0),
        s13.stride(1) if fp8 else 0, hid.stride(0), sh.stride(0), FP8=fp8, UE8M0=ue8m0, FLATTEN=persistent,
        GATHER_A=not cfg.tma_a, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    y = buf[:y_bytes].view(out_dtype).view(n_slots, h)
    grid_n = triton.cdiv(h, cfg.block_n_down)
    n_prog = min(sms, grid_m * grid_n) if persistent else grid_m * grid_n
    _down_tma_kernel[(n_prog,)](
        _desc(hid, [bm, bk]), _desc(w2.view(n_local * h, inter), [cfg.block_n_down, bk]), sh, s2, y, slots,
        block_expert, n_used, slot_weights, n_slots, h, inter, n_prog, sh.stride(0), s2.stride(0),
        s2.stride(1) if fp8 else 0, y.stride(0), FP8=fp8, FLATTEN=persistent, BLOCK_M=bm,
        BLOCK_N=cfg.block_n_down, BLOCK_K=bk, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


__all__ = ["expert_rows_tma", "tma_applies"]
