"""Our CUDA C++ sparse decode for DeepSeek-V4 / V4.1 on Hopper (``kernels/csrc/v4_sparse_decode*_sm90a.cu``).

Same contract as ``kernels.v4_sparse_decode.v4_sparse_decode_reference`` for V4 MODEL1 records
(FlashMLA's pages: the layout its sparse decode reads) and, in ``v2``/``v3``, V4.1's window rows
and compressed entries (``FORMAT_CODES``; each scope its own format, a template argument of the
kernels). Three variants, picked by ``variant`` (design, budget and measurements:
benchmarks/KERNEL_NOTES.md):

- ``v1`` (``v4_sparse_decode_sm90a.cu``): one CTA = one query token x 64 heads x one split of
  the token's 32-record tiles; a producer warpgroup gathers (cp.async) and dequantizes each
  record into fp16 shared memory, two consumer warpgroups each compute the scores over half of
  the dims (exchanged through shared memory) and half of the 512 output dims. 128 heads are two
  independent CTAs that each dequantize every record.
- ``v2`` (``v4_sparse_decode_t64_sm90a.cu``): 64-record tiles; the producer loads records
  straight into registers, one consumer warpgroup computes all of Q·Kᵀ and the softmax and hands
  P to the other; 65-128 heads run as 2-CTA clusters whose producers each dequantize half of
  every tile into both CTAs' shared memory (``cluster=False`` runs them as independent CTAs).
- ``v3``: v2, except up to 16 heads, where the tokens2 kernel (``v4_sparse_decode_tokens2_sm90a.cu``)
  runs: v2's tokens-major design with P·V on mma.sync (no proxy fence in the tile loop while the
  next tile's loads are in flight), 8 query rows up to 8 heads, branch-free loads.

Up to 32 heads per GPU (memory-bound) one CTA holds all of a token's heads: v1's narrow kernel
(``v4_sparse_decode_narrow_sm90a.cu``: 16 or 32 rows on mma.sync, v1's producer), and v2's up
to 16 heads (``v4_sparse_decode_tokens_sm90a.cu``: records on wgmma's M side, loaded into
registers as the Q·Kᵀ fragments, two warpgroups on alternate 64-record tiles; 17-32 heads keep
the narrow kernel). 33-63 heads run a 64-head kernel padded. MODEL1 pages and one-record rows
(the V4 family's 584-byte row pools) are both read.

V4.1 records (``v2`` and ``v3``; pages of whole 528- or 288-byte records, the row pools included):
the tokens-major kernel up to 16 heads, the 64-record kernel above, padded to 64 heads at 17-63
(the narrow kernel's cp.async producer reads MODEL1 records only). A call reads one family: V4
records, or V4.1 records in any mix of the two formats.

Build: nvcc (sm_90a) at first use through ``kernels.mla_decode_cuda.build_library`` (same
per-user cache, file lock and flags as the MLA decode kernels), called through ``ctypes``.
Launch shapes depend on tensor shapes only (never on index values or lengths): capturable in
a CUDA graph with preallocated ``out``/``lse``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from kernels import mla_decode_cuda as mdc
from kernels.v4_cache_formats import V4_DATA_BYTES, V4_ROPE_DIMS
from kernels.v4_sparse_decode import HEAD_DIM, MAX_SCOPES, SparseKV, check_inputs

SOURCES = (mdc.CSRC / "v4_sparse_decode_sm90a.cu", mdc.CSRC / "v4_sparse_decode_narrow_sm90a.cu",
           mdc.CSRC / "v4_sparse_decode_t64_sm90a.cu", mdc.CSRC / "v4_sparse_decode_tokens_sm90a.cu",
           mdc.CSRC / "v4_sparse_decode_tokens2_sm90a.cu")
HEADERS = (mdc.CSRC / "v4_sparse_decode_common.cuh", mdc.CSRC / "v4_sparse_decode_tokens_common.cuh",
           mdc.CSRC / "mla_decode_common.cuh", mdc.CSRC / "sm90_async.cuh")
LIBRARY_NAME = "v4_sparse_decode_sm90a"
HEADS_PER_CTA = 64  # the wgmma kernel
NARROW_MAX_HEADS = 32  # up to this many heads: the mma.sync kernel, all heads in one CTA
TOKENS_MAX_HEADS = 16  # up to this many heads v2 runs the tokens-major kernel
TILE = 32  # records per tile (v1 and the narrow kernel)
VARIANTS = ("v1", "v2", "v3")
# Timing diagnostics of v3's tokens2 kernel (V4 records in pages on 16 bytes, <= 16 heads; kDiag*
# in its .cu): no L2 prefetches and the tokens kernel's fence.proxy.async back in the loop; every
# record read from an L1-resident zero record (the loop without HBM; wrong numbers); no L2
# prefetches.
DIAGNOSTICS = {"fence": 1, "no_hbm": 2, "no_prefetch": 3}
# Record formats the v2 kernels read (kFmt* in kernels/csrc/v4_sparse_decode_common.cuh).
FORMAT_CODES = {"v4": 0, "v41_window": 1, "v41_entry": 2}
MAX_SPLITS = 32
V_DESC = (TILE * 128, 1024)  # V read N-major: bytes between 64-dim boxes, between 8-record groups
LOG2E = 1.4426950408889634


def smem_bytes(rows: int) -> int:
    """Shared memory of a CTA of ``rows`` query rows (mirror of the .cu plans): fp16 Q, two fp16
    K stages, four raw stages (data rows + a copy of the scales per producer thread), the
    consumers' partial scores, the per-record biases, four mbarriers, 1024 bytes to align."""
    return (rows * 1024 + 2 * TILE * 1024 + 4 * (TILE * V4_DATA_BYTES + TILE * 32) + 2 * 16 * 128 * 4
            + 2 * TILE * 4 + 4 * 8 + 1024)


def cta_rows(heads: int) -> int:
    """Query rows per CTA: 16 or 32 (narrow kernel, every head of a token), else 64 (wgmma)."""
    return 16 if heads <= 16 else (32 if heads <= NARROW_MAX_HEADS else HEADS_PER_CTA)


SMEM_BYTES = smem_bytes(HEADS_PER_CTA)
# v2 (mirror of the .cu plan): fp16 Q, two 64-record fp16 stages, two P buffers, the stages'
# biases, two buffers of rescale factors and per-warp flags, the epilogue's row factors, four
# mbarriers, 1024 bytes to align.
T64_SMEM_BYTES = 64 * 1024 + 2 * 64 * 1024 + 2 * 64 * 128 + 2 * 64 * 4 + 2 * 64 * 4 + 2 * 4 * 4 + 64 * 4 + 4 * 8 + 1024


# v2's tokens-major kernel (mirror of its plan): Q in k-step order, one 64-record fp16 tile and one
# P^T per warpgroup, per-warpgroup column maxima, 1024 bytes to align.
TOKENS_SMEM_BYTES = 16 * 1024 + 2 * 64 * 1024 + 2 * 16 * 128 + 2 * 4 * 16 * 4 + 1024


def tokens2_smem_bytes(heads: int) -> int:
    """v3's tokens2 kernel (mirror of its plan) for 8 or 16 query rows: Q, one fp16 tile of 64
    records in rows of 1040 bytes and one P^T (rows of 144 bytes) per warpgroup, the column maxima,
    1024 bytes to align."""
    rows = 8 if heads <= 8 else 16
    return rows * 1024 + 2 * 64 * 1040 + 2 * rows * 144 + 2 * 4 * rows * 4 + 1024


def kernel_for(variant: str, heads: int, family: str = "v4") -> tuple[str, int]:
    """(kernel, records per tile) that runs ``heads`` heads per GPU in ``variant`` for records of
    ``family`` (``record_family``): ``tokens2`` (v3, <= 16 heads), ``tokens`` (v2, <= 16 heads),
    ``narrow`` (<= 32, V4 records), ``tile64`` (v2 and v3) or ``wide`` (v1)."""
    if variant == "v3" and heads <= TOKENS_MAX_HEADS:
        return "tokens2", 64
    if variant in ("v2", "v3") and heads <= TOKENS_MAX_HEADS:
        return "tokens", 64
    if heads <= NARROW_MAX_HEADS and family == "v4":
        return "narrow", TILE
    return ("tile64", 64) if variant in ("v2", "v3") else ("wide", TILE)


def uses_cluster(variant: str, heads: int, cluster: bool | None = None, family: str = "v4") -> bool:
    """Whether the 2-CTA cluster runs: v2 and v3 at 65-128 heads (two 64-head blocks) of V4 records,
    unless ``cluster`` is False."""
    return (variant in ("v2", "v3") and family == "v4" and heads > NARROW_MAX_HEADS
            and -(-heads // HEADS_PER_CTA) == 2 and cluster is not False)


def record_family(scopes: Sequence[SparseKV]) -> str:
    """``v4`` (MODEL1 records) or ``v41`` (window rows and entries) for scopes of one family."""
    return "v4" if scopes[0].record == "v4" else "v41"


class _Scope(ctypes.Structure):
    """Mirror of ``SparseScope`` in the .cu file."""

    _fields_ = [
        ("cache", ctypes.c_void_p), ("page_stride", ctypes.c_longlong),
        ("indices", ctypes.c_void_p), ("idx_sb", ctypes.c_longlong), ("idx_ss", ctypes.c_longlong),
        ("lengths", ctypes.c_void_p),
        ("page_size", ctypes.c_int), ("k", ctypes.c_int), ("tiles", ctypes.c_int),
    ]


class _Params(ctypes.Structure):
    """Mirror of ``SparseParams`` in the .cu file (same order and types)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_sb", ctypes.c_longlong), ("q_ss", ctypes.c_longlong), ("q_sh", ctypes.c_longlong),
        ("scope", _Scope * MAX_SCOPES),
        ("sinks", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("o_sb", ctypes.c_longlong), ("o_ss", ctypes.c_longlong), ("o_sh", ctypes.c_longlong),
        ("lse", ctypes.c_void_p), ("l_sb", ctypes.c_longlong), ("l_ss", ctypes.c_longlong), ("l_sh", ctypes.c_longlong),
        ("part_o", ctypes.c_void_p), ("part_l", ctypes.c_void_p),
        ("num_scopes", ctypes.c_int), ("batch", ctypes.c_int), ("s_q", ctypes.c_int), ("heads", ctypes.c_int),
        ("num_splits", ctypes.c_int), ("tiles_per_split", ctypes.c_int),
        ("scale_log2", ctypes.c_float),
        ("v_desc_lead", ctypes.c_uint32), ("v_desc_stride", ctypes.c_uint32),
    ]


def build_library(nvcc: str | None = None, out_dir: Path | None = None) -> Path:
    return mdc.build_library(nvcc, out_dir, sources=SOURCES, headers=HEADERS, name=LIBRARY_NAME)


@functools.lru_cache(maxsize=4)
def _library_in(cache: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(out_dir=cache)))
    for fn, argtypes in (("v4_sparse_decode_sm90", [ctypes.POINTER(_Params), ctypes.c_void_p]),
                         ("v4_sparse_decode_narrow_sm90", [ctypes.POINTER(_Params), ctypes.c_void_p]),
                         ("v4_sparse_decode_t64_sm90", [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int,
                                                        ctypes.c_int, ctypes.c_void_p]),
                         ("v4_sparse_decode_tokens_sm90", [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int,
                                                           ctypes.c_void_p]),
                         ("v4_sparse_decode_tokens2_sm90", [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int,
                                                            ctypes.c_int, ctypes.c_void_p]),
                         ("v4_sparse_decode_tokens_sm90_smem_bytes", []),
                         ("v4_sparse_decode_tokens2_sm90_smem_bytes", [ctypes.c_int]),
                         ("v4_sparse_decode_sm90_params_bytes", []), ("v4_sparse_decode_sm90_smem_bytes", []),
                         ("v4_sparse_decode_t64_sm90_smem_bytes", []),
                         ("v4_sparse_decode_narrow_sm90_smem_bytes", [ctypes.c_int])):
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, ctypes.c_int
    if lib.v4_sparse_decode_sm90_params_bytes() != ctypes.sizeof(_Params):
        raise mdc.CudaKernelUnavailable("SparseParams layout of the built library differs from "
                                        "kernels/v4_sparse_decode_cuda.py")
    return lib


def library() -> ctypes.CDLL:
    """The built library (built once per process and kernel cache directory)."""
    return _library_in(mdc.cache_dir())


def unsupported_reason(scopes: Sequence[SparseKV]) -> str | None:
    """Why these scopes' caches are not what the kernels read (None: they are): V4 MODEL1 records
    (64 RoPE dims), or V4.1 window rows / entries, one family per call, pages on 8 bytes."""
    for i, sc in enumerate(scopes):
        if sc.record not in FORMAT_CODES:
            return f"scopes[{i}]: the cuda kernels read {', '.join(FORMAT_CODES)} records, not {sc.record!r}"
        if (sc.record == "v4") != (scopes[0].record == "v4"):
            return (f"scopes[{i}]: the cuda kernels read V4 or V4.1 records in one call, not {sc.record!r} beside "
                    f"{scopes[0].record!r}")
        if sc.record == "v4" and sc.rope_dims != V4_ROPE_DIMS:
            return f"scopes[{i}]: the cuda kernels read V4 records with {V4_ROPE_DIMS} RoPE dims, not {sc.rope_dims}"
        if sc.cache.data_ptr() % 8 or sc.cache.stride(0) % 8:
            return (f"scopes[{i}].cache: pages must start on 8 bytes (at {sc.cache.data_ptr() % 16} mod 16, "
                    f"stride {sc.cache.stride(0)})")
    return None


def plan_splits(bsz: int, s_q: int, heads: int, tiles: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, tiles_per_split): enough CTAs (one per SM) to fill the GPU once, no empty
    trailing split; from shapes only, so the launch can be captured in a CUDA graph."""
    if tiles < 1:
        raise ValueError(f"sparse decode needs at least one key tile, got {tiles}")
    ctas = bsz * s_q * (1 if heads <= NARROW_MAX_HEADS else -(-heads // HEADS_PER_CTA))
    splits = max(1, min(tiles, MAX_SPLITS, num_sms // max(ctas, 1)))
    per = -(-tiles // splits)
    return -(-tiles // per), per


def check_cuda_inputs(q: torch.Tensor, scopes: Sequence[SparseKV], sinks: torch.Tensor | None) -> None:
    """The contract's checks plus what this kernel needs; one line naming the tensor."""
    check_inputs(q, scopes, sinks)
    if reason := unsupported_reason(scopes):
        raise ValueError(reason)
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bf16 for the cuda kernel, got {q.dtype}")
    if q.stride(-1) != 1 or q.data_ptr() % 16 or any(st % 8 for st in q.stride()[:3]):
        raise ValueError("q must have a unit last stride, 16-byte aligned rows")
    for i, sc in enumerate(scopes):
        if sc.indices.stride(-1) != 1:
            raise ValueError(f"scopes[{i}].indices must have a unit last stride")
        if sc.indices.shape[-1] < 1:
            raise ValueError(f"scopes[{i}].indices has no picks (k = 0)")


def v4_sparse_decode_cuda(
    q: torch.Tensor, scopes: Sequence[SparseKV], sinks: torch.Tensor | None, softmax_scale: float,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None, num_splits: int | None = None,
    v_desc: tuple[int, int] | None = None, variant: str = "v1", cluster: bool | None = None,
    diagnostic: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, s_q, H, 512] bf16, lse [B, s_q, H] float32); no host sync. A 16-bit or float32
    q that is not bf16 is cast once (the kernel converts bf16 to fp16 as it loads).
    ``variant`` picks the design (``VARIANTS``, ``kernel_for``; the registry's ``CUDA_VARIANT``
    says which one serves; V4.1 records need v2), ``cluster=False`` runs v2's 65-128 heads of V4
    records as independent CTAs (V4.1 records always run so).
    ``num_splits`` overrides the plan (tests, benchmarks); ``v_desc`` (leading, stride bytes of
    V's N-major wgmma descriptor; default the variant's) exists for a device check that tells a
    swapped pair. ``diagnostic`` (``DIAGNOSTICS``; v3's tokens2 kernel on V4 records) is for timing
    only."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if q.dtype != torch.bfloat16 and q.is_floating_point():
        q = q.to(torch.bfloat16)
    if q.stride(-1) != 1 or q.data_ptr() % 16 or any(st % 8 for st in q.stride()[:3]):
        q = q.contiguous()
    check_cuda_inputs(q, scopes, sinks)
    family = record_family(scopes)
    if family != "v4" and variant == "v1":
        raise ValueError(f"variant {variant!r} reads V4 records only; V4.1 records need v2 or v3")
    if diagnostic is not None and (diagnostic not in DIAGNOSTICS or family != "v4"
                                   or kernel_for(variant, q.shape[2], family)[0] != "tokens2"):
        raise ValueError(f"diagnostic {diagnostic!r}: one of {tuple(DIAGNOSTICS)}, for v3's tokens2 kernel on "
                         "V4 records")
    bsz, s_q, heads, _ = q.shape
    if out is None:
        out = torch.empty(bsz, s_q, heads, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(bsz, s_q, heads, dtype=torch.float32, device=q.device)
    if out.shape != (bsz, s_q, heads, HEAD_DIM) or out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"out must be bf16 [{bsz}, {s_q}, {heads}, {HEAD_DIM}] with a unit last stride")
    if out.data_ptr() % 4 or any(st % 2 for st in out.stride()[:3]):
        raise ValueError("out must have 4-byte aligned pairs of values (even strides)")
    if lse.shape != (bsz, s_q, heads) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 [{bsz}, {s_q}, {heads}]")
    if bsz == 0:
        return out, lse
    from kernels.gpu import num_sms
    from kernels.v4_sparse_decode_triton import _combine_kernel

    kernel, tile = kernel_for(variant, heads, family)
    v_desc = v_desc or (tile * 128, 1024)
    tiles = [-(-sc.indices.shape[-1] // tile) for sc in scopes]
    splits, per = plan_splits(bsz, s_q, heads, sum(tiles), num_sms(q.device))
    if num_splits is not None:  # a benchmark's or test's override
        per = -(-sum(tiles) // max(1, min(num_splits, sum(tiles))))
        splits = -(-sum(tiles) // per)
    part_o = part_l = None
    if splits > 1:
        part_o = torch.empty(bsz * s_q * splits, heads, HEAD_DIM, dtype=torch.float32, device=q.device)
        part_l = torch.empty(bsz * s_q * splits, heads, dtype=torch.float32, device=q.device)
    scope_args = []
    for sc, nt in zip(scopes, tiles):
        scope_args.append(_Scope(sc.cache.data_ptr(), sc.cache.stride(0), sc.indices.data_ptr(), sc.indices.stride(0),
                                 sc.indices.stride(1), sc.lengths.data_ptr() if sc.lengths is not None else None,
                                 sc.page_size, sc.indices.shape[-1], nt))
    while len(scope_args) < MAX_SCOPES:
        scope_args.append(_Scope())
    p = _Params(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        (_Scope * MAX_SCOPES)(*scope_args),
        sinks.data_ptr() if sinks is not None else None,
        out.data_ptr(), out.stride(0), out.stride(1), out.stride(2),
        lse.data_ptr(), lse.stride(0), lse.stride(1), lse.stride(2),
        part_o.data_ptr() if part_o is not None else None, part_l.data_ptr() if part_l is not None else None,
        len(scopes), bsz, s_q, heads, splits, per, float(softmax_scale) * LOG2E, *v_desc,
    )
    formats = [FORMAT_CODES[sc.record] for sc in scopes]
    formats += formats[-1:] * (MAX_SCOPES - len(formats))  # one scope: its format twice
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        lib = library()
        if kernel == "tokens2":
            err = lib.v4_sparse_decode_tokens2_sm90(ctypes.byref(p), *formats, DIAGNOSTICS.get(diagnostic, 0),
                                                    ctypes.c_void_p(stream))
        elif kernel == "tokens":
            err = lib.v4_sparse_decode_tokens_sm90(ctypes.byref(p), *formats, ctypes.c_void_p(stream))
        elif kernel == "narrow":
            err = lib.v4_sparse_decode_narrow_sm90(ctypes.byref(p), ctypes.c_void_p(stream))
        elif kernel == "tile64":
            err = lib.v4_sparse_decode_t64_sm90(ctypes.byref(p), int(uses_cluster(variant, heads, cluster, family)),
                                                *formats, ctypes.c_void_p(stream))
        else:
            err = lib.v4_sparse_decode_sm90(ctypes.byref(p), ctypes.c_void_p(stream))
    if err != 0:
        raise RuntimeError(f"v4_sparse_decode_sm90 ({variant}, {kernel} kernel): cudaError_t {err}")
    if splits > 1:
        import triton

        _combine_kernel[(bsz * s_q, -(-heads // 16))](
            part_o, part_l, sinks if sinks is not None else lse, out, out.stride(0), out.stride(1), out.stride(2),
            lse, lse.stride(0), lse.stride(1), lse.stride(2), s_q, heads, splits,
            HAS_SINK=sinks is not None, SPLITS_P2=triton.next_power_of_2(splits), BH=16, num_warps=4,
        )
    return out, lse


__all__ = ["DIAGNOSTICS", "FORMAT_CODES", "HEADS_PER_CTA", "TILE", "VARIANTS", "build_library", "check_cuda_inputs",
           "kernel_for", "library", "plan_splits", "record_family", "tokens2_smem_bytes", "unsupported_reason",
           "uses_cluster", "v4_sparse_decode_cuda"]
