"""The CUDA C++ V4 sparse decode (kernels/v4_sparse_decode_cuda.py): host-side logic on the CPU
(build and ctypes mirror, split planning, variant dispatch, input checks, the registry), both
designs' kernels on the GPU against the float64 reference on fresh random inputs (poisoned
unreferenced records, −1 picks, lengths and partial tiles; CUDA-graph capture and replay)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels import mla_decode_cuda as mdc
from kernels import v4_sparse_decode_cuda as v4c
from kernels.attention import AttentionSpec, BackendUnavailable, CudaV4SparseDecode, select_v4_decode_backend
from kernels.attention import v4_sparse_decode as v4_registry
from kernels.v4_sparse_decode import SparseKV, v4_sparse_decode_reference
from tests.kernels.test_v4_sparse_decode import SCALE, make_case, rel_err, row_record_case

REL_TOL = 2e-2  # fp16 products, fp32 softmax: the bound vs float64
LSE_TOL = 5e-3

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def kernel_id(variant: str, heads: int, cluster: bool | None = None) -> str:
    """A test id naming the kernel that runs (v1-wide, v2-tokens, v2-tile64, v2-pair, ...), so that a
    device run can take one kernel at a time (``-k pair``)."""
    kernel = v4c.kernel_for(variant, heads)[0]
    return f"{variant}-{'pair' if v4c.uses_cluster(variant, heads, cluster) else kernel}-H{heads}"


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


def test_variants_pick_their_kernels():
    """v1 keeps the first kernels; v2 takes the tokens-major kernel up to 16 heads, the narrow one
    at 17-32, the 64-record kernel above, clustered at 65-128 heads unless told not to."""
    assert [v4c.kernel_for("v1", h) for h in (8, 16, 24, 64, 128)] == [
        ("narrow", 32), ("narrow", 32), ("narrow", 32), ("wide", 32), ("wide", 32)]
    assert [v4c.kernel_for("v2", h) for h in (8, 16, 24, 32, 48, 64, 128)] == [
        ("tokens", 64), ("tokens", 64), ("narrow", 32), ("narrow", 32), ("tile64", 64), ("tile64", 64), ("tile64", 64)]
    assert [v4c.uses_cluster("v2", h) for h in (16, 64, 65, 96, 128)] == [False, False, True, True, True]
    assert not v4c.uses_cluster("v2", 128, cluster=False) and not v4c.uses_cluster("v1", 128)
    assert v4_registry.CUDA_VARIANT in v4c.VARIANTS
    q, scopes, sinks = make_case(1, 1, 4, [(8, "v4", 4, False)], seed=1)
    with pytest.raises(ValueError, match="variant must be one of"):
        v4c.v4_sparse_decode_cuda(q, scopes, sinks, SCALE, variant="v3")


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
    with pytest.raises(ValueError, match=r"scopes\[1\].*V4 MODEL1 records only"):
        v4c.check_cuda_inputs(q, scopes, sinks)
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
    with pytest.raises(BackendUnavailable, match="--attention-backend cuda"):
        select_v4_decode_backend("cuda", spec, ("v4",))
    assert CudaV4SparseDecode.record_formats == ("v4",)


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
                                          for v, h in (("v1", 64), ("v2", 16), ("v2", 64), ("v2", 128))])
def test_cuda_kernel_scale_spread_one_scope_no_sinks(variant, heads):
    """Per-64-dim scales over 12 binades, a single scope, no sinks, forced 5 splits."""
    q, scopes, _ = make_case(3, 2, heads, [(700, "v4", 64, True)], seed=5, device="cuda", block_spread=8)
    want, want_lse = v4_sparse_decode_reference(q, scopes, None, SCALE, compute_dtype=torch.float64)
    out, lse = v4c.v4_sparse_decode_cuda(q, scopes, None, SCALE, num_splits=5, variant=variant)
    assert rel_err(out, want) <= REL_TOL
    assert (lse.double() - want_lse).abs().max().item() < LSE_TOL


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,heads", [pytest.param(v, h, id=kernel_id(v, h))
                                          for v, h in (("v1", 128), ("v2", 128), ("v2", 16))])
def test_cuda_kernel_lonely_query_and_graph_replay(variant, heads):
    """A request with no valid key gets out 0 and lse +inf; capture once, replay on new inputs
    written into the same buffers."""
    specs = [(128, "v4", 64, False), (512, "v4", 64, True)]
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
def test_registry_auto_picks_cuda_for_v4_records():
    dev = torch.device("cuda")
    spec = AttentionSpec(dev, torch.uint8, 64, 512, 64, 64, SCALE, torch.bfloat16, 2)
    backend = select_v4_decode_backend("auto", spec, ("v4",))
    assert backend.name == "cuda"
    assert select_v4_decode_backend("auto", spec, ("v4", "v41_entry")).name == "triton"
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
@pytest.mark.parametrize("heads", [pytest.param(h, id=kernel_id("v2", h)) for h in (8, 64, 128)])
def test_cuda_v2_on_row_records(heads):
    """One-record 584-byte rows (the serving pools: records on 8 bytes only)."""
    gen = torch.Generator().manual_seed(heads)
    q, rows, _ = row_record_case(3, heads, 200, "v4", gen, device="cuda")
    sinks = torch.randn(heads, generator=gen).cuda()
    want, want_lse = v4_sparse_decode_reference(q, [rows], sinks, SCALE, compute_dtype=torch.float64)
    out, lse = v4c.v4_sparse_decode_cuda(q, [rows], sinks, SCALE, variant="v2")
    assert rel_err(out, want) <= REL_TOL
    assert (lse.double() - want_lse).abs().max().item() < LSE_TOL
