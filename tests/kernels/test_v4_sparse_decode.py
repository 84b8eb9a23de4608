"""V4 / V4.1 sparse decode: the cache codecs, the torch reference against a float64 loop on
dequantized records, the Triton kernel under TRITON_INTERPRET=1 on tiny shapes (a subprocess:
the interpreter is chosen at import), and the kernel on the GPU at serving shapes.

Every case poisons what the kernel must not read: unreferenced records are 0xFF bytes (NaN as
e4m3, bf16 and UE8M0), indices past a scope's length point at poisoned records, and −1 picks
are mixed in.
"""

from __future__ import annotations

import functools
import math
import re
import textwrap

import pytest
import torch

from kernels.v4_cache_formats import V4_NOPE_DIMS as V4_NOPE
from kernels.v4_cache_formats import (pack_v41_entries, pack_v41_window_rows, pack_v4_records, pack_v4_rows,
                                      unpack_v4_rows, v4_page_bytes)
from kernels.v4_sparse_decode import (RECORD_BYTES, SparseKV, check_inputs, pack_v4_cache, row_record_cache,
                                      unpack_records, v4_cache_parts, v4_cache_view, v4_sparse_decode_reference)
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH

SCALE = 512**-0.5


def _pack(rows: torch.Tensor, record: str) -> torch.Tensor:
    if record == "v4":
        return pack_v4_cache(rows)
    return (pack_v41_window_rows if record == "v41_window" else pack_v41_entries)(rows)


def make_scope(bsz: int, s_q: int, k: int, record: str, page_size: int, with_lengths: bool, gen: torch.Generator,
               device: str = "cpu", invalid_frac: float = 0.15, block_spread: int = 0) -> SparseKV:
    """A cache whose only finite records are the picked ones, picks with −1s, and maybe lengths.
    ``block_spread``: each 64-dim block of a row is scaled by 2^u, u uniform in
    [−block_spread, block_spread / 2] (the per-block scales of a record then span that many binades)."""
    pages = -(-(bsz * s_q * k + 7) // page_size) + 1
    n = pages * page_size
    rows = torch.randn(pages, page_size, 512, generator=gen) * (1 + 3 * torch.rand(pages, page_size, 1, generator=gen))
    if block_spread:
        u = torch.randint(-block_spread, block_spread // 2 + 1, (pages, page_size, 8, 1), generator=gen)
        rows = (rows.view(pages, page_size, 8, 64) * torch.exp2(u.float())).view(pages, page_size, 512)
    packed = _pack(rows, record)
    cache = _pack(torch.zeros(pages, page_size, 512), record)
    cache.as_strided((pages, cache.stride(0)), (cache.stride(0), 1)).fill_(0xFF)  # pads included
    perm = torch.randperm(n, generator=gen)
    picked, poisoned = perm[: bsz * s_q * k], perm[bsz * s_q * k:]
    idx = picked.view(bsz, s_q, k).clone()
    idx[torch.rand(bsz, s_q, k, generator=gen) < invalid_frac] = -1
    lengths = None
    if with_lengths:
        lengths = torch.randint(1, k + 1, (bsz,), generator=gen, dtype=torch.int32)
        lengths[0] = k  # one full list
        past = torch.arange(k).view(1, 1, k) >= lengths.view(-1, 1, 1)
        idx = torch.where(past, poisoned[0].expand_as(idx), idx)  # past the length: poison
    live = idx[idx >= 0]
    if with_lengths:
        live = idx[(idx >= 0) & ~past]
    _copy_records(cache, packed, live.unique(), record)
    return SparseKV(cache.to(device), idx.to(torch.int32).to(device), record,
                    None if lengths is None else lengths.to(device))


def _copy_records(dst: torch.Tensor, src: torch.Tensor, flat: torch.Tensor, record: str) -> None:
    page, slot = flat // dst.shape[1], flat % dst.shape[1]
    if record == "v4":
        (dd, de), (sd, se) = v4_cache_parts(dst), v4_cache_parts(src)
        dd[page, slot] = sd[page, slot]
        de[page, slot] = se[page, slot]
    else:
        dst[page, slot] = src[page, slot]


def loaded_scope(bsz: int, s_q: int, k: int, record: str, pages: int, live: int, with_lengths: bool,
                 gen: torch.Generator, page_size: int = 64) -> SparseKV:
    """A scope for load tests, built on the generator's device: ``pages`` pages of 0xFF bytes
    (NaN) of which ``live`` random ones hold random records; picks uniform over the live records
    (15 % −1, repeats allowed) and maybe lengths (k/2..k, one full list) past which the picks point
    at a poisoned record."""
    dev = gen.device
    order = torch.randperm(pages, generator=gen, device=dev)
    if record == "v4":  # MODEL1 pages padded to 576 bytes, viewed as [pages, page_size, 584]
        base = torch.full((pages, v4_page_bytes(page_size)), 0xFF, dtype=torch.uint8, device=dev)
        cache = v4_cache_view(base, page_size)
    else:
        cache = torch.full((pages, page_size, RECORD_BYTES[record]), 0xFF, dtype=torch.uint8, device=dev)
    for chunk in order[:live].split(512):
        rows = torch.randn(len(chunk), page_size, 512, generator=gen, device=dev)
        rows *= 1 + 3 * torch.rand(len(chunk), page_size, 1, generator=gen, device=dev)
        if record == "v4":
            base[chunk] = pack_v4_records(rows)
        else:
            cache[chunk] = _pack(rows, record)
    idx = order[torch.randint(live, (bsz, s_q, k), generator=gen, device=dev)] * page_size
    idx += torch.randint(page_size, (bsz, s_q, k), generator=gen, device=dev)
    idx[torch.rand(bsz, s_q, k, generator=gen, device=dev) < 0.15] = -1
    lengths = None
    if with_lengths:
        lengths = torch.randint(k // 2, k + 1, (bsz,), generator=gen, device=dev, dtype=torch.int32)
        lengths[0] = k
        past = torch.arange(k, device=dev).view(1, 1, k) >= lengths.view(-1, 1, 1)
        idx = torch.where(past, order[live] * page_size, idx)  # a record of a poisoned page
    return SparseKV(cache, idx.to(torch.int32), record, lengths)


def make_case(bsz, s_q, heads, specs, seed=0, device="cpu", block_spread=0):
    """q, scopes, sinks for scope ``specs`` [(k, record, page_size, with_lengths)]."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(bsz, s_q, heads, 512, generator=gen) * 2).to(torch.bfloat16)
    scopes = [make_scope(bsz, s_q, k, rec, ps, wl, gen, device, block_spread=block_spread) for k, rec, ps, wl in specs]
    sinks = torch.randn(heads, generator=gen) * 3
    return q.to(device), scopes, sinks.to(device)


def float64_loop(q, scopes, sinks, scale):
    """The contract written out per request, token and head, on fully dequantized caches."""
    bsz, s_q, heads, _ = q.shape
    tables = [unpack_records(s.cache.cpu(), s.record).reshape(-1, 512).double() for s in scopes]
    out = torch.zeros(bsz, s_q, heads, 512, dtype=torch.float64)
    lse = torch.zeros(bsz, s_q, heads, dtype=torch.float64)
    for b in range(bsz):
        for t in range(s_q):
            keys = []
            for s, table in zip(scopes, tables):
                n = s.indices.shape[-1] if s.lengths is None else int(s.lengths[b])
                keys += [table[int(i)] for i in s.indices[b, t, :n].cpu() if int(i) >= 0]
            if not keys:
                lse[b, t] = math.inf
                continue
            kv = torch.stack(keys)
            for h in range(heads):
                logits = kv @ q[b, t, h].cpu().double() * scale
                m = logits.max()
                w = torch.exp(logits - m)
                lse[b, t, h] = m + torch.log(w.sum())
                denom = w.sum() + (torch.exp(sinks[h].double().cpu() - m) if sinks is not None else 0.0)
                out[b, t, h] = (w / denom) @ kv
    return out, lse


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


CPU_CASES = [  # (B, s_q, H, scopes)
    (2, 1, 4, [(7, "v4", 4, False), (20, "v4", 5, True)]),
    (2, 2, 3, [(9, "v41_window", 3, False), (12, "v41_entry", 4, True)]),
    (1, 2, 2, [(10, "v41_entry", 64, False)]),
]


def test_codecs_round_trip_the_model_rounding():
    from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0

    x = torch.randn(2, 3, 512) * 4
    v4 = unpack_records(pack_v4_cache(x), "v4")
    assert torch.equal(v4[..., V4_NOPE:], x[..., V4_NOPE:].bfloat16().float())
    assert rel_err(v4[..., :V4_NOPE], x[..., :V4_NOPE]) < 0.05
    assert torch.equal(unpack_records(pack_v41_window_rows(x), "v41_window"), fake_quant_fp8_ue8m0(x, 32))
    assert torch.equal(unpack_records(pack_v41_entries(x), "v41_entry"), fake_quant_fp4(x, 16, "e4m3"))
    assert pack_v4_cache(x).shape[-1] == RECORD_BYTES["v4"] and pack_v4_cache(x).stride(0) % 576 == 0


@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_reference_matches_float64_loop(case):
    bsz, s_q, heads, specs = CPU_CASES[case]
    q, scopes, sinks = make_case(bsz, s_q, heads, specs, seed=case)
    out, lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE)
    want, want_lse = float64_loop(q, scopes, sinks, SCALE)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, want) < 5e-3
    assert torch.allclose(lse.double(), want_lse, atol=1e-4, rtol=0)


def test_reference_lonely_query_and_infinite_sink():
    q, scopes, sinks = make_case(2, 1, 2, [(6, "v4", 4, False)], seed=5)
    scopes[0].indices[1] = -1  # request 1 has no key
    sinks[1] = math.inf  # head 1's sink takes all the mass
    out, lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE)
    assert (out[1] == 0).all() and (lse[1] == math.inf).all()
    assert (out[0, :, 1] == 0).all() and torch.isfinite(lse[0]).all() and out[0, :, 0].abs().sum() > 0


def test_bad_inputs_name_the_tensor():
    q, scopes, sinks = make_case(1, 1, 2, [(4, "v4", 4, False)], seed=1)
    with pytest.raises(ValueError, match="indices"):
        check_inputs(q, [SparseKV(scopes[0].cache, scopes[0].indices.long(), "v4")], sinks)
    with pytest.raises(ValueError, match="cache"):
        check_inputs(q, [SparseKV(scopes[0].cache, scopes[0].indices, "v41_window")], sinks)
    with pytest.raises(ValueError, match="sinks"):
        check_inputs(q, scopes, sinks[:1])


def row_record_case(bsz: int, heads: int, k: int, record: str, gen: torch.Generator, dim: int = 512,
                    rope_dims: int = 64, device: str = "cpu"):
    """q, a row-record scope (one record per row, as the V4 family's pools keep them; unpicked
    rows poisoned) and its rows [n, dim] as stored."""
    n = 2 * bsz * k + 3
    rows = torch.randn(n, dim, generator=gen) * (1 + 3 * torch.rand(n, 1, generator=gen))
    pack = {"v4": lambda x: pack_v4_rows(x, rope_dims), "v41_window": pack_v41_window_rows,
            "v41_entry": pack_v41_entries}[record]
    records = pack(rows)
    idx = torch.randperm(n, generator=gen)[: bsz * k].view(bsz, 1, k)
    idx[torch.rand(bsz, 1, k, generator=gen) < 0.2] = -1
    cache = torch.full_like(records, 0xFF)
    live = idx[idx >= 0]
    cache[live] = records[live]
    q = (torch.randn(bsz, 1, heads, dim, generator=gen) * 2).to(torch.bfloat16)
    scope = SparseKV(row_record_cache(cache.to(device)), idx.to(torch.int32).to(device), record, rope_dims=rope_dims)
    return q.to(device), scope, records


def test_loaded_scopes_are_read_only_where_picked():
    """The load tests' scopes (small here): picks land on live pages only, the picks past a length
    on a poisoned one, and the reference over them is finite for every format."""
    gen = torch.Generator().manual_seed(6)
    for record in ("v4", "v41_window", "v41_entry"):
        scope = loaded_scope(3, 2, 40, record, pages=12, live=4, with_lengths=True, gen=gen, page_size=8)
        assert scope.cache.shape == (12, 8, RECORD_BYTES[record])
        live_pages = (scope.cache.reshape(12, -1)[:, :8] != 0xFF).any(-1)  # poisoned pages are all 0xFF
        assert live_pages.sum() == 4
        past = (torch.arange(40).view(1, 1, -1) >= scope.lengths.view(-1, 1, 1)).expand(3, 2, 40)
        picked = scope.indices[~past & (scope.indices >= 0)].long() // 8
        assert live_pages[picked].all() and not live_pages[scope.indices[past].long() // 8].any()
        q = torch.randn(3, 2, 4, 512).bfloat16()
        out, lse = v4_sparse_decode_reference(q, [scope], None, SCALE)
        assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


def test_row_records_are_one_record_pages():
    """A V4 row record (``pack_v4_rows``) is a one-token MODEL1 page; the reference reads row
    caches of every format, and V4 records at any width (the tiny test models)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 512, generator=gen) * 3
    rows = pack_v4_rows(x, 64)
    assert torch.equal(row_record_cache(rows)[:, 0], pack_v4_cache(x[:, None])[:, 0])  # the same 584 bytes
    for record, dim, rope in (("v4", 512, 64), ("v4", 32, 8), ("v41_window", 64, 0), ("v41_entry", 512, 0)):
        q, scope, records = row_record_case(3, 4, 6, record, gen, dim, rope or 64)
        sinks = torch.randn(4, generator=gen)
        out, lse = v4_sparse_decode_reference(q, [scope], sinks, dim**-0.5, compute_dtype=torch.float64)
        if record == "v4":
            kv = unpack_v4_rows(records, dim, rope, torch.float64)
        else:
            kv = unpack_records(records[:, None], record)[:, 0].double()
        for b in range(3):
            picks = scope.indices[b, 0][scope.indices[b, 0] >= 0].long()
            logits = q[b, 0].double() @ kv[picks].T * dim**-0.5  # [H, k]
            probs = torch.softmax(torch.cat([logits, sinks.double()[:, None]], -1), -1)[:, :-1]
            assert torch.allclose(out[b, 0], probs @ kv[picks], atol=1e-9), (record, dim, b)
            assert torch.allclose(lse[b, 0], torch.logsumexp(logits, -1), atol=1e-9)
    with pytest.raises(ValueError, match="rope_dims"):  # the kernels read 64 RoPE dims only
        check_inputs(q, [SparseKV(scope.cache, scope.indices, "v4", rope_dims=32)], None)


_INTERPRET_SCRIPT = INTERPRETER_PATCH + textwrap.dedent(
    """
    import torch
    from tests.kernels.test_v4_sparse_decode import make_case, float64_loop, rel_err, SCALE
    from kernels.v4_sparse_decode_triton import SparseDecodeConfig as C, v4_sparse_decode_triton
    cases = [  # (B, s_q, H, scopes, config, block spread); default configs cover 16/64/128-row programs
        (2, 2, 8, [(70, "v4", 16, False), (130, "v4", 5, True)], C(), 0),
        (1, 2, 16, [(64, "v4", 64, True), (70, "v4", 3, False)], C(block_h=16, dv_split=2, num_splits=3), 0),
        (2, 1, 5, [(40, "v41_window", 7, False), (100, "v41_entry", 4, True)], C(num_splits=2), 0),
        (1, 2, 32, [(40, "v4", 16, False), (50, "v4", 7, True)], C(), 0),  # two 16-head blocks
        (1, 1, 64, [(40, "v4", 16, False), (50, "v4", 7, True)], C(), 10),  # 64 rows, dims halved; spread
        (1, 1, 128, [(33, "v4", 8, False), (40, "v4", 5, True)], C(num_splits=2), 0),
        (2, 2, 16, [(50, "v4", 16, False), (70, "v4", 3, True)], C(tokens_major=True, num_splits=2), 10),
        (2, 1, 16, [(40, "v41_window", 7, False), (60, "v41_entry", 4, True)], C(tokens_major=True), 0),
        (2, 2, 24, [(40, "v4", 4, False), (60, "v4", 5, True)], C(heads_first=False, dv_split=2, block_n=64), 0),
    ]
    for i, (bsz, s_q, h, specs, cfg, spread) in list(enumerate(cases))[PART::2]:  # half in each of two processes
        q, scopes, sinks = make_case(bsz, s_q, h, specs, seed=10 + i, block_spread=spread)
        if i == 2:
            scopes[0].indices[1] = -1; scopes[1].indices[1] = -1  # a request with no key
        if i == 6:
            sinks[0] = float("inf"); sinks[1] = float("-inf")  # a sink that takes all the mass, one absent
        out = torch.full((bsz, s_q, h, 512), float("nan"), dtype=torch.bfloat16)
        lse = torch.full((bsz, s_q, h), float("nan"))
        v4_sparse_decode_triton(q, scopes, sinks, SCALE, config=cfg, out=out, lse=lse)
        want, want_lse = float64_loop(q, scopes, sinks, SCALE)
        assert not out.isnan().any() and not lse.isnan().any(), "unwritten or poisoned output"
        err = rel_err(out, want)
        assert err < 1e-2, (i, err)
        assert torch.allclose(lse.double(), want_lse, atol=2e-3, rtol=0), (i, (lse.double() - want_lse).abs().max())
    print("interpreter ok")
    """
)


@pytest.mark.slow
def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    from tests.kernels.test_mxfp8_gemm import in_two_parts, run_interpreted

    run_interpreted(*in_two_parts(_INTERPRET_SCRIPT))


_SM90_STACK_LIMIT = {16: 8, 64: 488, 128: 64}  # spill stack of the default (measured-fastest) shapes, or less


def _compile_split_kernel(heads: int, row_pages: bool):
    """(ptx, resource usage) of the default program for ``heads``, compiled for sm_90 here:
    paged V4 scopes (16-byte page strides), or, with ``row_pages``, one-record pages of 584-byte
    rows (8 mod 16: the row pools and the sparse prefill's picks) as the launch specializes them
    (page size 1, the stride in 8-byte words, 73: no divisibility hint)."""
    from tests.kernels.test_mxfp8_gemm import _compile_sm90
    from kernels.v4_sparse_decode_triton import _split_kernel, resolve_config

    cfg = resolve_config(heads, None)
    types = dict(Q="*fp16", C0="*u8", C0_16="*bf16", I0="*i32", L0="*i32", C1="*u8", C1_16="*bf16", I1="*i32",
                 L1="*i32", SINK="*fp32", OUT="*bf16", LSE="*fp32", PO="*fp32", PL="*fp32", sm_log2="fp32")
    names = ("q_sb q_ss q_sh c0_ps c0_page i0_sb i0_ss K0 c1_ps c1_page i1_sb i1_ss K1 o_sb o_ss o_sh l_sb l_ss l_sh "
             "S_Q H num_splits tiles_per_split").split()
    types.update(dict.fromkeys(names, "i32"))
    consts = dict(FMT0=0, REC0=584, DATA0=576, ALIGN0=16, HAS_L0=False, FMT1=0, REC1=584, DATA1=576, ALIGN1=16,
                  HAS_L1=True, HAS_SCOPE1=True, HAS_SINK=True, SPLIT=True, DV_SPLIT=cfg.dv_split, BH=cfg.block_h,
                  BN=cfg.block_n, TM=cfg.tokens_major, HEADS_FIRST=cfg.heads_first)
    divisible = ["q_sb", "q_ss", "q_sh", "o_sb", "o_ss", "o_sh", "i0_sb", "i0_ss", "i1_sb", "i1_ss"]
    if row_pages:
        consts.update(c0_page=1, c1_page=1, ALIGN0=8, ALIGN1=8)
    else:
        divisible += ["c0_ps", "c1_ps"]
    return _compile_sm90(_split_kernel, types, consts, divisible=tuple(divisible), num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)


@pytest.fixture(scope="module")
def split_kernels_for_sm90():
    """{(heads, row_pages): future of :func:`_compile_split_kernel`} for the tests below."""
    pytest.importorskip("triton")
    from tests.kernels.test_mxfp8_gemm import _PTXAS, started_two_at_a_time

    if not _PTXAS.exists():
        pytest.skip("needs triton's bundled ptxas")
    keys = [(heads, False) for heads in sorted(_SM90_STACK_LIMIT)] + [(64, True)]
    with started_two_at_a_time({key: functools.partial(_compile_split_kernel, *key) for key in keys}) as futures:
        yield futures


@pytest.mark.slow
@pytest.mark.parametrize("heads", sorted(_SM90_STACK_LIMIT))
def test_default_configs_compile_for_sm90_pipelined(split_kernels_for_sm90, heads):
    """The defaults the H200 runs, compiled here: cp.async-pipelined gathers (where staged), the MMA kind
    (mma.sync for 16-row programs, wgmma from 64 rows) and at most the known spill stack."""
    from kernels.v4_sparse_decode_triton import resolve_config

    cfg = resolve_config(heads, None)
    ptx, usage = split_kernels_for_sm90[heads, False].result()
    if cfg.num_stages > 1:
        assert "cp.async" in ptx, "the record gathers are not pipelined"
    if cfg.block_h >= 64:
        assert "wgmma.mma_async" in ptx, usage
    else:
        assert "mma.sync" in ptx and "wgmma" not in ptx, usage
    stack = int(usage.split("STACK:")[1].split()[0])
    assert usage.endswith("LOCAL:0") and stack <= _SM90_STACK_LIMIT[heads], (cfg, usage)


@pytest.mark.slow
def test_row_record_pages_compile_like_paged_ones_for_sm90(split_kernels_for_sm90):
    """64 heads (wgmma, two stages) on 584-byte one-record pages, the program of the sparse
    prefill's picks on V4 layers: the record bytes are gathered by 8-byte cp.async stages, as
    from 16-byte-strided pages (with the stride as bytes the compiler saw no alignment: byte
    loads outside the pipeline, 960 B of spills, and NaN on the H200)."""
    ptx, usage = split_kernels_for_sm90[64, True].result()
    assert "wgmma.mma_async" in ptx, usage
    assert ptx.count("cp.async.ca.shared.global") > ptx.count("ld.global.b8"), "record bytes not pipelined"
    assert re.search(r"cp\.async\.ca\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x8", ptx), "no 8-byte gathers"
    stack = int(usage.split("STACK:")[1].split()[0])
    assert usage.endswith("LOCAL:0") and stack <= _SM90_STACK_LIMIT[64], usage


GPU_CASES = [  # (B, s_q, H, top-k, page size of the entries)
    (4, 1, 8, 512, 64), (4, 2, 16, 2048, 64), (3, 2, 64, 512, 2), (2, 1, 128, 2048, 64), (2, 2, 128, 512, 61),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bsz,s_q,heads,topk,page", GPU_CASES)
def test_triton_kernel_on_gpu(bsz, s_q, heads, topk, page):
    from kernels.v4_sparse_decode_triton import v4_sparse_decode_triton

    q, scopes, sinks = make_case(bsz, s_q, heads, [(128, "v4", 64, False), (topk, "v4", page, True)],
                                 seed=heads + topk, device="cuda")
    out, lse = v4_sparse_decode_triton(q, scopes, sinks, SCALE)
    want, want_lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE, compute_dtype=torch.float64)
    assert not out.isnan().any()
    assert rel_err(out, want) <= 2e-2
    assert (lse.double() - want_lse).abs().max().item() < 5e-3


GPU_VARIANTS = [  # (heads, config fields): the sweep shapes no default runs (the bench checks the rest)
    (16, dict(tokens_major=True)), (16, dict(dv_split=2, block_n=64)), (64, dict(block_h=128)), (128, dict(block_h=64)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads,fields", GPU_VARIANTS)
def test_triton_kernel_variants_on_gpu(heads, fields):
    """Launch variants on the GPU, with per-block scales spread over 12 binades."""
    from kernels.v4_sparse_decode_triton import SparseDecodeConfig, v4_sparse_decode_triton

    q, scopes, sinks = make_case(3, 2, heads, [(128, "v4", 64, False), (512, "v4", 61, True)], seed=heads,
                                 device="cuda", block_spread=8)
    out, lse = v4_sparse_decode_triton(q, scopes, sinks, SCALE, config=SparseDecodeConfig(**fields))
    want, want_lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE, compute_dtype=torch.float64)
    assert not out.isnan().any()
    assert rel_err(out, want) <= 2e-2
    assert (lse.double() - want_lse).abs().max().item() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernel_v41_formats_and_graph_replay():
    from kernels.v4_sparse_decode_triton import v4_sparse_decode_triton

    q, scopes, sinks = make_case(3, 2, 32, [(128, "v41_window", 64, False), (512, "v41_entry", 64, True)],
                                 seed=7, device="cuda")
    out = torch.empty(3, 2, 32, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(3, 2, 32, device="cuda")
    v4_sparse_decode_triton(q, scopes, sinks, SCALE, out=out, lse=lse)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        v4_sparse_decode_triton(q, scopes, sinks, SCALE, out=out, lse=lse)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want, want_lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE, compute_dtype=torch.float64)
    assert rel_err(out, want) <= 2e-2
    assert (lse.double() - want_lse).abs().max().item() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("record", ["v4", "v41_window", "v41_entry"])
def test_triton_kernel_on_row_records(record, heads):
    """The row pools' layout (one-record pages, record number = row) through the kernel; 64
    heads: the two-stage wgmma program, on V4's 584-byte rows (8 mod 16) as well."""
    from kernels.v4_sparse_decode_triton import v4_sparse_decode_triton

    gen = torch.Generator().manual_seed(21)
    q, window, _ = row_record_case(5, heads, 128, record if record != "v41_entry" else "v41_window", gen,
                                   device="cuda")
    _, entries, _ = row_record_case(5, heads, 700, record, gen, device="cuda")
    entries = SparseKV(entries.cache, entries.indices, record, torch.tensor([700, 1, 0, 350, 64], dtype=torch.int32,
                                                                            device="cuda"))
    sinks = torch.randn(heads, generator=gen).cuda()
    out, lse = v4_sparse_decode_triton(q, [window, entries], sinks, SCALE)
    want, want_lse = v4_sparse_decode_reference(q, [window, entries], sinks, SCALE, compute_dtype=torch.float64)
    assert not out.isnan().any()
    assert rel_err(out, want) <= 2e-2
    assert (lse.double() - want_lse).abs().max().item() < 5e-3


def test_v4_backend_registry_picks_torch_on_cpu_and_names_the_flag():
    from kernels.attention import BackendUnavailable, AttentionSpec, TritonV4SparseDecode, select_v4_decode_backend

    spec = AttentionSpec(torch.device("cpu"), torch.uint8, 16, 512, 64, 64, SCALE, torch.bfloat16, 2)
    backend = select_v4_decode_backend("auto", spec, ("v4",))
    assert backend.name == "torch"
    q, scopes, sinks = make_case(1, 2, 16, [(8, "v4", 4, False)], seed=3)
    out, _ = backend.decode(q, scopes, sinks, SCALE)
    assert rel_err(out, float64_loop(q, scopes, sinks, SCALE)[0]) < 5e-3
    with pytest.raises(BackendUnavailable, match="--attention-backend triton"):
        select_v4_decode_backend("triton", spec)
    assert "v41_entry" in TritonV4SparseDecode.record_formats
    with pytest.raises(BackendUnavailable, match="unknown"):
        select_v4_decode_backend("flashmla", spec)
