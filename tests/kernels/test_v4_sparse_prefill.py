"""V4 / V4.1 sparse prefill: the torch reference against a float64 loop written from the
contract, the Triton kernels under TRITON_INTERPRET=1 on tiny shapes (a subprocess: the
interpreter is chosen at import), and the kernels on the GPU against the float64 reference.

Every case is a request's chunk at some start (> 0 mostly, so the window reaches into the
cached ring rows and the chunk straddles compressor windows) over pools whose unused rows are
poisoned (0xFF bytes: NaN as e4m3, bf16 and UE8M0; NaN values for model-dtype rows), with −1
picks mixed in. (That the reference equals the model's own torch attention is checked through
the models: tests/model/test_v4_sparse_attention.py.)
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.v4_cache_formats import pack_v41_entries, pack_v41_window_rows, pack_v4_rows
from kernels.v4_sparse_prefill import (PrefillEntries, PrefillWindow, StoredRows, check_prefill_inputs,
                                       v4_sparse_prefill_reference)
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH

REPO = Path(__file__).resolve().parents[2]


def _pack(rows: torch.Tensor, record: str, rope_dims: int, dtype: torch.dtype) -> torch.Tensor:
    if record == "rows":
        return rows.to(dtype)
    if record == "v4":
        return pack_v4_rows(rows, rope_dims)
    return (pack_v41_window_rows if record == "v41_window" else pack_v41_entries)(rows)


def _pool(num_rows: int, live: torch.Tensor, values: torch.Tensor, record: str, rope_dims: int,
          dtype: torch.dtype) -> torch.Tensor:
    """A pool layer of ``num_rows`` rows, poisoned but at rows ``live`` (which hold ``values``)."""
    packed = _pack(values, record, rope_dims, dtype)
    pool = torch.full((num_rows, packed.shape[-1]), float("nan") if record == "rows" else 0xFF, dtype=packed.dtype)
    pool[live] = packed
    return pool


def _stored_values(stored: StoredRows, rows: torch.Tensor, dim: int) -> torch.Tensor:
    return stored.read(rows, dim, torch.float64)


def make_prefill_case(t: int, start: int, heads: int, size: int, *, record_w: str = "v4", record_e: str | None = None,
                      mode: str = "picks", ratio: int = 4, topk: int = 6, dim: int = 512, rope_dims: int = 64,
                      dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu", unit: int = 3,
                      no_pick_frac: float = 0.2):
    """(q, start, window, entries, sinks): a chunk of ``t`` tokens at ``start`` in ring unit ``unit``
    of a window pool, entries (``mode`` picks / causal / none) on scattered pages of an entry pool."""
    gen = torch.Generator().manual_seed(seed)
    end = start + t

    def rand_rows(n):
        return torch.randn(n, dim, generator=gen) * (1 + 2 * torch.rand(n, 1, generator=gen))

    # window ring: unit ``unit`` of 5, position p at row unit·size + p % size
    p_cached = min(start, size - 1)
    cached_pos = torch.arange(start - p_cached, start)
    wrows = unit * size + cached_pos % size
    wpool = _pool(5 * size, wrows, rand_rows(p_cached), record_w, rope_dims, dtype)
    cached = StoredRows(wpool.to(device), record_w, rope_dims)
    chunk_raw = rand_rows(t)
    chunk = StoredRows(_pack(chunk_raw, record_w, rope_dims, dtype), record_w, rope_dims).read(
        torch.arange(t), dim, dtype)  # the chunk's rows after the cache rounding, as the model passes them
    window = PrefillWindow(chunk.to(device), cached, wrows.to(torch.int32).to(device), size)

    entries = None
    if mode != "none":
        record_e = record_e or record_w
        n = end // ratio
        page = 4
        pages = torch.randperm(-(-n // page) + 6, generator=gen)[: -(-n // page)] + 1  # scattered pages, none is 0
        erows = pages.repeat_interleave(page)[:n] * page + torch.arange(n) % page
        epool = _pool((pages.max().item() + 2 if n else 2) * page, erows, rand_rows(n), record_e, rope_dims, dtype)
        picks = None
        if mode == "picks":
            picks = torch.full((t, topk), -1, dtype=torch.long)
            for i in range(t):
                visible = (start + i + 1) // ratio
                k = min(topk, visible)
                picks[i, :k] = torch.randperm(visible, generator=gen)[:k]
                picks[i, torch.randperm(topk, generator=gen)] = picks[i].clone()  # -1s anywhere
            picks[torch.rand(t, topk, generator=gen) < no_pick_frac] = -1
            picks = picks.to(device)
        entries = PrefillEntries(StoredRows(epool.to(device), record_e, rope_dims), erows.to(device), picks, ratio)
    q = (torch.randn(t, heads, dim, generator=gen) * 2).to(dtype)
    sinks = torch.randn(heads, generator=gen) * 3
    return q.to(device), start, window, entries, sinks.to(device)


def float64_loop(q, start, window, entries, sinks, scale):
    """The contract written out per token and head."""
    t, heads, dim = q.shape
    cached = _stored_values(window.cached, window.rows.cpu(), dim)
    first = start - cached.shape[0]
    rows = torch.cat([cached, window.chunk.cpu().double()])
    ent = None
    if entries is not None and entries.rows.shape[0]:
        ent = _stored_values(entries.stored, entries.rows.cpu(), dim)
    out = torch.zeros(t, heads, dim, dtype=torch.float64)
    for i in range(t):
        p = start + i
        keys = [rows[kp - first] for kp in range(max(0, p - window.size + 1), p + 1)]
        if ent is not None:
            if entries.picks is None:
                keys += [ent[w] for w in range((p + 1) // entries.ratio)]
            else:
                keys += [ent[int(w)] for w in entries.picks[i].cpu() if int(w) >= 0]
        kv = torch.stack(keys)
        for h in range(heads):
            logits = kv @ q[i, h].cpu().double() * scale
            m = logits.max()
            w = torch.exp(logits - m)
            denom = w.sum() + (torch.exp(sinks[h].double().cpu() - m) if sinks is not None else 0.0)
            out[i, h] = (w / denom) @ kv
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


CPU_CASES = [  # (T, start, H, window, case fields)
    (9, 13, 3, 8, dict(record_w="v4", mode="picks", ratio=4, topk=5, dim=32, rope_dims=8)),  # tiny V4 CSA
    (11, 5, 2, 8, dict(record_w="v4", mode="causal", ratio=8, dim=32, rope_dims=8)),  # V4 HCA, straddles a window
    (7, 0, 2, 4, dict(record_w="v41_window", record_e="v41_entry", mode="picks", ratio=2, topk=4, dim=64)),
    (6, 20, 2, 8, dict(record_w="rows", mode="picks", ratio=1, topk=6, dim=16, dtype=torch.float32)),
    (5, 3, 2, 8, dict(record_w="rows", mode="none", dim=16, dtype=torch.float64)),
    (10, 17, 4, 8, dict(record_w="v4", mode="picks", ratio=4, topk=8, dim=512, rope_dims=64)),
]


@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_reference_matches_float64_loop(case):
    t, start, heads, size, fields = CPU_CASES[case]
    q, start, window, entries, sinks = make_prefill_case(t, start, heads, size, seed=case, **fields)
    scale = q.shape[-1] ** -0.5
    got = v4_sparse_prefill_reference(q, start, window, entries, sinks, scale, compute_dtype=torch.float64,
                                      query_block=4)
    want = float64_loop(q, start, window, entries, sinks, scale)
    assert not got.isnan().any()
    assert rel_err(got, want) < 1e-12
    out = v4_sparse_prefill_reference(q, start, window, entries, sinks, scale)  # q's dtype, float32 inside
    assert out.dtype == q.dtype and rel_err(out, want) < 1e-2


def test_bad_inputs_name_the_tensor():
    q, start, window, entries, sinks = make_prefill_case(4, 6, 2, 8, dim=32, rope_dims=8)
    with pytest.raises(ValueError, match="window.rows"):
        check_prefill_inputs(q, start + 1, window, entries, sinks)
    with pytest.raises(ValueError, match="window.chunk"):
        check_prefill_inputs(q[:3], start, window, entries, sinks)
    with pytest.raises(ValueError, match="entries.picks"):
        check_prefill_inputs(q, start, window, PrefillEntries(entries.stored, entries.rows, entries.picks[:2]), sinks)
    with pytest.raises(ValueError, match="entries.stored.record"):
        check_prefill_inputs(q, start, window, PrefillEntries(StoredRows(entries.stored.cache, "fp4"), entries.rows,
                                                              entries.picks), sinks)
    with pytest.raises(ValueError, match="sinks"):
        check_prefill_inputs(q, start, window, entries, sinks[:1])


_INTERPRET_SCRIPT = INTERPRETER_PATCH + textwrap.dedent(
    """
    import torch
    from tests.kernels.test_v4_sparse_prefill import make_prefill_case, float64_loop, rel_err
    from kernels.v4_sparse_prefill_triton import SparsePrefillConfig as C, v4_sparse_prefill_triton
    cases = [  # (T, start, H, window, case fields, config)
        (5, 9, 4, 8, dict(record_w="v4", mode="picks", ratio=4, topk=6), C()),  # 4 heads: 16-token tiles
        (6, 3, 2, 8, dict(record_w="v4", mode="causal", ratio=4), C(block_n=16)),  # V4 HCA
        (4, 6, 2, 4, dict(record_w="v41_window", record_e="v41_entry", mode="picks", ratio=1, topk=5),
         C(block_h=2, block_t=8, dv_split=1, block_n=16)),
        (3, 0, 16, 8, dict(record_w="rows", mode="picks", ratio=2, topk=3), C()),  # bf16 rows, start 0
        (7, 12, 3, 8, dict(record_w="rows", mode="none"), C(block_h=4, block_t=4, block_n=16)),
        # the bench's V4 CSA shape at 64 heads (both kernels' 64-head programs), 584-byte rows
        (2, 4093, 64, 128, dict(record_w="v4", mode="picks", ratio=4, topk=512, no_pick_frac=0.0), C()),
    ]
    import kernels.v4_sparse_prefill_triton as kernel_module
    cases.append((9, 5, 2, 8, dict(record_w="v4", mode="picks", ratio=2, topk=4), C(block_h=2, block_t=8, block_n=16)))
    for i, (t, start, h, size, fields, cfg) in enumerate(cases):
        if i == len(cases) - 1:  # launches split over token ranges (as past the grid's 65535 tiles)
            kernel_module.MAX_GRID_Y, kernel_module.DECODE_TOKENS = 1, 4
        q, start, window, entries, sinks = make_prefill_case(t, start, h, size, seed=20 + i, **fields)
        out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16)
        v4_sparse_prefill_triton(q, start, window, entries, sinks, 512**-0.5, config=cfg, out=out)
        want = float64_loop(q, start, window, entries, sinks, 512**-0.5)
        assert not out.isnan().any(), (i, "unwritten or poisoned output")
        err = rel_err(out, want)
        assert err < 1e-2, (i, err)
    print("interpreter ok")
    """
)


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0 and "interpreter ok" in res.stdout, (res.stdout[-2000:], res.stderr[-4000:])


_COMPILE_CASES = [  # (heads, window record, HCA entries, picks partial, spill stack or less): defaults of 8/64 heads
    (64, "v41_window", False, True, 512), (8, "v4", True, False, 128),
    (64, "v4", False, True, 528),  # V4 CSA's window + merge program
]


def _compile_window_kernel(heads: int, record: str, has_ent: bool, has_part: bool):
    """(ptx, resource usage) of the default window program for ``heads``, compiled for sm_90 here."""
    from kernels.v4_sparse_decode_triton import DATA_BYTES, FORMATS, RECORD_BYTES
    from kernels.v4_sparse_prefill_triton import _window_kernel, resolve_prefill_config
    from tests.kernels.test_mxfp8_gemm import _compile_sm90

    cfg = resolve_prefill_config(heads, None)
    types = dict(Q="*fp16", CH16="*bf16", WC="*u8", WC16="*bf16", WR="*i32", EC="*u8", EC16="*bf16", ER="*i32",
                 PO="*fp32", PL="*fp32", SINK="*fp32", OUT="*bf16", sm_log2="fp32")
    ints = "q_st q_sh ch_st wc_rw P ec_rw N_ENT ratio o_st o_sh T H start window tile0"
    types.update(dict.fromkeys(ints.split(), "i32"))
    entry = "v41_entry" if record == "v41_window" else record
    align = {r: 16 if RECORD_BYTES[r] % 16 == 0 else 8 for r in (record, entry)}
    consts = dict(WFMT=FORMATS[record], WDATA=DATA_BYTES[record], WALIGN=align[record], EFMT=FORMATS[entry],
                  EDATA=DATA_BYTES[entry], EALIGN=align[entry],
                  HAS_ENT=has_ent, HAS_PART=has_part, HAS_SINK=True, DV_SPLIT=cfg.dv_split, BT=cfg.block_t,
                  BH=cfg.block_h, BN=cfg.block_n)
    divisible = ["q_st", "q_sh", "ch_st", "o_st", "o_sh"]  # the row strides in words: 33, 18, 73 (no hint)
    return _compile_sm90(_window_kernel, types, consts, divisible=tuple(divisible), num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)


@pytest.fixture(scope="module")
def window_kernels_for_sm90():
    """{compile case: future of :func:`_compile_window_kernel`} for the test below."""
    pytest.importorskip("triton")
    from tests.kernels.test_mxfp8_gemm import _PTXAS, started_two_at_a_time

    if not _PTXAS.exists():
        pytest.skip("needs triton's bundled ptxas")
    cases = [case[:4] for case in _COMPILE_CASES]
    with started_two_at_a_time({case: functools.partial(_compile_window_kernel, *case) for case in cases}) as futures:
        yield futures


@pytest.mark.slow
@pytest.mark.parametrize("heads,record,has_ent,has_part,limit", _COMPILE_CASES)
def test_window_kernel_compiles_for_sm90(window_kernels_for_sm90, heads, record, has_ent, has_part, limit):
    """The window kernel the H200 runs, compiled here (the interpreter does not check what only
    the compiler does): wgmma, cp.async-pipelined gathers, no local memory beyond a known spill."""
    from kernels.v4_sparse_prefill_triton import resolve_prefill_config

    ptx, usage = window_kernels_for_sm90[heads, record, has_ent, has_part].result()
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx, usage
    stack = int(usage.split("STACK:")[1].split()[0])
    assert usage.endswith("LOCAL:0") and stack <= limit, (resolve_prefill_config(heads, None), usage)


# ---- GPU: the kernels against the float64 reference on fresh random inputs -------------------------
GPU_CASES = [  # (T, start, H, case fields)
    (300, 1000, 8, dict(record_w="v4", mode="picks", ratio=4, topk=512)),  # V4 CSA
    (256, 8192, 64, dict(record_w="v4", mode="picks", ratio=4, topk=512)),  # V4 CSA at 64 heads (the bench's NaN)
    (200, 37, 64, dict(record_w="v4", mode="causal", ratio=128)),  # V4 HCA: few entries yet
    (257, 4000, 64, dict(record_w="v4", mode="causal", ratio=128)),  # V4 HCA, entries on every token
    (300, 700, 8, dict(record_w="v41_window", record_e="v41_entry", mode="picks", ratio=2, topk=512)),
    (130, 3000, 64, dict(record_w="v41_window", record_e="v41_entry", mode="picks", ratio=1, topk=512)),
    (100, 0, 64, dict(record_w="v41_window", mode="none")),  # a window-only layer, from position 0
    (190, 2100, 64, dict(record_w="rows", mode="picks", ratio=4, topk=512)),  # --kv-cache-dtype auto
    (70, 50, 8, dict(record_w="rows", mode="causal", ratio=4)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,start,heads,fields", GPU_CASES)
def test_triton_kernels_on_gpu(t, start, heads, fields):
    from kernels.v4_sparse_prefill_triton import v4_sparse_prefill_triton

    q, start, window, entries, sinks = make_prefill_case(t, start, heads, 128, seed=t + heads, device="cuda",
                                                         **fields)
    out = v4_sparse_prefill_triton(q, start, window, entries, sinks, 512**-0.5)
    want = v4_sparse_prefill_reference(q, start, window, entries, sinks, 512**-0.5, compute_dtype=torch.float64)
    assert not out.isnan().any()
    assert rel_err(out, want) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fields", [dict(block_h=16, block_t=4), dict(block_h=64, block_t=2, num_warps=8),
                                    dict(block_h=8, block_t=8, num_warps=4), dict(block_h=8, block_t=16, dv_split=1),
                                    dict(block_n=64)])
def test_triton_kernel_variants_on_gpu(fields):
    from kernels.v4_sparse_prefill_triton import SparsePrefillConfig, v4_sparse_prefill_triton

    for heads in (8, 64):
        q, start, window, entries, sinks = make_prefill_case(150, 333, heads, 128, mode="causal", ratio=4,
                                                             seed=heads, device="cuda")
        cfg = SparsePrefillConfig(**{**fields, "block_h": min(fields.get("block_h", heads), 64)})
        out = v4_sparse_prefill_triton(q, start, window, entries, sinks, 512**-0.5, config=cfg)
        want = v4_sparse_prefill_reference(q, start, window, entries, sinks, 512**-0.5, compute_dtype=torch.float64)
        assert rel_err(out, want) <= 2e-2, (heads, fields)


def test_backend_registry_and_errors():
    from kernels.attention import (AttentionSpec, BackendUnavailable, TorchV4SparsePrefill,
                                   select_v4_prefill_backend)

    spec = AttentionSpec(torch.device("cpu"), torch.uint8, 16, 512, 64, 1, 512**-0.5, torch.bfloat16)
    assert select_v4_prefill_backend("auto", spec, ("v4",)) is None  # a CPU: the model's torch attention
    assert select_v4_prefill_backend("torch", spec, ("v4",)) is None
    with pytest.raises(BackendUnavailable, match="--prefill-attention-backend triton"):
        select_v4_prefill_backend("triton", spec, ("v4",))
    with pytest.raises(BackendUnavailable, match="--prefill-attention-backend sdpa"):
        select_v4_prefill_backend("sdpa", spec)
    q, start, window, entries, sinks = make_prefill_case(4, 6, 2, 8, dim=32, rope_dims=8)
    out = TorchV4SparsePrefill().prefill(q, start, window, entries, sinks, 32**-0.5)
    assert rel_err(out, float64_loop(q, start, window, entries, sinks, 32**-0.5)) < 1e-2
    assert math.isfinite(out.float().sum().item())
