"""Our CUDA C++ MXFP8 GEMM for Hopper (``kernels/csrc/mxfp8_gemm_sm90a.cu``): same operands and
contract as :func:`kernels.mxfp8_gemm.mxfp8_gemm` (activations e4m3 + UE8M0 per 32 along K,
weights e4m3 + UE8M0 per 32×32 block, grouped wo_a, bf16/fp32 output or an MXFP8 epilogue).

Why C++: the per-32 promotion (an FMA of each 32-wide K slice's fp32 partial into the
accumulator) has to overlap the next slice's wgmma; the kernels issue slice j+1 before they
promote slice j, from two partial register sets (design notes in the .cu files and
benchmarks/KERNEL_NOTES.md, "MXFP8 GEMM in CUDA C++" and "MXFP8 GEMM v2").

Two kernels, the same numbers bit for bit (``config["kernel"]``): ``"v1"`` (the default,
kernels/csrc/mxfp8_gemm_sm90a.cu) and ``"v2"`` (kernels/csrc/mxfp8_gemm_v2_sm90a.cu: scale
products computed once per quad, wgmmas in flight across stages, clusters with TMA multicast),
which measured 0.86-0.93x of v1 at prefill sizes (benchmarks/RESULTS.md, 2026-12-07). v2 has a
``promote=False`` diagnostic: the same pipeline without the per-32 scales (wrong numbers), whose
time is the ceiling any promotion schedule on that pipeline can reach.

Persistent CTAs (one per SM) walk the output tiles, 64 × 128 (one consumer warpgroup, M ≤ 64)
or 128 × 128 (two), K in 128-byte TMA stages. Where the tiles leave SMs idle, K is split:
fp32 partials in a workspace, summed in a fixed order by a Triton launch (with
``quantize_out`` that launch also rounds to bf16 and quantizes by the epilogue's integer rules,
so z's bytes are those of quantizing the split's bf16 sum).

Build: compiled with ``nvcc`` on first use into the kernel cache of kernels/mla_decode_cuda.py
(same builder, file lock and C ABI through ``ctypes``); nothing is downloaded.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch

from kernels.fp8 import FP8_DTYPE
from kernels.mla_decode_cuda import CSRC, CudaKernelUnavailable, find_nvcc
from kernels.mla_decode_cuda import build_library as mla_build_library
from kernels.mxfp8_gemm_triton import split_sum
from kernels.gpu import num_sms
from kernels.mxfp8_operands import MX_BLOCK, check_operands, scale_bytes, split_k_for

SOURCES = (CSRC / "mxfp8_gemm_sm90a.cu", CSRC / "mxfp8_gemm_v2_sm90a.cu")
HEADERS = (CSRC / "sm90_async.cuh", CSRC / "mxfp8_rounding.cuh", CSRC / "mxfp8_gemm_common.cuh",
           CSRC / "mxfp8_gemm_pipeline.cuh")
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC")
BLOCK_N = 128
BLOCK_K = 128
ROWS_PER_CONSUMER = 64
MODES = {"bf16": 0, "fp32": 1, "split": 2, "quant": 3}
KERNELS = ("v1", "v2")
CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2))  # v2's CTA clusters (along M, along N) with 128-row tiles
NO_PROMOTION_CLUSTERS = ((1, 1), (2, 1))  # those of v2's no-promotion diagnostic


class _GemmParams(ctypes.Structure):
    """Mirror of ``GemmParams`` in the .cu file (same order and types)."""

    _fields_ = [
        ("sa", ctypes.c_void_p), ("sb", ctypes.c_void_p), ("out", ctypes.c_void_p), ("out_scales", ctypes.c_void_p),
        ("ldsa", ctypes.c_longlong), ("ldsb", ctypes.c_longlong), ("ldc", ctypes.c_longlong),
        ("ldsc", ctypes.c_longlong), ("split_stride", ctypes.c_longlong),
        ("m", ctypes.c_int), ("n", ctypes.c_int), ("k_group", ctypes.c_int), ("n_group", ctypes.c_int),
        ("mode", ctypes.c_int), ("splits", ctypes.c_int), ("k_iters_per_split", ctypes.c_int),
        ("scales_u32", ctypes.c_int),
    ]


def build_library(nvcc: str | None = None, out_dir: Path | None = None) -> Path:
    """The MXFP8 GEMM library (built once per source digest into the kernel cache)."""
    return mla_build_library(nvcc, out_dir, sources=SOURCES, headers=HEADERS, name="mxfp8_gemm_sm90a",
                             flags=NVCC_FLAGS)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library()))
    lib.mxfp8_gemm_sm90.argtypes = [ctypes.POINTER(_GemmParams), ctypes.c_void_p, ctypes.c_longlong,
                                    ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                                    ctypes.c_void_p]
    lib.mxfp8_gemm_sm90.restype = ctypes.c_int
    lib.mxfp8_gemm_sm90_v2.argtypes = [ctypes.POINTER(_GemmParams), ctypes.c_void_p, ctypes.c_longlong,
                                       ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.mxfp8_gemm_sm90_v2.restype = ctypes.c_int
    lib.mxfp8_gemm_sm90_params_bytes.restype = ctypes.c_int
    if lib.mxfp8_gemm_sm90_params_bytes() != ctypes.sizeof(_GemmParams):
        raise CudaKernelUnavailable("GemmParams layout of the built library differs from kernels/mxfp8_gemm_cuda.py")
    return lib


@functools.cache
def cuda_gemm_available(device_index: int = 0) -> bool:
    """A Hopper-class GPU (sm_90), nvcc, and the library built (once per process; a failed
    build warns once and leaves the Triton kernel in charge of ``backend=None``)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    if find_nvcc() is None:
        return False
    try:
        _library()
    except CudaKernelUnavailable as exc:
        warnings.warn(f"the CUDA MXFP8 GEMM is unavailable, using the Triton kernel: {exc}", stacklevel=2)
        return False
    return True


def unsupported_reason(x8, xs, w8, ws, m: int, n: int, kg: int, groups: int) -> str | None:
    """Why the CUDA kernel cannot take these operands (None when it can): TMA needs 16-byte
    aligned bases and row strides, the epilogue writes column pairs, and a grouped tile must
    not straddle two groups (in N or in a K stage)."""
    if n % 2:
        return f"N ({n}) is odd"
    if groups > 1 and (n // groups) % BLOCK_N:
        return f"the group's {n // groups} rows are not a multiple of {BLOCK_N}"
    if groups > 1 and kg % BLOCK_K:
        return f"the group's K ({kg}) is not a multiple of {BLOCK_K}"  # a last stage would read the next group
    for name, t in (("x8", x8), ("w8", w8)):
        if t.data_ptr() % 16 or t.stride(0) % 16:
            return f"{name} is not 16-byte aligned with a row stride that is a multiple of 16"
    if xs.stride(-1) != 1 or ws.stride(-1) != 1:
        return "the scales are not contiguous in K"
    return None


def split_for(tiles: int, k_stages: int, m: int, n: int, kg: int, sms: int) -> int:
    """K splits where the output tiles alone leave SMs idle: the smallest divisor of the K
    stages reaching one wave (each split ≥ 2 stages), the fp32 partials no larger than the
    weight's bytes; 1 when the tiles fill the GPU."""
    return split_k_for(tiles, k_stages, sms, max(1, min(32, kg // (4 * max(m, 1)))))


def default_cuda_config(m: int, n: int, kg: int, sms: int = 132) -> dict:
    """One consumer warpgroup (64-row tiles) up to M = 64, two (128 rows) beyond; split-K by
    :func:`split_for`."""
    consumers = 1 if m <= ROWS_PER_CONSUMER else 2
    tiles = -(-m // (ROWS_PER_CONSUMER * consumers)) * -(-n // BLOCK_N)
    return {"consumers": consumers, "SPLIT_K": split_for(tiles, -(-kg // BLOCK_K), m, n, kg, sms)}


def default_cluster(m: int, consumers: int, aligned_scales: bool) -> tuple[int, int]:
    """v2's CTA cluster (along M, along N): pairs along M share B's tile (each CTA loads half and
    multicasts it) where there are 128-row tiles to pair without leaving many CTAs on an empty
    tile (an even count, or ≥ 8); 1 × 1 for 64-row tiles and unaligned scale rows (not built).
    v2's 2 × 1 measured 6-8 % above its 1 × 1 without promotion (benchmarks/RESULTS.md, 2026-12-07)."""
    tiles_m = -(-m // (ROWS_PER_CONSUMER * consumers))
    if consumers != 2 or not aligned_scales or tiles_m < 2 or (tiles_m % 2 and tiles_m < 8):
        return (1, 1)
    return (2, 1)


def cluster_fits(cluster: tuple[int, int], n: int, groups: int) -> bool:
    """A cluster along N shares A's tile between two column tiles: they must be in one group."""
    return cluster[1] == 1 or (n // groups) % (2 * BLOCK_N) == 0


def config_error(kernel: str, consumers: int, cluster: tuple[int, int], promote: bool, aligned: bool, n: int,
                 groups: int) -> str | None:
    """Why the built kernels have no instantiation for this choice (None: they have one). v1: no
    options. v2: clusters of 128-row tiles with aligned scale rows (along N within a group); its
    no-promotion diagnostic with 128-row tiles, aligned scale rows, clusters 1 x 1 or 2 x 1."""
    if kernel not in KERNELS:
        return f"kernel one of {KERNELS}"
    if consumers not in (1, 2):
        return "consumers 1 or 2"
    big = consumers == 2 and aligned
    if kernel == "v1" and (cluster != (1, 1) or not promote):
        return "v1 has no clusters and no diagnostic"
    if cluster not in CLUSTERS or (cluster != (1, 1) and not big) or not cluster_fits(cluster, n, groups):
        return (f"{kernel}'s clusters are {CLUSTERS}, beyond 1 x 1 with 128-row tiles and scale rows of whole "
                "stages and, along N, column tiles of one group")
    if not promote and (not big or cluster not in NO_PROMOTION_CLUSTERS):
        return "the no-promotion diagnostic is built with 128-row tiles, aligned scale rows and clusters 1 x 1 or 2 x 1"
    return None


def mxfp8_gemm_cuda(
    x8: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, groups: int = 1,
    out_dtype: torch.dtype = torch.bfloat16, quantize_out: bool = False, config: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.mxfp8_gemm.mxfp8_gemm` on the CUDA C++ kernels; raises
    :class:`CudaKernelUnavailable` naming what does not fit.

    ``config``: ``consumers`` 1 or 2 and ``SPLIT_K`` (default :func:`default_cuda_config`),
    ``kernel`` ``"v1"`` (default) or ``"v2"``; for v2 ``cluster`` (along M, along N; default
    :func:`default_cluster`) and ``promote``: False is the benchmark's diagnostic, the same
    pipeline without the per-32 scales (wrong numbers: its time is the pipeline's ceiling). What
    is built: :func:`config_error`."""
    m, n, kg = check_operands(x8, xs, w8, ws, groups)
    if quantize_out and n % MX_BLOCK:
        raise ValueError(f"quantize_out needs N ({n}) to be a multiple of {MX_BLOCK}")
    if not x8.is_cuda:
        raise CudaKernelUnavailable("the CUDA MXFP8 GEMM needs CUDA tensors")
    reason = unsupported_reason(x8, xs, w8, ws, m, n, kg, groups)
    if reason:
        raise CudaKernelUnavailable(f"the CUDA MXFP8 GEMM cannot take these operands: {reason}")
    if not quantize_out and out_dtype not in (torch.bfloat16, torch.float32):
        raise CudaKernelUnavailable(f"the CUDA MXFP8 GEMM writes bf16 or fp32, not {out_dtype}")
    xs, ws = scale_bytes(xs), scale_bytes(ws)
    cfg = dict(default_cuda_config(m, n, kg, num_sms(x8.device)), **(config or {}))
    consumers, split, kernel = cfg["consumers"], cfg.get("SPLIT_K", 1), cfg.get("kernel", "v1")
    k_stages = -(-kg // BLOCK_K)
    if split < 1 or k_stages % split:
        raise ValueError(f"bad CUDA GEMM config {cfg}: SPLIT_K dividing the {k_stages} K stages")
    dev = x8.device
    if quantize_out:
        out = torch.empty(m, n, dtype=torch.uint8, device=dev)
        scales = torch.empty(m, n // MX_BLOCK, dtype=torch.uint8, device=dev)
    else:
        out = torch.empty(m, n, dtype=out_dtype, device=dev)
        scales = None
    if m == 0 or n == 0:
        return (out.view(FP8_DTYPE), scales) if quantize_out else out
    if split > 1:
        dst, mode = torch.empty(split, m, n, dtype=torch.float32, device=dev), MODES["split"]
    elif quantize_out:
        dst, mode = out, MODES["quant"]
    else:
        dst, mode = out, MODES["bf16" if out_dtype == torch.bfloat16 else "fp32"]
    aligned = (kg % BLOCK_K == 0 and xs.stride(0) % 4 == 0 and ws.stride(0) % 4 == 0
               and xs.data_ptr() % 4 == 0 and ws.data_ptr() % 4 == 0)
    default = (1, 1) if kernel == "v1" else default_cluster(m, consumers, aligned)
    cluster = tuple(cfg.get("cluster") or default)
    promote = bool(cfg.get("promote", True))
    why = config_error(kernel, consumers, cluster, promote, aligned, n, groups)
    if why:
        raise ValueError(f"bad CUDA GEMM config {cfg} (cluster {cluster}): {why}")
    p = _GemmParams(
        xs.data_ptr(), ws.data_ptr(), dst.data_ptr(), scales.data_ptr() if mode == MODES["quant"] else None,
        xs.stride(0), ws.stride(0), dst.stride(-2), scales.stride(0) if scales is not None else 0,
        dst.stride(0) if split > 1 else 0,
        m, n, kg, n // groups if groups > 1 else n, mode, split, k_stages // split, int(aligned),
    )
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        if kernel == "v1":
            err = _library().mxfp8_gemm_sm90(ctypes.byref(p), x8.data_ptr(), x8.stride(0), x8.shape[1],
                                             w8.data_ptr(), w8.stride(0), consumers, ctypes.c_void_p(stream))
        else:
            err = _library().mxfp8_gemm_sm90_v2(ctypes.byref(p), x8.data_ptr(), x8.stride(0), x8.shape[1],
                                                w8.data_ptr(), w8.stride(0), consumers, cluster[0], cluster[1],
                                                int(promote), ctypes.c_void_p(stream))
    if err != 0:
        reasons = {-1: "bad argument", -2: "the driver refused an operand's TMA tensor map",
                   -3: f"no {cluster[0]} x {cluster[1]} cluster fits on this GPU"}
        raise RuntimeError(f"mxfp8_gemm_sm90 ({kernel}): {reasons.get(err, f'cudaError_t {err}')}")
    if split > 1:
        split_sum(dst, out, scales)
    if quantize_out:
        return out.view(FP8_DTYPE), scales
    return out


__all__ = ["CLUSTERS", "KERNELS", "NO_PROMOTION_CLUSTERS", "cluster_fits", "config_error", "cuda_gemm_available",
           "default_cluster", "default_cuda_config", "mxfp8_gemm_cuda", "split_for", "unsupported_reason"]
