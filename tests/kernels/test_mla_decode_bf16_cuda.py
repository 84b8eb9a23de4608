"""The bf16 narrow MLA decode kernel (kernels/csrc/mla_decode_bf16_narrow_sm90a.cu) and its
dispatch in kernels/mla_decode_cuda.py.

CPU (CI): which kernel a query/cache dtype and row count get, the one-line errors for the rest,
the shared-memory plan, the split planner at bf16's tile bytes, and the cuda backend's bf16
support. GPU (``-m gpu``, on the device): fresh random bf16 inputs with unused pages and the
slots past each sequence poisoned with NaN, outputs filled with NaN before the call (every
element must be written), against a float64 reference on the same bf16 inputs: 16 and 32 rows
per CTA (8 to 48 rows per request), s_q 1 to 3, lengths around tile edges, pages of 64 and 256
tokens, forced and planned split counts (the combine), strided views, CUDA-graph replay with new
lengths, the backend over several layers, and 21 launches back to back under full HBM load.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import mla_decode_cuda as mdc
from kernels.attention import AttentionSpec, BackendUnavailable, CudaDecode, select_decode_backend
from tests.kernels.test_mla_decode_gpu import SM_SCALE, decode_step, make_case, spec_for
from tests.kernels.test_mla_fused_kernels import bits

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not IS_HOPPER, reason="needs a compute capability 9.x GPU")
# Relative error against float64 on the same bf16 inputs: P in bf16 and the bf16 output (each
# 2^-9 per element) give ~2-3e-3; the Triton bf16 kernel's tests use the same bound.
OUT_TOL = 1e-2
LSE_TOL = 2e-3  # natural log, absolute: Q.K^T in bf16 wgmma accumulates in fp32


# ----------------------------------------------------------------------------- CPU


def test_bf16_dispatch_and_one_line_errors():
    assert [mdc.choose_kernel(r, BF16) for r in (1, 16, 17, 32)] == ["narrow-bf16"] * 4
    assert [mdc.choose_kernel(r) for r in (16, 33)] == ["narrow", "wgmma"]  # e4m3 unchanged
    assert mdc.checked_kernel(32, BF16, BF16) == "narrow-bf16"
    assert mdc.checked_kernel(128, BF16, BF16, "narrow-bf16") == "narrow-bf16"  # named: 4 CTAs per request
    assert mdc.checked_kernel(128, FP8, FP8) == "wgmma"
    cases = [
        ((33, BF16, BF16), ValueError, "at most 32 query rows per request (s_q x heads), got 33; use the triton"),
        ((16, BF16, FP8), TypeError, "needs an e4m3 query and cache, or a bf16 query and cache"),
        ((16, torch.float16, torch.float16), TypeError, "or a bf16 query and cache"),
        ((16, BF16, BF16, "narrow"), ValueError, "kernel 'narrow' does not decode a torch.bfloat16 cache"),
        ((16, FP8, FP8, "narrow-bf16"), ValueError, "kernel 'narrow-bf16' does not decode a torch.float8_e4m3fn"),
        ((16, BF16, BF16, "mma"), ValueError, "unknown kernel 'mma'"),
    ]
    for args, exc, message in cases:
        with pytest.raises(exc) as err:
            mdc.checked_kernel(*args)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_bf16_inputs_are_refused_before_any_launch():
    q, kv, bt, sl, _, _ = make_case(1, 2, 20, [700], BF16)  # CPU tensors: refused before any launch
    with pytest.raises(ValueError, match="at most 32 query rows per request"):
        mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE)
    with pytest.raises(TypeError, match="or a bf16 query and cache"):
        mdc.mla_decode_cuda(q[:, :1], kv.to(FP8), bt, sl, SM_SCALE)


def test_bf16_shared_memory_plan_fits_one_cta_per_sm():
    for rows in mdc.NARROW_ROWS:
        smem = mdc.bf16_narrow_smem_bytes(rows)
        assert smem + mdc.SMEM_RESERVED_PER_CTA <= mdc.SMEM_PER_SM
        assert smem <= 227 * 1024  # the per-block opt-in limit
        ring = 2 * mdc.BF16_RING_BOXES[rows] * mdc.BF16_BOX_BYTES
        assert ring >= 2 * 9 * mdc.BF16_BOX_BYTES + 2 * mdc.BF16_BOX_BYTES  # a tile and two boxes per warpgroup
    assert mdc.bf16_narrow_smem_bytes(16) == 221120 and mdc.bf16_narrow_smem_bytes(32) == 228016


def test_bf16_split_planner():
    # B=128 x 16 heads fills the GPU with one wave; B=64 takes two splits (one wave of 128 CTAs).
    assert mdc.choose_num_splits(128, 16, 64, 132, "narrow-bf16") == 1
    assert mdc.choose_num_splits(64, 16, 64, 132, "narrow-bf16") == 2
    # Twice FP8's bytes per tile: a tile takes twice as long once HBM is shared.
    model = mdc.SPLIT_COST
    assert model.tile_time("narrow-bf16", 132, 1) == pytest.approx(2 * model.tile_time("narrow", 132, 1))
    for bsz, seq in ((1, 32768), (4, 8192), (16, 2048)):
        tiles = seq // 64
        splits = mdc.choose_num_splits(bsz, 16, tiles, 132, "narrow-bf16")
        assert 1 < splits and bsz * splits <= 132, (bsz, seq, splits)


def _spec(cache=BF16, heads=16, query_len=1):
    return AttentionSpec(torch.device("cuda"), cache, heads, 512, 64, 64, SM_SCALE, torch.bfloat16,
                         query_len=query_len)


def test_cuda_backend_and_auto_take_a_bf16_cache_up_to_32_rows(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(mdc, "default_library_path", lambda: "built")
    assert CudaDecode.unsupported_reason(_spec()) is None
    assert CudaDecode.unsupported_reason(_spec(query_len=2)) is None  # 32 rows
    assert select_decode_backend("cuda", _spec()).name == "cuda"
    assert select_decode_backend("auto", _spec()).name == "cuda"
    assert select_decode_backend("auto", _spec(heads=16, query_len=3)).name == "triton"  # 48 rows
    with pytest.raises(BackendUnavailable) as err:
        select_decode_backend("cuda", _spec(heads=16, query_len=3))
    assert str(err.value) == ("--attention-backend cuda: a bf16 cache takes at most 32 query rows per request "
                              "(heads x query tokens); got 48 (--kv-cache-dtype fp8, or --attention-backend triton)")
    backend = CudaDecode(_spec())
    assert backend.query_dtype(BF16, BF16) == BF16  # the model stages the query in the cache's dtype
    assert backend.query_dtype(FP8, BF16) == FP8


# ----------------------------------------------------------------------------- GPU


def reference_f64(q, kv, tables, seq_lens):
    """(out [B, s_q, H, 512], lse [B, s_q, H]) in float64 from the bf16 inputs; query token j
    of a request of n keys sees keys 0 .. n - s_q + j."""
    bsz, s_q, heads, _ = q.shape
    page = kv.shape[1]
    out = torch.empty(bsz, s_q, heads, 512, dtype=torch.float64, device=q.device)
    lse = torch.empty(bsz, s_q, heads, dtype=torch.float64, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        keys = kv[tables[b, : -(-n // page)].long()].reshape(-1, kv.shape[2])[:n].double()
        scores = torch.einsum("shd,nd->shn", q[b].double(), keys) * SM_SCALE
        hidden = torch.arange(n, device=q.device)[None, :] > (n - s_q + torch.arange(s_q, device=q.device))[:, None]
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        lse[b] = torch.logsumexp(scores, -1)
        out[b] = torch.einsum("shn,nc->shc", torch.exp(scores - lse[b][..., None]), keys[:, :512])
    return out, lse


def check_f64(q, kv, tables, seq_lens, out, lse, rows=None):
    """Every element written, and out / lse within the bounds of float64 on the same inputs
    (``rows``: the requests to compare, default all)."""
    assert not out.isnan().any() and not lse.isnan().any(), "an output element was not written"
    if rows is not None:
        q, tables, seq_lens, out, lse = q[rows], tables[rows], seq_lens[rows], out[rows], lse[rows]
    ref, ref_lse = reference_f64(q, kv, tables, seq_lens)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert err < OUT_TOL and lse_err < LSE_TOL, (err, lse_err)


def _run(case, seed, page=64, **kw):
    bsz, s_q, heads, lens = case
    q, kv, bt, sl, _, _ = make_case(bsz, s_q, heads, lens, BF16, page=page, seed=seed, device="cuda")
    out = torch.full((bsz, s_q, heads, 512), float("nan"), dtype=BF16, device="cuda")
    lse = torch.full((bsz, s_q, heads), float("nan"), device="cuda")
    mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, out=out, lse=lse, **kw)
    torch.cuda.synchronize()
    check_f64(q, kv, bt, sl, out, lse)


BF16_CASES = [  # (B, s_q, H, lens): 16- and 32-row CTAs, padded rows, lengths around tile edges
    (3, 1, 16, [1, 64, 300]),
    (2, 2, 16, [2, 4100]),  # 32 rows
    (2, 1, 8, [65, 700]),  # 8 heads: half the rows are padding
    (2, 2, 10, [3, 129]),  # 20 rows in a 32-row CTA
    (4, 1, 16, [63, 64, 65, 128]),
    (1, 2, 16, [1000]),
]


@gpu
@needs_hopper
@pytest.mark.parametrize("case", BF16_CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_bf16_kernel_against_float64(case, num_splits):
    _run(case, seed=len(case[3]) + 5 * (num_splits or 0), num_splits=num_splits)


@gpu
@needs_hopper
@pytest.mark.parametrize("page", [256, 192])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_bf16_kernel_pages_of_several_tiles(page, num_splits):
    """256-token pages (a shift and a mask per tile), 192 (the division path)."""
    _run((3, 2, 16, [700, 65, 2000]), seed=page + num_splits, page=page, num_splits=num_splits)


@gpu
@needs_hopper
def test_bf16_kernel_named_for_48_rows_and_fp16_output():
    """kernel="narrow-bf16" takes more than 32 rows when named (two 32-row CTAs per request);
    an fp16 output is the bf16 result cast."""
    _run((2, 3, 16, [3, 777]), seed=21, kernel="narrow-bf16")
    q, kv, bt, sl, _, _ = make_case(2, 1, 16, [70, 3], BF16, seed=22, device="cuda")
    out, lse = mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    check_f64(q, kv, bt, sl, out, lse)


@gpu
@needs_hopper
def test_bf16_kernel_reads_strided_views():
    """A page-strided cache (the other half of each page row block NaN: the tensor map follows
    the strides) and a query whose rows are strided."""
    q, kv, bt, sl, _, _ = make_case(2, 1, 16, [700, 65], BF16, seed=23, device="cuda")
    wide = torch.full((kv.shape[0], 2 * kv.shape[1], 576), float("nan"), dtype=BF16, device="cuda")
    wide[:, : kv.shape[1]] = kv
    wide_q = torch.full((2, 1, 16, 640), float("nan"), dtype=BF16, device="cuda")
    wide_q[..., :576] = q
    out, lse = mdc.mla_decode_cuda(wide_q[..., :576], wide[:, : kv.shape[1]], bt, sl, SM_SCALE)
    check_f64(q, kv, bt, sl, out, lse)


@gpu
@needs_hopper
@pytest.mark.parametrize("case", [BF16_CASES[0], BF16_CASES[1]])
def test_bf16_backend_over_several_layers_of_one_step(case):
    backend = select_decode_backend("cuda", spec_for(case, BF16))
    for err, lse_err in decode_step(backend, case, BF16, layers=3):
        assert err < OUT_TOL and lse_err < LSE_TOL, (err, lse_err)


@gpu
@needs_hopper
@pytest.mark.parametrize("bsz,s_q,width,splits", [(4, 1, 64, 1), (2, 2, 512, None)])
def test_bf16_graph_replay_with_new_lengths(bsz, s_q, width, splits):
    """A graph of 4 x 4k tokens without splits, one of 2 x 32k tokens with the planner's split
    count (many splits and the PDL combine), replayed with other lengths than at capture: the
    same bits as eager, then the float64 bounds for each set of lengths (three back-to-back
    replays each)."""
    q, kv, bt, sl, _, _ = make_case(bsz, s_q, 16, [width * 64] * bsz, BF16, seed=width + s_q, device="cuda")
    out = torch.empty(bsz, s_q, 16, 512, dtype=BF16, device="cuda")
    lse = torch.empty(bsz, s_q, 16, device="cuda")

    def call():
        mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, out=out, lse=lse, num_splits=splits)

    sl.copy_(torch.tensor([width * 64 - 1] + [s_q] * (bsz - 1), dtype=torch.int32))
    call()
    torch.cuda.synchronize()
    want_out, want_lse = out.clone(), lse.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(want_out)) and torch.equal(bits(lse), bits(want_lse))
    g = torch.Generator().manual_seed(width)
    for _ in range(3):  # slots past the new lengths hold data or NaN: both must stay out
        lens = torch.randint(s_q, width * 64 + 1, (bsz,), generator=g, dtype=torch.int32)
        sl.copy_(lens)
        out.fill_(float("nan"))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        check_f64(q, kv, bt, sl, out, lse)


def _full_load_case(bsz, s_q, seed, width=145, min_len=7000):
    """bsz requests of min_len..width * 64 - 64 tokens on random pages of a bf16 cache with 7
    spare pages (256 requests: 2.7 GB); every slot no request reads holds NaN.
    (q [bsz, s_q, 16, 576], kv, tables, lens)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    page = 64
    num_pages = bsz * width + 7
    kv = torch.full((num_pages, page, 576), float("nan"), dtype=BF16, device="cuda")
    tables = torch.randperm(num_pages, device="cuda", generator=g)[: bsz * width].view(bsz, width).int()
    lens = torch.randint(min_len, width * page - 63, (bsz,), device="cuda", generator=g, dtype=torch.int32)
    tok = torch.arange(width * page, device="cuda")
    slots = (tables.long()[:, tok // page] * page + tok % page)[tok[None, :] < lens[:, None]]
    flat = kv.view(-1, 576)
    for chunk in slots.split(1 << 18):  # only the tokens of each sequence; the rest stays NaN
        flat[chunk] = torch.randn(len(chunk), 576, device="cuda", generator=g).to(BF16)
    q = torch.randn(bsz, s_q, 16, 576, device="cuda", generator=g).to(BF16)
    return q, kv, tables, lens


@gpu
@needs_hopper
@pytest.mark.parametrize("bsz,s_q,splits", [(256, 1, None), (128, 2, None), (64, 1, 4)])
def test_bf16_kernel_is_exact_and_repeatable_under_full_hbm_load(bsz, s_q, splits):
    """7-9k tokens per request in a NaN-poisoned 0.7-2.7 GB cache: 256 CTAs of 16 rows (two
    waves), 128 of 32 rows, and 64 requests x 4 splits with the PDL combine. HBM is saturated
    and the two warpgroups of a CTA drift apart. 21 launches back to back (no host sync between them)
    give the same bits, and four requests match float64."""
    q, kv, tables, lens = _full_load_case(bsz, s_q, seed=bsz + s_q)
    call = functools.partial(mdc.mla_decode_cuda, q, kv, tables, lens, SM_SCALE, num_splits=splits)
    first_out, first_lse = call()
    differ = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(20):
        out, lse = call()
        differ += (bits(out) != bits(first_out)).sum() + (bits(lse) != bits(first_lse)).sum()
    assert differ.item() == 0
    rows = torch.tensor([0, 1, bsz // 2, bsz - 1], device="cuda")
    check_f64(q, kv, tables, lens, first_out, first_lse, rows=rows)
