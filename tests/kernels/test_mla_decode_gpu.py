"""MLA decode kernels and backends against the torch reference.

CPU (CI): the torch backend, the launch heuristics, and the Triton kernel itself under
TRITON_INTERPRET=1 on tiny shapes (in two subprocesses, half the cases each, since the
interpreter must be chosen before Triton is imported). GPU (``-m gpu``, on the device): the
Triton kernel and the triton, auto, flashinfer and trtllm backends on fresh random inputs, with
unused cache pages and slots poisoned with NaN and the outputs poisoned before the call, for s_q
1..4 and ragged lengths. The registry and its ``auto`` policy: tests/kernels/test_attention_backends.py.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from kernels.attention import AttentionSpec, BackendUnavailable, select_decode_backend
from kernels.fp8 import quantize_per_tensor
from kernels.mla_decode import mla_decode_reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
D = 576
SM_SCALE = 192 ** -0.5


def make_case(bsz, s_q, heads, lens, dtype, page=64, seed=0, device="cpu"):
    """Random query/cache in the given dtype; pages not in the table and slots past each
    sequence's end hold NaN. Returns (q, kv, block_tables, seq_lens, q_scale, k_scale)."""
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page) for n in lens)
    num_blocks = bsz * max_pages + 5
    kv = torch.randn(num_blocks, page, D, generator=g)
    q = torch.randn(bsz, s_q, heads, D, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: bsz * max_pages].reshape(bsz, max_pages).int()
    if dtype == torch.float8_e4m3fn:
        q_scale, k_scale = 0.02, 0.03
        qx, kvx = quantize_per_tensor(q, q_scale), quantize_per_tensor(kv, k_scale)
    else:
        q_scale = k_scale = 1.0
        qx, kvx = q.to(dtype), kv.to(dtype)
    used = torch.zeros(num_blocks, dtype=torch.bool)
    bits = kvx.view(torch.uint8) if dtype == torch.float8_e4m3fn else kvx
    nan = 0x7F if dtype == torch.float8_e4m3fn else float("nan")  # e4m3fn's NaN byte
    for b, n in enumerate(lens):
        pages = -(-n // page)
        used[tables[b, :pages].long()] = True
        if n % page:
            bits[tables[b, pages - 1], n % page:] = nan
        tables[b, pages:] = tables[b, 0]  # stale entries past the end must not be read
    bits[~used] = nan
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return (qx.to(device), kvx.to(device), tables.to(device), lens_t.to(device), q_scale, k_scale)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def spec_for(case, dtype, page=64, device="cuda") -> AttentionSpec:
    """The start-up description a runner would give the backends for ``case``'s attention."""
    compute = torch.float16 if dtype == torch.float16 else (torch.float32 if dtype == torch.float32 else torch.bfloat16)
    return AttentionSpec(torch.device(device), dtype, case[2], D - 64, 64, page, SM_SCALE, compute, query_len=case[1])


def decode_step(backend, case, dtype, layers=2, seed=0, device="cuda"):
    """One step as the model drives a backend: the metadata built once, then ``layers`` layers,
    each with its own fresh query and cache values in the step's pages (poison kept). Returns
    (relative error, max |LSE error|) per layer against the reference."""
    bsz, s_q, h, lens = case
    q, kv, bt, sl, qs, ks = make_case(bsz, s_q, h, lens, dtype, seed=seed, device=device)
    metadata = backend.build_metadata(bt, sl, s_q)
    poison = kv.float().isnan()
    errors = []
    for layer in range(layers):
        if layer:
            g = torch.Generator().manual_seed(seed + 1000 * layer)
            fresh_q, fresh_kv = torch.randn(q.shape, generator=g), torch.randn(kv.shape, generator=g)
            if dtype == torch.float8_e4m3fn:
                q, kv = quantize_per_tensor(fresh_q, qs).to(device), quantize_per_tensor(fresh_kv, ks).to(device)
                kv.view(torch.uint8)[poison] = 0x7F
            else:
                q, kv = fresh_q.to(dtype).to(device), fresh_kv.to(dtype).to(device)
                kv[poison] = float("nan")
        out, lse = backend.decode(q, kv, metadata, SM_SCALE, D - 64, k_scale=ks, q_scale=qs)
        ref, ref_lse = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
        assert not out.isnan().any() and not lse.isnan().any(), "an output element was not written"
        errors.append((rel_err(out, ref), (lse - ref_lse).abs().max().item()))
    return errors


# ----------------------------------------------------------------------------- CPU


def test_torch_backend_is_the_reference_on_every_layer():
    case = (2, 2, 4, [70, 3])
    backend = select_decode_backend("auto", spec_for(case, torch.float32, device="cpu"))
    assert backend.name == "torch"
    for err, lse_err in decode_step(backend, case, torch.float32, layers=2, seed=1, device="cpu"):
        assert err == 0 and lse_err == 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_launch_heuristics():
    from kernels.mla_decode_triton import choose_num_splits, default_config

    assert choose_num_splits(256, 132) == 1  # B=128, 2 column blocks: the grid already fills
    assert choose_num_splits(1, 132) == 32  # B=1: capped
    assert choose_num_splits(8, 132) == 32  # B=8: cdiv(264, 8) = 33, capped
    assert default_config(torch.float8_e4m3fn, torch.float8_e4m3fn, 16).block_h == 16
    assert default_config(torch.bfloat16, torch.bfloat16, 256).block_h == 64
    assert default_config(torch.float8_e4m3fn, torch.float8_e4m3fn, 128).block_h == 128


INTERPRETER_PATCH = textwrap.dedent(
    """
    import numpy as np, triton.runtime.interpreter as ti
    # Triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 rejects.
    _orig = ti._patch_lang_tensor
    def _patched(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    ti._patch_lang_tensor = _patched
    """
)

_INTERPRET_SCRIPT = INTERPRETER_PATCH + textwrap.dedent(
    """
    import torch
    from tests.kernels.test_mla_decode_gpu import make_case, rel_err, SM_SCALE
    from kernels.mla_decode import mla_decode_reference
    from kernels.mla_decode_triton import MLADecodeConfig, mla_decode_triton
    C = MLADecodeConfig
    cases = [  # (B, s_q, H, lens, dtype, config, tolerance)
        (2, 1, 16, [70, 1], torch.float8_e4m3fn, C(block_h=16, block_n=32, num_stages=1, dv=256), 1e-2),
        (2, 2, 8, [130, 33], torch.float8_e4m3fn,
         C(block_h=16, block_n=64, num_stages=1, pv="fp8", num_splits=3), 6e-2),
        (1, 3, 8, [100], torch.float16, C(block_h=32, block_n=32, num_stages=1, dv=128, num_splits=2), 1e-2),
        (2, 2, 8, [64, 33], torch.float8_e4m3fn, C(block_h=16, block_n=64, num_stages=1, tokens_major=True), 1e-2),
    ]
    for bsz, s_q, h, lens, dt, cfg, tol in cases[PART::2]:  # half of them in each of two processes
        q, kv, bt, sl, qs, ks = make_case(bsz, s_q, h, lens, dt, seed=bsz + s_q)
        out = torch.full((bsz, s_q, h, 512), float("nan"), dtype=torch.bfloat16 if dt != torch.float16 else dt)
        lse = torch.full((bsz, s_q, h), float("nan"))
        mla_decode_triton(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, config=cfg, out=out, lse=lse)
        ref, ref_lse = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
        assert not out.isnan().any() and not lse.isnan().any(), "unwritten output"
        err = rel_err(out, ref)
        assert err < tol, (cfg, err)
        assert (lse - ref_lse).abs().max().item() < 1e-3
    print("interpreter ok")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_kernel_under_interpreter():
    """The kernel's arithmetic on CPU. The interpreter's bf16 dot is broken (it multiplies
    raw bits), so the 16-bit path is checked in fp16 here and in bf16 on the GPU."""
    from tests.kernels.test_mxfp8_gemm import in_two_parts, run_interpreted

    run_interpreted(*in_two_parts(_INTERPRET_SCRIPT))


# ----------------------------------------------------------------------------- GPU

# Absolute LSE error (|lse| ~ 10 here). Hopper's FP8 MMAs accumulate Q·Kᵀ with reduced
# precision (measured ~5e-3 on the H200, 2026-11-29); bf16 MMAs accumulate in full fp32.
LSE_TOL = {torch.float8_e4m3fn: 1.5e-2, torch.bfloat16: 2e-3}

GPU_CASES = [  # (B, s_q, H, lens)
    (3, 1, 16, [1, 64, 300]),
    (4, 1, 128, [4096, 65, 1, 777]),
    (2, 2, 16, [2, 1000]),
    (3, 2, 128, [130, 64, 2]),
    (2, 3, 32, [3, 513]),
    (2, 4, 128, [4, 200]),
]


def run_against_reference(kernel, case, dtype, seed=0, **kw):
    """Run ``kernel`` (a decode function with the reference's contract) on a fresh poisoned
    case into NaN-filled outputs; return (relative error, max |LSE error|) vs the reference."""
    bsz, s_q, h, lens = case
    q, kv, bt, sl, qs, ks = make_case(bsz, s_q, h, lens, dtype, seed=seed, device="cuda")
    out = torch.full((bsz, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((bsz, s_q, h), float("nan"), device="cuda")
    kernel(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks, out=out, lse=lse, **kw)
    torch.cuda.synchronize()
    ref, ref_lse = mla_decode_reference(q, kv, bt, sl, SM_SCALE, q_scale=qs, k_scale=ks)
    assert not out.isnan().any() and not lse.isnan().any(), "an output element was not written"
    return rel_err(out, ref), (lse - ref_lse).abs().max().item()


def _run_triton(case, dtype, config=None, seed=0):
    from kernels.mla_decode_triton import mla_decode_triton

    return run_against_reference(mla_decode_triton, case, dtype, seed, config=config)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_triton_default_config(case, dtype):
    err, lse_err = _run_triton(case, dtype, seed=len(case[3]))
    assert err < 1e-2, err
    assert lse_err < LSE_TOL[dtype], lse_err


FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
CONFIGS = [  # (config, dtypes it fits: bf16 tiles need twice the shared memory)
    (dict(block_h=64, block_n=64, num_warps=8, num_stages=2, dv=512), (FP8,)),
    (dict(block_h=64, block_n=32, num_warps=4, num_stages=2, dv=256, num_splits=5), (FP8, BF16)),
    (dict(block_h=128, block_n=32, num_warps=8, num_stages=2, dv=256), (FP8,)),
    (dict(block_h=64, block_n=32, num_warps=8, num_stages=2, dv=512, num_splits=3), (BF16,)),
    (dict(block_h=16, block_n=32, num_warps=4, num_stages=3, dv=256, num_splits=3), (FP8, BF16)),
    (dict(block_h=64, block_n=32, num_warps=4, num_stages=2, dv=256, pv="fp8"), (FP8,)),
    (dict(block_h=16, block_n=64, num_warps=4, num_stages=3, dv=256, tokens_major=True), (FP8,)),
    (dict(block_h=32, block_n=32, num_warps=4, num_stages=2, dv=256, tokens_major=True, num_splits=3), (FP8, BF16)),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("config_kw,dtype", [(c, d) for c, ds in CONFIGS for d in ds])
def test_triton_configs(config_kw, dtype):
    from kernels.mla_decode_triton import MLADecodeConfig

    tol = 6e-2 if config_kw.get("pv") == "fp8" else 1e-2
    for case in (GPU_CASES[1], GPU_CASES[3], GPU_CASES[4]):
        err, lse_err = _run_triton(case, dtype, MLADecodeConfig(**config_kw), seed=7)
        assert err < tol and lse_err < LSE_TOL[dtype], (case, err, lse_err)


@gpu
@needs_cuda
def test_triton_and_auto_backends_match_reference():
    case = (2, 1, 16, [100, 7])
    # auto takes the CUDA library on Hopper, whose P.V runs in FP8 (1.5e-2 measured; the issue's
    # bound for an FP8 decode is 2e-2); triton keeps P in fp16.
    for requested, tol in (("triton", 1e-2), ("auto", 2e-2)):
        backend = select_decode_backend(requested, spec_for(case, torch.float8_e4m3fn))
        for err, _ in decode_step(backend, case, torch.float8_e4m3fn, layers=2, seed=3):
            assert err < tol, (requested, backend.name, err)


@gpu
@needs_cuda
def test_trtllm_refused_off_blackwell():
    if torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("on Blackwell the refusal does not apply")
    with pytest.raises(BackendUnavailable, match="--attention-backend trtllm: needs a SM10x GPU"):
        select_decode_backend("trtllm", spec_for((1, 1, 16, [10]), torch.bfloat16))


@gpu
@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[3]])
def test_flashinfer_backend_matches_reference(case, dtype):
    """The real FlashInfer fa3 kernel through the backend: planned once, three layers run."""
    backend = select_decode_backend("flashinfer", spec_for(case, dtype))
    workspace = backend.workspace
    for err, lse_err in decode_step(backend, case, dtype, layers=3, seed=11):
        assert err < 2e-2 and lse_err < 2e-2, (err, lse_err)
    assert backend.workspace is workspace
