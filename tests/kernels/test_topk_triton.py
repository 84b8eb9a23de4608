"""kernels/topk_triton.py: the Triton selection against the torch selection of
kernels/v4_indexer.py (kernels/topk.py's order), pick for pick and mask for mask.

CPU, under TRITON_INTERPRET=1 (a subprocess: the interpreter is chosen at import): crafted rows
— ReLU zeros of both signs, coarse ties, one crowded histogram bin, a row all tied, negative
scores, −inf padding, fewer finite scores than k, an empty row, a huge dynamic range — at
candidate buffers small enough that every path runs (the small and the large sort, the exact
radix path; checked from the histogram here); candidate blocks with ties, masked blocks and
the newest block pinned. Compiled for sm_90 at V4.1-Flash's sizes without spills. GPU: rows of
65536 scores with k = 512 and block rows of 8192 with k = 2048, the crowded and tied rows at
full width."""

from __future__ import annotations

import functools
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.topk import order_keys
from kernels.v4_indexer import candidate_blocks, topk_picks
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH
from tests.kernels.test_mxfp8_gemm import run_interpreted

pytest.importorskip("triton")

_PTXAS = Path(importlib.util.find_spec("triton").origin).parent / "backends/nvidia/bin/ptxas"


def crafted_rows(n: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [10, n] float32, visible [10]): entries at and past ``visible`` are −inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, n, generator=g)
    s = x.clone()
    s[0] = torch.where(x[0] < 0.5, torch.where(torch.arange(n) % 2 == 0, 0.0, -0.0), x[0])  # ReLU zeros, ±0
    s[1] = torch.round(x[1] * 2) / 2  # coarse ties everywhere
    s[2] = 1.0 + x[2] * 1e-6  # one crowded level-1 bin
    s[3] = -x[3].abs()
    s[3, ::7] = -0.0
    s[4] = 3.0  # every score tied
    s[5, n // 4:] = float("-inf")  # fewer finite scores than visible
    s[8] = x[8] * torch.pow(10.0, torch.randn(n, generator=g) * 10).clamp(1e-30, 1e30)
    s[9] = torch.where(x[9] > 0, x[9], 0.0)
    visible = torch.tensor([n, n - 3, n, n - 1, n, n, 7, 0, n, n // 2])
    s[torch.arange(n)[None, :] >= visible[:, None]] = float("-inf")
    return s.to(device), visible.to(device)


def selection_path(row: torch.Tensor, k: int, small: int, cap: int) -> str:
    """Which path kernels/topk_triton.py's finish takes on one row: from the level-1 bins of
    its finite scores, the candidates in bins ≥ the threshold bin (the kernel's rule, in torch)."""
    fin = row[row > float("-inf")]
    if fin.numel() <= k:
        return "small"
    bins = (order_keys(fin) >> 53) + 1024  # ordered score bits >> 21
    kth = bins.sort(descending=True).values[k - 1]
    n = int((bins >= kth).sum())
    return "small" if n <= small else ("large" if n <= cap else "exact")


def block_rows(blocks: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(block maxima [6, blocks], visible [6] with block size 8): ties, masked blocks, an
    empty row, a partial newest block; blocks past the visible ones −inf."""
    g = torch.Generator().manual_seed(seed)
    bm = torch.round(torch.randn(6, blocks, generator=g) * 3) / 3  # many ties
    bm[1, ::3] = float("-inf")  # masked blocks
    bm[2] = 0.5
    visible = torch.tensor([8 * blocks, 8 * blocks - 5, 8 * blocks, 0, 13, 8 * blocks // 2 + 1])
    live = (visible + 7) // 8
    bm[torch.arange(blocks)[None, :] >= live[:, None]] = float("-inf")
    return bm.to(device), visible.to(device)


_INTERPRET_SCRIPT = INTERPRETER_PATCH + textwrap.dedent(
    """
    import torch
    from kernels.topk_triton import candidate_blocks_triton, topk_rows_triton
    from kernels.v4_indexer import candidate_blocks, topk_picks
    from tests.kernels.test_topk_triton import block_rows, crafted_rows, selection_path
    wide, narrow = crafted_rows(200, seed=0), crafted_rows(24, seed=0)
    paths = set()
    # narrow: k past the row width (picks [rows, n], −1 past each row's finite scores)
    for (scores, visible), k, small, cap in ((wide, 1, 16, 32), (wide, 3, 16, 32), (wide, 13, 16, 64),
                                             (wide, 40, 64, 128), (narrow, 30, 32, 32)):
        got = topk_rows_triton(scores, visible, k, small=small, cap=cap)
        want = topk_picks(scores, k)
        for r in range(scores.shape[0]):
            assert torch.equal(got[r], want[r]), (k, r, got[r], want[r])
            paths.add(selection_path(scores[r], k, small, cap))
    assert paths == {"small", "large", "exact"}, paths
    bm, vis = block_rows(40, seed=1)
    for k in (1, 2, 7, 30, 40, 64):
        assert torch.equal(candidate_blocks_triton(bm, vis, k, 8), candidate_blocks(bm, vis.view(-1, 1), k, 8)), k
    print("interpreter ok")
    """
)


@pytest.mark.slow
def test_selection_under_interpreter():
    run_interpreted(_INTERPRET_SCRIPT)


def test_bad_inputs_raise_one_line_errors():
    from kernels.topk_triton import candidate_blocks_triton, topk_rows_triton

    s, vis = torch.zeros(2, 8), torch.tensor([8, 8])
    with pytest.raises(ValueError, match="scores must be float32"):
        topk_rows_triton(s.double(), vis, 2)
    with pytest.raises(ValueError, match="visible must be"):
        topk_rows_triton(s, vis[:1], 2)
    with pytest.raises(ValueError, match="k must be in 1"):
        topk_rows_triton(s, vis, 0)
    with pytest.raises(ValueError, match="candidate buffers must be powers of two"):
        topk_rows_triton(s, vis, 2, small=24, cap=64)
    with pytest.raises(ValueError, match="at most 16384 candidate blocks"):
        candidate_blocks_triton(torch.zeros(1, 16385), torch.tensor([8]), 4, 8)


@pytest.mark.slow
@pytest.mark.skipif(not _PTXAS.exists(), reason="needs triton's bundled ptxas")
def test_selection_kernels_compile_for_sm90_without_spills():
    """V4.1-Flash's sizes (k = 512: candidate buffers 1024 and 4096; candidate rows of 8192
    and 16384 blocks): no local memory, no spill stack."""
    from kernels.topk_triton import (HIST_STRIDE, NUM_BINS, _block_mask_kernel, _collect_kernel, _finish_kernel,
                                     _histogram_kernel, selection_sizes)
    from tests.kernels.test_mxfp8_gemm import _compile_sm90, two_at_a_time

    kp, small, cap = selection_sizes(512)
    common = dict(S="*fp32", s_stride="i32", VIS="*i64", HIST="*i32", k="i32")
    tables = dict(NB=NUM_BINS, STRIDE=HIST_STRIDE)
    cases = [
        (_histogram_kernel, dict(common), dict(CHUNK=1024, **tables), 4),
        (_collect_kernel, dict(common, CAND="*i64"), dict(CAP=cap, CHUNK=8192, BLOCK=1024, **tables), 4),
        (_finish_kernel, dict(common, CAND="*i64", PICKS="*i64", p_stride="i32", MAP="*i32", map_stride="i32",
                              width="i32"), dict(KP=kp, SMALL=small, CAP=cap, BLOCK=1024, MAP_BLOCK=8, **tables), 8),
    ] + [(_block_mask_kernel, dict(BM="*fp32", bm_stride="i32", VIS="*i64", MASK="*i8", m_stride="i32",
                                   num_blocks="i32", k="i32"), dict(BS=8, ROW=row), 8) for row in (8192, 16384)]
    calls = [functools.partial(_compile_sm90, fn, {n: t for n, t in types.items() if n in fn.arg_names}, consts,
                               num_warps=warps) for fn, types, consts, warps in cases]
    for (fn, *_), (_, usage) in zip(cases, two_at_a_time(calls)):
        assert re.search(r"STACK:0 .*LOCAL:0", usage), (fn.fn.__name__, usage)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_selection_on_gpu_at_v41_sizes():
    from kernels.topk_triton import candidate_blocks_triton, topk_rows_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, 65536, device="cuda", generator=g)
    scores = torch.where(x > -0.5, x, 0.0)  # ReLU zeros among the candidates
    scores[1::4] = torch.round(scores[1::4] * 4) / 4  # heavy ties
    visible = torch.randint(0, 65537, (128,), device="cuda", generator=g)
    visible[:8] = 65536
    scores[torch.arange(65536, device="cuda")[None, :] >= visible[:, None]] = float("-inf")
    crafted, crafted_vis = crafted_rows(65536, seed=2, device="cuda")
    for s, vis in ((scores, visible), (crafted, crafted_vis)):
        assert torch.equal(topk_rows_triton(s, vis, 512), topk_picks(s, 512))
    paths = {selection_path(crafted[r].cpu(), 512, 1024, 4096) for r in range(crafted.shape[0])}
    assert "exact" in paths, paths
    bm = torch.round(torch.randn(128, 8192, device="cuda", generator=g) * 8) / 8
    bvis = torch.randint(0, 65537, (128,), device="cuda", generator=g)
    bm[torch.arange(8192, device="cuda")[None, :] >= ((bvis + 7) // 8)[:, None]] = float("-inf")
    assert torch.equal(candidate_blocks_triton(bm, bvis, 2048, 8), candidate_blocks(bm, bvis.view(-1, 1), 2048, 8))
