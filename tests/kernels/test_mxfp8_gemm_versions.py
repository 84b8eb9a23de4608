"""The MXFP8 GEMM's CUDA kernel versions against each other (kernels/mxfp8_gemm_cuda.py): which
configurations are built (CPU), v2 writing v1's bytes in every built configuration (also at a
size of many tiles per CTA, 21 launches back to back each), and v2's no-promotion diagnostic (GPU,
``-m gpu``). Shared operands and the reference checks:
tests/kernels/test_mxfp8_gemm.py."""

from __future__ import annotations

import pytest
import torch

from kernels.mxfp8_gemm import mxfp8_gemm_reference
from tests.kernels.test_mxfp8_gemm import _bytes_equal, activations, needs_cuda, rel_err, weight


def test_cuda_v2_cluster_choice():
    from kernels.mxfp8_gemm_cuda import cluster_fits, default_cluster

    # pairs along M share B where 128-row tiles pair up; never for 64-row tiles or unaligned scale rows
    assert default_cluster(8192, 2, True) == (2, 1)
    assert default_cluster(1024, 2, True) == (2, 1)
    assert default_cluster(300, 2, True) == (1, 1)  # 3 tiles: one CTA of two idles
    assert default_cluster(1100, 2, True) == (2, 1)  # 9 tiles: one of 10 idles
    assert default_cluster(128, 2, True) == (1, 1)
    assert default_cluster(64, 1, True) == (1, 1)
    assert default_cluster(8192, 2, False) == (1, 1)
    # along N two column tiles share A's rows and K range: one group for both
    assert cluster_fits((1, 2), 8192, 8) and not cluster_fits((2, 2), 8 * 384, 8) and cluster_fits((2, 1), 384, 3)


def test_cuda_config_errors_name_what_is_built():
    from kernels.mxfp8_gemm_cuda import config_error

    ok = dict(consumers=2, cluster=(1, 1), promote=True, aligned=True, n=1280, groups=1)
    for kernel in ("v1", "v2"):
        assert config_error(kernel, **ok) is None
    assert config_error("v3", **ok) and config_error("v1", **dict(ok, consumers=3))
    assert config_error("v1", **dict(ok, cluster=(2, 1))) and config_error("v1", **dict(ok, promote=False))
    assert config_error("v2", **dict(ok, cluster=(2, 2))) is None
    assert config_error("v2", **dict(ok, cluster=(2, 1), aligned=False))  # unaligned scale rows: 1 x 1 only
    assert config_error("v2", **dict(ok, cluster=(2, 1), consumers=1))
    assert config_error("v2", **dict(ok, consumers=1)) is None and config_error("v2", **dict(ok, aligned=False)) is None
    # the diagnostic: 128-row tiles, aligned scale rows, 1 x 1 or 2 x 1
    for cluster in ((1, 1), (2, 1)):
        assert config_error("v2", **dict(ok, cluster=cluster, promote=False)) is None
    assert config_error("v2", **dict(ok, cluster=(1, 2), promote=False))
    assert config_error("v2", **dict(ok, promote=False, consumers=1))
    assert config_error("v2", **dict(ok, promote=False, aligned=False))


def _grouped_case(m, n, k, groups):
    """Operands of an m x n GEMM over K = k in ``groups`` column groups (K k / groups each), on
    the GPU, and their float32 reference: (x8, xs, w8, ws, ref, K per group)."""
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    kg = k // groups
    x8, xs = quantize_mxfp8_triton(activations(m, k, seed=m + n, device="cuda"))
    w8, ws = weight(n, kg, seed=n + k, device="cuda")
    return x8, xs, w8, ws, mxfp8_gemm_reference(x8, xs, w8, ws, groups=groups, out_dtype=torch.float32), kg


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m, n, k, groups", [(1024, 1280, 1024, 1), (300, 768, 512, 1), (129, 512, 384, 1),
                                             (257, 512, 1024, 2), (40, 1000, 512, 1), (200, 384, 224, 1),
                                             (2048, 2560, 512, 1)])
def test_gpu_v2_equals_v1_bit_for_bit(m, n, k, groups):
    """The second kernel in every cluster shape that fits (and both tile heights, split-K, the
    quantizing epilogue, the bf16 epilogue under which the next tile's first slices start) writes
    the first kernel's bytes: the same partials promoted in the same order; the first is checked
    against the reference here too. 300 rows: a pair of 128-row tiles with one CTA on an empty
    tile; 257 × 2 groups: clusters along N within a group; 2048 x 2560: several tiles per CTA."""
    from kernels.mxfp8_gemm import mxfp8_gemm
    from kernels.mxfp8_gemm_cuda import CLUSTERS, cluster_fits, default_cuda_config

    x8, xs, w8, ws, ref, kg = _grouped_case(m, n, k, groups)
    aligned = kg % 128 == 0
    for consumers in (1, 2):
        for split in sorted({1, default_cuda_config(m, n, kg)["SPLIT_K"]}):
            base = {"consumers": consumers, "SPLIT_K": split}
            y1 = mxfp8_gemm(x8, xs, w8, ws, groups, torch.float32, config=dict(base, kernel="v1"), backend="cuda")
            assert rel_err(y1, ref) < 1e-4, base
            b1 = mxfp8_gemm(x8, xs, w8, ws, groups, torch.bfloat16, config=dict(base, kernel="v1"), backend="cuda")
            quant = n % 32 == 0  # the MXFP8 epilogue quantizes whole 32-column blocks
            if quant:
                q1 = mxfp8_gemm(x8, xs, w8, ws, groups, quantize_out=True, config=dict(base, kernel="v1"),
                                backend="cuda")
            for cluster in CLUSTERS if consumers == 2 and aligned else [(1, 1)]:
                if not cluster_fits(cluster, n, groups):
                    continue
                cfg = dict(base, kernel="v2", cluster=cluster)
                y2 = mxfp8_gemm(x8, xs, w8, ws, groups, torch.float32, config=cfg, backend="cuda")
                assert torch.equal(y1, y2), cfg
                b2 = mxfp8_gemm(x8, xs, w8, ws, groups, torch.bfloat16, config=cfg, backend="cuda")
                assert torch.equal(b1, b2), cfg
                if quant:
                    q2 = mxfp8_gemm(x8, xs, w8, ws, groups, quantize_out=True, config=cfg, backend="cuda")
                    assert _bytes_equal(q1[0], q2[0]) and torch.equal(q1[1], q2[1]), cfg


@pytest.mark.gpu
@needs_cuda
def test_gpu_v2_no_promotion_diagnostic_runs():
    """The benchmark's diagnostic (v2 without the per-32 scales) is the unscaled FP8 product."""
    from kernels.mxfp8_gemm import mxfp8_gemm
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    x8, xs = quantize_mxfp8_triton(activations(512, 1024, seed=3, device="cuda"))
    w8, ws = weight(768, 1024, seed=4, device="cuda")
    plain = x8.float() @ w8.float().t()
    for cluster in ((1, 1), (2, 1)):
        cfg = {"consumers": 2, "SPLIT_K": 1, "kernel": "v2", "cluster": cluster, "promote": False}
        y = mxfp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, config=cfg, backend="cuda")
        assert rel_err(y, plain) < 1e-2, cluster


@pytest.mark.gpu
@needs_cuda
def test_gpu_versions_are_exact_and_repeatable_under_load():
    """V4.1's wo_b at 4096 tokens (4096 x 5120, K = 8192): 1280 or 2560 output tiles of 64 K stages,
    10-20 per persistent CTA, so each producer runs ahead across tiles and the CTAs of a
    cluster drift apart. Every built configuration (v1 and v2 with both tile heights, v2 in every
    cluster; bf16 out, whose next tile starts under the stores in v2, and fp32), 21 launches back to
    back each, writes the first bits of v1 with the same tile height every time; four rows match the
    reference."""
    from kernels.mxfp8_gemm import mxfp8_gemm
    from kernels.mxfp8_gemm_cuda import CLUSTERS
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton
    from tests.kernels.test_mla_fused_kernels import bits

    m, n, k = 4096, 5120, 8192
    x8, xs = quantize_mxfp8_triton(activations(m, k, seed=21, device="cuda"))
    w8, ws = weight(n, k, seed=22, device="cuda")
    configs = [{"kernel": "v1", "consumers": 2}, *({"kernel": "v2", "consumers": 2, "cluster": c} for c in CLUSTERS),
               {"kernel": "v1", "consumers": 1}, {"kernel": "v2", "consumers": 1}]
    first = {}  # (consumers, dtype): v1's output
    for cfg in configs:
        cfg["SPLIT_K"] = 1
        for dtype in (torch.bfloat16, torch.float32):
            key = (cfg["consumers"], dtype)
            if key not in first:
                first[key] = mxfp8_gemm(x8, xs, w8, ws, out_dtype=dtype, config=cfg, backend="cuda")
            differ = torch.zeros((), dtype=torch.int64, device="cuda")
            for _ in range(21):
                y = mxfp8_gemm(x8, xs, w8, ws, out_dtype=dtype, config=cfg, backend="cuda")
                differ += (bits(y) != bits(first[key])).sum()
            assert differ.item() == 0, (cfg, dtype)
    rows = torch.tensor([0, 1, m // 2, m - 1], device="cuda")
    ref = mxfp8_gemm_reference(x8[rows], xs[rows], w8, ws, out_dtype=torch.float32)
    for consumers in (1, 2):
        assert rel_err(first[(consumers, torch.float32)][rows], ref) < 1e-4
        assert rel_err(first[(consumers, torch.bfloat16)][rows], ref) < 4e-3
