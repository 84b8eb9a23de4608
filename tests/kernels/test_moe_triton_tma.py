"""The TMA-descriptor MoE kernels (``kernels.moe_triton_tma``, the many-rows regime) against the
reference, the FP8 emulation and today's pointer-load kernels with the same tiles.

CPU (CI): when the TMA path applies; the kernels under TRITON_INTERPRET=1 on tiny shapes (fp16
there, see tests/kernels/test_moe_triton.py), both launch forms; their sm_90 compilation (TMA
loads, wgmma, no spills). GPU (``-m gpu``): DeepSeek shapes at prefill sizes, on memory poisoned
with NaN, and CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch

from kernels.moe import moe_experts_reference
from kernels.moe_triton import CONFIG_TABLE, MoEConfig, default_config
from tests.kernels.test_moe_triton import fp8_experts, fp8_moe_emulated, gpu_routing, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MANY_ROWS = CONFIG_TABLE[-1]  # (None, bf16 config, fp8 config): > 255 rows per expert, the TMA path's regime


# ----------------------------------------------------------------------------- CPU: dispatch

def test_tma_serves_only_the_many_rows_regime():
    # Measured faster at prefill sizes only (1.07-1.13x); decode and mid-size rows keep pointer loads.
    assert not any(row[1].tma or row[2].tma for row in CONFIG_TABLE[:-1])
    for fp8 in (False, True):
        assert not default_config(8, 256, fp8).tma  # R1 TP8 decode
        cfg = default_config(8192 * 6, 64, fp8)  # 768 rows per expert
        assert cfg.tma and not cfg.tma_a and cfg.block_m % 16 == 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tma_applies(monkeypatch):
    from kernels.moe_triton_tma import tma_applies

    x = torch.randn(4, 64, dtype=torch.float16)
    w13, w2 = torch.randn(2, 64, 64, dtype=torch.float16), torch.randn(2, 64, 32, dtype=torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tma_applies(x, w13, w2, 64)  # CPU tensors, no interpreter: nothing can run
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tma_applies(x, w13, w2, 64)
    assert not tma_applies(x, w13, w2, 8)  # the gather's 16-row programs must tile a block
    assert not tma_applies(x, w13.transpose(0, 1).contiguous().transpose(0, 1), w2, 64)  # experts not stacked
    assert not tma_applies(x, w13[:, :, :60], w2, 64)  # a slice: rows not back to back
    h60 = torch.randn(2, 72, 60, dtype=torch.float16), torch.randn(2, 60, 36, dtype=torch.float16)
    assert not tma_applies(x[:, :60], *h60, 64)  # H = 60: 120-byte rows of w13
    i36 = torch.randn(2, 72, 64, dtype=torch.float16), torch.randn(2, 64, 36, dtype=torch.float16)
    assert not tma_applies(x, *i36, 64)  # I = 36: 72-byte rows of w2


# ----------------------------------------------------------------------------- CPU: kernels under the interpreter

@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tma_kernels_under_interpreter():
    """fp16: T=37 (not a multiple of the block: padding rows), k=3, foreign experts (offset 2),
    an idle local expert, I=48 (the last gate box overlaps the up rows) and H=80 (ragged K for
    gate_up, the last down box reaches the next expert's rows). FP8: H=208 (a ragged scale
    group), UE8M0 too. One program per tile, 3 persistent programs, x's rows gathered in gate_up
    by pointer loads; the TMA path is checked to run and to give the pointer kernels' numbers."""
    from tests.kernels.test_mla_fused_kernels import run_under_interpreter

    run_under_interpreter(
        """
        import dataclasses, torch
        import kernels.moe_triton as moe_triton
        from kernels.moe import moe_experts_reference
        from kernels.moe_triton import MoEConfig, moe_experts_triton, moe_experts_fp8_triton
        from tests.kernels.test_moe_triton import fp8_experts, fp8_moe_emulated, rel_err
        calls = []
        run = moe_triton.expert_rows_tma
        moe_triton.expert_rows_tma = lambda *a: calls.append(a[10]) or run(*a)
        g = torch.Generator().manual_seed(0)
        t, k, h, inter = 37, 3, 80, 48
        ids = torch.randint(0, 9, (t, k), generator=g)
        ids[ids == 4] = 8  # local experts are global 2..5; 4 gets no slot, 0, 1, 6, 7, 8 are foreign
        x = torch.randn(t, h, generator=g).half()
        w13 = (torch.randn(4, 2 * inter, h, generator=g) * 0.1).half()
        w2 = (torch.randn(4, h, inter, generator=g) * 0.1).half()
        wts = torch.rand(t, k, generator=g)
        ref = moe_experts_reference(x.float(), w13.float(), w2.float(), wts, ids, 2)
        ptr_cfg = MoEConfig(16, 32, 32, 32, 2, 4, 1)
        ptr = moe_experts_triton(x, w13, w2, wts, ids, 2, ptr_cfg)
        for persistent, tma_a in [(False, True), (True, True), (True, False)]:
            cfg = dataclasses.replace(ptr_cfg, tma=True, persistent=persistent, tma_a=tma_a)
            out = moe_experts_triton(x, w13, w2, wts, ids, 2, cfg)
            assert calls[-1] == cfg and out.dtype == torch.float16 and out.shape == (t, h)
            assert rel_err(out, ref) < 3e-3, rel_err(out, ref)
            assert rel_err(out, ptr) < 1e-6, rel_err(out, ptr)
        w13_8, s13, w2_8, s2 = fp8_experts(3, 208, 128, seed=1)  # local experts 1..3
        ids = torch.tensor([[1, 2], [5, 0], [2, 4], [2, 1], [0, 1], [1, 1], [2, 2], [1, 2], [0, 2]])
        t = ids.shape[0]
        x = torch.randn(t, 208, generator=g).bfloat16() * 3
        wts = torch.rand(t, 2, generator=g)
        ptr_cfg = MoEConfig(16, 128, 64, 128, 2, 4, 1)
        for ue8m0, persistent, tma_a in [(False, False, True), (False, True, True), (True, False, False)]:
            emu = fp8_moe_emulated(x.float(), w13_8, s13, w2_8, s2, wts, ids, 1, ue8m0)
            ptr = moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, 1, ptr_cfg, ue8m0=ue8m0)
            cfg = dataclasses.replace(ptr_cfg, tma=True, persistent=persistent, tma_a=tma_a)
            out = moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, 1, cfg, ue8m0=ue8m0)
            assert calls[-1] == cfg and out.dtype == torch.bfloat16 and out.shape == (t, 208)
            assert rel_err(out, emu) < 4e-3, rel_err(out, emu)
            assert rel_err(out, ptr) < 1e-6, rel_err(out, ptr)
        print("interpreter ok")
        """
    )


# ----------------------------------------------------------------------------- CPU: sm_90 compilation

_PTXAS = None
if HAS_TRITON:
    from tests.kernels.test_mxfp8_gemm import _PTXAS


def tma_kernel_cases(cfg: MoEConfig, fp8: bool):
    """(kernel, argument types, constexprs, options) of gate_up and down for one config."""
    from kernels.moe_triton_tma import _down_tma_kernel, _gate_up_tma_kernel

    dt = "fp8e4nv" if fp8 else "bf16"
    bk = 128 if fp8 else cfg.block_k
    common = dict(SA="*fp32", SW="*fp32", SLOTS="*i32", BLOCK_EXPERT="*i32", N_USED="*i32", n_slots="i32", K="i32",
                  n_programs="i32", stride_sam="i32", stride_swe="i32", stride_swn="i32")
    up = dict(common, A_DESC=f"tensordesc<{dt}[{cfg.block_m}, {bk}]>", X=f"*{dt}", top_k="i32",
              W_DESC=f"tensordesc<{dt}[{cfg.block_n}, {bk}]>", Hd=f"*{dt}", SH="*fp32", inter="i32", stride_xm="i32",
              stride_hm="i32", stride_shm="i32")
    down = dict(common, A_DESC=f"tensordesc<{dt}[{cfg.block_m}, {bk}]>",
                W_DESC=f"tensordesc<{dt}[{cfg.block_n_down}, {bk}]>", Y="*bf16", TOPK_W="*fp32", N="i32",
                stride_ym="i32")
    up_consts = dict(UE8M0=False, BLOCK_N=cfg.block_n, GATHER_A=not cfg.tma_a)
    if not cfg.tma_a:
        up_consts["A_DESC"] = None
    tiles = dict(FP8=fp8, FLATTEN=cfg.persistent, BLOCK_M=cfg.block_m, BLOCK_K=bk, GROUP_M=cfg.group_m)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return [(_gate_up_tma_kernel, up, dict(tiles, **up_consts), opts),
            (_down_tma_kernel, down, dict(tiles, BLOCK_N=cfg.block_n_down), opts)]


@pytest.mark.slow
@pytest.mark.skipif(_PTXAS is None or not _PTXAS.exists(), reason="needs triton's bundled ptxas")
def test_tma_configs_compile_for_sm90_with_tma_wgmma_and_no_spills():
    """The many-rows row's tiles on the TMA path, one program per tile, persistent and with A
    gathered by pointer loads: TMA loads, wgmma, no local memory."""
    from tests.kernels.test_mxfp8_gemm import _compile_sm90, two_at_a_time

    _, bf16_cfg, fp8_cfg = MANY_ROWS
    cases, calls = [], []
    for base, fp8 in ((dataclasses.replace(bf16_cfg, tma=True), False), (dataclasses.replace(fp8_cfg, tma=True), True)):
        for cfg in (base, dataclasses.replace(base, persistent=True), dataclasses.replace(base, tma_a=False)):
            for fn, types, consts, opts in tma_kernel_cases(cfg, fp8):
                cases.append((fn, cfg))
                calls.append(functools.partial(_compile_sm90, fn, types, consts, divisible=("K", "N", "inter"), **opts))
    for (fn, cfg), (ptx, usage) in zip(cases, two_at_a_time(calls)):
        assert "cp.async.bulk.tensor.2d" in ptx and "wgmma.mma_async" in ptx, (fn, cfg)
        assert " STACK:0 " in usage and usage.endswith("LOCAL:0"), (fn, cfg, usage)


# ----------------------------------------------------------------------------- GPU: prefill shapes

GPU_CASES = [  # (E_local, H, I, k, expert_offset, E_global, T): all in the many-rows regime
    (64, 2048, 1408, 6, 0, 64, 4096),  # DeepSeek-V2-Lite, 384 rows per expert
    (32, 7168, 2048, 8, 64, 256, 2048),  # R1, EP8 rank 2 (most choices foreign; ~64 rows per expert)
]


def poison_allocator(nbytes: int) -> None:
    """Fill ``nbytes`` of the caching allocator's memory with NaN and free it, so the kernels'
    buffers likely start as NaN: a row or column left unwritten shows in the output."""
    torch.full((nbytes // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def _count_tma_calls(monkeypatch) -> list:
    import kernels.moe_triton as moe_triton

    calls = []
    run = moe_triton.expert_rows_tma
    monkeypatch.setattr(moe_triton, "expert_rows_tma", lambda *a: calls.append(a[10]) or run(*a))
    return calls


VARIANTS = {"tile": {}, "persistent": dict(persistent=True), "gather-a": dict(tma_a=False)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_tma_bf16_matches_reference_and_pointer_kernels(case, variant, monkeypatch):
    from kernels.moe_triton import moe_experts_triton

    e, h, inter, k, off, eg, t = case
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.02).bfloat16()
    wts, ids = gpu_routing(t, k, eg, t + 1)
    cfg = dataclasses.replace(default_config(t * k, e, fp8=False), tma=True, **VARIANTS[variant])
    assert cfg.tma
    today = moe_experts_triton(x, w13, w2, wts, ids, off, dataclasses.replace(cfg, tma=False))
    calls = _count_tma_calls(monkeypatch)
    poison_allocator(3 * t * k * h * 2)
    out = moe_experts_triton(x, w13, w2, wts, ids, off, cfg)
    assert calls == [cfg]
    ref = moe_experts_reference(x.float(), w13.float(), w2.float(), wts, ids, off)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref) < 1e-2  # bf16 intermediate + per-slot rows + output
    assert rel_err(out, today) < 1e-3, rel_err(out, today)  # same sums in the same K order: rounding only


_FP8_EXPERTS: dict = {}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_tma_fp8_matches_emulation_and_pointer_kernels(case, variant, monkeypatch):
    from kernels.moe_triton import moe_experts_fp8_triton

    e, h, inter, k, off, eg, t = case
    if case not in _FP8_EXPERTS:  # one set per case for the three variants
        _FP8_EXPERTS.clear()
        _FP8_EXPERTS[case] = fp8_experts(e, h, inter, seed=e, device="cuda")
    w13_8, s13, w2_8, s2 = _FP8_EXPERTS[case]
    x = torch.randn(t, h, device="cuda").bfloat16()
    wts, ids = gpu_routing(t, k, eg, t)
    cfg = dataclasses.replace(default_config(t * k, e, fp8=True), tma=True, **VARIANTS[variant])
    assert cfg.tma
    today = moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, off, dataclasses.replace(cfg, tma=False))
    calls = _count_tma_calls(monkeypatch)
    poison_allocator(3 * t * k * h * 2)
    out = moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, off, cfg)
    assert calls == [cfg]
    emu = fp8_moe_emulated(x.float(), w13_8, s13, w2_8, s2, wts, ids, off)
    assert not out.isnan().any()
    assert rel_err(out, emu) < 1.5e-2, rel_err(out, emu)  # see test_gpu_fp8_matches_emulation
    # Same MMAs on the same operands: at most a few intermediate values round to another e4m3 code.
    assert rel_err(out, today) < 5e-3, rel_err(out, today)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_tma_cuda_graph_replay(fp8, variant, monkeypatch):
    """Captured once at a prefill size (512 rows per local expert), replayed on new routing."""
    from kernels.moe_triton import moe_experts_fp8_triton, moe_experts_triton

    e, h, inter, k, t = 16, 1024, 256, 4, 2048
    cfg = dataclasses.replace(default_config(t * k, e, fp8), tma=True, **VARIANTS[variant])
    assert cfg.tma
    x = torch.randn(t, h, device="cuda").bfloat16()
    if fp8:
        w = fp8_experts(e, h, inter, device="cuda")
        fn = lambda: moe_experts_fp8_triton(x, *w, wts, ids, 4, cfg)  # noqa: E731
        oracle = lambda: fp8_moe_emulated(x.float(), *w, wts, ids, 4)  # noqa: E731
    else:
        w13 = (torch.randn(e, 2 * inter, h, device="cuda") * 0.02).bfloat16()
        w2 = (torch.randn(e, h, inter, device="cuda") * 0.02).bfloat16()
        fn = lambda: moe_experts_triton(x, w13, w2, wts, ids, 4, cfg)  # noqa: E731
        oracle = lambda: moe_experts_reference(x.float(), w13.float(), w2.float(), wts, ids, 4)  # noqa: E731
    wts, ids = gpu_routing(t, k, 2 * e, 0)
    calls = _count_tma_calls(monkeypatch)
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    assert calls == [cfg, cfg]
    for seed in (1, 2):
        new_w, new_ids = gpu_routing(t, k, 2 * e, seed)
        wts.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        assert rel_err(out, oracle()) < 1.5e-2
