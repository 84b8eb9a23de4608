"""Our CUDA C++ paged MLA decode for Hopper (``kernels/csrc/``): FP8 query and FP8 latent
cache, or bf16 query and bf16 cache up to 32 query rows per request; split-KV, CUDA-graph safe.
Same contract as ``kernels.mla_decode.mla_decode_reference``.

Three kernels; the launch picks by cache dtype and query rows per request (heads per GPU x
query tokens):

- ``narrow`` (``mla_decode_wgmma_narrow_sm90a.cu``), up to 32 rows (16 heads per GPU under TP8,
  V2-Lite): decode is memory-bound there. Tokens-major FP8 wgmma (the tile's 64 tokens on the
  M side, 16 or 32 query rows on N, so no MMA row is padding), two warpgroups per CTA on
  alternate tiles, a five-stage TMA ring, one CTA per SM.
- ``wgmma`` (``mla_decode_wgmma_sm90a.cu``), 64+ rows (128 heads): compute-bound; FP8 wgmma
  for Q·Kᵀ and P·V (P·V as O^T = V^T·P^T with V^T built in registers: Hopper's FP8 MMAs need
  both operands K-major), 64 rows and two warpgroups per CTA that take turns (each computes the
  scores and softmax of every other tile and publishes P, each accumulates half of the output
  dims over every tile), cache tiles loaded by TMA (the library encodes the cache's tensor map
  on each call: host work only, a CUDA graph keeps it).
- ``narrow-bf16`` (``mla_decode_bf16_narrow_sm90a.cu``), a bf16 cache, up to 32 rows: the narrow
  kernel's tokens-major products in bf16 (V^T read transposed from shared memory by wgmma), each
  warpgroup streaming its tiles through a private ring of 8 KB TMA boxes (a 72 KB bf16 tile:
  three whole tiles and Q do not fit). More rows with a bf16 cache: the Triton kernel.

Split-KV (small batches): ``choose_num_splits`` picks the split count from a cost model of the
launch (one CTA per SM for every kernel: waves x (fixed cost + tiles per split), plus the
partials' round trip and the combine); the splits write normalized partials and their LSE, and
``mla_decode_combine_sm90a.cu`` merges them, launched with programmatic dependent launch so that
its launch hides under the decode kernel.

Build: the sources are compiled with ``nvcc`` (sm_90a) on first use (about 10 s) into a
per-user cache (:func:`set_cache_dir`, default ``~/.cache/mlaserve/kernels``; the server sets it
from ``MLASERVE_KERNEL_CACHE``), keyed by a
hash of the sources and flags, under a file lock so that tensor-parallel workers build it once.
The library has a C ABI and is called through ``ctypes`` with raw pointers and the current CUDA
stream, so it depends on no particular torch version. Nothing is downloaded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernels.gpu import num_sms

CSRC = Path(__file__).with_name("csrc")
# All kernels go into one library.
COMBINE_SOURCE = CSRC / "mla_decode_combine_sm90a.cu"  # the split-KV merge, launched after either kernel
SOURCES = (CSRC / "mla_decode_wgmma_sm90a.cu", CSRC / "mla_decode_wgmma_narrow_sm90a.cu",
           CSRC / "mla_decode_bf16_narrow_sm90a.cu", COMBINE_SOURCE)
HEADERS = (CSRC / "mla_decode_common.cuh", CSRC / "sm90_async.cuh", CSRC / "mla_decode_wgmma_tile.cuh")
NVCC_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-gencode", "arch=compute_90a,code=sm_90a",
              "-shared", "-Xcompiler", "-fPIC")
TILE = 64  # tokens per tile; the page size must be a multiple
D_LATENT = 512
D_ROPE = 64
SMEM_PER_SM = 228 * 1024  # Hopper: 228 KB per SM, of which each resident CTA also takes 1 KB
SMEM_RESERVED_PER_CTA = 1024
# The wgmma kernel (mla_decode_wgmma_sm90a.cu): 64 query rows per CTA, two warpgroups, one CTA
# per SM. Query rows per request above NARROW_MAX_ROWS go to it; fewer go to the narrow kernel.
KERNELS = ("narrow", "wgmma", "narrow-bf16")
NARROW_KERNELS = ("narrow", "narrow-bf16")  # 16 or 32 query rows per CTA
NARROW_MAX_ROWS = 32
WGMMA_ROWS = 64
# A cache tile in a wgmma kernel's shared memory, as TMA writes it: five 64-token x 128-byte
# boxes (mla_decode_wgmma_tile.cuh).
WGMMA_TILE_BYTES = 5 * 64 * 128
# Shared memory of a wgmma CTA (mirror of the .cu plan): four cache tiles, packed Q, four slots
# of a tile's P, rescale factors and reference maxima (and a stamp), the final row sums and
# maxima, the stages' mbarriers, and room to align the tiles to 1024 bytes.
WGMMA_STAGES = 4
WGMMA_SLOTS = 4
WGMMA_SMEM_BYTES = (WGMMA_STAGES * WGMMA_TILE_BYTES + 64 * 576 + WGMMA_SLOTS * (64 * 64 + 2 * 64 * 4 + 4)
                    + 5 * 64 * 4 + WGMMA_STAGES * 8 + 1024)

# The narrow kernel (mla_decode_wgmma_narrow_sm90a.cu): 16 or 32 query rows per CTA (the
# smallest that holds a request's rows; more rows take several CTAs), two warpgroups, five
# stages, one CTA per SM.
NARROW_ROWS = (16, 32)
NARROW_STAGES = 5
NARROW_CTAS_PER_SM = 1
# The bf16 narrow kernel (mla_decode_bf16_narrow_sm90a.cu): 16 or 32 query rows per CTA, two
# warpgroups, each with a ring of 8 KB boxes (64 tokens x 64 dims, nine per tile), one CTA per SM.
BF16_BOX_BYTES = 64 * 128
BF16_RING_BOXES = {16: 12, 32: 11}  # per warpgroup
# The combine (mla_decode_combine_sm90a.cu) merges up to 128 splits (four LSEs per lane).
MAX_SPLITS = 128


def narrow_rows_per_cta(rows: int) -> int:
    return NARROW_ROWS[0] if rows <= NARROW_ROWS[0] else NARROW_ROWS[1]


def narrow_smem_bytes(rows_per_cta: int) -> int:
    """Shared memory of a narrow CTA (mirror of ``NarrowPlan`` in the .cu file): the stages'
    cache tiles, packed Q, P and per-warp column maxima (two parities) per warpgroup, per-warp
    column sums, two mbarriers per stage, and room to align the tiles to 1024 bytes."""
    n = rows_per_cta
    return (NARROW_STAGES * WGMMA_TILE_BYTES + n * 576 + 2 * n * 64 + (2 * 2 * 4 * n + 4 * n) * 4
            + 2 * NARROW_STAGES * 8 + 1024)


def bf16_narrow_smem_bytes(rows_per_cta: int) -> int:
    """Shared memory of a bf16 narrow CTA (mirror of ``Bf16Plan`` in the .cu file): both
    warpgroups' box rings, packed bf16 Q, P^T per warpgroup, per-warp column maxima per
    warpgroup and column sums, one mbarrier per box slot, and room to align to 1024 bytes."""
    n, ring = rows_per_cta, BF16_RING_BOXES[rows_per_cta]
    return 2 * ring * BF16_BOX_BYTES + n * 2 * 576 + 2 * n * 128 + (2 * 4 * n + 4 * n) * 4 + 2 * ring * 8 + 1024


class CudaKernelUnavailable(RuntimeError):
    """The CUDA C++ backend cannot run here (no nvcc, not a Hopper-class GPU, build failed)."""


class _Params(ctypes.Structure):
    """Mirror of ``Params`` in the .cu file (same order and types)."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_sb", ctypes.c_longlong), ("q_ss", ctypes.c_longlong), ("q_sh", ctypes.c_longlong),
        ("kv", ctypes.c_void_p), ("kv_sp", ctypes.c_longlong), ("kv_st", ctypes.c_longlong),
        ("block_tables", ctypes.c_void_p), ("bt_s", ctypes.c_longlong),
        ("seq_lens", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("o_sb", ctypes.c_longlong), ("o_ss", ctypes.c_longlong), ("o_sh", ctypes.c_longlong),
        ("lse", ctypes.c_void_p), ("l_sb", ctypes.c_longlong), ("l_ss", ctypes.c_longlong), ("l_sh", ctypes.c_longlong),
        ("part_o", ctypes.c_void_p), ("part_l", ctypes.c_void_p),
        ("batch", ctypes.c_int), ("s_q", ctypes.c_int), ("heads", ctypes.c_int), ("num_splits", ctypes.c_int),
        ("page_size", ctypes.c_int),
        ("scale_log2", ctypes.c_float), ("out_scale", ctypes.c_float),
    ]


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc") or (("/usr/local/cuda/bin/nvcc") if Path("/usr/local/cuda/bin/nvcc").exists() else None)


DEFAULT_CACHE_DIR = Path.home() / ".cache" / "mlaserve" / "kernels"
_cache_dir = DEFAULT_CACHE_DIR


def set_cache_dir(path: str | os.PathLike) -> None:
    """Where :func:`build_library` keeps builds from now on (the next kernel call rebuilds or
    reuses the library there)."""
    global _cache_dir
    if Path(path) != _cache_dir:
        _cache_dir = Path(path)
        default_library_path.cache_clear()
        _library.cache_clear()


def cache_dir() -> Path:
    return _cache_dir


def build_library(nvcc: str | None = None, out_dir: Path | None = None, sources: tuple[Path, ...] = SOURCES,
                  headers: tuple[Path, ...] = HEADERS, name: str = "mla_decode_sm90a",
                  flags: tuple[str, ...] = NVCC_FLAGS) -> Path:
    """Compile ``sources`` (default: the MLA decode kernels) with ``flags`` into the library
    ``name`` unless a build of these exact sources, headers and flags exists."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaKernelUnavailable("the cuda backend needs nvcc (set CUDA_HOME or put nvcc on PATH)")
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in (*sources, *headers):
        digest.update(path.read_bytes())
    key = digest.hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{name}-{key}.so"
    if lib.exists():
        return lib
    with open(out_dir / f".{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait and reuse its result
        if lib.exists():
            return lib
        tmp = lib.with_suffix(f".tmp{os.getpid()}")
        _compile_and_link(nvcc, flags, sources, tmp)
        os.replace(tmp, lib)
    return lib


def _run_nvcc(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise CudaKernelUnavailable(f"nvcc failed building {what}:\n{res.stderr[-4000:]}")


def _compile_and_link(nvcc: str, flags: tuple[str, ...], sources: tuple[Path, ...], out: Path) -> None:
    """Each source to an object file, as many at once as there are cores (one nvcc call over
    several files compiles them one after another: 34 s for the V4 library's five on 2 cores, its
    largest alone 19 s), then one link into the shared library ``out``. Objects are
    whole-program device code, exactly what a single nvcc call over all the sources links."""
    if len(sources) == 1:
        _run_nvcc([nvcc, *flags, "-o", str(out), str(sources[0])], sources[0].name)
        return
    compile_flags = [f for f in flags if f != "-shared"]
    objects = [out.with_name(f"{out.name}.{i}.o") for i in range(len(sources))]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(len(sources), cores)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            jobs = [pool.submit(_run_nvcc, [nvcc, *compile_flags, "-c", "-o", str(obj), str(src)], src.name)
                    for src, obj in zip(sources, objects)]
            for job in jobs:
                job.result()  # the first failure, naming its source
        _run_nvcc([nvcc, *flags, "-o", str(out), *map(str, objects)], ", ".join(path.name for path in sources))
    finally:
        for obj in objects:
            obj.unlink(missing_ok=True)


@functools.lru_cache(maxsize=1)
def default_library_path() -> Path:
    """``build_library()`` once per process (a failure is not cached: the next call retries)."""
    return build_library()


# The C entry points' argument types (every one returns an int error code).
_ENTRY_POINTS = {
    "mla_decode_fp8_wgmma_sm90": [ctypes.POINTER(_Params), ctypes.c_longlong, ctypes.c_void_p],
    "mla_decode_fp8_wgmma_narrow_sm90": [ctypes.POINTER(_Params), ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p],
    "mla_decode_bf16_narrow_sm90": [ctypes.POINTER(_Params), ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p],
    "mla_decode_split_combine_sm90": [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_void_p],
    "mla_decode_fp8_sm90_params_bytes": [],
}


def declare_entry_points(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give the library's entry points their ctypes signatures; a library built from some of the
    sources (benchmarks/ablate_mla_wgmma.py builds one kernel at a time) gets those it has."""
    for name, argtypes in _ENTRY_POINTS.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = declare_entry_points(ctypes.CDLL(str(default_library_path())))
    if lib.mla_decode_fp8_sm90_params_bytes() != ctypes.sizeof(_Params):
        raise CudaKernelUnavailable("Params layout of the built library differs from kernels/mla_decode_cuda.py")
    return lib


def choose_kernel(rows: int, cache_dtype: torch.dtype = torch.float8_e4m3fn) -> str:
    """An e4m3 cache: ``narrow`` (tokens-major wgmma, 16 or 32 rows per CTA) up to
    NARROW_MAX_ROWS query rows per request, where decode is memory-bound and a 64-row CTA would
    be mostly padding; ``wgmma`` (64 rows per CTA) above. A bf16 cache: ``narrow-bf16`` up to
    NARROW_MAX_ROWS rows; more is a ValueError (no bf16 kernel for them here)."""
    if cache_dtype == torch.bfloat16:
        if rows > NARROW_MAX_ROWS:
            raise ValueError(f"the cuda backend decodes a bf16 cache for at most {NARROW_MAX_ROWS} query rows per "
                             f"request (s_q x heads), got {rows}; use the triton backend or an fp8 cache")
        return "narrow-bf16"
    return "narrow" if rows <= NARROW_MAX_ROWS else "wgmma"


@dataclasses.dataclass(frozen=True)
class SplitCostModel:
    """What a split-KV launch costs, in µs (benchmarks/KERNEL_NOTES.md, "Small batches"), for
    :func:`choose_num_splits`. Both kernels keep one CTA per SM, so a CTA's time is its fixed
    cost plus its tiles, a launch takes ``waves`` of them, and splitting adds the partials'
    round trip through L2 and the combine."""

    # One CTA's time per 64-token tile when its SM is the bound: the 64-row kernel takes 195 µs
    # for 124 tiles per SM at B=128, 128 heads (compute-bound); the narrow kernel's compute per
    # 16-32 row tile is well under the HBM share it gets at full occupancy (1.3 µs).
    wgmma_tile_us: float = 1.57
    narrow_tile_us: float = 0.5
    narrow_bf16_tile_us: float = 0.7  # not yet measured: bf16 operands, 36 + 32 k16 steps per tile
    cta_us: float = 2.0  # per CTA: Q load, the first tile's latency, the epilogue
    combine_us: float = 1.0  # the combine's own time (its launch hides under the decode: PDL)
    l2_bytes_per_us: float = 5e6  # partials written by the splits and read back by the combine
    hbm_bytes_per_us: float = 3.6e6  # the cache stream when every SM pulls at once
    sm_bytes_per_us: float = 5e4  # what one SM's TMA ring streams at most

    def tile_time(self, kernel: str, active_ctas: int, readers_per_tile: int) -> float:
        """A tile's time in one of ``active_ctas`` CTAs: its SM's compute, or its share of HBM
        (``readers_per_tile`` CTAs of a request read each tile; L2 serves all but the first)."""
        tile_bytes = TILE * (D_LATENT + D_ROPE) * (2 if kernel == "narrow-bf16" else 1)
        hbm = active_ctas * tile_bytes / readers_per_tile / self.hbm_bytes_per_us
        compute = {"narrow": self.narrow_tile_us, "narrow-bf16": self.narrow_bf16_tile_us}.get(kernel,
                                                                                           self.wgmma_tile_us)
        return max(compute, hbm, tile_bytes / self.sm_bytes_per_us)


SPLIT_COST = SplitCostModel()


def rows_per_cta(rows: int, kernel: str) -> int:
    return narrow_rows_per_cta(rows) if kernel in NARROW_KERNELS else WGMMA_ROWS


def launch_ctas(bsz: int, rows: int, kernel: str) -> tuple[int, int]:
    """CTAs per split (requests x row blocks) and the row blocks of one request."""
    per_request = -(-rows // rows_per_cta(rows, kernel))
    return bsz * per_request, per_request


def estimate_split_us(splits: int, bsz: int, rows: int, max_tiles: int, num_sms: int, kernel: str,
                      model: SplitCostModel = SPLIT_COST) -> float:
    """Modelled time of a launch with ``splits`` splits of requests of ``max_tiles`` tiles."""
    ctas, per_request = launch_ctas(bsz, rows, kernel)
    total = ctas * splits
    waves = -(-total // num_sms)
    tiles = -(-max_tiles // splits)
    per_cta = model.cta_us + tiles * model.tile_time(kernel, min(total, num_sms), per_request)
    t = waves * per_cta
    if splits > 1:
        part_bytes = 2 * total * rows_per_cta(rows, kernel) * (2 * D_LATENT + 4)  # bf16 O, fp32 LSE: written, read
        t += model.combine_us + part_bytes / model.l2_bytes_per_us
    return t


@functools.lru_cache(maxsize=4096)  # called per layer on eager steps: one search per shape
def choose_num_splits(bsz: int, rows: int, max_tiles: int, num_sms: int, kernel: str,
                      model: SplitCostModel = SPLIT_COST) -> int:
    """The split count the cost model says is fastest (the fewest among equals). Depends only on
    shapes (the batch, the block table's width in tiles, never sequence lengths), so the launch
    can be captured in a CUDA graph; requests shorter than ``max_tiles`` leave splits empty."""
    best, best_t = 1, float("inf")
    for splits in range(1, max(1, min(max_tiles, MAX_SPLITS)) + 1):
        t = estimate_split_us(splits, bsz, rows, max_tiles, num_sms, kernel, model)
        if t < best_t - 1e-9:
            best, best_t = splits, t
    return best


def checked_kernel(rows: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, kernel: str | None = None) -> str:
    """The kernel that decodes ``rows`` query rows per request with this query and cache dtype
    (``kernel`` when given, else :func:`choose_kernel`'s), or a one-line TypeError/ValueError."""
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    if q_dtype == cache_dtype == fp8:
        takes = ("narrow", "wgmma")
    elif q_dtype == cache_dtype == bf16:
        takes = ("narrow-bf16",)
    else:
        raise TypeError(f"the cuda backend needs an e4m3 query and cache, or a bf16 query and cache "
                        f"(got {q_dtype}, {cache_dtype})")
    kernel = kernel or choose_kernel(rows, cache_dtype)
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNELS}")
    if kernel not in takes:
        raise ValueError(f"kernel {kernel!r} does not decode a {cache_dtype} cache; one of {takes}")
    return kernel


def mla_decode_cuda(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    kernel: str | None = None,
    merge_splits: bool = True,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode; returns (out [B, s_q, H, 512] in ``out_dtype``, default bf16; lse
    [B, s_q, H] float32). The kernel writes bf16; another ``out_dtype`` costs one cast.
    q and kv_cache are both e4m3 or both bf16. ``kernel`` (``narrow`` or ``wgmma`` for e4m3,
    ``narrow-bf16`` for bf16, which also takes more than 32 rows when named: several CTAs per
    request) defaults to ``choose_kernel(s_q * H, kv_cache.dtype)``, ``num_splits`` (1 to
    MAX_SPLITS) to ``choose_num_splits``. ``merge_splits=False`` skips the split-KV
    combine, leaving out and lse unwritten when there are splits (benchmarks time the decode
    kernel alone with it); ``pdl=False`` launches the combine as a plain stream-ordered kernel
    instead of with programmatic dependent launch (same result; benchmarks measure the gain).

    Every request needs ``seq_lens[b] >= s_q``. No host synchronization, launch shape from
    tensor shapes only: capturable in a CUDA graph (pass ``out``/``lse`` to reuse buffers).
    """
    from kernels.mla_decode_triton import _check_inputs

    _check_inputs(q, kv_cache, block_tables, seq_lens, kv_lora_rank)
    kernel = checked_kernel(q.shape[1] * q.shape[2], q.dtype, kv_cache.dtype, kernel)
    if kv_lora_rank != D_LATENT:
        raise ValueError(f"the cuda backend is built for kv_lora_rank {D_LATENT}, got {kv_lora_rank}")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype != torch.bfloat16:  # the kernel writes bf16; other dtypes (fp16 models) get a cast
        if out is not None:
            raise ValueError(f"out must be bf16 for the cuda backend, not {out.dtype}")
        out16, lse = mla_decode_cuda(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, q_scale,
                                     k_scale, torch.bfloat16, num_splits, None, lse, kernel, merge_splits, pdl)
        return out16.to(out_dtype), lse
    page = kv_cache.shape[1]
    if page % TILE:
        raise ValueError(f"the cuda backend needs a page size that is a multiple of {TILE}, got {page}")
    for name, t, strides in (("q", q, q.stride()[:3]), ("kv_cache", kv_cache, kv_cache.stride()[:2])):
        if t.data_ptr() % 16 or any(s % 16 for s in strides):
            raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 16 bytes")
    if kv_cache.stride(1) != kv_cache.shape[2]:
        raise ValueError("the cuda backend needs the cache's token rows contiguous within a page")
    bsz, s_q, h, _ = q.shape
    rows = s_q * h
    max_tiles = max(1, block_tables.shape[1] * page // TILE)
    splits = num_splits or choose_num_splits(bsz, rows, max_tiles, num_sms(q.device), kernel)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be 1 to {MAX_SPLITS}, got {splits}")
    if out is None:
        out = torch.empty(bsz, s_q, h, D_LATENT, dtype=out_dtype, device=q.device)
    if lse is None:
        lse = torch.empty(bsz, s_q, h, dtype=torch.float32, device=q.device)
    if out.shape != (bsz, s_q, h, D_LATENT) or out.stride(-1) != 1 or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be bf16 [B, s_q, H, {D_LATENT}] with unit last stride")
    if out.data_ptr() % 16 or any(st % 8 for st in out.stride()[:3]):
        # the kernels write 16-byte runs of a row: other layouts go through a copy
        tmp, lse = mla_decode_cuda(q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, q_scale,
                                   k_scale, out_dtype, num_splits, None, lse, kernel, merge_splits, pdl)
        return out.copy_(tmp), lse
    if lse.shape != (bsz, s_q, h) or lse.dtype != torch.float32:
        raise ValueError("lse must be float32 [B, s_q, H]")
    if bsz == 0:
        return out, lse
    part_o = part_l = None
    if splits > 1:
        part_o = torch.empty(bsz * rows, splits, D_LATENT, dtype=torch.bfloat16, device=q.device)
        part_l = torch.empty(bsz * rows, splits, dtype=torch.float32, device=q.device)
    qe, ke = q.element_size(), kv_cache.element_size()  # the kernels take q and kv strides in bytes
    p = _Params(
        q.data_ptr(), q.stride(0) * qe, q.stride(1) * qe, q.stride(2) * qe,
        kv_cache.data_ptr(), kv_cache.stride(0) * ke, kv_cache.stride(1) * ke,
        block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1), out.stride(2),
        lse.data_ptr(), lse.stride(0), lse.stride(1), lse.stride(2),
        part_o.data_ptr() if part_o is not None else None, part_l.data_ptr() if part_l is not None else None,
        bsz, s_q, h, splits, page,
        float(softmax_scale) * float(q_scale) * float(k_scale) * 1.4426950408889634, float(k_scale),
    )
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        if kernel == "narrow":
            err = _library().mla_decode_fp8_wgmma_narrow_sm90(ctypes.byref(p), kv_cache.shape[0],
                                                               narrow_rows_per_cta(rows), ctypes.c_void_p(stream))
        elif kernel == "narrow-bf16":
            err = _library().mla_decode_bf16_narrow_sm90(ctypes.byref(p), kv_cache.shape[0],
                                                          narrow_rows_per_cta(rows), ctypes.c_void_p(stream))
        else:
            err = _library().mla_decode_fp8_wgmma_sm90(ctypes.byref(p), kv_cache.shape[0], ctypes.c_void_p(stream))
        _raise_on_error(err, kernel)
        if splits > 1 and merge_splits:  # with PDL its launch overlaps the decode kernel
            err = _library().mla_decode_split_combine_sm90(ctypes.byref(p), int(pdl), ctypes.c_void_p(stream))
            _raise_on_error(err, "combine")
    return out, lse


def _raise_on_error(err: int, what: str) -> None:
    if err != 0:
        reasons = {-1: "rows per CTA not built", -2: "the driver refused the cache's TMA tensor map",
                   -3: f"split count outside 2..{MAX_SPLITS}"}
        reason = reasons.get(err, f"cudaError_t {err}")
        raise RuntimeError(f"mla_decode_sm90a ({what}): {reason}")


__all__ = ["CudaKernelUnavailable", "SplitCostModel", "build_library", "default_library_path", "set_cache_dir",
           "checked_kernel", "choose_kernel", "choose_num_splits", "estimate_split_us", "mla_decode_cuda"]
