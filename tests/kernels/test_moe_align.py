"""The Triton slot alignment (kernels/moe_align.py) gives the torch reference's layout bit for
bit: under TRITON_INTERPRET=1 on small cases (CPU, NaN-free but poisoned fresh buffers), and
on the GPU at prefill and decode sizes (V2-Lite 64 experts, R1 256 / EP 32) and inside a
CUDA graph. The reference's own properties are tested in tests/kernels/test_moe_triton.py."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from kernels.fused_glue import unfused_glue
from kernels.moe_align import align_slots_to_blocks, align_slots_to_blocks_reference
from tests.kernels.test_mla_fused_kernels import run_under_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None
# (T, k, E_local, expert offset, BLOCK_M, id range): every expert busy, idle experts, EP ranks
# (foreign ids below and above the local range), all-foreign, one slot.
CASES = [(1, 8, 256, 0, 16, 256), (5, 2, 4, 2, 16, 10), (37, 6, 8, 3, 4, 14), (9, 3, 4, 100, 8, 110),
         (64, 4, 3, 0, 64, 9), (300, 6, 64, 0, 128, 64), (3, 2, 4, 0, 16, 0), (700, 8, 32, 64, 64, 256)]


def make_ids(t, k, id_range, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if id_range == 0:  # every choice foreign
        return torch.full((t, k), 50, device=device)
    return torch.rand(t, id_range, generator=g).topk(k, dim=-1).indices.to(device)  # distinct per token


def check_align(impl, t, k, n_local, offset, block_m, id_range, seed=0, device="cpu"):
    ids = make_ids(t, k, id_range, seed, device)
    want = align_slots_to_blocks_reference(ids.cpu(), n_local, offset, block_m)
    for ids_dtype in (torch.int64, torch.int32):
        got = impl(ids.to(ids_dtype), n_local, offset, block_m)
        assert all(g.dtype == torch.int32 for g in got)
        assert torch.equal(got[0].cpu(), want[0]), "sorted slots differ"
        assert torch.equal(got[1].cpu(), want[1]), "block experts differ"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be run")
def test_triton_alignment_under_interpreter():
    from tests.kernels.test_prefill_glue import POISON_EMPTY

    run_under_interpreter(POISON_EMPTY + textwrap.dedent(f"""
        from kernels.moe_align import align_slots_to_blocks_triton
        from tests.kernels.test_moe_align import check_align
        for i, case in enumerate({CASES!r}):
            check_align(align_slots_to_blocks_triton, *case, seed=i)
        print("interpreter ok")
        """))


def test_cpu_dispatch_is_the_reference():
    ids = make_ids(9, 3, 12, 1)
    for ctx in (torch.no_grad(), unfused_glue()):
        with ctx:
            got, want = align_slots_to_blocks(ids, 8, 2, 16), align_slots_to_blocks_reference(ids, 8, 2, 16)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="local expert"):
        align_slots_to_blocks(ids, 0, 0, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,k,n_local,offset,block_m,id_range", CASES + [
    (8192, 6, 64, 0, 128, 64), (8192, 8, 256, 0, 64, 256), (8192, 8, 32, 96, 64, 256), (64, 8, 256, 0, 16, 256)])
def test_alignment_gpu(t, k, n_local, offset, block_m, id_range):
    torch.cuda.empty_cache()
    torch.full((1 << 28,), -7, dtype=torch.int32, device="cuda")  # leave garbage in the free blocks
    check_align(align_slots_to_blocks, t, k, n_local, offset, block_m, id_range, seed=t, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_alignment_captures_in_a_cuda_graph():
    ids = make_ids(64, 8, 256, 3, "cuda")
    align_slots_to_blocks(ids, 256, 0, 16)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots, block_expert = align_slots_to_blocks(ids, 256, 0, 16)
    ids.copy_(make_ids(64, 8, 256, 4, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = align_slots_to_blocks_reference(ids.cpu(), 256, 0, 16)
    assert torch.equal(slots.cpu(), want[0]) and torch.equal(block_expert.cpu(), want[1])
