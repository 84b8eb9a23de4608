"""The CUDA C++ V4 / V4.1 sparse decode (kernels/v4_sparse_decode_cuda.py): host-side logic on the
CPU (build and ctypes mirror, split planning, variant and record-format dispatch, input checks, the
registry and its routing), both designs' kernels on the GPU against the float64 reference on fresh
random inputs (poisoned unreferenced records, −1 picks, lengths and partial tiles; CUDA-graph
capture and replay), V4.1's window rows and entries in v2 and v3 (tests named ``v41``); v3's tokens2
kernel (tests named ``v3``) on every case v2's tokens kernel runs, plus 8-row and padded head counts;
every served kernel and the 2-CTA cluster repeated back to back under full HBM load (``full_hbm_load``)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels import mla_decode_cuda as mdc
from kernels import v4_sparse_decode_cuda as v4c
from kernels.attention import AttentionSpec, BackendUnavailable, CudaV4SparseDecode, select_v4_decode_backend
from kernels.attention import v4_sparse_decode as v4_registry
from kernels.v4_cache_formats import pack_v41_entries, pack_v41_window_rows
from kernels.v4_sparse_decode import SparseKV, row_record_cache, unpack_records, v4_sparse_decode_reference
from tests.kernels.test_mla_fused_kernels import bits
from tests.kernels.test_v4_sparse_decode import SCALE, loaded_scope, make_case, rel_err, row_record_case

REL_TOL = 2e-2  # fp16 products, fp32 softmax: the bound vs float64
V41_FORMATS = ("v41_window", "v41_entry")
LSE_TOL = 5e-3

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def kernel_id(variant: str, heads: int, cluster: bool | None = None, family: str = "v4") -> str:
    """A test id naming the kernel that runs (v1-wide, v2-tokens, v2-tile64, v2-pair, ...), so that a
    device run can take one kernel at a time (``-k pair``)."""
    kernel = v4c.kernel_for(variant, heads, family)[0]
    return f"{variant}-{'pair' if v4c.uses_cluster(variant, heads, cluster, family) else kernel}-H{heads}"


# ----------------------------------------------------------------------------- CPU


@pytest.mark.skipif(mdc.find_nvcc() is None, reason="needs nvcc")
def test_library_builds_and_matches_the_ctypes_mirror(tmp_path):
    lib_path = v4c.build_library(out_dir=tmp_path)
    assert v4c.build_library(out_dir=tmp_path) == lib_path  # cached by source hash
    lib = ctypes.CDLL(str(lib_path))
    assert lib.v4_sparse_decode_sm90_params_bytes() == ctypes.sizeof(v4c._Params)
    assert lib.v4_sparse_decode_sm90_smem_bytes() == v4c.SMEM_BYTES
    assert v4c.SMEM_BYTES + mdc.SMEM_RESERVED_PER_CTA <= mdc.SMEM_PER_SM
    for heads in (8, 16, 24, 32):
        assert lib.v4_sparse_decode_narrow_sm90_smem_bytes(heads) == v4c.smem_bytes(v4c.cta_rows(heads))
    assert lib.v4_sparse_decode_narrow_sm90_smem_bytes(64) == -1
    for fn, mirror in (("v4_sparse_decode_t64_sm90_smem_bytes", v4c.T64_SMEM_BYTES),
                       ("v4_sparse_decode_tokens_sm90_smem_bytes", v4c.TOKENS_SMEM_BYTES)):  # v2
        assert getattr(lib, fn)() == mirror, fn
        assert mirror + mdc.SMEM_RESERVED_PER_CTA <= mdc.SMEM_PER_SM, fn
    for heads in (1, 8, 9, 16):  # v3's tokens2: 8 or 16 query rows
        assert lib.v4_sparse_decode_tokens2_sm90_smem_bytes(heads) == v4c.tokens2_smem_bytes(heads), heads
        assert v4c.tokens2_smem_bytes(heads) + mdc.SMEM_RESERVED_PER_CTA <= mdc.SMEM_PER_SM, heads
    assert lib.v4_sparse_decode_tokens2_sm90_smem_bytes(17) == -1


def test_variants_pick_their_kernels():
    """v1 keeps the first kernels; v2 takes the tokens-major kernel up to 16 heads, the narrow one
    at 17-32, the 64-record kernel above, clustered at 65-128 heads unless told not to; v3 is v2
    with the tokens2 kernel up to 16 heads (its timing diagnostics nowhere else)."""
    assert [v4c.kernel_for("v1", h) for h in (8, 16, 24, 64, 128)] == [
        ("narrow", 32), ("narrow", 32), ("narrow", 32), ("wide", 32), ("wide", 32)]
    assert [v4c.kernel_for("v2", h) for h in (8, 16, 24, 32, 48, 64, 128)] == [
        ("tokens", 64), ("tokens", 64), ("narrow", 32), ("narrow", 32), ("tile64", 64), ("tile64", 64), ("tile64", 64)]
    assert [v4c.uses_cluster("v2", h) for h in (16, 64, 65, 96, 128)] == [False, False, True, True, True]
    assert not v4c.uses_cluster("v2", 128, cluster=False) and not v4c.uses_cluster("v1", 128)
    assert v4_registry.CUDA_VARIANT in v4c.VARIANTS
    # V4.1 records: no narrow kernel (its producer reads MODEL1 pages), 17-63 heads padded to 64, no cluster
    assert [v4c.kernel_for("v2", h, "v41")[0] for h in (8, 16, 17, 32, 48, 64, 128)] == [
        "tokens", "tokens", "tile64", "tile64", "tile64", "tile64", "tile64"]
    assert not any(v4c.uses_cluster("v2", h, family="v41") for h in (65, 96, 128))
    for family in ("v4", "v41"):
        assert [v4c.kernel_for("v3", h, family) for h in (1, 8, 16)] == [("tokens2", 64)] * 3
        assert [v4c.kernel_for("v3", h, family) for h in (17, 32, 48, 64, 128)] == [
            v4c.kernel_for("v2", h, family) for h in (17, 32, 48, 64, 128)]
        assert [v4c.uses_cluster("v3", h, family=family) for h in (16, 64, 128)] == [
            v4c.uses_cluster("v2", h, family=family) for h in (16, 64, 128)]
    q, scopes, sinks = make_case(1, 1, 4, [(8, "v4", 4, False)], seed=1)
    with pytest.raises(ValueError, match="variant must be one of"):
        v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, variant="v4")
    with pytest.raises(ValueError, match="diagnostic 'fence'"):  # the tokens kernel has none
        v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, variant="v2", diagnostic="fence")
    v41 = make_case(1, 1, 4, [(8, "v41_window", 4, False)], seed=1)[1]
    with pytest.raises(ValueError, match="diagnostic 'no_hbm'"):  # V4 records only
        v4c.v4_sparse_decode_cuda(q, v41, sinks, SCALE, variant="v3", diagnostic="no_hbm")


def test_split_planning_fills_the_gpu_from_shapes_only():
    # B=128 tokens x 64 heads: one CTA per SM already, no split
    assert v4c.plan_splits(128, 1, 64, 68, 132) == (1, 68)
    # 4 tokens x 128 heads = 8 CTAs: 16 splits would fill 128 SMs; no empty trailing split
    splits, per = v4c.plan_splits(4, 1, 128, 68, 132)
    assert 8 * splits <= 132 and (splits - 1) * per < 68 <= splits * per
    # up to 32 heads one CTA holds every head of a token: 4 tokens -> 33 splits wanted, 32 cap
    assert v4c.plan_splits(4, 1, 16, 68, 132)[0] == 23  # 68 tiles / 3 per split
    for bsz, heads, tiles in ((1, 64, 3), (2, 128, 100), (3, 16, 20), (64, 8, 68)):
        splits, per = v4c.plan_splits(bsz, 1, heads, tiles, 132)
        assert 1 <= splits <= min(tiles, v4c.MAX_SPLITS) and (splits - 1) * per < tiles <= splits * per
    with pytest.raises(ValueError, match="at least one key tile"):
        v4c.plan_splits(1, 1, 64, 0, 132)


def test_bad_inputs_name_the_tensor():
    q, scopes, sinks = make_case(1, 1, 4, [(8, "v4", 4, False), (12, "v41_window", 4, False)], seed=1)
    with pytest.raises(ValueError, match=r"scopes\[1\].*V4 or V4.1 records in one call"):
        v4c.check_cuda_inputs(q, scopes, sinks)
    rows = SparseKV(torch.zeros(3, 1, 1024, dtype=torch.uint8), scopes[1].indices, "bf16")
    assert "not 'bf16'" in v4c.unsupported_reason([rows])
    v41 = make_case(1, 1, 4, [(8, "v41_entry", 4, False), (12, "v41_window", 4, True)], seed=1)[1]
    assert v4c.unsupported_reason(v41) is None and v4c.record_family(v41) == "v41"
    with pytest.raises(ValueError, match="V4.1 records need v2"):
        v4c.v4_sparse_decode_cuda(q, v41, sinks, SCALE, variant="v1")
    with pytest.raises(TypeError, match="q must be bf16"):
        v4c.check_cuda_inputs(q.float(), scopes[:1], sinks)
    with pytest.raises(ValueError, match="sinks must be float32"):
        v4c.check_cuda_inputs(q, scopes[:1], sinks[:2])
    gen = torch.Generator().manual_seed(2)
    _, rows, _ = row_record_case(1, 4, 16, "v4", gen)  # 584-byte rows: on 8 bytes, read
    assert v4c.unsupported_reason([rows]) is None and v4c.unsupported_reason(scopes[:1]) is None
    buf = torch.zeros(rows.cache.numel() + 8, dtype=torch.uint8)
    shifted = buf[4:4 + rows.cache.numel()].view(rows.cache.shape)  # records on 4 bytes
    with pytest.raises(ValueError, match=r"scopes\[0\].cache: pages must start on 8 bytes"):
        v4c.check_cuda_inputs(q, [SparseKV(shifted, rows.indices, "v4")], sinks)


def test_registry_on_cpu_keeps_torch_and_names_the_flag():
    spec = AttentionSpec(torch.device("cpu"), torch.uint8, 64, 512, 64, 64, SCALE, torch.bfloat16, 1)
    assert select_v4_decode_backend("auto", spec, ("v4",)).name == "torch"
    assert select_v4_decode_backend("auto", spec, V41_FORMATS).name == "torch"
    with pytest.raises(BackendUnavailable, match="--attention-backend cuda"):
        select_v4_decode_backend("cuda", spec, ("v4",))
    assert CudaV4SparseDecode.record_formats == ("v4", *V41_FORMATS)


def test_registry_routes_v41_records_to_the_cuda_kernels(monkeypatch):
    """On an SM90 GPU (faked here: capability, library), ``auto`` takes cuda for V4.1's formats as
    for V4's; its decode runs the CUDA kernels for V4.1 records in either scope order and the
    Triton kernel for what they do not read (bf16 rows, V4 beside V4.1)."""
    import kernels.attention.base as base
    import kernels.v4_sparse_decode_triton as v4t

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(base, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(v4c, "library", lambda: None)
    calls = []
    monkeypatch.setattr(v4c, "v4_sparse_decode_cuda", lambda q, scopes, *a, **kw: calls.append(("cuda", kw)))
    monkeypatch.setattr(v4t, "v4_sparse_decode_triton", lambda q, scopes, *a, **kw: calls.append(("triton", kw)))
    spec = AttentionSpec(torch.device("cuda"), torch.uint8, 8, 512, 64, 1, SCALE, torch.bfloat16, 1)
    for formats in (V41_FORMATS, ("v41_window",), ("v4",)):
        assert select_v4_decode_backend("auto", spec, formats).name == "cuda", formats
    assert select_v4_decode_backend("auto", spec, ("v41_window", "bf16")).name == "triton"
    backend = select_v4_decode_backend("cuda", spec, V41_FORMATS)
    q, window_entries, sinks = make_case(2, 1, 8, [(8, "v41_window", 1, False), (12, "v41_entry", 1, True)], seed=3)
    backend.decode(q, window_entries, sinks, SCALE)
    backend.decode(q, window_entries[::-1], sinks, SCALE)
    v4_scope = make_case(2, 1, 8, [(8, "v4", 4, False)], seed=3)[1]
    backend.decode(q, v4_scope + window_entries[1:], sinks, SCALE)
    rows = SparseKV(torch.zeros(9, 1, 1024, dtype=torch.uint8), window_entries[0].indices, "bf16")
    backend.decode(q, [rows], sinks, SCALE)
    assert [c[0] for c in calls] == ["cuda", "cuda", "triton", "triton"]
    assert calls[0][1]["variant"] == "v3" and calls[0][1]["cluster"] is False


def _e2m1_words_as_f16(w: torch.Tensor) -> torch.Tensor:
    """Mirror of ``e2m1x8_to_f16_biased`` (kernels/csrc/v4_sparse_decode_common.cuh) on int64 words
    [n]: [n, 8] fp16 values, each e2m1 code's value times 2^-14."""
    m32, sign = 0xFFFFFFFF, 0x80808080

    def mux(x, y):  # lop3 0xCA with the sign mask
        return ((x & sign) | (y & ~sign)) & m32

    a, b = mux(w << 4, w << 1), mux(w, w >> 3)
    out = []
    for k in range(4):  # __byte_perm(a, b, k | k << 4 | k << 8 | (4 + k) << 12) & 0x8E008E00
        h = ((((a >> (8 * k)) & 0xFF) << 8) | (((b >> (8 * k)) & 0xFF) << 24)) & 0x8E008E00
        out += [h & 0xFFFF, h >> 16]
    return torch.stack(out, -1).to(torch.int16).view(torch.float16)


def test_v41_entry_dequantization_is_exact_in_fp16():
    """The kernels' e2m1 placement gives every code of every position (value x 2^-14, the subnormal
    code included), and every code times every finite e4m3 scale x 2^7 is exact in fp16: entry tiles
    hold K x 2^-7 without rounding (the issue's error budget is then V4's: fp16 P, bf16 out)."""
    from kernels.microscaling import fp4_codes_to_float

    gen = torch.Generator().manual_seed(0)
    words = torch.cat([torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64),
                       torch.arange(16).repeat_interleave(8) << (4 * torch.arange(8).repeat(16))])
    codes = (words.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF
    want = fp4_codes_to_float(codes.to(torch.uint8)).double() * 2.0**-14
    assert torch.equal(_e2m1_words_as_f16(words).double(), want)
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    scales = scales[torch.isfinite(scales) & (scales >= 0)] * 128  # exact: at most 448 * 128
    values = _e2m1_words_as_f16(torch.arange(16) * 0x11111111)[:, 0]  # the 16 codes, x 2^-14
    got = (values.view(-1, 1) * scales.view(1, -1)).double()  # fp16 products, as HMUL2
    assert torch.equal(got, values.double().view(-1, 1) * scales.double().view(1, -1))


# ----------------------------------------------------------------------------- GPU

GPU_CASES = [  # (variant, B, s_q, H, top-k, page size of the entries, cluster)
    # v1: the wgmma kernel (64+), the narrow one
    ("v1", 4, 1, 64, 512, 64, None), ("v1", 3, 2, 64, 2048, 61, None), ("v1", 2, 1, 128, 2048, 64, None),
    ("v1", 2, 2, 128, 512, 2, None), ("v1", 2, 1, 48, 512, 64, None), ("v1", 4, 1, 8, 512, 64, None),
    ("v1", 3, 2, 16, 2048, 64, None), ("v1", 2, 2, 32, 512, 61, None), ("v1", 2, 1, 24, 2048, 2, None),
    # v2: the tokens-major kernel (8, 16), the 64-record kernel (48, 64), the pair (128; 96: a
    # half-empty second head block) and its independent CTAs; top-k off the 64-record tiles
    ("v2", 4, 1, 8, 512, 64, None), ("v2", 3, 2, 16, 2048, 61, None), ("v2", 2, 1, 16, 300, 2, None),
    ("v2", 4, 1, 64, 512, 64, None), ("v2", 3, 2, 64, 1000, 61, None), ("v2", 2, 1, 48, 700, 64, None),
    ("v2", 2, 1, 128, 2048, 64, None), ("v2", 2, 2, 128, 300, 2, None), ("v2", 2, 1, 96, 512, 64, None),
    ("v2", 2, 2, 128, 1000, 61, False),
    # v3: the tokens2 kernel on v2's tokens cases, 8 query rows with fewer heads (1, 5), 16 with 12
    ("v3", 4, 1, 8, 512, 64, None), ("v3", 3, 2, 16, 2048, 61, None), ("v3", 2, 1, 16, 300, 2, None),
    ("v3", 3, 1, 1, 700, 64, None), ("v3", 2, 2, 5, 1000, 61, None), ("v3", 3, 1, 12, 512, 2, None),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,bsz,s_q,heads,topk,page,cluster", [
    pytest.param(*c, id=f"{kernel_id(c[0], c[3], c[6])}-B{c[1]}-sq{c[2]}-k{c[4]}-page{c[5]}") for c in GPU_CASES])
def test_cuda_kernel_matches_float64(variant, bsz, s_q, heads, topk, page, cluster):
    """Window 128 + top-k entries with −1 picks and lengths (partial last tiles), unreferenced
    records NaN; the planned splits, one split (no combine) and three, all within the bound."""
    q, scopes, sinks = make_case(bsz, s_q, heads, [(128, "v4", 64, False), (topk, "v4", page, True)],
                                 seed=heads + topk + s_q, device="cuda")
    want, want_lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE, compute_dtype=torch.float64)
    kw = dict(variant=variant, cluster=cluster)
    for splits in (None, 1, 3):
        out, lse = v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, num_splits=splits, **kw)
        assert not out.isnan().any() and not lse.isnan().any(), splits
        assert (lse.double() - want_lse).abs().max().item() < LSE_TOL, splits  # Q·Kᵀ and the softmax sums
        err = rel_err(out, want)
        if err > REL_TOL:  # say whether V's N-major descriptor has its two offsets swapped
            swapped = (1024, v4c.kernel_for(variant, heads)[1] * 128)
            err_swapped = rel_err(v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, num_splits=splits,
                                                            v_desc=swapped, **kw)[0], want)
        assert err <= REL_TOL, (splits, err, f"with V's descriptor offsets swapped: {err_swapped:.2e}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,heads", [pytest.param(v, h, id=kernel_id(v, h))
                                          for v, h in (("v1", 64), ("v2", 16), ("v2", 64), ("v2", 128), ("v3", 16),
                                                       ("v3", 8))])
def test_cuda_kernel_scale_spread_one_scope_no_sinks(variant, heads):
    """Per-64-dim scales over 12 binades, a single scope, no sinks, forced 5 splits."""
    q, scopes, _ = make_case(3, 2, heads, [(700, "v4", 64, True)], seed=5, device="cuda", block_spread=8)
    want, want_lse = v4_sparse_decode_reference(q, scopes, None, SCALE, compute_dtype=torch.float64)
    out, lse = v4c.v4_sparse_decode_cuda(q, scopes, None, SCALE, num_splits=5, variant=variant)
    assert rel_err(out, want) <= REL_TOL
    assert (lse.double() - want_lse).abs().max().item() < LSE_TOL


def _check_lonely_query_and_graph_replay(variant, heads, specs):
    """A request with no valid key gets out 0 and lse +inf; capture once, replay on new inputs
    written into the same buffers."""
    q, scopes, sinks = make_case(3, 2, heads, specs, seed=9, device="cuda")
    for sc in scopes:
        sc.indices[1] = -1
    out = torch.empty(3, 2, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(3, 2, heads, device="cuda")
    v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, out=out, lse=lse, variant=variant)  # build, configure
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all() and (lse[1] > 0).all()  # the lonely request
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, out=out, lse=lse, variant=variant)
    q2, scopes2, sinks2 = make_case(3, 2, heads, specs, seed=10, device="cuda")
    q.copy_(q2)
    sinks.copy_(sinks2)
    for sc, sc2 in zip(scopes, scopes2):
        sc.cache.copy_(sc2.cache)
        sc.indices.copy_(sc2.indices)
        if sc.lengths is not None:
            sc.lengths.copy_(sc2.lengths)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, want_lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE, compute_dtype=torch.float64)
    assert rel_err(out, want) <= REL_TOL
    assert (lse.double() - want_lse).abs().max().item() < LSE_TOL


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,heads", [pytest.param(v, h, id=kernel_id(v, h))
                                          for v, h in (("v1", 128), ("v2", 128), ("v2", 16), ("v3", 16),
                                                       ("v3", 8))])
def test_cuda_kernel_lonely_query_and_graph_replay(variant, heads):
    """The lonely request and graph replay (``_check_lonely_query_and_graph_replay``) on V4 pages."""
    _check_lonely_query_and_graph_replay(variant, heads, [(128, "v4", 64, False), (512, "v4", 64, True)])

@pytest.mark.gpu
@needs_gpu
def test_registry_auto_picks_cuda_for_v4_records():
    dev = torch.device("cuda")
    spec = AttentionSpec(dev, torch.uint8, 64, 512, 64, 64, SCALE, torch.bfloat16, 2)
    backend = select_v4_decode_backend("auto", spec, ("v4",))
    assert backend.name == "cuda"
    assert select_v4_decode_backend("auto", spec, ("v4", "bf16")).name == "triton"  # bf16 rows: Triton
    small = AttentionSpec(dev, torch.uint8, 16, 512, 64, 64, SCALE, torch.bfloat16, 2)
    assert select_v4_decode_backend("auto", small, ("v4",)).name == "cuda"
    # one-record row caches (the serving pools), both kernels; a cache on 4 bytes is refused
    gen = torch.Generator().manual_seed(3)
    for heads in (64, 16):
        q, rows, _ = row_record_case(3, heads, 96, "v4", gen, device="cuda")
        sinks = torch.randn(heads, generator=gen).cuda()
        want, want_lse = v4_sparse_decode_reference(q, [rows], sinks, SCALE, compute_dtype=torch.float64)
        out, lse = v4c.v4_sparse_decode_cuda(q, [rows], sinks, SCALE)
        assert rel_err(out, want) <= REL_TOL, heads
        assert (lse.double() - want_lse).abs().max().item() < LSE_TOL, heads
        buf = torch.empty(rows.cache.numel() + 8, dtype=torch.uint8, device="cuda")
        shifted = buf[4:4 + rows.cache.numel()].view(rows.cache.shape).copy_(rows.cache)
        with pytest.raises(ValueError, match=r"scopes\[0\]\.cache: pages must start on 8 bytes"):
            backend.decode(q, [SparseKV(shifted, rows.indices, "v4")], sinks, SCALE)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,heads", [pytest.param(v, h, id=kernel_id(v, h))
                                          for v, h in (("v2", 8), ("v2", 64), ("v2", 128), ("v3", 8), ("v3", 16))])
def test_cuda_v2_on_row_records(variant, heads):
    """One-record 584-byte rows (the serving pools: records on 8 bytes only)."""
    gen = torch.Generator().manual_seed(heads)
    q, rows, _ = row_record_case(3, heads, 200, "v4", gen, device="cuda")
    sinks = torch.randn(heads, generator=gen).cuda()
    want, want_lse = v4_sparse_decode_reference(q, [rows], sinks, SCALE, compute_dtype=torch.float64)
    out, lse = v4c.v4_sparse_decode_cuda(q, [rows], sinks, SCALE, variant=variant)
    assert rel_err(out, want) <= REL_TOL
    assert (lse.double() - want_lse).abs().max().item() < LSE_TOL


LOAD_CASES = [  # (variant, records, H, B, splits, cluster): every served kernel (v3), the cluster, the combine
    ("v3", "v4", 16, 256, None, False), ("v3", "v4", 16, 64, 3, False), ("v3", "v4", 32, 256, None, False),
    ("v3", "v4", 128, 128, None, False), ("v3", "v4", 128, 128, None, True), ("v3", "v41", 16, 256, None, False),
    ("v3", "v41", 64, 256, None, False),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,family,heads,bsz,splits,cluster", [
    pytest.param(*c, id=f"{c[1]}-{kernel_id(c[0], c[2], c[5], 'v4' if c[1] == 'v4' else 'v41')}-B{c[3]}-s{c[4]}")
    for c in LOAD_CASES])
def test_cuda_kernels_are_exact_and_repeatable_under_full_hbm_load(variant, family, heads, bsz, splits, cluster):
    """B requests x 2 query tokens, each a window of 128 picks and a top-k of 2048 (lengths
    1024-2048, 15 % −1) over a 0.3-0.6 GB cache whose 4096 live pages are picked at random and
    the rest is NaN: 512 CTAs of 34 tiles (68 of 32 records in the narrow kernel; 384 with three
    splits and the combine) or 256 CTA pairs, several waves, so HBM is busy and the roles within a
    CTA (and the CTAs of a pair) drift apart. 21 launches back to back give the same bits; four
    requests match the float64 reference."""
    gen = torch.Generator(device="cuda").manual_seed(heads + bsz)
    window, entries = ("v4", "v4") if family == "v4" else ("v41_window", "v41_entry")
    scopes = [loaded_scope(bsz, 2, 128, window, 1024, 512, False, gen),
              loaded_scope(bsz, 2, 2048, entries, 16384, 4096, True, gen)]
    q = (torch.randn(bsz, 2, heads, 512, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen, device="cuda") * 3

    def call():
        return v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, num_splits=splits, variant=variant, cluster=cluster)

    assert v4c.uses_cluster(variant, heads, cluster, v4c.record_family(scopes)) == bool(cluster)
    first_out, first_lse = call()
    differ = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(20):  # back to back, no host sync
        out, lse = call()
        differ += (bits(out) != bits(first_out)).sum() + (bits(lse) != bits(first_lse)).sum()
    assert differ.item() == 0
    rows = torch.tensor([0, 1, bsz // 2, bsz - 1], device="cuda")
    sub = [SparseKV(sc.cache, sc.indices[rows], sc.record, None if sc.lengths is None else sc.lengths[rows])
           for sc in scopes]
    want, want_lse = v4_sparse_decode_reference(q[rows], sub, sinks, SCALE, compute_dtype=torch.float64)
    assert not first_out.isnan().any() and not first_lse.isnan().any()
    assert rel_err(first_out[rows], want) <= REL_TOL
    assert (first_lse[rows].double() - want_lse).abs().max().item() < LSE_TOL


# ----------------------------------------------------------------------------- GPU, V4.1 records

V41_CASES = [  # (B, s_q, H, window page size, top-k, entry page size): the tokens-major kernel (8, 16),
    # the 64-record kernel padded (24, 32) and as one or two head blocks (64, 128); paged and row caches
    (4, 1, 8, 64, 512, 64), (3, 2, 8, 1, 512, 1), (3, 2, 16, 61, 300, 61), (2, 1, 16, 1, 1000, 2),
    (2, 2, 24, 64, 512, 64), (2, 1, 32, 1, 512, 1), (4, 1, 64, 64, 512, 64), (3, 2, 64, 1, 700, 1),
    (2, 1, 128, 64, 512, 64), (2, 2, 128, 1, 300, 2),
]


def pages_on_8_bytes(scope: SparseKV) -> SparseKV:
    """The same records in pages whose stride is 8 mod 16 (the kernels' 8-byte load path)."""
    pages, page_size, nbytes = scope.cache.shape
    buf = torch.full((pages, page_size * nbytes + 8), 0xFF, dtype=torch.uint8, device=scope.cache.device)
    cache = buf[:, : page_size * nbytes].view(pages, page_size, nbytes)
    cache.copy_(scope.cache)
    return SparseKV(cache, scope.indices, scope.record, scope.lengths)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,heads", [pytest.param(v, h, id=f"v41-{kernel_id(v, h, family='v41')}")
                                          for v, h in (("v2", 8), ("v2", 64), ("v3", 8), ("v3", 16))])
def test_cuda_v41_dequantizes_exactly(variant, heads):
    """One valid pick per query token and no sink: out is that record, so every dequantized value
    must come back bit for bit (bf16 holds each: at most 4 significant bits for e4m3, 6 for e2m1
    times e4m3). Entry scales from e4m3's subnormals to ~400 (every e2m1 code), window scales from
    2^-13 to 2^1 per 16 dims (fp16 holds every e4m3 value times those: no rounding)."""
    gen = torch.Generator().manual_seed(11)
    bsz, s_q, n = 6, 2, 300
    rows = torch.randn(2, n, 512, generator=gen)
    spread = torch.randint(-14, 10, (2, n, 32, 1), generator=gen).float()  # per 16 dims
    spread[0].clamp_(-6, 8)  # window rows: block amax >= ~2^-5 keeps their fp16 products exact
    rows = (rows.view(2, n, 32, 16) * torch.exp2(spread)).view(2, n, 512)
    window = row_record_cache(pack_v41_window_rows(rows[0])).cuda()
    entries = row_record_cache(pack_v41_entries(rows[1])).cuda()
    pick = torch.randint(0, n, (bsz, s_q), generator=gen)
    in_window = torch.rand(bsz, s_q, generator=gen) < 0.5
    w_idx = torch.full((bsz, s_q, 128), -1, dtype=torch.int32)
    e_idx = torch.full((bsz, s_q, 512), -1, dtype=torch.int32)
    slot_w, slot_e = torch.randint(0, 128, (bsz, s_q), generator=gen), torch.randint(0, 512, (bsz, s_q), generator=gen)
    for b in range(bsz):
        for t in range(s_q):
            if in_window[b, t]:
                w_idx[b, t, slot_w[b, t]] = pick[b, t]
            else:
                e_idx[b, t, slot_e[b, t]] = pick[b, t]
    scopes = [SparseKV(window, w_idx.cuda(), "v41_window"), SparseKV(entries, e_idx.cuda(), "v41_entry")]
    q = (torch.randn(bsz, s_q, heads, 512, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    out, _ = v4c.v4_sparse_decode_cuda(q, scopes, None, SCALE, num_splits=1, variant=variant)
    values = torch.stack([unpack_records(window.cpu(), "v41_window")[:, 0],
                          unpack_records(entries.cpu(), "v41_entry")[:, 0]])  # [2, n, 512]
    want = values[(~in_window).long(), pick].bfloat16()  # [B, s_q, 512]
    assert torch.equal(out.cpu(), want.unsqueeze(2).expand_as(out))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,bsz,s_q,heads,wpage,topk,epage", [
    pytest.param(v, *c, id=f"v41-{kernel_id(v, c[2], family='v41')}-B{c[0]}-sq{c[1]}-k{c[4]}-pages{c[3]}/{c[5]}")
    for v in ("v2", "v3") for c in V41_CASES if v == "v2" or c[2] <= v4c.TOKENS_MAX_HEADS])
def test_cuda_v41_matches_float64(variant, bsz, s_q, heads, wpage, topk, epage):
    """Window 128 rows + top-k entries (lengths, partial tiles, −1 picks), unreferenced records NaN:
    the planned splits, one split and three; the scopes in the other order; pages on 8 bytes."""
    q, scopes, sinks = make_case(bsz, s_q, heads, [(128, "v41_window", wpage, False), (topk, "v41_entry", epage, True)],
                                 seed=heads + topk + s_q, device="cuda")
    want, want_lse = v4_sparse_decode_reference(q, scopes, sinks, SCALE, compute_dtype=torch.float64)
    runs = [(scopes, splits) for splits in (None, 1, 3)]
    runs += [(scopes[::-1], None), ([pages_on_8_bytes(sc) for sc in scopes], 3)]
    for i, (sc, splits) in enumerate(runs):
        out, lse = v4c.v4_sparse_decode_cuda(q, sc, sinks, SCALE, num_splits=splits, variant=variant)
        assert not out.isnan().any() and not lse.isnan().any(), i
        assert (lse.double() - want_lse).abs().max().item() < LSE_TOL, i
        assert rel_err(out, want) <= REL_TOL, (i, rel_err(out, want))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,heads", [pytest.param(v, h, id=f"v41-{kernel_id(v, h, family='v41')}")
                                          for v, h in (("v2", 8), ("v2", 64), ("v3", 8), ("v3", 16))])
@pytest.mark.parametrize("record", ["v41_window", "v41_entry"])
def test_cuda_v41_one_scope_scale_spread(record, variant, heads):
    """One scope of one format (a window-only layer; entries alone), per-64-dim blocks over 12
    binades, no sinks, forced 5 splits."""
    q, scopes, _ = make_case(3, 2, heads, [(700, record, 64, True)], seed=5, device="cuda", block_spread=8)
    want, want_lse = v4_sparse_decode_reference(q, scopes, None, SCALE, compute_dtype=torch.float64)
    out, lse = v4c.v4_sparse_decode_cuda(q, scopes, None, SCALE, num_splits=5, variant=variant)
    assert rel_err(out, want) <= REL_TOL
    assert (lse.double() - want_lse).abs().max().item() < LSE_TOL


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,heads", [pytest.param(v, h, id=f"v41-{kernel_id(v, h, family='v41')}")
                                          for v, h in (("v2", 8), ("v2", 128), ("v3", 8), ("v3", 16))])
def test_cuda_v41_lonely_query_and_graph_replay(variant, heads):
    """The lonely request and graph replay on V4.1 row caches, as the serving pools keep them."""
    _check_lonely_query_and_graph_replay(variant, heads, [(128, "v41_window", 1, False), (512, "v41_entry", 1, True)])

@pytest.mark.gpu
@needs_gpu
def test_registry_auto_picks_cuda_for_v41_records():
    """``auto`` with V4.1's formats on SM90 is the cuda backend, and its decode runs the CUDA kernels
    on the serving pools' row records (window rows and entries, 8 and 64 heads)."""
    spec = AttentionSpec(torch.device("cuda"), torch.uint8, 64, 512, 64, 1, SCALE, torch.bfloat16, 1)
    backend = select_v4_decode_backend("auto", spec, V41_FORMATS)
    assert backend.name == "cuda"
    gen = torch.Generator().manual_seed(4)
    for heads in (8, 64):
        q, window, _ = row_record_case(3, heads, 128, "v41_window", gen, device="cuda")
        _, entries, _ = row_record_case(3, heads, 400, "v41_entry", gen, device="cuda")
        sinks = torch.randn(heads, generator=gen).cuda()
        want, want_lse = v4_sparse_decode_reference(q, [window, entries], sinks, SCALE, compute_dtype=torch.float64)
        assert v4c.unsupported_reason([window, entries]) is None
        out, lse = backend.decode(q, [window, entries], sinks, SCALE)
        assert rel_err(out, want) <= REL_TOL, heads
        assert (lse.double() - want_lse).abs().max().item() < LSE_TOL, heads
