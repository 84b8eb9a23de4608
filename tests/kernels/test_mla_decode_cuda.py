"""The CUDA C++ MLA decode (kernels/mla_decode_cuda.py) against the torch reference.

CPU (CI): the library builds with nvcc (when nvcc is installed), its parameter block matches
the ctypes mirror, the launch heuristics, and when the ``cuda`` attention backend is chosen
or refused. GPU (``-m gpu``, on the device): fresh random FP8 inputs with unused pages and
slots past each sequence poisoned with NaN and outputs poisoned before the call, s_q 1..4,
16..128 heads, ragged lengths, both kernels, forced split counts, CUDA-graph replay, the
backend class over several layers of one step, and both kernels and the split combine repeated
back to back under full HBM load (tests named ``full_hbm_load``).
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch

from kernels import mla_decode_cuda as mdc
from kernels.attention import AttentionSpec, BackendUnavailable, CudaDecode, select_decode_backend
from kernels.mla_decode import mla_decode_reference
from tests.kernels.test_mla_decode_gpu import (GPU_CASES, SM_SCALE, decode_step, make_case, rel_err,
                                               run_against_reference, spec_for)
from tests.kernels.test_mla_fused_kernels import bits

FP8 = torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not IS_HOPPER, reason="needs a compute capability 9.x GPU")
# Absolute LSE error; FP8 Q·Kᵀ accumulates with reduced precision on Hopper (see the Triton tests).
LSE_TOL = 1.5e-2
# Both kernels run P.V in FP8 (P as e4m3: 3 mantissa bits); measured 1.3e-2 at S=4096. The
# issue's bound for an FP8 decode is 2e-2.
WGMMA_REL_TOL = 2e-2


# ----------------------------------------------------------------------------- CPU


@pytest.mark.skipif(mdc.find_nvcc() is None, reason="needs nvcc")
def test_library_builds_and_matches_the_ctypes_mirror(tmp_path):
    lib_path = mdc.build_library(out_dir=tmp_path)
    assert lib_path.exists()
    assert mdc.build_library(out_dir=tmp_path) == lib_path  # cached by source hash
    lib = ctypes.CDLL(str(lib_path))
    assert lib.mla_decode_fp8_sm90_params_bytes() == ctypes.sizeof(mdc._Params)
    # the Python mirror of each kernel's shared-memory plan is exact
    assert lib.mla_decode_fp8_wgmma_sm90_smem_bytes() == mdc.WGMMA_SMEM_BYTES
    assert mdc.WGMMA_SMEM_BYTES + mdc.SMEM_RESERVED_PER_CTA <= mdc.SMEM_PER_SM
    for rows in mdc.NARROW_ROWS:
        assert lib.mla_decode_fp8_wgmma_narrow_sm90_smem_bytes(rows) == mdc.narrow_smem_bytes(rows)
        assert (mdc.narrow_smem_bytes(rows) + mdc.SMEM_RESERVED_PER_CTA) * mdc.NARROW_CTAS_PER_SM <= mdc.SMEM_PER_SM
    assert lib.mla_decode_fp8_wgmma_narrow_sm90_smem_bytes(48) == -1
    for rows in mdc.NARROW_ROWS:
        assert lib.mla_decode_bf16_narrow_sm90_smem_bytes(rows) == mdc.bf16_narrow_smem_bytes(rows)
    assert lib.mla_decode_bf16_narrow_sm90_smem_bytes(48) == -1
    assert lib.mla_decode_split_combine_max_splits() == mdc.MAX_SPLITS


def test_missing_nvcc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(mdc, "find_nvcc", lambda: None)
    with pytest.raises(mdc.CudaKernelUnavailable, match="needs nvcc"):
        mdc.build_library(out_dir=tmp_path)


def _spec(cache=FP8, page=64, heads=16, device="cuda", rank=512):
    return AttentionSpec(torch.device(device), cache, heads, rank, 64, page, SM_SCALE, torch.bfloat16)


def test_a_failed_build_falls_back_to_triton_under_auto_and_is_a_startup_error_when_asked(monkeypatch):
    def broken_build():
        raise mdc.CudaKernelUnavailable("nvcc failed building mla_decode_wgmma_sm90a.cu:\nerror: ...")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(mdc, "default_library_path", broken_build)
    assert CudaDecode.unsupported_reason(_spec()).startswith("nvcc failed")
    assert select_decode_backend("auto", _spec()).name == "triton"
    with pytest.raises(BackendUnavailable, match="--attention-backend cuda: nvcc failed"):
        select_decode_backend("cuda", _spec())
    monkeypatch.setattr(mdc, "default_library_path", lambda: "built")
    assert select_decode_backend("auto", _spec()).name == "cuda"
    assert select_decode_backend("auto", _spec(heads=128)).name == "cuda"  # any head count
    assert select_decode_backend("auto", _spec(cache=torch.bfloat16)).name == "cuda"  # 16 rows: the bf16 kernel
    assert select_decode_backend("auto", _spec(cache=torch.bfloat16, heads=128)).name == "triton"
    assert select_decode_backend("auto", _spec(page=16)).name == "triton"
    with pytest.raises(BackendUnavailable, match="block-size"):
        select_decode_backend("cuda", _spec(page=16))


def test_launch_heuristics():
    # Up to 32 rows the narrow kernel, above the 64-row wgmma kernel; one CTA per SM each.
    assert [mdc.choose_kernel(r) for r in (1, 16, 32, 33, 64, 128, 512)] == ["narrow"] * 3 + ["wgmma"] * 4
    assert [mdc.narrow_rows_per_cta(r) for r in (1, 16, 17, 32, 48)] == [16, 16, 32, 32, 32]
    assert mdc.launch_ctas(32, 48, "narrow") == (64, 2)  # two 32-row CTAs per request
    assert mdc.launch_ctas(3, 120, "wgmma") == (6, 2)
    assert mdc.choose_num_splits(512, 128, 64, 132, "wgmma") == 1  # the batch fills the GPU
    assert mdc.choose_num_splits(1, 16, 3, 132, "narrow") == 3  # no more splits than tiles


# (B, rows, tiles at S=4096, kernel) -> the split counts measured best before the cost model:
# one wave of one CTA per SM (B=128 16 heads: 84.4 µs, 128 heads: 195 µs).
LARGE_BATCH_SPLITS = {
    (128, 16, "narrow"): 1, (64, 16, "narrow"): 2, (128, 32, "narrow"): 1, (64, 32, "narrow"): 2,
    (128, 128, "wgmma"): 1, (64, 128, "wgmma"): 1, (128, 256, "wgmma"): 1, (64, 256, "wgmma"): 1,
    (32, 128, "wgmma"): 2,
}


def test_split_planner_keeps_the_large_batch_launches():
    for (bsz, rows, kernel), splits in LARGE_BATCH_SPLITS.items():
        assert mdc.choose_num_splits(bsz, rows, 64, 132, kernel) == splits, (bsz, rows, kernel)


SMALL_GRID = [(bsz, seq) for bsz in (1, 2, 4, 8, 16) for seq in (2048, 8192, 32768)]


@pytest.mark.parametrize("rows,kernel", [(128, "wgmma"), (16, "narrow"), (16, "narrow-bf16")])
def test_split_planner_fills_the_gpu_in_one_wave_at_small_batches(rows, kernel):
    for bsz, seq in SMALL_GRID:
        tiles = seq // 64
        splits = mdc.choose_num_splits(bsz, rows, tiles, 132, kernel)
        ctas = mdc.launch_ctas(bsz, rows, kernel)[0] * splits
        per_split = -(-tiles // splits)
        assert 1 <= splits <= min(tiles, mdc.MAX_SPLITS)
        assert ctas <= 132, (bsz, seq, splits)  # one CTA per SM: a second wave repeats the fixed cost
        # Either a good part of the SMs is busy (the narrow kernel saturates HBM with ~70), or
        # every split is already down to a few tiles (256 tokens).
        assert ctas >= 132 // 3 or per_split <= 4, (bsz, seq, splits)
        # No split count the model knows is faster, and each is the model's estimate.
        best = mdc.estimate_split_us(splits, bsz, rows, tiles, 132, kernel)
        assert all(mdc.estimate_split_us(s, bsz, rows, tiles, 132, kernel) >= best - 1e-9
                   for s in range(1, min(tiles, mdc.MAX_SPLITS) + 1))


def test_split_planner_counts_waves_and_partials():
    model = mdc.SPLIT_COST
    one_wave = mdc.estimate_split_us(16, 4, 128, 128, 132, "wgmma")  # 128 CTAs x 8 tiles
    two_waves = mdc.estimate_split_us(32, 4, 128, 128, 132, "wgmma")  # 256 CTAs x 4 tiles
    tile = model.tile_time("wgmma", 128, 2)
    assert one_wave == pytest.approx(model.cta_us + 8 * tile + model.combine_us
                                     + 2 * 128 * 64 * (2 * 512 + 4) / model.l2_bytes_per_us)
    assert two_waves > one_wave  # the second wave pays the fixed cost again, and twice the partials
    assert mdc.estimate_split_us(1, 4, 128, 128, 132, "wgmma") == pytest.approx(model.cta_us + 128 * tile)
    # Memory-bound narrow tiles: a full GPU shares HBM; a lone CTA is held by its own TMA ring.
    assert model.tile_time("narrow", 132, 1) > model.tile_time("narrow", 8, 1) >= model.narrow_tile_us
    # With a free combine the model splits as far as one wave allows.
    fast_combine = mdc.SplitCostModel(combine_us=0.0, l2_bytes_per_us=1e12)
    assert mdc.choose_num_splits(1, 128, 512, 132, "wgmma", fast_combine) == 64  # 128 CTAs x 8 tiles


def test_split_count_outside_the_combine_range_is_refused():
    q, kv, bt, sl, qs, ks = make_case(1, 1, 16, [700], FP8)  # CPU tensors: refused before any launch
    with pytest.raises(ValueError, match=f"num_splits must be 1 to {mdc.MAX_SPLITS}"):
        mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, num_splits=mdc.MAX_SPLITS + 1)


def test_cuda_backend_refusals_name_the_flag_and_the_reason(monkeypatch):
    with pytest.raises(BackendUnavailable) as err:
        select_decode_backend("cuda", _spec(device="cpu"))
    assert str(err.value) == "--attention-backend cuda: needs a CUDA GPU (the engine runs on cpu)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert CudaDecode.unsupported_reason(_spec()) == "needs a SM9x GPU; this one is SM80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert "needs a KV cache in fp8 e4m3, bfloat16; got float16" in CudaDecode.unsupported_reason(
        _spec(cache=torch.float16))
    assert "kv_lora_rank" in CudaDecode.unsupported_reason(_spec(rank=256))


# ----------------------------------------------------------------------------- GPU


def _run(case, seed, **kw):
    return run_against_reference(mdc.mla_decode_cuda, case, FP8, seed, **kw)


@gpu
@needs_hopper
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_default_shape(case, num_splits):
    err, lse_err = _run(case, seed=len(case[3]) + (num_splits or 0), num_splits=num_splits)
    assert err < WGMMA_REL_TOL and lse_err < LSE_TOL, (err, lse_err)


@gpu
@needs_hopper
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[3]])
def test_backend_class_over_several_layers_of_one_step(case):
    """The registry's cuda backend, metadata built once and three layers' caches decoded."""
    backend = select_decode_backend("cuda", spec_for(case, FP8))
    for err, lse_err in decode_step(backend, case, FP8, layers=3):
        assert err < WGMMA_REL_TOL and lse_err < LSE_TOL, (err, lse_err)


WGMMA_CASES = [  # (B, s_q, H, lens): 64+ rows, rows not a multiple of 64, 16 heads x 4 MTP tokens
    (2, 1, 128, [4100, 66]),
    (3, 1, 64, [1, 64, 300]),
    (2, 4, 16, [4, 513]),
    (2, 3, 40, [3, 700]),
    (1, 2, 128, [2]),
]


@gpu
@needs_hopper
@pytest.mark.parametrize("case", WGMMA_CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_wgmma_kernel(case, num_splits):
    wgmma = functools.partial(mdc.mla_decode_cuda, kernel="wgmma")
    err, lse_err = run_against_reference(wgmma, case, FP8, 3 + (num_splits or 0), num_splits=num_splits)
    assert err < WGMMA_REL_TOL and lse_err < LSE_TOL, (err, lse_err)


NARROW_CASES = [  # (B, s_q, H, lens): 16 and 32 rows, 8 heads, rows not a multiple of 16, 48 rows
    (3, 1, 16, [1, 64, 300]),  # (two CTAs), lengths around tile edges, a long sequence
    (2, 2, 16, [2, 4100]),
    (2, 1, 8, [65, 700]),
    (2, 2, 10, [3, 129]),
    (1, 3, 16, [1000]),
    (4, 1, 16, [63, 64, 65, 128]),
    (2, 1, 128, [2048, 300]),  # four 32-row CTAs per request (the benchmark's narrow arm at 128 heads)
]


@gpu
@needs_hopper
@pytest.mark.parametrize("case", NARROW_CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_narrow_kernel(case, num_splits):
    narrow = functools.partial(mdc.mla_decode_cuda, kernel="narrow")
    err, lse_err = run_against_reference(narrow, case, FP8, 7 + (num_splits or 0), num_splits=num_splits)
    assert err < WGMMA_REL_TOL and lse_err < LSE_TOL, (err, lse_err)


def _full_load_case(bsz, heads, seed, width=145, min_len=7000):
    """bsz requests of min_len..width * 64 - 64 tokens on random pages of a cache with 7 spare
    pages (bsz x 145 pages of 64 tokens: 1.4 GB at 256 requests); every slot no request reads
    holds NaN. (q [bsz, 1, heads, 576], kv, tables, lens), e4m3."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    page = 64
    num_pages = bsz * width + 7
    kv_bytes = torch.full((num_pages, page, 576), 0x7F, dtype=torch.uint8, device="cuda")  # e4m3 NaN
    tables = torch.randperm(num_pages, device="cuda", generator=g)[: bsz * width].view(bsz, width).int()
    lens = torch.randint(min_len, width * page - 63, (bsz,), device="cuda", generator=g, dtype=torch.int32)
    tok = torch.arange(width * page, device="cuda")
    slots = (tables.long()[:, tok // page] * page + tok % page)[tok[None, :] < lens[:, None]]
    flat = kv_bytes.view(-1, 576)
    for chunk in slots.split(1 << 18):  # only the tokens of each sequence; the rest stays NaN
        flat[chunk] = (torch.randn(len(chunk), 576, device="cuda", generator=g) * 0.5).to(FP8).view(torch.uint8)
    q = (torch.randn(bsz, 1, heads, 576, device="cuda", generator=g) * 0.5).to(FP8)
    return q, kv_bytes.view(FP8), tables, lens


def _check_repeatable(call, q, kv, tables, lens, launches=21):
    """``launches`` calls back to back (no host sync between them) give the same bits, and four
    requests of the first match the reference."""
    first_out, first_lse = call()
    differ = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(launches - 1):
        out, lse = call()
        differ += (bits(out) != bits(first_out)).sum() + (bits(lse) != bits(first_lse)).sum()
    assert differ.item() == 0
    bsz = q.shape[0]
    rows = torch.tensor([0, 1, bsz // 2, bsz - 1], device="cuda")
    ref, ref_lse = mla_decode_reference(q[rows], kv, tables[rows], lens[rows], SM_SCALE)
    assert rel_err(first_out[rows], ref) < WGMMA_REL_TOL
    assert (first_lse[rows] - ref_lse).abs().max().item() < LSE_TOL
    return first_out, first_lse


@gpu
@needs_hopper
def test_narrow_kernel_is_exact_and_repeatable_under_full_hbm_load():
    """256 requests of 7-9k tokens in a 1.4 GB cache, 16 heads (V2-Lite's decode at batch 256):
    HBM is saturated and the two warpgroups of a CTA drift apart. Every launch must give the same
    bits, matching the reference. Before each stage had two mbarriers, a warpgroup could pass the
    wait for a tile whose copy was not yet issued; on an H100 that faulted every few launches."""
    q, kv, tables, lens = _full_load_case(256, 16, seed=11)
    _check_repeatable(lambda: mdc.mla_decode_cuda(q, kv, tables, lens, SM_SCALE, kernel="narrow"), q, kv, tables, lens)


@gpu
@needs_hopper
@pytest.mark.parametrize("kernel,bsz,heads,splits", [("wgmma", 128, 128, None), ("wgmma", 64, 128, 4),
                                                     ("narrow", 64, 16, 4)])
def test_kernels_and_split_combine_are_exact_and_repeatable_under_full_hbm_load(kernel, bsz, heads, splits):
    """The full-load case of the narrow kernel's stress test for the 64-row kernel (128 requests x
    128 heads: 256 CTAs of 110-144 tiles, two waves, both warpgroups reading every stage), and the
    split path under load (4 splits: 512 or 256 CTAs), whose combine, launched with programmatic
    dependent launch, becomes resident while the decode's last wave runs (the next launch's
    partials may take the memory it reads). 21 launches back to back give the same bits, matching
    the reference; the combine as a plain launch the same bits too."""
    q, kv, tables, lens = _full_load_case(bsz, heads, seed=bsz + heads)

    def call(pdl=True):
        return mdc.mla_decode_cuda(q, kv, tables, lens, SM_SCALE, kernel=kernel, num_splits=splits, pdl=pdl)

    out, lse = _check_repeatable(call, q, kv, tables, lens)
    if splits:
        plain_out, plain_lse = call(pdl=False)
        assert torch.equal(plain_out, out) and torch.equal(plain_lse, lse)


@gpu
@needs_hopper
def test_wgmma_kernel_page_size_128_and_graph_replay():
    q, kv, bt, sl, qs, ks = make_case(3, 1, 128, [300, 1, 4000], FP8, page=128, seed=8, device="cuda")
    out = torch.empty(3, 1, 128, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(3, 1, 128, device="cuda")
    call = lambda: mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, out=out, lse=lse)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    sl.copy_(torch.tensor([129, 1, 2000], dtype=torch.int32))  # new lengths (slots past the old ones are NaN)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, ref_lse = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    assert rel_err(out, ref) < WGMMA_REL_TOL and (lse - ref_lse).abs().max().item() < LSE_TOL


@gpu
@needs_hopper
@pytest.mark.parametrize("kernel,heads", [("wgmma", 128), ("narrow", 16)])
def test_tma_kernels_read_a_page_strided_cache_and_a_second_cache(kernel, heads):
    """The TMA tensor map follows the cache tensor: a view whose pages are strided (the other
    half of each page row block holds NaN), then another cache of another size (as per layer)."""
    case = (2, 1, heads, [700, 65])
    q, kv, bt, sl, qs, ks = make_case(*case, FP8, seed=13, device="cuda")
    wide = torch.full((kv.shape[0], 2 * kv.shape[1], 576), 0x7F, dtype=torch.uint8, device="cuda").view(FP8)  # NaN
    wide[:, : kv.shape[1]] = kv
    strided = wide[:, : kv.shape[1]]
    assert strided.stride(0) == 2 * kv.stride(0)
    ref, ref_lse = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    out, lse = mdc.mla_decode_cuda(q, strided, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, kernel=kernel)
    assert rel_err(out, ref) < WGMMA_REL_TOL and (lse - ref_lse).abs().max().item() < LSE_TOL
    q2, kv2, bt2, sl2, qs2, ks2 = make_case(1, 2, heads // 2, [2000], FP8, seed=14, device="cuda")
    out2, _ = mdc.mla_decode_cuda(q2, kv2, bt2, sl2, SM_SCALE, q_scale=qs2, k_scale=ks2, kernel=kernel)
    ref2, _ = mla_decode_reference(q2, kv2, bt2, sl2, SM_SCALE, q_scale=qs2, k_scale=ks2)
    assert rel_err(out2, ref2) < WGMMA_REL_TOL


@gpu
@needs_hopper
@pytest.mark.parametrize("kernel,heads", [("wgmma", 64), ("narrow", 16)])
def test_wgmma_kernels_fill_an_out_view_whose_rows_are_not_16_byte_aligned(kernel, heads):
    """The kernels store 8 bf16 (16 bytes) of a row at once; other layouts go through a copy."""
    q, kv, bt, sl, qs, ks = make_case(2, 1, heads, [300, 65], FP8, seed=15, device="cuda")
    wide = torch.full((2, 1, heads, 516), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = wide[..., :512]  # head stride 516 elements
    mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, out=out, kernel=kernel)
    ref, _ = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    assert rel_err(out, ref) < WGMMA_REL_TOL and wide[..., 512:].isnan().all()


@gpu
@needs_hopper
@pytest.mark.parametrize("kernel,heads", [("wgmma", 128), ("narrow", 16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_tma_kernels_page_of_three_tiles(kernel, heads, num_splits):
    """192-token pages: a tile's page and row take the kernels' division path (page sizes of a
    power of two of tiles take a shift and a mask)."""
    q, kv, bt, sl, qs, ks = make_case(3, 1, heads, [700, 65, 1000], FP8, page=192, seed=16, device="cuda")
    out, lse = mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, kernel=kernel,
                                   num_splits=num_splits)
    ref, ref_lse = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    assert rel_err(out, ref) < WGMMA_REL_TOL and (lse - ref_lse).abs().max().item() < LSE_TOL


@gpu
@needs_hopper
def test_page_size_128_and_strided_query():
    bsz, s_q, h, lens = 2, 1, 16, [300, 129]
    q, kv, bt, sl, qs, ks = make_case(bsz, s_q, h, lens, FP8, page=128, seed=9, device="cuda")
    wide = torch.empty(bsz, s_q, h, 640, dtype=FP8, device="cuda")  # a view with row stride 640
    wide[..., :576] = q
    out, lse = mdc.mla_decode_cuda(wide[..., :576], kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    ref, ref_lse = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    assert rel_err(out, ref) < WGMMA_REL_TOL and (lse - ref_lse).abs().max().item() < LSE_TOL


def _eager_then_captured(call, out, lse):
    """Runs ``call`` (which fills ``out``/``lse``) eagerly, then captures it: the graph and the
    eager results."""
    call()
    torch.cuda.synchronize()
    want_out, want_lse = out.clone(), lse.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph, want_out, want_lse


@gpu
@needs_hopper
def test_cuda_graph_replay_matches_eager():
    q, kv, bt, sl, qs, ks = make_case(4, 1, 16, [70, 1, 640, 4000], FP8, seed=4, device="cuda")
    out = torch.empty(4, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(4, 1, 16, device="cuda")
    call = lambda: mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, out=out, lse=lse)  # noqa: E731
    graph, want_out, want_lse = _eager_then_captured(call, out, lse)
    out.fill_(float("nan"))
    sl.copy_(torch.tensor([70, 1, 640, 4000], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    sl.copy_(torch.tensor([3, 1, 64, 2000], dtype=torch.int32))  # new lengths, same graph
    graph.replay()
    ref, _ = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    assert rel_err(out, ref) < WGMMA_REL_TOL


@gpu
@needs_hopper
def test_fp16_output_for_fp16_models():
    q, kv, bt, sl, qs, ks = make_case(2, 1, 16, [70, 3], FP8, seed=12, device="cuda")
    out, lse = mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, out_dtype=torch.float16)
    ref, _ = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    assert out.dtype == torch.float16 and rel_err(out, ref) < WGMMA_REL_TOL


@gpu
@needs_hopper
def test_bad_inputs_are_refused():
    q, kv, bt, sl, qs, ks = make_case(1, 1, 16, [10], torch.float16, device="cuda")
    with pytest.raises(TypeError, match="e4m3"):
        mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE)
    q, kv, bt, sl, qs, ks = make_case(1, 1, 16, [10], FP8, page=32, device="cuda")
    with pytest.raises(ValueError, match="multiple of 64"):
        mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE)
    q, kv, bt, sl, qs, ks = make_case(1, 1, 16, [10], FP8, device="cuda")
    with pytest.raises(ValueError, match="unknown kernel"):
        mdc.mla_decode_cuda(q, kv, bt, sl, SM_SCALE, kernel="mma")


def test_ablation_tool_still_finds_the_kernel_lines_it_deletes():
    """benchmarks/ablate_mla_wgmma.py deletes verbatim kernel lines; keep it in step with the .cu."""
    from benchmarks.ablate_mla_wgmma import KERNEL_CUTS

    for kernel, (source, cuts) in KERNEL_CUTS.items():
        src = source.read_text()
        for name, edits in cuts.items():
            assert all(line in src for line, _ in edits), (kernel, name)


# ----------------------------------------------------------------------------- GPU, small batches

SMALL_BATCH_CASES = [  # (B, s_q, H, lens): the planner's many-split launches, up to 32k tokens
    (1, 1, 128, [32768]),
    (2, 1, 128, [2048, 32763]),
    (4, 1, 128, [1, 8192, 70, 20001]),
    (2, 2, 128, [2, 16385]),
    (1, 1, 16, [32768]),
    (4, 1, 16, [1, 8192, 4097, 32700]),
]


def _small_batch_case(case, seed):
    from tests.kernels.test_mla_decode_lse import make_poisoned_case

    bsz, s_q, heads, lens = case
    return make_poisoned_case(bsz, s_q, heads, lens, seed, "cuda")


def _check_f64(q, kv, tables, seq_lens, out, lse):
    """Output and LSE against float64 on the same FP8 inputs (the LSE test's bound)."""
    from tests.kernels.test_mla_decode_lse import LSE_TOL as F64_LSE_TOL
    from tests.kernels.test_mla_decode_lse import reference_f64

    ref, ref_lse = reference_f64(q, kv, tables, seq_lens)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert err < WGMMA_REL_TOL and lse_err < F64_LSE_TOL, (err, lse_err)


@gpu
@needs_hopper
@pytest.mark.parametrize("case", SMALL_BATCH_CASES)
def test_small_batches_split_many_ways_against_float64(case):
    """Default (planned) split counts at B = 1-4: NaN-poisoned unused pages and slots, NaN-filled
    outputs, ragged lengths from one token to 32k."""
    from tests.kernels.test_mla_decode_lse import K_SCALE, Q_SCALE
    from tests.kernels.test_mla_decode_lse import SM_SCALE as LSE_SM_SCALE

    q, kv, tables, seq_lens = _small_batch_case(case, seed=sum(case[3]) % 997)
    bsz, s_q, heads, _ = case
    rows = s_q * heads
    splits = mdc.choose_num_splits(bsz, rows, tables.shape[1], 132, mdc.choose_kernel(rows))
    assert splits > 1  # these shapes are the split path
    out = torch.full((bsz, s_q, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((bsz, s_q, heads), float("nan"), device="cuda")
    mdc.mla_decode_cuda(q, kv, tables, seq_lens, LSE_SM_SCALE, q_scale=Q_SCALE, k_scale=K_SCALE, out=out, lse=lse)
    _check_f64(q, kv, tables, seq_lens, out, lse)
    # The combine as a plain stream-ordered launch: the same bits.
    plain_out, plain_lse = mdc.mla_decode_cuda(q, kv, tables, seq_lens, LSE_SM_SCALE, q_scale=Q_SCALE,
                                               k_scale=K_SCALE, pdl=False)
    assert torch.equal(plain_out, out) and torch.equal(plain_lse, lse)


@gpu
@needs_hopper
@pytest.mark.parametrize("heads", [128, 16])
def test_small_batch_graph_replay_with_new_lengths(heads):
    """One graph captured for a 32k-token block table (the split count fixed at capture), replayed
    with shorter and longer requests than at capture: the combine (a programmatic dependent
    launch) follows the decode kernel in the graph."""
    from tests.kernels.test_mla_decode_lse import K_SCALE, Q_SCALE
    from tests.kernels.test_mla_decode_lse import SM_SCALE as LSE_SM_SCALE

    q, kv, tables, seq_lens = _small_batch_case((2, 1, heads, [32768, 32768]), seed=31 + heads)
    out = torch.empty(2, 1, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, 1, heads, device="cuda")

    def call():
        mdc.mla_decode_cuda(q, kv, tables, seq_lens, LSE_SM_SCALE, q_scale=Q_SCALE, k_scale=K_SCALE, out=out,
                            lse=lse)

    seq_lens.copy_(torch.tensor([5000, 1], dtype=torch.int32))
    graph, want_out, want_lse = _eager_then_captured(call, out, lse)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)  # deterministic, same as eager
    for lens in ([32768, 64], [1, 32767], [129, 2048]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        for _ in range(3):  # back-to-back replays: the next decode may start under this combine
            graph.replay()
        torch.cuda.synchronize()
        _check_f64(q, kv, tables, seq_lens, out, lse)
