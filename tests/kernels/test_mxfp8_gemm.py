"""MXFP8 GEMM (kernels/mxfp8_gemm.py) and activation quantization (kernels/mxfp8_quant_triton.py).

CPU (CI): the torch references against hand-built dequantized matmuls and validation; the
Triton kernels under TRITON_INTERPRET=1 in two subprocesses at once (the interpreter must be
chosen before Triton is imported): the quantization byte for byte against
``kernels.microscaling.quantize_mxfp8`` (every e4m3 rounding boundary included), the GEMM
against the reference on odd shapes, and the wo_a epilogue's e4m3 z + scales byte for byte
against quantizing its bf16 output separately at 1, 129 and 1153 tokens (small N and K).
GPU (``-m gpu``): the same at V4.1-Flash shapes, with CUDA-graph capture and replay.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kernels.microscaling import dequantize_mxfp8, quantize_mxfp8
from kernels.mxfp8_gemm import check_operands, mxfp8_gemm_reference
from kernels.weight_formats import e8m0_to_float, quantize_fp8_blocks
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def activations(m, k, seed=0, device="cpu", dtype=torch.bfloat16):
    """Random non-zero activations whose 32-blocks span many binades (distinct scale bytes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 8, (m, k // 32, 1), generator=g).float()
                                                    ).repeat_interleave(32, 1).reshape(m, k)
    return (x + torch.sign(x) * 1e-6).to(dtype).to(device)


def weight(n, k, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w8, ws = quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.03, (32, 32))  # V4.1's 32×32 UE8M0
    return w8.to(device), ws.to(device)


# ----------------------------------------------------------------------------- references (CPU)


def test_activation_scales_and_zero_blocks():
    x = activations(3, 96)
    x[1, 32:64] = 0
    q, s = quantize_mxfp8(x)
    assert s.dtype == torch.uint8 and s.shape == (3, 3) and s[1, 1] == 105  # amax floor 1e-4 → 2^-22
    assert (q[1, 32:64].float() == 0).all()
    # the exponent rule: 2^(byte-127) is the smallest power of two ≥ amax/448
    amax = x.float().reshape(3, 3, 32).abs().amax(-1)
    scale = e8m0_to_float(s)
    live = amax > 0
    assert (scale[live] * 448 >= amax[live]).all() and (scale[live] * 224 < amax[live]).all()
    assert rel_err(dequantize_mxfp8(q, s), x.float()) < 0.04


@pytest.mark.parametrize("groups", [1, 3])
def test_reference_is_dequantized_matmul(groups):
    m, n, k = 7, 96, 64
    x8, xs = quantize_mxfp8(activations(m, k * groups))
    w8, ws = weight(n, k)
    y = mxfp8_gemm_reference(x8, xs, w8, ws, groups=groups, out_dtype=torch.float32)
    xd = x8.float() * e8m0_to_float(xs).repeat_interleave(32, 1)
    wd = w8.float() * e8m0_to_float(ws).repeat_interleave(32, 0).repeat_interleave(32, 1)
    r = n // groups
    manual = torch.cat([xd[:, g * k:(g + 1) * k] @ wd[g * r:(g + 1) * r].t() for g in range(groups)], 1)
    assert y.shape == (m, n) and rel_err(y, manual) < 1e-6


def test_split_k_only_where_tiles_leave_sms_idle():
    from kernels.mxfp8_gemm import default_config, split_k_for

    assert split_k_for(200, 40, 132) == 1
    assert split_k_for(10, 40, 132) == 20 and split_k_for(40, 64, 132) == 4
    assert split_k_for(10, 3, 132) == 1 and split_k_for(10, 40, 132, max_split=8) == 8
    assert default_config(1, 1280, 5120)["SPLIT_K"] == 20  # wq_a decode: 10 tiles → 200 programs
    assert default_config(1, 1280, 5120, quantize_out=True)["SPLIT_K"] == 20  # the reduce quantizes
    assert default_config(8192, 5120, 8192)["SPLIT_K"] == 1
    assert default_config(128, 1280, 5120)["SPLIT_K"] == 10  # partials capped at the weight's bytes


def test_cuda_config_and_operand_checks():
    from kernels.mxfp8_gemm_cuda import default_cuda_config, unsupported_reason

    # decode: 64-row tiles, K split to one wave; prefill: 128-row tiles, no split
    assert default_cuda_config(1, 1280, 5120) == {"consumers": 1, "SPLIT_K": 20}
    assert default_cuda_config(64, 5120, 8192) == {"consumers": 1, "SPLIT_K": 4}
    assert default_cuda_config(65, 8192, 4096) == {"consumers": 2, "SPLIT_K": 4}
    assert default_cuda_config(8192, 5120, 8192) == {"consumers": 2, "SPLIT_K": 1}
    assert default_cuda_config(3, 64, 32)["SPLIT_K"] == 1  # one K stage cannot split
    x8, xs = quantize_mxfp8(activations(4, 256))
    w8, ws = weight(256, 128)
    assert unsupported_reason(x8, xs, w8, ws, 4, 256, 128, 2) is None
    assert "multiple of 128" in unsupported_reason(x8, xs, w8[:192], ws[:6], 4, 192, 128, 2)
    assert "odd" in unsupported_reason(x8, xs, w8, ws, 4, 255, 128, 2)
    x8b, xsb = quantize_mxfp8(activations(4, 192))
    w8b, wsb = weight(256, 96)
    assert "K (96)" in unsupported_reason(x8b, xsb, w8b, wsb, 4, 256, 96, 2)
    assert unsupported_reason(x8b[:, :96], xsb[:, :3], w8b, wsb, 4, 256, 96, 1) is None
    assert "16-byte" in unsupported_reason(x8[:, 1:], xs, w8, ws, 4, 256, 128, 2)


def test_backend_choice_is_validated():
    from kernels.mxfp8_gemm import mxfp8_gemm
    from kernels.mxfp8_gemm_cuda import CudaKernelUnavailable

    x8, xs = quantize_mxfp8(activations(4, 64))
    w8, ws = weight(64, 64)
    with pytest.raises(ValueError, match="unknown MXFP8 GEMM backend"):
        mxfp8_gemm(x8, xs, w8, ws, backend="cutlass")
    with pytest.raises(CudaKernelUnavailable, match="CUDA tensors"):
        mxfp8_gemm(x8, xs, w8, ws, backend="cuda")


def test_operand_validation():
    x8, xs = quantize_mxfp8(activations(4, 128))
    w8, ws = weight(64, 64)
    assert check_operands(x8, xs, w8, ws, groups=2) == (4, 64, 64)
    with pytest.raises(ValueError, match="input features"):
        check_operands(x8, xs, w8, ws)
    with pytest.raises(ValueError, match="activation scales xs"):
        check_operands(x8[:, :64], xs, w8, ws)
    with pytest.raises(ValueError, match="weight scales ws"):
        check_operands(x8, xs, w8, ws[:1], groups=2)
    with pytest.raises(TypeError, match="x8 must be a 2-D e4m3"):
        check_operands(x8.float(), xs, w8, ws, groups=2)
    with pytest.raises(ValueError, match="groups of a multiple of 32"):
        w8b, wsb = weight(96, 64)
        check_operands(x8, xs, w8b, wsb, groups=2)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(2, 40))


# ----------------------------------------------------------------------------- Triton, interpreted (CPU)

# Two scripts, run at once (one core each): the quantization and the wo_a epilogue, and the GEMM.
_INTERPRET_PRELUDE = INTERPRETER_PATCH + textwrap.dedent(
    """
    import torch
    from kernels.microscaling import quantize_mxfp8
    from kernels.mxfp8_gemm import default_config, mxfp8_gemm, mxfp8_gemm_reference
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton
    from tests.kernels.test_mxfp8_gemm import activations, weight, rel_err

    def same(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    """
)
_INTERPRET_SCRIPTS = [_INTERPRET_PRELUDE + textwrap.dedent(part) for part in (
    """
    # every e4m3 value, the midpoints between neighbours and one fp32 ulp either side of
    # them, in blocks led by 448 (scale 1), and their negatives
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    edge = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])])
    edge = torch.cat([edge, -edge, torch.zeros(-2 * len(edge) % 31)]).reshape(-1, 31)
    edge = torch.cat([torch.full((len(edge), 1), 448.0), edge], 1)
    for x in [edge, activations(7, 96, dtype=torch.float32), activations(33, 1056), activations(5, 64).half(),
              torch.zeros(2, 64, dtype=torch.bfloat16)]:
        q, s = quantize_mxfp8_triton(x)
        rq, rs = quantize_mxfp8(x)
        assert same(q, rq) and torch.equal(s, rs), x.shape

    # wo_a's quantizing epilogue: z's bytes equal quantizing the bf16 z separately
    groups, r, kg = 2, 64, 64
    w8, ws = weight(groups * r, kg, seed=3)
    # 1153 = 9 · 128 + 1 rows: ten M tiles, so a full GROUP_M group of tiles, then a partial
    # one ending in a one-row tile (8193, the step budget + 1, on the GPU)
    for t in (1, 129, 1153):
        x8, xs = quantize_mxfp8_triton(activations(t, groups * kg, seed=t))
        z8, zs = mxfp8_gemm(x8, xs, w8, ws, groups=groups, quantize_out=True)
        z = mxfp8_gemm(x8, xs, w8, ws, groups=groups)
        u8, us = quantize_mxfp8_triton(z)
        assert same(z8, u8) and torch.equal(zs, us), t
        r8, rs = quantize_mxfp8(z)
        assert same(z8, r8) and torch.equal(zs, rs), t
        assert z8.shape == (t, groups * r) and zs.shape == (t, groups * r // 32)
    # split-K with the quantizing reduce: the same bytes as quantizing the same split's bf16 sum
    for t in (1, 129):
        x8, xs = quantize_mxfp8_triton(activations(t, groups * kg, seed=t + 7))
        cfg = dict(default_config(t, groups * r, kg, groups), SPLIT_K=2, BLOCK_K=32)
        z8, zs = mxfp8_gemm(x8, xs, w8, ws, groups=groups, quantize_out=True, config=cfg)
        u8, us = quantize_mxfp8_triton(mxfp8_gemm(x8, xs, w8, ws, groups=groups, config=cfg))
        assert same(z8, u8) and torch.equal(zs, us), t
    print("interpreter ok")
    """,
    """
    # GEMM vs reference: M off the tile, a ragged N, several groups, split-K (tile overrides)
    for m, n, k, g, tiles in [(37, 96, 160, 1, {}), (5, 100, 64, 1, {}), (20, 128, 64, 2, {}),
                              (130, 256, 256, 4, {}), (5, 96, 192, 1, dict(SPLIT_K=3, BLOCK_K=32, BLOCK_N=32)),
                              (37, 64, 256, 2, dict(SPLIT_K=2, BLOCK_K=64, BLOCK_N=32)),
                              (3, 100, 512, 1, dict(SPLIT_K=4, BLOCK_M=16, BLOCK_N=64))]:
        x8, xs = quantize_mxfp8_triton(activations(m, k * g, seed=m))
        w8, ws = weight(n, k, seed=n)
        cfg = dict(default_config(m, n, k, g), **tiles)
        ref = mxfp8_gemm_reference(x8, xs, w8, ws, groups=g, out_dtype=torch.float32)
        y = mxfp8_gemm(x8, xs, w8, ws, groups=g, out_dtype=torch.float32, config=cfg)
        assert rel_err(y, ref) < 1e-5, (m, n, k, g, rel_err(y, ref))
        yb = mxfp8_gemm(x8, xs, w8, ws, groups=g, config=cfg)
        assert torch.equal(yb, y.bfloat16())  # bf16 output is the RNE rounding of the fp32 one
    empty = mxfp8_gemm(x8[:0], xs[:0], w8, ws)
    z0, s0 = mxfp8_gemm(x8[:0], xs[:0], w8[:96], ws[:3], quantize_out=True)
    assert empty.shape == (0, 100) and z0.shape == (0, 96) and s0.shape == (0, 3)
    print("interpreter ok")
    """,
)]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_kernels_under_interpreter():
    run_interpreted(*_INTERPRET_SCRIPTS)


def run_interpreted(*scripts: str, timeout: int = 600) -> None:
    """Run each script (which prints "interpreter ok" at its end) in its own TRITON_INTERPRET=1
    subprocess, all at once: the interpreter runs on one core, so a test whose cases split
    into two independent scripts takes both."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))

    def run(script: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, check=False,
                              capture_output=True, text=True, timeout=timeout)

    with ThreadPoolExecutor(len(scripts)) as pool:
        for res in pool.map(run, scripts):
            assert res.returncode == 0 and "interpreter ok" in res.stdout, res.stderr[-3000:]


def in_two_parts(script: str) -> tuple[str, str]:
    """``script`` with ``PART`` (in ``cases[PART::2]``, say) 0 and 1: two halves of its cases
    for :func:`run_interpreted` to run at once."""
    return script.replace("PART", "0"), script.replace("PART", "1")


# ----------------------------------------------------------------------------- sm_90 compilation (CPU)


def _compile_sm90(fn, types: dict, consts: dict, divisible: tuple[str, ...] = (), **options):
    """Compile a @triton.jit kernel for sm_90 without a GPU (Triton's bundled ptxas); returns
    (ptx, ptxas resource usage line). Pointers, strides and the ``divisible`` integer arguments
    are 16-divisible, as at run time."""
    import inspect
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in consts else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (types[n].startswith("*") or n.startswith("stride") or n in divisible)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:  # one per call: compiles may run in threads
        cubin.write(k.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    return k.asm["ptx"], re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage).group(0)


def two_at_a_time(calls: list) -> list:
    """``[call() for call in calls]`` on two threads: a compile for sm_90 spends its time in MLIR,
    LLVM and ptxas, which run without the GIL (Triton's own AsyncCompileMode compiles on a
    thread pool likewise), so a test's compiles take both cores."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: call(), calls))


@contextlib.contextmanager
def started_two_at_a_time(calls: dict):
    """{key: future of call()} for {key: call}, run as in :func:`two_at_a_time`: the compiles of
    one-compile tests (a module fixture's), each test waiting for its own; calls no test
    waited for are dropped at exit."""
    pool = ThreadPoolExecutor(2)
    try:
        yield {key: pool.submit(call) for key, call in calls.items()}
    finally:
        pool.shutdown(cancel_futures=True)


_PTXAS = Path(importlib.util.find_spec("triton").origin).parent / "backends/nvidia/bin/ptxas" if HAS_TRITON else None


@pytest.mark.slow
@pytest.mark.skipif(_PTXAS is None or not _PTXAS.exists(), reason="needs triton's bundled ptxas")
def test_default_configs_compile_for_sm90_with_wgmma_and_no_spills():
    """The kernels the H200 will run, compiled here: the default tiles of V4.1-Flash's linears
    and of wo_a's quantizing epilogue, the split-K sum and the quantization (with inverse RoPE)."""
    from kernels.mxfp8_gemm_triton import _mxfp8_gemm_kernel, _split_sum_kernel, _split_sum_quant_kernel, default_config
    from kernels.mxfp8_quant_triton import _mxfp8_quant_kernel

    ints = ("M", "N", "K_GROUP", "N_GROUP", "K_STEPS", "stride_am", "stride_sam", "stride_bn", "stride_sbn",
            "stride_cm", "stride_scm", "stride_split")
    types = dict(A="*fp8e4nv", SA="*u8", B="*fp8e4nv", SB="*u8", SC="*u8", **dict.fromkeys(ints, "i32"))
    cases = {}
    for m in (1, 128):
        for n, k, groups, quant in [(1280, 5120, 1, False), (5120, 8192, 1, False), (8192, 4096, 8, True)]:
            cfg = default_config(m, n, k, groups, quantize_out=quant)
            split = cfg.pop("SPLIT_K") > 1
            out = "*u8" if quant else ("*fp32" if split else "*bf16")
            cases[(tuple(sorted(cfg.items())), quant, split)] = (cfg, out)
    gemms, calls = [], []
    for (_, quant, split), (cfg, out) in cases.items():
        opts = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
        consts = dict(cfg, QUANT_OUT=quant, OUT_BF16=out == "*bf16", SPLIT=split)
        gemms.append(consts)
        calls.append(functools.partial(_compile_sm90, _mxfp8_gemm_kernel, dict(types, C=out), consts, **opts))
    calls.append(functools.partial(_compile_sm90, _split_sum_kernel, {"W": "*fp32", "C": "*bf16", "MN": "i32",
                                                                      "SPLITS": "i32"},
                                   {"BLOCK": 1024, "OUT_BF16": True}, num_warps=4))
    calls.append(functools.partial(_compile_sm90, _split_sum_quant_kernel, {"W": "*fp32", "Q": "*u8", "S": "*u8",
                                                                            "M": "i32", "N": "i32", "SPLITS": "i32"},
                                   {"BLOCK_M": 8, "BLOCKS": 8}, num_warps=4))
    qtypes = dict(X="*bf16", Y="*u8", S="*u8", COS="*bf16", SIN="*bf16", **dict.fromkeys(
        ("M", "K", "stride_xm", "stride_ym", "stride_sm", "stride_cm"), "i32"))
    for rope in (0, 64):
        consts = {"BLOCK_M": 8, "BLOCKS": 16, "HEAD_DIM": 512, "ROPE": rope, "ROUND_BF16": True}
        calls.append(functools.partial(_compile_sm90, _mxfp8_quant_kernel, qtypes, consts, num_warps=4,
                                       enable_fp_fusion=False))
    compiled = two_at_a_time(calls)
    for consts, (ptx, usage) in zip(gemms, compiled):
        assert "wgmma" in ptx and usage.endswith("LOCAL:0") and " STACK:0 " in usage, (consts, usage)
    (_, sum_usage), (_, sum_quant_usage), *quant_usages = compiled[len(gemms):]
    assert " STACK:0 " in sum_usage
    assert " STACK:0 " in sum_quant_usage and sum_quant_usage.endswith("LOCAL:0"), sum_quant_usage
    for _, usage in quant_usages:
        assert " STACK:0 " in usage and usage.endswith("LOCAL:0"), usage


_NVCC = Path("/usr/local/cuda-13.0/bin/nvcc")


_ROUNDING_HARNESS = r"""
#include <cstdio>
#include <vector>
#include "mxfp8_rounding.cuh"
// stdin: fp32 accumulators, 32 per block; stdout: per block 32 e4m3 bytes then the scale byte,
// as the CUDA GEMM's quantizing epilogue computes them (bf16 rounding first).
int main() {
  std::vector<float> x(32);
  while (fread(x.data(), 4, 32, stdin) == 32) {
    float amax = 0.f;
    for (float& v : x) { v = round_to_bf16(v); amax = amax > (v < 0 ? -v : v) ? amax : (v < 0 ? -v : v); }
    const uint32_t byte = ue8m0_byte(amax);
    unsigned char out[33];
    for (int i = 0; i < 32; ++i) out[i] = static_cast<unsigned char>(quantize_e4m3(x[i], pow2_from_byte(254u - byte)));
    out[32] = static_cast<unsigned char>(byte);
    fwrite(out, 1, 33, stdout);
  }
  return 0;
}
"""


@pytest.mark.skipif(not _NVCC.exists() and not os.environ.get("CUDA_HOME"), reason="needs nvcc")
def test_cuda_epilogue_rounding_matches_reference_quantization(tmp_path):
    """The CUDA epilogue's rules (kernels/csrc/mxfp8_rounding.cuh, compiled for the host) on fp32
    accumulators: e4m3 bytes and UE8M0 scales equal quantize_mxfp8 of their bf16 rounding, over
    every e4m3 value and tie, bf16 rounding ties, and random fp32 bits across many binades."""
    from kernels.mla_decode_cuda import CSRC, find_nvcc

    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2  # e4m3 ties (exact in bf16)
    edge = torch.cat([grid, mids, -grid, -mids])
    edge = torch.cat([edge, torch.zeros(-len(edge) % 31)]).reshape(-1, 31)
    edge = torch.cat([torch.full((len(edge), 1), 448.0), edge], 1).reshape(-1)
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (4096 * 32,), generator=g, dtype=torch.int64)
    expo = torch.randint(100, 160, (4096, 1), generator=g).repeat_interleave(32, 1).reshape(-1)  # a binade per block
    rand = ((bits & 0x807FFFFF) | (expo << 23)).to(torch.int32).view(torch.float32)
    ties = (rand.view(torch.int32) & ~0xFFFF) | torch.tensor([0x8000, 0x7FFF, 0x8001, 0x18000])[
        torch.randint(0, 4, rand.shape, generator=g)].to(torch.int32)
    x = torch.cat([edge, rand, ties.view(torch.float32), torch.zeros(32)]).contiguous()
    src = tmp_path / "harness.cu"
    src.write_text(_ROUNDING_HARNESS)
    exe = tmp_path / "harness"
    nvcc = find_nvcc() or str(_NVCC)
    subprocess.run([nvcc, "-O2", "-I", str(CSRC), "-o", str(exe), str(src)], check=True, capture_output=True,
                   timeout=300)
    out = subprocess.run([str(exe)], input=x.numpy().tobytes(), capture_output=True, check=True, timeout=60).stdout
    got = torch.frombuffer(bytearray(out), dtype=torch.uint8).reshape(-1, 33)
    rq, rs = quantize_mxfp8(x.reshape(-1, 32).bfloat16())
    assert torch.equal(got[:, 32], rs.reshape(-1))
    assert torch.equal(got[:, :32], rq.view(torch.uint8))


@pytest.mark.skipif(not _NVCC.exists() and not os.environ.get("CUDA_HOME"), reason="needs nvcc")
def test_cuda_library_compiles_without_spills_and_matches_the_ctypes_mirror(tmp_path):
    """One nvcc build of the library with the served flags: every instantiation of the two
    kernels (mxfp8_gemm_sm90a.cu: 4, mxfp8_gemm_v2_sm90a.cu: 9) has no local memory and no ptxas
    warning that it had to serialize the wgmmas (C7510-C7518, which would undo the promotion
    overlap), and the built library's parameter struct and shared-memory plans are the ones
    kernels/mxfp8_gemm_cuda.py mirrors."""
    import ctypes

    from kernels import mxfp8_gemm_cuda as mgc
    from kernels.mla_decode_cuda import find_nvcc

    nvcc = find_nvcc() or str(_NVCC)
    lib_path = tmp_path / "mxfp8_gemm_sm90a.so"
    res = subprocess.run([nvcc, *mgc.NVCC_FLAGS, "-Xptxas", "-v", "-o", str(lib_path), *map(str, mgc.SOURCES)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    spills = [line for line in res.stderr.splitlines() if "spill" in line]
    assert len(spills) == 13 and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), spills
    serialized = [f"C751{i}" for i in range(9)]
    assert not any(code in res.stderr for code in serialized) and "serialized" not in res.stderr, res.stderr[-3000:]
    lib = ctypes.CDLL(str(lib_path))
    assert lib.mxfp8_gemm_sm90_params_bytes() == ctypes.sizeof(mgc._GemmParams)
    for consumers in (1, 2):  # a 1 KB reserve per CTA on top, within Hopper's 228 KB per SM
        assert 190 * 1024 < lib.mxfp8_gemm_sm90_smem_bytes(consumers) <= 227 * 1024
        assert 190 * 1024 < lib.mxfp8_gemm_sm90_v2_smem_bytes(consumers) <= 227 * 1024
    assert lib.mxfp8_gemm_sm90_smem_bytes(3) == -1 and lib.mxfp8_gemm_sm90_v2_smem_bytes(3) == -1


# ----------------------------------------------------------------------------- GPU


def _bytes_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
def test_gpu_quant_matches_reference():
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    for m, k, dtype in [(1, 5120, torch.bfloat16), (37, 8192, torch.bfloat16), (300, 1280, torch.float32),
                        (8, 4096, torch.float16)]:
        x = activations(m, k, seed=m, dtype=dtype, device="cuda")
        q, s = quantize_mxfp8_triton(x)
        rq, rs = quantize_mxfp8(x)
        assert _bytes_equal(q, rq) and torch.equal(s, rs)


# V4.1-Flash: wq_a 5120→1280, wq_b 1280→32768, wo_b 8192→5120, a ragged N and a tiny K
GEMM_SHAPES = [(1, 1280, 5120), (129, 32768, 1280), (300, 5120, 8192), (16, 1000, 512), (4096, 1280, 5120),
               (3, 64, 32), (37, 250, 160), (200, 384, 224)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("shape", GEMM_SHAPES)
def test_gpu_gemm_matches_reference(shape, backend):
    """K off the 128-wide stage (160, 224: unaligned scale rows, a zero-filled last stage), N
    off the tile and off 32 (250), M off both tile heights; bf16, fp32 and split-K outputs."""
    from kernels.mxfp8_gemm import mxfp8_gemm, mxfp8_linear
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    m, n, k = shape
    x = activations(m, k, seed=m, device="cuda")
    w8, ws = weight(n, k, seed=n, device="cuda")
    x8, xs = quantize_mxfp8_triton(x)
    ref = mxfp8_gemm_reference(x8, xs, w8, ws, out_dtype=torch.float32)
    y = mxfp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, backend=backend)
    # same products; the FP8 MMA's own narrower accumulation of each 32-slice and the fp32 sum
    # order differ from the reference (a wrong scale would be an O(1) error)
    assert rel_err(y, ref) < 1e-4
    yb = mxfp8_gemm(x8, xs, w8, ws, backend=backend)
    assert yb.dtype == torch.bfloat16 and rel_err(yb, ref) < 1e-2
    if backend == "cuda":
        from kernels.mxfp8_gemm_cuda import default_cuda_config

        for consumers in (1, 2):  # both tile heights, unsplit and split where K allows
            for split in sorted({1, default_cuda_config(m, n, k)["SPLIT_K"]}):
                cfg = {"consumers": consumers, "SPLIT_K": split}
                yc = mxfp8_gemm(x8, xs, w8, ws, out_dtype=torch.float32, backend="cuda", config=cfg)
                assert rel_err(yc, ref) < 1e-4, cfg
    assert rel_err(mxfp8_linear(x, w8, ws), ref) < 1e-2


def capture(fn):
    """Warm up on a side stream, capture ``fn`` in a CUDA graph; returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("tp", ["tp1", "tp8"])
@pytest.mark.parametrize("tokens", [1, 129, 8193])
def test_gpu_wo_a_epilogue_bytes_match_separate_quant(tokens, tp, backend):
    """V4.1-Flash wo_a (TP1: 8 groups of 8 heads × 512 → 1024; TP8: one group): z's e4m3 bytes
    and scales (wo_b's input) from the fused epilogue, or from the quantizing split-K reduce,
    equal quantizing its bf16 output separately, eager and in graph replays."""
    from kernels.mxfp8_gemm import default_config, mxfp8_gemm
    from kernels.gpu import num_sms
    from kernels.mxfp8_gemm_cuda import default_cuda_config
    from kernels.mxfp8_quant_triton import quantize_mxfp8_triton

    groups, r, kg = (8, 1024, 4096) if tp == "tp1" else (1, 1024, 4096)
    w8, ws = weight(groups * r, kg, seed=5, device="cuda")
    x = activations(tokens, groups * kg, seed=tokens, device="cuda")
    x8, xs = quantize_mxfp8_triton(x)
    # the same tiling and split as the fused launch (another split sums in another order and
    # moves some bf16 roundings of z: a different z, not a different quantization)
    if backend == "cuda":
        same_tiles = default_cuda_config(tokens, groups * r, kg, num_sms(torch.device("cuda")))
    else:
        same_tiles = default_config(tokens, groups * r, kg, groups, num_sms(torch.device("cuda")), quantize_out=True)
    z8, zs = mxfp8_gemm(x8, xs, w8, ws, groups=groups, quantize_out=True, backend=backend)
    z = mxfp8_gemm(x8, xs, w8, ws, groups=groups, config=same_tiles, backend=backend)
    u8, us = quantize_mxfp8_triton(z)
    assert _bytes_equal(z8, u8) and torch.equal(zs, us)
    r8, rs = quantize_mxfp8(z)
    assert _bytes_equal(z8, r8) and torch.equal(zs, rs)
    ref = mxfp8_gemm_reference(x8, xs, w8, ws, groups=groups, out_dtype=torch.float32)
    assert rel_err(dequantize_mxfp8(z8, zs), ref) < 4e-2

    static = x.clone()

    def fused():
        return mxfp8_gemm(*quantize_mxfp8_triton(static), w8, ws, groups=groups, quantize_out=True, backend=backend)

    def separate():
        q, s = quantize_mxfp8_triton(static)
        return quantize_mxfp8_triton(mxfp8_gemm(q, s, w8, ws, groups=groups, config=same_tiles, backend=backend))

    g_fused, (gz8, gzs) = capture(fused)
    g_sep, (gu8, gus) = capture(separate)
    for seed in (1, 2):
        static.copy_(activations(tokens, groups * kg, seed=seed + tokens, device="cuda"))
        g_fused.replay()
        g_sep.replay()
        torch.cuda.synchronize()
        assert _bytes_equal(gz8, gu8) and torch.equal(gzs, gus)
        e8, es = fused()
        assert _bytes_equal(gz8, e8) and torch.equal(gzs, es)  # replay == eager
