"""The V4.1 indexer's Triton kernels (kernels/v4_indexer_triton.py): the scoring kernel, the
queries' quantization and the whole picks chain (its selection: tests/kernels/test_topk_triton.py).

CPU: under TRITON_INTERPRET=1 on tiny shapes (a subprocess: the interpreter is chosen at
import) the scores against the torch reference, the quantization byte for byte, and the chain's
picks and candidate blocks exactly equal to the reference selection of the kernel's own scores
(and to the reference chain up to ties); compiled for sm_90 here (FP8 wgmma, no spills, key
records read no wider than their alignment). GPU: the same at V4.1-Flash's shapes with
NaN-poisoned unused pages, and the chain captured in a CUDA graph and replayed."""

from __future__ import annotations

import functools
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.topk import key_scores
from kernels.v4_indexer import (candidate_blocks, index_picks_reference, index_scores_reference,
                                quantize_index_queries, topk_picks)
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH
from tests.kernels.test_mxfp8_gemm import capture, run_interpreted, two_at_a_time
from tests.kernels.test_v4_indexer import _paged_keys, assert_same_picks

_PTXAS = (Path(importlib.util.find_spec("triton").origin).parent / "backends/nvidia/bin/ptxas"
          if importlib.util.find_spec("triton") else None)
needs_ptxas = pytest.mark.skipif(_PTXAS is None or not _PTXAS.exists(), reason="needs triton's bundled ptxas")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_prmt_conversion_is_exact_on_every_byte():
    """The kernel's PTX (e2m1 pairs → e4m3, 4 bytes a call) mirrored instruction for instruction
    by ``kernels.mxfp4_moe.fold_bytes_lut`` with the kernel's tables: every byte value gives the
    e4m3 of both its codes, each output byte from the same input byte."""
    import re

    from kernels.mxfp4_moe import fold_bytes_lut
    from kernels.v4_indexer_triton import _E2M1_TO_E4M3_ASM
    from kernels.weight_formats import fp4_codes_to_float

    tables = [int(t, 16) for t in re.findall(r"mov.b32 t(?:lo|hi), (0x[0-9A-F]+);", _E2M1_TO_E4M3_ASM.value)]
    v = torch.arange(256, dtype=torch.int64)
    word = v | (v.roll(1) << 8) | (v.roll(2) << 16) | (v.roll(3) << 24)  # four different bytes per word
    lo, hi = fold_bytes_lut(word, torch.tensor(tables[0]), torch.tensor(tables[1]))
    for i in range(4):
        byte = (word >> (8 * i)) & 0xFF
        for out, code in ((lo, byte & 15), (hi, byte >> 4)):
            got = ((out >> (8 * i)) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).float()
            assert torch.equal(got, fp4_codes_to_float(code.to(torch.uint8)).float())



def kernel_args(device: str, small: bool):
    """The positional arguments of ``index_scores_triton`` (and of the reference): decode at
    mixed counts with and without a candidate mask, a prefill chunk of one request (partial
    query tiles), 8 padded heads and V4.1-Flash's 32 × 128; unused pages NaN-poisoned (0xFF)."""
    shapes = [(8, 64, [0, 3, 17, 40]), (32, 128, [1, 64, 130])] if small else \
        [(8, 64, [0, 3, 17, 400]), (32, 128, [1, 64, 130, 5000, 9001, 0, 2048, 777])]
    for heads, dim, counts in shapes:
        pool, tables, _, n = _paged_keys(counts, dim, 16, seed=heads + dim, device=device)
        g = torch.Generator().manual_seed(heads)
        for qpr in (1, 5 if small else 301):  # small: two query tiles of 4, the second partial
            nreq = len(counts) if qpr == 1 else 1
            nq = nreq * qpr
            q8, qs = quantize_index_queries(torch.randn(nq, heads, dim, generator=g).to(device))
            w = torch.randn(nq, heads, generator=g).to(device)
            if qpr == 1:
                vis = torch.tensor(counts, device=device)
            else:
                vis = torch.randint(0, counts[-1] + 1, (nq,), generator=g).to(device)
            allowed = (torch.rand(nq, -(-n // 8), generator=g) > 0.4).to(device)
            table = tables if qpr == 1 else tables[-1:]
            for al in (None, allowed):
                yield q8, qs, w, pool, table, 16, vis, n, dim**-0.5, qpr, al, 8, True


def kernel_cases(device: str, small: bool):
    """(Triton, reference) pairs of scores and block maxima on :func:`kernel_args`."""
    from kernels.v4_indexer_triton import index_scores_triton

    for args in kernel_args(device, small):
        n = args[7]
        want = index_scores_reference(*args)
        got = index_scores_triton(*args)
        yield got[0], want[0]
        yield got[1], want[1]
        keys, _ = index_scores_triton(*args, keys_out=True)
        assert torch.equal(keys & 0xFFFFFFFF, (0xFFFFFFFF - torch.arange(n, device=device)).expand_as(keys))
        yield key_scores(keys), want[0]



def chain_args(device: str, small: bool):
    """Positional arguments of ``index_picks_triton`` / ``index_picks_reference``: raw queries
    over a wide dynamic range, decode at mixed counts (the candidate source, then a layer under
    its mask) and a prefill chunk of one request; unused pages NaN-poisoned."""
    shapes = [(8, 64, [0, 3, 17, 40], 5, 2), (32, 128, [1, 64, 130], 40, 3)] if small else \
        [(32, 128, [1, 700, 5000, 65536, 0, 2048, 777, 40000], 512, 2048)]
    for heads, dim, counts, k, kb in shapes:
        pool, tables, _, n = _paged_keys(counts, dim, 16 if small else 64, seed=heads + dim, device=device)
        page_rows = 16 if small else 64
        g = torch.Generator().manual_seed(dim)
        # small: decode on the narrow shape, a 5-query prefill chunk (a partial second query tile)
        # on V4.1's 32 x 128 (CI time)
        for qpr in ((1,) if heads == 8 else (5,)) if small else (1, 256):
            nq = len(counts) if qpr == 1 else qpr
            q = (torch.randn(nq, heads, dim, generator=g) * torch.logspace(-2, 2, dim)).to(device)
            w = torch.randn(nq, heads, generator=g).to(device)
            vis = torch.tensor(counts) if qpr == 1 else torch.randint(0, counts[-1] + 1, (nq,), generator=g)
            vis = vis.to(device)
            table = tables if qpr == 1 else tables[-1:]
            yield q, w, pool, table, page_rows, vis, n, dim**-0.5, k, qpr, None, 8, kb
            allowed = (torch.rand(nq, -(-n // 8), generator=g) > 0.5).to(device)
            yield q, w, pool, table, page_rows, vis, n, dim**-0.5, k, qpr, allowed, 8, None


def check_chain(args, reference_rows=None, **chain) -> None:
    """The chain on ``args`` (options ``chain``): its picks and candidate blocks are the
    reference selection of the kernel's own scores exactly (restricted: with the allowed blocks
    compacted too), and the reference chain's up to ties (on ``reference_rows``)."""
    from kernels.v4_indexer_triton import index_picks_triton, index_scores_triton

    q, w, pool, table, page_rows, vis, n, scale, k, qpr, allowed, bs, kb = args
    picks, mask = index_picks_triton(*args, **chain)
    q8, qs = quantize_index_queries(q)
    scores, bmax = index_scores_triton(q8, qs, w, pool, table, page_rows, vis, n, scale, qpr, allowed, bs,
                                       kb is not None)
    assert torch.equal(picks, topk_picks(scores, k))
    if allowed is not None:  # the allowed blocks compacted into dense keys: the same scores, the same picks
        most = int(allowed.sum(1).max())
        for bound in (most, most + 5):
            assert torch.equal(index_picks_triton(*args, allowed_blocks=bound, **chain)[0], picks), bound
    assert (mask is None) == (kb is None)
    if kb is not None:
        assert torch.equal(mask, candidate_blocks(bmax, vis.view(-1, 1), kb, bs))
    rows = torch.arange(q.shape[0]) if reference_rows is None else torch.tensor(reference_rows)
    rows_d = rows.to(q.device)
    one = table.shape[0] == 1
    sub = (q[rows_d], w[rows_d], pool, table if one else table[rows_d], page_rows, vis[rows_d], n, scale, k,
           len(rows) if one else 1, None if allowed is None else allowed[rows_d], bs, kb)
    want, _ = index_picks_reference(*sub)
    ref_scores, _ = index_scores_reference(*quantize_index_queries(sub[0]), *sub[1:8], sub[9], sub[10], bs)
    assert_same_picks(picks[rows_d].cpu(), want.cpu(), ref_scores.cpu())


# Two scripts, run at once (one core each): the scores and the quantization, and the chain.
_INTERPRET_SCRIPTS = [INTERPRETER_PATCH + textwrap.dedent(script) for script in (
    """
    import torch
    from kernels.v4_indexer import quantize_index_queries
    from kernels.v4_indexer_triton import mma_order, quantize_queries_triton
    from tests.kernels.test_v4_indexer_triton import chain_args, check_chain, kernel_cases
    for got, want in kernel_cases("cpu", small=True):
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got)) and not got.isnan().any()
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 128, generator=g) * torch.logspace(-30, 30, 128)
    q[0, 1, :32] = 0.0  # an all-zero block
    for x in (q, q.to(torch.bfloat16)):
        zero = torch.full((3, 40), 7, dtype=torch.int32)
        q8, scale = quantize_queries_triton(x, zero=zero)
        want8, want_scale = quantize_index_queries(x)
        assert torch.equal(q8.view(torch.uint8), mma_order(want8).view(torch.uint8))
        assert torch.equal(scale, want_scale) and not zero.any()
    first = next(chain_args("cpu", small=True))
    check_chain(first, select_buffers=(16, 64), fused_histogram=False)  # the histogram by its own pass
    import kernels.v4_indexer_triton as kt
    kt.MAX_K, kt.MAX_MASK_BLOCKS = 4, 2  # past the Triton selection's sizes: the torch fallbacks
    check_chain(first)
    print("interpreter ok")
    """,
    """
    from tests.kernels.test_v4_indexer_triton import chain_args, check_chain
    for args in chain_args("cpu", small=True):
        check_chain(args, select_buffers=(16, 64) if args[8] < 16 else (64, 256))
    print("interpreter ok")
    """,
)]


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_interpreted(*_INTERPRET_SCRIPTS)


_INTS = "pt_stride page_rows al_stride out_stride bm_stride num_q num_keys q_per_req tiles".split()
SCORE_TYPES = dict(Q8="*u8", QS="*fp32", W="*fp32", KEYS="*u8", PT="*i64", VIS="*i64", ALLOWED="*u8", BMAX="*fp32",
                   HIST="*i32", softmax_scale="fp32", **dict.fromkeys(_INTS, "i32"))


@pytest.mark.slow
@needs_ptxas
def test_default_shapes_compile_for_sm90_on_fp8_wgmma_without_spills():
    """V4.1-Flash's shapes (32 heads × 128), decode and prefill defaults, the picks chain's
    launch (float32 scores, the histogram, no dead tiles) and the contract's (int64 keys or
    scores with block maxima, dead tiles −inf), with and without the candidate mask: FP8 wgmma,
    cp.async-pipelined codes, no local memory or spill stack; the quantization likewise."""
    from kernels.topk_triton import HIST_STRIDE
    from kernels.v4_indexer_triton import (_compact_blocks_kernel, _index_scores_kernel, _quantize_queries_kernel,
                                           default_shape)
    from tests.kernels.test_mxfp8_gemm import _compile_sm90

    divisible = ("pt_stride", "page_rows", "out_stride", "num_keys", "tiles")
    scores = []  # (picks_path, consts, compile call)
    for qpr in (1, 256):
        bn, bq, warps, stages = default_shape(qpr)
        for allowed in (False, True):
            for picks_path in (True, False):
                consts = dict(H=32, HP=32, D=128, REC=68, BQ=bq, BN=bn, BS=8, HAS_ALLOWED=allowed, SKIP=True,
                              PRMT=True, WANT_BMAX=not allowed, KEYS_OUT=not picks_path and allowed,
                              HISTOGRAM=picks_path, HSTRIDE=HIST_STRIDE, WRITE_DEAD=not picks_path, PREFETCH=True)
                types = dict(SCORE_TYPES, OUT="*i64" if consts["KEYS_OUT"] else "*fp32")
                scores.append((picks_path, consts, functools.partial(
                    _compile_sm90, _index_scores_kernel, types, consts, divisible, num_warps=warps,
                    num_stages=stages)))
    quantize = functools.partial(
        _compile_sm90, _quantize_queries_kernel,
        dict(Q="*fp32", Q8="*u8", QS="*fp32", ZERO="*i32", q_stride="i32", zero_stride="i32", zero_n="i32"),
        dict(H=32, HP=32, D=128, ZP=4096), ("q_stride",), num_warps=4)
    compact = functools.partial(
        _compile_sm90, _compact_blocks_kernel,
        dict(ALLOWED="*u8", al_stride="i32", VIS="*i64", PT="*i64", pt_stride="i32", q_per_req="i32", VPT="*i64",
             BLIST="*i32", VIS_C="*i32", nblocks="i32", width="i32"),
        dict(BS=8, BPP=8, ROW=8192), ("al_stride", "nblocks"), num_warps=8)
    *compiled, (_, quantize_usage), (_, compact_usage) = two_at_a_time([c for *_, c in scores] + [quantize, compact])
    for (picks_path, consts, _), (ptx, usage) in zip(scores, compiled):
        assert "wgmma" in ptx and "e4m3" in ptx and "cp.async" in ptx and "prmt.b32" in ptx, usage
        assert ("atom.global" in ptx) == picks_path, usage
        assert re.search(r"STACK:0 .*LOCAL:0", usage), (consts, usage)
    assert re.search(r"STACK:0 .*LOCAL:0", quantize_usage), quantize_usage
    assert re.search(r"STACK:0 .*LOCAL:0", compact_usage), compact_usage


_POINTER_TYPES = {torch.uint8: "*u8", torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64",
                  torch.float32: "*fp32"}


def _specialize(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a launch as Triton's launcher specializes it: tensors
    whose address and integers that are multiples of 16 get ``tt.divisibility`` 16, integers
    equal to 1 become constants."""
    import inspect

    names = list(inspect.signature(fn.fn).parameters)
    sig, consts, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(names, list(args) + [kwargs[n] for n in names[len(args):]])):
        if name in kwargs or (isinstance(value, int) and value == 1):
            sig[name], consts[(i,)] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            sig[name], aligned = _POINTER_TYPES[value.dtype], value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            sig[name], aligned = "fp32", False
        else:
            sig[name], aligned = "i32" if -2**31 <= value < 2**31 else "i64", value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def global_access_bytes(ptx: str, source: str) -> dict[int, set[int]]:
    """The bytes each global load, store and cp.async of ``ptx`` moves per thread, by the line of
    ``source`` it was generated from (the PTX's .loc directives)."""
    import re

    # by file name: Triton's cache is keyed by the source text, so a PTX compiled from another
    # checkout of the same file carries that checkout's path
    files = {k for k, path in re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', ptx) if Path(path).name == Path(source).name}
    line, widths = None, {}
    for text in ptx.splitlines():
        if m := re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", text):
            line = int(m.group(2)) if m.group(1) in files else None
        elif m := re.search(r"cp\.async\.c[ag]\.shared\.global[^;]*\],\s*(0x[0-9a-f]+|\d+)", text):
            widths.setdefault(line, set()).add(int(m.group(1), 0))
        elif m := re.search(r"\b(?:ld|st)\.global((?:\.[\w:]+)*)", text):
            vec = re.search(r"\.v(\d)", m.group(1))
            bits = re.findall(r"\.[bsuf](\d+)\b", m.group(1))
            widths.setdefault(line, set()).add((int(vec.group(1)) if vec else 1) * int(bits[-1]) // 8)
    return widths


@pytest.mark.slow
@needs_ptxas
def test_key_record_loads_assume_no_more_alignment_than_the_records(monkeypatch):
    """Every launch of the GPU tests (arguments built here, launches recorded: the scores'
    contract and the picks chain, restricted layers on compacted blocks too) compiled for sm_90
    as Triton's launcher specializes it: the global accesses generated from the lines that read
    key records (the e2m1 codes, the scale word) move at most the records' alignment per access
    (68-byte records: 4 bytes, 34-byte: 2), since a record starts at 68 · row; nothing moves more
    than 16. Triton's alignment analysis once took the records for 16-aligned (16-byte
    cp.async: a misaligned address on the GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.topk_triton as kk
    import kernels.v4_indexer_triton as kt

    launches = {}

    def recorder(name):
        class Recorder:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.setdefault(name, []).append((args, kwargs))
        return Recorder()

    for module, name in ((kt, "_index_scores_kernel"), (kt, "_quantize_queries_kernel"), (kt, "_compact_blocks_kernel"),
                         (kk, "_collect_kernel"), (kk, "_finish_kernel"), (kk, "_block_mask_kernel")):
        monkeypatch.setattr(module, name, recorder(name))
    for args in kernel_args("cpu", small=False):
        kt.index_scores_triton(*args)
        kt.index_scores_triton(*args, keys_out=True)
        q8, qs, w, pool, table, page_rows, vis, n, scale, qpr, allowed, bs, _ = args
        kt.index_picks_triton(torch.randn(q8.shape), w, pool, table, page_rows, vis, n, scale, 64, qpr, allowed, bs,
                              16 if allowed is None else None)
        if allowed is not None:  # the restricted launch on compacted blocks (pages of one block)
            kt.index_picks_triton(torch.randn(q8.shape), w, pool, table, page_rows, vis, n, scale, 64, qpr, allowed,
                                  bs, allowed_blocks=allowed.shape[1])
    monkeypatch.undo()
    record_lines = {i + 1 for i, text in enumerate(Path(kt.__file__).read_text().splitlines())
                    if re.search(r"tl\.load\((rec|word)\b", text)}
    assert len(record_lines) == 2  # the e2m1 codes and the scale words
    compiles = {}  # one per distinct specialization: (name, module, constexpr kwargs, consts, compile call)
    for name, calls in launches.items():
        module = kt if hasattr(kt, name) else kk
        fn = getattr(module, name)
        for args, kwargs in calls:
            kwargs = dict(kwargs, PRMT=True) if "PRMT" in kwargs else dict(kwargs)  # the GPU's byte lookups
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            sig, consts, attrs = _specialize(fn, args, kwargs)
            key = repr((name, sig, consts, attrs, options))
            if key not in compiles:
                compiles[key] = (name, module, kwargs, consts, functools.partial(
                    triton.compile, ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                    options=options))
    kernels = two_at_a_time([job[-1] for job in compiles.values()])
    for (name, module, kwargs, consts, _), kernel in zip(compiles.values(), kernels):
        widths = global_access_bytes(kernel.asm["ptx"], module.__file__)
        if name == "_index_scores_kernel":
            rec = kwargs["REC"]
            for line in record_lines:
                assert widths.get(line) and max(widths[line]) <= rec & -rec, (rec, line, widths.get(line), consts)
        assert max(max(w) for w in widths.values()) <= 16, (name, widths)
    assert len([k for k in compiles if "_index_scores_kernel" in k]) >= 12, len(compiles)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
def test_triton_kernel_on_gpu():
    for got, want in kernel_cases("cuda", small=False):
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got)) and not got.isnan().any()
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_picks_chain_on_gpu():
    """V4.1-Flash's step (32 heads × 128, pages of 64, top-512, candidate top-2048 blocks of
    8): decode of 8 requests up to 64k keys and a 256-query prefill block, with and without
    the candidate mask; the quantization byte for byte."""
    from kernels.v4_indexer_triton import mma_order, quantize_queries_triton

    for args in chain_args("cuda", small=False):
        check_chain(args, reference_rows=[0, 3, 6] if args[9] == 1 else [0, 100, 255])
    q = torch.randn(64, 32, 128, device="cuda") * torch.logspace(-20, 20, 128, device="cuda")
    q8, scale = quantize_queries_triton(q.to(torch.bfloat16))
    want8, want_scale = quantize_index_queries(q.to(torch.bfloat16))
    assert torch.equal(q8.view(torch.uint8), mma_order(want8).view(torch.uint8)) and torch.equal(scale, want_scale)


@pytest.mark.gpu
@needs_gpu
def test_picks_chain_replays_in_a_cuda_graph():
    """The chain captured once at a fixed width, replayed on new queries and counts written in
    place: every replay equals an eager run on the same inputs."""
    from kernels.v4_indexer_triton import index_picks_triton

    counts = [0, 37, 3000, 20000]
    pool, tables, _, n = _paged_keys(counts, 128, 64, seed=3, device="cuda")
    q = torch.randn(4, 32, 128, device="cuda")
    w = torch.randn(4, 32, device="cuda")
    vis = torch.tensor(counts, device="cuda")

    def step():
        return index_picks_triton(q, w, pool, tables, 64, vis, n, 128**-0.5, 512, topk_blocks=256)

    graph, (picks, mask) = capture(step)
    for rep in range(3):
        q.copy_(torch.randn_like(q))
        w.copy_(torch.randn_like(w))
        vis.copy_(torch.tensor([c - 5 * rep if c > 5 * rep else c for c in counts]))
        graph.replay()
        want_picks, want_mask = step()
        assert torch.equal(picks, want_picks) and torch.equal(mask, want_mask), rep
