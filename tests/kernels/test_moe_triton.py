"""Fused Triton MoE (``kernels.moe_triton``) against ``moe_experts_reference``.

CPU (CI): the expert-sorted block layout (torch ops), the config table and the FP8 dispatch;
the Triton kernels themselves under TRITON_INTERPRET=1 on tiny shapes, in a subprocess with
the repo's interpreter patches (``run_under_interpreter``: numpy int(), RNE float narrowing).
The interpreter's bf16 ``tl.dot`` multiplies raw bits, so the 16-bit path runs in fp16 there
and in bf16 on the GPU. GPU (``-m gpu``): real DeepSeek shapes and CUDA-graph replay.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.fp8 import dequantize_per_token_group, dequantize_weight_blocks, quantize_per_token_group, \
    quantize_weight_blocks
from kernels.moe import fp8_experts_backend, moe_experts_fp8, moe_experts_reference, silu_and_mul
from kernels.moe_triton import CONFIG_TABLE, MoEConfig, align_slots_to_blocks, default_config, padded_rows

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fp8_experts(e, h, inter, seed=0, device="cpu"):
    """Random experts quantized to 128x128 blocks, made on ``device``: (w13_8, s13, w2_8, s2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q13 = [quantize_weight_blocks(torch.randn(2 * inter, h, generator=g, device=device) * 0.05) for _ in range(e)]
    q2 = [quantize_weight_blocks(torch.randn(h, inter, generator=g, device=device) * 0.05) for _ in range(e)]
    return [torch.stack([q[i] for q in qs]) for qs in (q13, q2) for i in (0, 1)]


def fp8_moe_emulated(x, w13_8, s13, w2_8, s2, topk_weights, topk_ids, expert_offset=0, ue8m0=False):
    """What the FP8 kernels compute, in fp32 torch: x and the intermediate quantized per token
    per 128 columns by the reference quantizer, dequantized weights, fp32 sums."""
    xq = dequantize_per_token_group(*quantize_per_token_group(x, 128, ue8m0))
    w13 = dequantize_weight_blocks(w13_8, s13)
    w2 = dequantize_weight_blocks(w2_8, s2)
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(topk_ids - expert_offset == e, as_tuple=True)
        if tok.numel():
            hq = dequantize_per_token_group(*quantize_per_token_group(silu_and_mul(xq[tok] @ w13[e].t()), 128, ue8m0))
            out.index_add_(0, tok, (hq @ w2[e].t()) * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- CPU: layout, config, dispatch

@pytest.mark.parametrize("t,k,n_local,offset,block_m", [(1, 8, 256, 0, 16), (5, 2, 4, 2, 16), (37, 6, 8, 3, 4),
                                                         (9, 3, 4, 100, 8), (64, 4, 3, 0, 64)])
def test_align_slots_to_blocks(t, k, n_local, offset, block_m):
    g = torch.Generator().manual_seed(t * k)
    ids = torch.randint(0, n_local + 6, (t, k), generator=g)
    ids[:, 0] = offset + n_local - 1  # keep one local expert busy ...
    ids[ids == offset] = offset + n_local  # ... and local expert 0 idle (foreign id instead)
    slots, block_expert = align_slots_to_blocks(ids, n_local, offset, block_m)
    n_slots = t * k
    assert slots.dtype == block_expert.dtype == torch.int32
    assert slots.shape == (padded_rows(n_slots, n_local, block_m),) and slots.numel() % block_m == 0
    assert block_expert.shape == (slots.numel() // block_m,)
    local = ids.flatten() - offset
    owned = ((local >= 0) & (local < n_local)).nonzero().flatten()
    real = slots[slots < n_slots].long()
    assert sorted(real.tolist()) == owned.tolist()  # every owned slot exactly once, no foreign one
    assert ((slots == n_slots) | (slots < n_slots)).all()
    rows_expert = block_expert.long().repeat_interleave(block_m)
    assert (local[real] == rows_expert[slots < n_slots]).all()  # each row sits in its expert's block
    used = block_expert >= 0
    n_used = int(used.sum())
    assert used[:n_used].all() and not used[n_used:].any()  # used blocks first, -1 after
    assert 0 not in block_expert.tolist()  # the idle expert has no block
    for e in block_expert[used].unique().tolist():  # each expert's blocks: contiguous, partly filled only last
        blocks = (block_expert == e).nonzero().flatten()
        assert (blocks.diff() == 1).all()
        filled = (slots.view(-1, block_m)[blocks] < n_slots).sum(1)
        assert (filled[:-1] == block_m).all() and filled[-1] >= 1


def test_align_all_foreign_and_bounds():
    ids = torch.full((3, 2), 50)
    slots, block_expert = align_slots_to_blocks(ids, 4, 0, 16)
    assert (slots == 6).all() and (block_expert == -1).all()
    assert padded_rows(1, 256, 16) == 16  # one slot → one block whatever E is
    assert padded_rows(8, 256, 16) == 8 * 16
    assert padded_rows(2048 * 8, 32, 64) == 18432  # T·k + E·(BM-1) = 18400, rounded up to a block
    with pytest.raises(ValueError, match="local expert"):
        align_slots_to_blocks(ids, 0, 0, 16)


def test_default_config_regimes():
    assert default_config(8, 256, fp8=True).block_m == 16  # R1 TP8 decode
    assert default_config(2048 * 6, 64, fp8=False).block_m == 64  # V2-Lite, 2048 tokens: 192 rows/expert
    assert default_config(8192 * 6, 64, fp8=False).block_m == 128  # 8192 tokens: 768 rows/expert
    assert default_config(8192 * 6, 64, fp8=True).block_m == 64  # FP8: 128-row tiles measured slower
    for limit, bf16_cfg, fp8_cfg in CONFIG_TABLE:
        assert fp8_cfg.block_n == 128 and fp8_cfg.block_k == 128  # one quant group / scale block
        assert bf16_cfg.block_m in (16, 64, 128)


def test_fp8_backend_choice():
    assert fp8_experts_backend(False, (128, 128), 256) == "dequant"
    assert fp8_experts_backend(True, (128, 128), 256) == ("triton" if HAS_TRITON else "dequant")
    assert fp8_experts_backend(True, (64, 64), 256) == "dequant"
    assert fp8_experts_backend(True, (128, 128), 192) == "dequant"
    assert fp8_experts_backend(True, (128, 128), 192, "dequant") == "dequant"
    with pytest.raises(ValueError, match="unknown FP8 MoE backend"):
        fp8_experts_backend(True, (128, 128), 256, "cutlass")


def test_fp8_entry_point_on_cpu_is_dequantized_reference():
    w13_8, s13, w2_8, s2 = fp8_experts(3, 200, 128)
    x = torch.randn(6, 200)
    ids = torch.tensor([[1, 2], [5, 0], [2, 4], [2, 1], [0, 3], [3, 3]])
    wts = torch.rand(6, 2)
    out = moe_experts_fp8(x, w13_8, s13, w2_8, s2, wts, ids, expert_offset=1)
    ref = moe_experts_reference(x, dequantize_weight_blocks(w13_8, s13), dequantize_weight_blocks(w2_8, s2),
                                wts, ids, 1)
    assert torch.equal(out, ref)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_input_validation():
    from kernels.moe_triton import moe_experts_fp8_triton, moe_experts_triton

    x = torch.randn(2, 64, dtype=torch.float16)
    w13, w2 = torch.randn(2, 64, 64, dtype=torch.float16), torch.randn(2, 64, 32, dtype=torch.float16)
    ids, wts = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with pytest.raises(TypeError, match="bf16/fp16"):
        moe_experts_triton(x.float(), w13.float(), w2.float(), wts, ids)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        moe_experts_triton(x, w13, w2[:, :32], wts, ids)
    with pytest.raises(ValueError, match="must both be"):
        moe_experts_triton(x, w13, w2, wts[:1], ids)
    w13_8, s13, w2_8, s2 = fp8_experts(2, 256, 128)
    xb = torch.randn(2, 256)
    with pytest.raises(ValueError, match="scale_inv shapes"):
        moe_experts_fp8_triton(xb, w13_8, s13[:, :1], w2_8, s2, wts, ids)
    with pytest.raises(ValueError, match="block_n must be 128"):
        moe_experts_fp8_triton(xb, w13_8, s13, w2_8, s2, wts, ids, config=MoEConfig(block_n=64))
    with pytest.raises(TypeError, match="e4m3"):
        moe_experts_fp8_triton(xb, w13_8.float(), s13, w2_8, s2, wts, ids)


# ----------------------------------------------------------------------------- CPU: kernels under the interpreter

@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_kernels_under_interpreter():
    """fp16 and FP8 kernels on T=5/T=1, k=2, foreign experts (offset ≠ 0), an idle expert, a
    ragged hidden size (200) for FP8, both table block_m values and UE8M0 scales."""
    from tests.kernels.test_mla_fused_kernels import run_under_interpreter

    run_under_interpreter(
        """
        import torch
        from kernels.moe import moe_experts_reference
        from kernels.fp8 import dequantize_weight_blocks
        from kernels.moe_triton import MoEConfig, moe_experts_triton, moe_experts_fp8_triton
        from tests.kernels.test_moe_triton import fp8_experts, fp8_moe_emulated, rel_err
        g = torch.Generator().manual_seed(0)
        # local experts 2..5; 0, 1, 7, 9 are another rank's; local expert 4 (global 4) gets no token
        ids5 = torch.tensor([[2, 3], [5, 9], [3, 0], [2, 5], [1, 3]])
        ids1 = torch.tensor([[7, 3]])
        for ids, cfg in [(ids5, MoEConfig(16, 32, 64, 32, 2, 4, 1)), (ids1, MoEConfig(64, 32, 32, 32, 8, 4, 1)),
                         (ids5, None)]:
            t = ids.shape[0]
            x = torch.randn(t, 64, generator=g).half()
            w13 = (torch.randn(4, 64, 64, generator=g) * 0.1).half()
            w2 = (torch.randn(4, 64, 32, generator=g) * 0.1).half()
            wts = torch.rand(t, 2, generator=g)
            out = moe_experts_triton(x, w13, w2, wts, ids, 2, cfg)
            ref = moe_experts_reference(x.float(), w13.float(), w2.float(), wts, ids, 2)
            assert out.dtype == torch.float16 and out.shape == (t, 64)
            # fp32 accumulation; fp16 intermediate, per-slot rows and output (2^-11 each)
            assert rel_err(out, ref) < 3e-3, rel_err(out, ref)
        w13_8, s13, w2_8, s2 = fp8_experts(3, 200, 128, seed=1)  # local experts 1..3; 3 is idle below
        ids5 = torch.tensor([[1, 2], [5, 0], [2, 4], [2, 1], [0, 1]])
        for ids, cfg, ue8m0 in [(ids5, None, False), (ids5, MoEConfig(64, 128, 64, 128, 8, 4, 1), True),
                                (torch.tensor([[2, 6]]), None, False)]:
            t = ids.shape[0]
            x = torch.randn(t, 200, generator=g).bfloat16() * 3
            wts = torch.rand(t, 2, generator=g)
            out = moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, 1, cfg, ue8m0=ue8m0)
            assert out.dtype == torch.bfloat16 and out.shape == (t, 200)
            # Same quantized operands as the kernels: only bf16 rounding of the per-slot rows
            # and of the output (2^-9 relative each) remains.
            emu = fp8_moe_emulated(x.float(), w13_8, s13, w2_8, s2, wts, ids, 1, ue8m0)
            assert rel_err(out, emu) < 4e-3, rel_err(out, emu)
            # Against unquantized activations: e4m3 keeps 3 mantissa bits (rounding error
            # ≤ 2^-4, ~2.5-3 % RMS per quantized operand); x and the intermediate are both
            # quantized, so ~4 % is expected; tiny dot products average little, hence 8 %.
            ref = moe_experts_reference(x.float(), dequantize_weight_blocks(w13_8, s13),
                                        dequantize_weight_blocks(w2_8, s2), wts, ids, 1)
            assert rel_err(out, ref) < 8e-2, rel_err(out, ref)
        print("interpreter ok")
        """
    )


# ----------------------------------------------------------------------------- GPU: real shapes

GPU_SHAPES = [  # (E_local, H, I, k, expert_offset, E_global)
    (64, 2048, 1408, 6, 0, 64),  # DeepSeek-V2-Lite
    (256, 7168, 256, 8, 0, 256),  # R1, TP8 (intermediate split 8 ways)
    (32, 7168, 2048, 8, 64, 256),  # R1, EP8 rank 2 (most choices are foreign)
]


def gpu_routing(t, k, e_global, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e_global, device="cuda", generator=g).topk(k, dim=-1).indices
    return torch.rand(t, k, device="cuda", generator=g), ids


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("t", [1, 37, 512])
def test_gpu_bf16_matches_reference(shape, t):
    from kernels.moe_triton import moe_experts_triton

    e, h, inter, k, off, eg = shape
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.02).bfloat16()
    wts, ids = gpu_routing(t, k, eg, t + 1)
    out = moe_experts_triton(x, w13, w2, wts, ids, off)
    ref = moe_experts_reference(x.float(), w13.float(), w2.float(), wts, ids, off)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref) < 1e-2  # bf16 intermediate + per-slot rows + output


_GPU_EXPERTS: dict = {}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 37, 512])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_fp8_matches_emulation(shape, t):
    from kernels.moe_triton import moe_experts_fp8_triton

    e, h, inter, k, off, eg = shape
    if shape not in _GPU_EXPERTS:  # one set per shape for the whole module (R1's take seconds)
        _GPU_EXPERTS.clear()
        _GPU_EXPERTS[shape] = fp8_experts(e, h, inter, seed=e, device="cuda")
    w13_8, s13, w2_8, s2 = _GPU_EXPERTS[shape]
    x = torch.randn(t, h, device="cuda").bfloat16()
    wts, ids = gpu_routing(t, k, eg, t)
    for cfg in [None] + [row[2] for row in CONFIG_TABLE]:
        out = moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, off, cfg)
        emu = fp8_moe_emulated(x.float(), w13_8, s13, w2_8, s2, wts, ids, off)
        assert not out.isnan().any()
        # Hopper's FP8 MMA accumulates each 128-wide K step with reduced precision (see
        # KERNEL_NOTES.md), so a few intermediate values round to a neighbouring e4m3 code
        # (one code = 12.5 %); bf16 rows and output add ~2e-3. A wrong scale or routing
        # weight gives errors of order 1.
        assert rel_err(out, emu) < 1.5e-2, (cfg, rel_err(out, emu))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_cuda_graph_replay(fp8):
    """Captured once, replayed on new routing: no host sync, no data-dependent shape."""
    from kernels.moe_triton import moe_experts_fp8_triton, moe_experts_triton

    e, h, inter, k, t = 16, 1024, 256, 4, 8
    x = torch.randn(t, h, device="cuda").bfloat16()
    if fp8:
        w = fp8_experts(e, h, inter, device="cuda")
        fn = lambda: moe_experts_fp8_triton(x, *w, wts, ids, 4)  # noqa: E731
        oracle = lambda: fp8_moe_emulated(x.float(), *w, wts, ids, 4)  # noqa: E731
    else:
        w13 = (torch.randn(e, 2 * inter, h, device="cuda") * 0.02).bfloat16()
        w2 = (torch.randn(e, h, inter, device="cuda") * 0.02).bfloat16()
        fn = lambda: moe_experts_triton(x, w13, w2, wts, ids, 4)  # noqa: E731
        oracle = lambda: moe_experts_reference(x.float(), w13.float(), w2.float(), wts, ids, 4)  # noqa: E731
    wts, ids = gpu_routing(t, k, 2 * e, 0)
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for seed in (1, 2):
        new_w, new_ids = gpu_routing(t, k, 2 * e, seed)
        wts.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        assert rel_err(out, oracle()) < 1e-2
