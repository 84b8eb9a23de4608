"""Swap-AB W4A8 decode kernels for MXFP4 routed experts (kernels/mxfp4_moe_decode.py).

CPU: config checks and the decode dispatch; under TRITON_INTERPRET=1 the router + quantization
launch against ``align_slots_to_blocks`` and ``kernels.fp8``, and the kernels against the W4A8
reference (tiny shapes, folds ≤ 8 binades apart: the interpreter's fp16 → e4m3 truncation, see
test_mxfp4_moe.py); slow: the table tiles compiled offline for sm_90 (wgmma, no spills). GPU
(``-m gpu``): against the reference at decode sizes T = 1, 3, 16, 64, 256, and CUDA-graph
capture replaying fresh inputs.
"""

from __future__ import annotations

import functools
import textwrap

import pytest
import torch

from kernels.mxfp4_moe import moe_mxfp4_reference
from kernels.mxfp4_moe_decode import (
    DECODE_TABLE,
    MAX_ROUTE_SLOTS,
    SwapABConfig,
    decode_config,
    route_and_quantize,
    use_swap_ab,
)
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH
from tests.kernels.test_mxfp4_moe import BF16_DOT_PATCH, experts, routing
from tests.kernels.test_mxfp8_gemm import (_PTXAS, _compile_sm90, in_two_parts, rel_err, run_interpreted,
                                           two_at_a_time)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_decode_dispatch_and_config_checks():
    assert use_swap_ab(6, 384) and use_swap_ab(256 * 6, 384)
    assert not use_swap_ab(8192 * 6, 384)  # prefill keeps the token-row tiles
    assert not use_swap_ab(MAX_ROUTE_SLOTS + 6, 4096)  # beyond the one-program router
    assert decode_config(6, 384) == DECODE_TABLE[0][1] and decode_config(1536, 384) == DECODE_TABLE[-1][1]
    assert decode_config(1536, 384).fused and not decode_config(6, 384).fused
    for _, cfg in DECODE_TABLE:
        cfg.check(5120, 2304)  # V4.1-Flash
    for bad in (SwapABConfig(block_f=32), SwapABConfig(block_t=8), SwapABConfig(spans=4), SwapABConfig(split_k=0),
                SwapABConfig(block_f_down=64, num_warps=8)):
        with pytest.raises(ValueError, match="bad swap-AB config"):
            bad.check(5120, 2304)  # spans=4 does not divide I/128 = 18
    with pytest.raises(ValueError, match="at most 2048 token-slots"):
        route_and_quantize(torch.zeros(400, 6, dtype=torch.long), 8, 0, 16)


_INTERPRET_SCRIPT = INTERPRETER_PATCH + BF16_DOT_PATCH + textwrap.dedent(
    """
    import torch
    from kernels.moe_triton import align_slots_to_blocks
    from kernels.mxfp4_moe import moe_mxfp4_reference
    from kernels.fp8 import quantize_per_token_group
    from kernels.mxfp4_moe import pair_columns
    from kernels.mxfp4_moe_decode import SwapABConfig, route_and_quantize
    from kernels.mxfp4_experts import moe_mxfp4_kernels
    from tests.kernels.test_mxfp4_moe import experts, rel_err, routing
    # half of the router cases and of the kernel cases in each of two processes
    for t, k, e, off, bt, d in [(1, 6, 20, 0, 16, 256), (37, 3, 9, 2, 16, 1280), (5, 2, 4, 0, 32, 128),
                                (60, 6, 384, 0, 16, None)][PART::2]:  # 384 experts: a 512-bin histogram
        wts, ids = routing(t, k, e + off + 2, seed=t)  # some choices belong to other ranks
        x = None if d is None else (torch.randn(t, d) * torch.exp2(torch.randint(-6, 6, (t, 1)).float())).bfloat16()
        slots, blocks, q, s = route_and_quantize(ids, e, off, bt, x, ue8m0=t == 37)
        want = align_slots_to_blocks(ids, e, off, bt)
        assert torch.equal(slots, want[0]) and torch.equal(blocks, want[1]), (t, k, e, off, bt)
        if x is not None:
            rq, rs = quantize_per_token_group(x, 128, ue8m0=t == 37)
            assert torch.equal(q.view(torch.uint8), pair_columns(rq).view(torch.uint8)) and torch.equal(s, rs)
    e, d, inter = 5, 256, 256
    w = experts(e, d, inter, seed=4, spread=8)
    C = SwapABConfig
    cases = [  # (T, k, allowed experts, expert_offset, limit, config)
        (3, 2, [0, 1, 3], 0, 1.0, C(128, 64, 16)),                          # fused gate/up, 4 warps
        (4, 2, None, 0, 1.0, C(128, 128, 16, num_warps=8)),                 # 8 warps
        (5, 2, None, 1, 0.0, C(64, 128, 16, 2, split_k=2, split_k_down=3)),  # foreign experts, splits, 2 spans
        (20, 1, [2], 0, 1.0, C(64, 64, 16)),                                # one expert, two blocks
        (20, 3, None, 0, 1.0, C(128, 64, 32, 1, split_k_down=2)),           # 32-slot blocks
        (2, 2, None, 0, 1.0, None),                                         # the default (decode table)
    ]
    for t, k, only, off, limit, cfg in cases[PART::2]:
        wts, ids = routing(t, k, e + off, seed=t, only=only)
        xb = torch.randn(t, d).bfloat16()
        local = [wi[off:] if off else wi for wi in w]
        out = moe_mxfp4_kernels(xb, *local, wts, ids, limit, off, mode="w4a8", config=cfg)
        ref = moe_mxfp4_reference(xb, *local, wts, ids, limit, "w4a8", off)
        unquantized = moe_mxfp4_reference(xb.float(), *local, wts, ids, limit, "w4a16", off)
        err = rel_err(out, ref)
        assert out.dtype == torch.float32 and not out.isnan().any()
        assert err < 1e-2 and err < 0.25 * rel_err(ref, unquantized), (t, k, only, cfg, err)
    print("interpreter ok")
    """
)


@pytest.mark.slow
def test_router_and_swap_ab_kernels_under_interpreter():
    run_interpreted(*in_two_parts(_INTERPRET_SCRIPT))


@pytest.mark.slow
@pytest.mark.skipif(_PTXAS is None or not _PTXAS.exists(), reason="needs triton's bundled ptxas")
def test_swap_ab_kernels_compile_for_sm90_to_wgmma():
    """Every table tile (and the sweep's 32-slot / 2-span forms): FP8 wgmma (weights as the
    M side), PRMT conversion, cp.async weight streaming, no spills; the router too."""
    from kernels.mxfp4_moe_decode import _down_swap_kernel, _gate_up_swap_kernel, _route_quant_kernel

    up_ints = ("n_slots", "K", "inter", "top_k", "split_k", "stride_am", "stride_sam", "stride_we", "stride_wn",
               "stride_swe", "stride_swn", "stride_hm", "stride_shm", "stride_ps", "stride_pm")
    down_ints = ("n_slots", "K", "split_k", "stride_am", "stride_sam", "stride_we", "stride_wn", "stride_swe",
                 "stride_swn", "stride_ys", "stride_ym")
    common = dict(SA="*fp32", W="*i8", SW="*u8", SLOTS="*i32", BLOCK_EXPERT="*i32", LUT="*i32", A="*fp8e4nv")
    cfgs = {cfg for _, cfg in DECODE_TABLE} | {SwapABConfig(64, 64, 32, 2, split_k=2, split_k_down=2),
                                                SwapABConfig(128, 128, 16, 2, num_warps=8, num_stages=3)}
    up_types = dict(common, H="*u8", SH="*fp32", P="*fp32", TOPK_W="*fp32", limit="fp32",
                    **dict.fromkeys(up_ints, "i32"))
    cases, calls = [], []
    for cfg in sorted(cfgs, key=str):
        consts = dict(CLAMP=True, UE8M0=False, FUSED=cfg.fused, BLOCK_T=cfg.block_t, BLOCK_F=cfg.block_f,
                      SPANS=cfg.spans, CONVERT=1)
        cases.append((cfg, "gate_up"))
        calls.append(functools.partial(_compile_sm90, _gate_up_swap_kernel, up_types, consts, divisible=("K", "inter"),
                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        split = cfg.split_k_down > 1
        types = dict(common, Y="*fp32" if split else "*bf16", **dict.fromkeys(down_ints, "i32"))
        consts = dict(SPLIT=split, BLOCK_T=cfg.block_t, BLOCK_F=cfg.block_f_down, SPANS=cfg.spans, CONVERT=1)
        cases.append((cfg, "down"))
        calls.append(functools.partial(_compile_sm90, _down_swap_kernel, types, consts, divisible=("K",),
                                       num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ints = ("n_slots", "n_local", "expert_offset", "n_rows", "n_blocks", "K", "parts", "stride_xm", "stride_ym",
            "stride_sm")
    calls.append(functools.partial(
        _compile_sm90, _route_quant_kernel, dict(IDS="*i64", SLOTS="*i32", BLOCK_EXPERT="*i32", SCRATCH="*i32",
                                                 X="*bf16", Y="*u8", SY="*fp32", **dict.fromkeys(ints, "i32")),
        dict(NS=MAX_ROUTE_SLOTS, NB=512, BLOCK_T=16, FILL=1024, UE8M0=False, QSPANS=8), num_warps=4))
    *compiled, (_, route_usage) = two_at_a_time(calls)
    for (cfg, kernel), (ptx, usage) in zip(cases, compiled):
        assert " STACK:0 " in usage and usage.endswith("LOCAL:0"), (cfg, kernel, usage)
        if kernel == "gate_up":
            assert f"wgmma.mma_async.sync.aligned.m64n{cfg.block_t}k32.f32.e4m3.e4m3" in ptx, cfg
            assert "prmt.b32" in ptx and "cp.async" in ptx and "mma.sync" not in ptx, cfg
        else:
            assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx, cfg
    assert route_usage.endswith("LOCAL:0"), route_usage
    # the weight bytes get num_stages - 1 shared-memory buffers (not 1: see _fold_rows' scale load)
    cfg = DECODE_TABLE[-1][1]
    ttgir = _ttgir(_gate_up_swap_kernel, up_types,
                   dict(CLAMP=True, UE8M0=False, FUSED=True, BLOCK_T=16, BLOCK_F=cfg.block_f, SPANS=1, CONVERT=1),
                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert f"memdesc<{cfg.num_stages - 1}x{cfg.block_f}x4x16xi8" in ttgir


def _ttgir(fn, types, consts, **options):
    """TTGIR of an sm_90 compile (pointers and strides 16-divisible, as at run time)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in consts else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (types[n].startswith("*") or n.startswith("stride") or n in ("K", "inter"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options).asm["ttgir"]


# ----------------------------------------------------------------------------- GPU


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 3, 16, 64, 256])
def test_gpu_swap_ab_matches_reference(t):
    from kernels.moe_triton import align_slots_to_blocks
    from kernels.mxfp4_experts import moe_mxfp4_kernels
    from kernels.mxfp4_moe_triton import default_config, quantize_paired_triton

    if not _sm90():
        pytest.skip("W4A8 swap-AB needs SM90 (FP8 wgmma)")
    e, d, inter = 64, 1024, 768
    w = experts(e, d, inter, seed=11, device="cuda", spread=12)  # folds past shift -8: the PRMT tables round
    k = 6
    wts, ids = routing(t, k, e + 8, seed=t, device="cuda", only=list(range(2, e + 8)))  # experts 0, 1 idle
    x = torch.randn(t, d, device="cuda").bfloat16()
    local = [wi[2:] for wi in w]  # expert_offset 2: ranks own 62 experts, 8 of the ids are foreign
    ref = moe_mxfp4_reference(x, *local, wts, ids, 10.0, "w4a8", 2)
    configs = [None] + [cfg for _, cfg in DECODE_TABLE] + [SwapABConfig(64, 128, 32, 2, split_k=3, split_k_down=2)]
    for cfg in configs:
        out = moe_mxfp4_kernels(x, *local, wts, ids, 10.0, 2, mode="w4a8", config=cfg)
        assert not out.isnan().any()
        assert rel_err(out, ref) < 5e-3, (t, cfg, rel_err(out, ref))
    rows = moe_mxfp4_kernels(x, *local, wts, ids, 10.0, 2, mode="w4a8", config=default_config(t * k, e - 2))
    assert rel_err(rows, ref) < 5e-3  # the token-row kernels agree
    slots, blocks, q, s = route_and_quantize(ids, e - 2, 2, 16, x)
    want = align_slots_to_blocks(ids, e - 2, 2, 16)
    assert torch.equal(slots, want[0]) and torch.equal(blocks, want[1])
    rq, rs = quantize_paired_triton(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_router_at_v41_expert_counts():
    """384 local experts (a 512-bin histogram), up to the 2048-slot sort, expert parallelism."""
    from kernels.moe_triton import align_slots_to_blocks

    for t, k, n_local, offset, bt in [(1, 6, 384, 0, 16), (256, 6, 384, 0, 16), (341, 6, 384, 0, 32),
                                      (64, 6, 48, 96, 16), (2048, 1, 384, 0, 16)]:
        _, ids = routing(t, k, 384, seed=t, device="cuda")
        slots, blocks, _, _ = route_and_quantize(ids, n_local, offset, bt)
        want = align_slots_to_blocks(ids, n_local, offset, bt)
        assert torch.equal(slots, want[0]) and torch.equal(blocks, want[1]), (t, k, n_local, offset, bt)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 16])
def test_gpu_swap_ab_graph_capture_replays_fresh_inputs(t):
    from kernels.mxfp4_experts import moe_mxfp4_kernels

    if not _sm90():
        pytest.skip("W4A8 swap-AB needs SM90 (FP8 wgmma)")
    e, d, inter, k = 32, 512, 256, 6
    w = experts(e, d, inter, seed=3, device="cuda", spread=4)
    wts, ids = routing(t, k, e, seed=1, device="cuda")
    x = torch.randn(t, d, device="cuda").bfloat16()
    moe_mxfp4_kernels(x, *w, wts, ids, 1.0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_mxfp4_kernels(x, *w, wts, ids, 1.0)
    for seed in (5, 6):  # new tokens and a new routing in the captured buffers
        new_wts, new_ids = routing(t, k, e, seed=seed, device="cuda")
        wts.copy_(new_wts)
        ids.copy_(new_ids)
        x.copy_(torch.randn(t, d, device="cuda"))
        graph.replay()
        assert torch.equal(out, moe_mxfp4_kernels(x, *w, wts, ids, 1.0))
        assert rel_err(out, moe_mxfp4_reference(x, *w, wts, ids, 1.0, "w4a8")) < 5e-3
