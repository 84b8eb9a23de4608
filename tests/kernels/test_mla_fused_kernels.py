"""Fused MLA KV-cache write and query stage (kernels/mla_kv_write.py, kernels/mla_query_stage.py).

CPU (CI): the torch references against independent fp64 formulations (RMSNorm by formula,
RoPE as a complex rotation, einsum), the dispatch, input validation, and both Triton kernels
under TRITON_INTERPRET=1 on tiny shapes (in one subprocess; the interpreter must be chosen
before Triton is imported). GPU (``-m gpu``): real shapes, NaN-poisoned caches and outputs,
every written slot checked bit for bit, untouched slots still NaN, and CUDA-graph capture.

Exactness: the rotated k_pe/q_pe and every FP8 byte are bit-equal to the torch composition
(the kernels disable FMA contraction and use IEEE division). The RMSNorm's fp32 sum order
differs from torch, so kv_c may differ by one ulp of its dtype; the cache then holds exactly
the (quantized) values the kernel returned. The W_UK product is torch.bmm's own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, quantize_per_tensor
from kernels.mla_kv_write import write_kv_cache, write_kv_cache_reference
from kernels.mla_kv_write import triton_supports as kv_write_uses_triton
from kernels.mla_query_stage import stage_query, stage_query_reference
from kernels.mla_query_stage import triton_supports as stage_uses_triton
from kernels.rope import build_cos_sin_cache, yarn_inv_freq
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-6
MAX_POS = 4096
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def cos_sin(rope: int, device="cpu") -> torch.Tensor:
    """A YaRN-scaled cache like R1's (factor 40), so both rope regimes are exercised."""
    return build_cos_sin_cache(yarn_inv_freq(rope, 10000.0, 40.0, MAX_POS), MAX_POS).to(device)


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """All NaN (0x7F is e4m3fn's NaN byte)."""
    if dtype == FP8_DTYPE:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(FP8_DTYPE)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def bits(x: torch.Tensor) -> torch.Tensor:
    """A view for bitwise comparison (NaN == NaN)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


# ----------------------------------------------------------------------------- independent fp64 math


def exact_norm(x, w, eps=EPS):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def exact_rope(x, positions, cs):
    """Adjacent pairs as complex numbers times e^{iθ}: an independent interleaved rotation."""
    half = x.shape[-1] // 2
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], half, 2).contiguous())
    cs = cs[positions.long()].double()
    rot = torch.complex(cs[:, :half], cs[:, half:]).reshape(x.shape[0], *[1] * (x.dim() - 2), half)
    return torch.view_as_real(z * rot).flatten(-2)


def pair_magnitude(x):
    return x.reshape(*x.shape[:-1], -1, 2).norm(dim=-1).repeat_interleave(2, dim=-1)


def assert_rounded(actual, exact, dtype, mag=None, half_ulps=1, extra_rel=0.0):
    """``actual`` is ``exact`` rounded to ``dtype``: |actual - exact| <= half_ulps half-ulps of
    ``dtype`` (relative, or absolute in the subnormal range) + extra_rel·|exact| + 2e-6·mag
    (``mag``: the scale of the fp32 arithmetic before rounding; default |exact|)."""
    fi = torch.finfo(dtype)
    mag = exact.abs() if mag is None else mag
    err = (actual.double() - exact).abs()
    bound = half_ulps * fi.eps / 2 * (exact.abs() + fi.tiny) + extra_rel * exact.abs() + 2e-6 * mag
    assert not actual.isnan().any() and (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def assert_fp8_of(actual8, exact, scale, compute_dtype, mag):
    """e4m3 values hold clamp(exact / scale) up to half an e4m3 ulp plus the compute dtype's
    rounding before quantization."""
    expected = (exact / scale).clamp(-448, 448)
    assert_rounded(actual8.double(), expected, FP8_DTYPE, mag / scale, extra_rel=torch.finfo(compute_dtype).eps / 2)


# ----------------------------------------------------------------------------- KV write cases


def make_kv_case(t, lora, rope, kv_dtype, cache_dtype, block, num_blocks, n_slots, pads, seed, device="cpu"):
    """Random kv and a NaN-poisoned cache; the first ``n_slots`` rows get distinct slots (never
    the scratch slot), of which rows ``pads`` are -1 (padding); rows past n_slots: TP padding."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(t, lora + rope, generator=g) * 3).to(kv_dtype)
    weight = (torch.rand(lora, generator=g) + 0.5).to(kv_dtype)
    positions = torch.randint(0, MAX_POS, (t,), generator=g)
    positions[0] = MAX_POS - 1
    slots = torch.randperm(num_blocks * block - 1, generator=g)[:n_slots]
    slots[list(pads)] = -1
    cache = poisoned((num_blocks, block, lora + rope), cache_dtype)
    return [x.to(device) for x in (kv, weight, positions, cache, slots)]


def check_kv_write(impl, t, lora, rope, kv_dtype, cache_dtype, block=16, num_blocks=4, n_slots=None, pads=(2,),
                   k_scale=0.01, seed=0, device="cpu"):
    """Run ``impl`` (a write_kv_cache-like function) and check it against the reference."""
    n_slots = t if n_slots is None else n_slots
    kv, weight, positions, cache, slots = make_kv_case(
        t, lora, rope, kv_dtype, cache_dtype, block, num_blocks, n_slots, pads, seed, device)
    cs = cos_sin(rope, device)
    before = cache.clone()
    kv_c, k_pe = impl(kv, weight, EPS, positions, cs, cache, slots, k_scale)
    kv_c, k_pe, cache, slots = kv_c.cpu(), k_pe.cpu(), cache.cpu(), slots.cpu()
    cpu = [x.cpu() for x in (kv, weight, positions, cs)]
    ref_cache = before.cpu().clone()
    ref_c, ref_pe = write_kv_cache_reference(*cpu[:2], EPS, *cpu[2:], ref_cache, slots, k_scale)
    assert kv_c.dtype == k_pe.dtype == kv_dtype and kv_c.shape == (t, lora) and k_pe.shape == (t, rope)
    assert torch.equal(bits(k_pe), bits(ref_pe)), "rotated k_pe differs from the torch composition"
    # kv_c: the norm's fp32 sum order may differ from torch's: one ulp of a 16-bit dtype,
    # a few (2e-6 relative) of fp32.
    assert_rounded(kv_c, ref_c.double(), kv_dtype, half_ulps=2)
    # The cache holds exactly the (quantized) returned values, at every written slot.
    entries = torch.cat([kv_c, k_pe], dim=-1)[:n_slots]
    entries = quantize_per_tensor(entries, k_scale) if cache_dtype == FP8_DTYPE else entries.to(cache_dtype)
    flat, flat_before = bits(cache.view(-1, lora + rope)), bits(before.cpu().view(-1, lora + rope))
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], bits(entries[row])), f"slot {slot} (row {row})"
            written[slot] = True
    pad_rows = [r for r, s in enumerate(slots.tolist()) if s < 0]
    if pad_rows:  # pad rows race for the scratch slot: each element comes from one of them
        assert (flat[-1] == bits(entries[pad_rows])).any(dim=0).all(), "scratch slot"
        written[-1] = True
    assert torch.equal(flat[~written], flat_before[~written]), "a slot no row maps to was written"


# ----------------------------------------------------------------------------- query stage cases


def make_stage_case(t, h, nope, lora, rope, dtype, seed, device="cpu"):
    """q as one [T, H, nope+rope] tensor split into views, as the model's q_proj gives them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, nope + rope, generator=g).to(dtype).to(device)
    w_uk = (torch.randn(h, nope, lora, generator=g) * nope ** -0.5).to(dtype)
    positions = torch.randint(0, MAX_POS, (t,), generator=g)
    positions[-1] = MAX_POS - 1
    return q[..., :nope], w_uk.to(device), q[..., nope:], positions.to(device)


def check_stage(impl, t, h, nope, lora, rope, dtype, out_dtype, q_scale=0.02, seed=0, device="cpu"):
    """Run ``impl`` (a stage_query-like function) into a NaN-poisoned ``out`` and check it."""
    q_nope, w_uk, q_pe, positions = make_stage_case(t, h, nope, lora, rope, dtype, seed, device)
    cs = cos_sin(rope, device)
    out = poisoned((t, h, lora + rope), out_dtype, device)
    got = impl(q_nope, w_uk, q_pe, positions, cs, out_dtype, q_scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    # The product exactly as the fused path computes it (same device, same output layout).
    pitch = lora if out_dtype == FP8_DTYPE else lora + rope
    same_layout = torch.empty(t, h, pitch, dtype=dtype, device=device)[..., :lora]
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=same_layout.transpose(0, 1))
    got, same_layout = got.cpu(), same_layout.cpu()
    cpu = [x.cpu() for x in (q_nope, w_uk, q_pe, positions, cs)]
    ref = stage_query_reference(*cpu, out_dtype, q_scale)
    assert got.shape == ref.shape and got.dtype == out_dtype and got.is_contiguous()
    assert torch.equal(bits(got[..., lora:]), bits(ref[..., lora:])), "rope columns differ from torch"
    if out_dtype == FP8_DTYPE:
        assert torch.equal(bits(got[..., :lora]), bits(quantize_per_tensor(same_layout, q_scale)))
    else:
        assert torch.equal(bits(got[..., :lora]), bits(same_layout))
    # Across devices torch's bmm itself may round differently: one ulp at the row's scale.
    ref_lat = stage_query_reference(*cpu, dtype)[..., :lora].double()
    err = (same_layout.double() - ref_lat).abs().max().item()
    assert err <= torch.finfo(dtype).eps * ref_lat.abs().max().item(), err


# ----------------------------------------------------------------------------- CPU: references


@pytest.mark.parametrize("kv_dtype,cache_dtype", [(BF16, BF16), (BF16, FP8_DTYPE), (FP32, FP32), (FP16, FP8_DTYPE)])
def test_kv_write_reference_vs_exact_math(kv_dtype, cache_dtype):
    t, lora, rope, k_scale = 7, 512, 64, 0.01  # k_scale small enough that some values saturate
    kv, weight, positions, cache, slots = make_kv_case(t, lora, rope, kv_dtype, cache_dtype, 64, 3, 6, (4,), 1)
    cs = cos_sin(rope)
    before = cache.clone()
    kv_c, k_pe = write_kv_cache_reference(kv, weight, EPS, positions, cs, cache, slots, k_scale)
    norm, rot = exact_norm(kv[:, :lora], weight), exact_rope(kv[:, lora:], positions, cs)
    assert_rounded(kv_c, norm, kv_dtype)
    assert_rounded(k_pe, rot, kv_dtype, pair_magnitude(rot))
    flat = cache.view(-1, lora + rope)
    exact = torch.cat([norm, rot], dim=-1)
    mag = torch.cat([norm.abs(), pair_magnitude(rot)], dim=-1)
    for row, slot in [(r, s) for r, s in enumerate(slots.tolist()) if s >= 0] + [(4, -1)]:
        if cache_dtype == FP8_DTYPE:
            assert_fp8_of(flat[slot].float(), exact[row], k_scale, kv_dtype, mag[row])
        else:
            assert_rounded(flat[slot], exact[row], kv_dtype, mag[row])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[[s for s in slots.tolist() if s >= 0] + [-1]] = False
    assert torch.equal(bits(flat[untouched]), bits(before.view(-1, lora + rope)[untouched]))
    if cache_dtype == FP8_DTYPE:
        assert (flat.float().abs() == 448).any(), "the case should exercise saturation"


@pytest.mark.parametrize("dtype,out_dtype", [(BF16, BF16), (BF16, FP8_DTYPE), (FP32, FP32), (FP32, FP8_DTYPE)])
def test_stage_reference_vs_exact_math(dtype, out_dtype):
    t, h, nope, lora, rope, q_scale = 3, 4, 128, 512, 64, 0.005
    q_nope, w_uk, q_pe, positions = make_stage_case(t, h, nope, lora, rope, dtype, 2)
    cs = cos_sin(rope)
    got = stage_query_reference(q_nope, w_uk, q_pe, positions, cs, out_dtype, q_scale)
    assert got.shape == (t, h, lora + rope) and got.dtype == out_dtype
    lat = torch.einsum("thn,hnl->thl", q_nope.double(), w_uk.double())
    lat_mag = torch.einsum("thn,hnl->thl", q_nope.double().abs(), w_uk.double().abs())
    rot = exact_rope(q_pe, positions, cs)
    exact = torch.cat([lat, rot], dim=-1)
    mag = torch.cat([lat_mag, pair_magnitude(rot)], dim=-1)
    if out_dtype == FP8_DTYPE:
        assert_fp8_of(got.float(), exact, q_scale, dtype, mag)
        assert (got.float().abs() == 448).any(), "the case should exercise saturation"
    else:
        assert_rounded(got, exact, dtype, mag)


def test_cpu_dispatch_is_the_reference():
    kv, weight, positions, cache, slots = make_kv_case(5, 32, 16, BF16, FP8_DTYPE, 16, 4, 5, (2,), 3)
    cs = cos_sin(16)
    assert not kv_write_uses_triton(kv, cache) and not stage_uses_triton(kv)
    ref_cache = cache.clone()
    got = write_kv_cache(kv, weight, EPS, positions, cs, cache, slots, 0.05)
    ref = write_kv_cache_reference(kv, weight, EPS, positions, cs, ref_cache, slots, 0.05)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.equal(bits(cache), bits(ref_cache))
    q_nope, w_uk, q_pe, positions = make_stage_case(5, 2, 24, 32, 16, BF16, 3)
    for out_dtype in (BF16, FP8_DTYPE):
        ref = stage_query_reference(q_nope, w_uk, q_pe, positions, cs, out_dtype, 0.05)
        assert torch.equal(bits(stage_query(q_nope, w_uk, q_pe, positions, cs, out_dtype, 0.05)), bits(ref))
        out = poisoned(ref.shape, out_dtype)
        assert stage_query(q_nope, w_uk, q_pe, positions, cs, out_dtype, 0.05, out=out) is out
        assert torch.equal(bits(out), bits(ref))


def test_input_validation():
    kv, weight, positions, cache, slots = make_kv_case(5, 32, 16, BF16, BF16, 16, 4, 5, (), 4)
    cs = cos_sin(16)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        write_kv_cache(kv, weight, EPS, positions, cos_sin(8), cache, slots)
    with pytest.raises(ValueError, match="positive even rope"):
        write_kv_cache(kv[:, :47], weight, EPS, positions, cs, cache, slots)
    with pytest.raises(ValueError, match="at most 5 entries"):
        write_kv_cache(kv, weight, EPS, positions, cs, cache, torch.arange(6))
    with pytest.raises(ValueError, match="kv_cache must be"):
        write_kv_cache(kv, weight, EPS, positions, cs, cache[..., :40], slots)
    with pytest.raises(TypeError, match="kv_cache dtype"):
        write_kv_cache(kv, weight, EPS, positions, cs, cache.to(torch.float64), slots)
    q_nope, w_uk, q_pe, positions = make_stage_case(5, 2, 24, 32, 16, BF16, 4)
    with pytest.raises(TypeError, match="out_dtype"):
        stage_query(q_nope, w_uk, q_pe, positions, cs, FP32)
    with pytest.raises(ValueError, match="w_uk"):
        stage_query(q_nope, w_uk[:, :20], q_pe, positions, cs)
    with pytest.raises(TypeError, match="share one of"):
        stage_query(q_nope, w_uk.float(), q_pe, positions, cs)
    with pytest.raises(ValueError, match="out must be"):
        stage_query(q_nope, w_uk, q_pe, positions, cs, BF16, out=torch.empty(5, 2, 47, dtype=BF16))


# ----------------------------------------------------------------------------- CPU: the Triton kernels

# Triton 3.6's interpreter narrows floats itself: fp32 -> bf16 truncates, and its "round to
# nearest even" for fp8 rounds ties up and drops the mantissa carry into the exponent. The
# GPU converts with RNE; so does torch, which we substitute to make bytes comparable.
ROUNDING_PATCH = textwrap.dedent(
    """
    import numpy as np, torch, triton.language as tl, triton.runtime.interpreter as ti
    _FLOATS = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
               tl.float8e4nv: torch.float8_e4m3fn}
    _INTS = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}
    _orig_convert = ti._convert_float
    def _convert_float(data, src, dst, rounding_mode):
        if src not in _FLOATS or dst not in _FLOATS:
            return _orig_convert(data, src, dst, rounding_mode)
        s, d = _FLOATS[src], _FLOATS[dst]
        x = torch.from_numpy(np.ascontiguousarray(data).view(_INTS[s.itemsize][0])).view(s)
        return x.to(d).view(_INTS[d.itemsize][1]).numpy().view(f"uint{8 * d.itemsize}")
    ti._convert_float = _convert_float
    """
)


def run_under_interpreter(body: str, timeout: int = 300) -> None:
    """Run ``body`` in a fresh interpreter-mode Python (with the patches); it prints 'interpreter ok'."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    script = INTERPRETER_PATCH + ROUNDING_PATCH + textwrap.dedent(body)
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0 and "interpreter ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be run")
def test_triton_kernels_under_interpreter():
    """Both kernels on kv_lora 32, rope 16, H 2, block 16, T 5 (row 2 a -1 pad row; in the
    first case row 4 is TP padding), every cache/output dtype."""
    run_under_interpreter(
        """
        import torch
        from tests.kernels.test_mla_fused_kernels import check_kv_write, check_stage, FP8_DTYPE
        from kernels.mla_kv_write import write_kv_cache_triton
        from kernels.mla_query_stage import stage_query_triton
        BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
        check_kv_write(write_kv_cache_triton, 5, 32, 16, BF16, FP8_DTYPE, n_slots=4, k_scale=0.01)
        for kv_dtype, cache_dtype in [(BF16, BF16), (FP16, FP16), (FP32, FP32), (BF16, FP32), (FP32, FP8_DTYPE)]:
            check_kv_write(write_kv_cache_triton, 5, 32, 16, kv_dtype, cache_dtype, k_scale=0.05, seed=1)
        for dtype, out_dtype in [(BF16, BF16), (BF16, FP8_DTYPE), (FP16, FP16), (FP32, FP32), (FP32, FP8_DTYPE)]:
            check_stage(stage_query_triton, 5, 2, 24, 32, 16, dtype, out_dtype, q_scale=0.01)
        print("interpreter ok")
        """
    )


# ----------------------------------------------------------------------------- GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [BF16, FP8_DTYPE])
@pytest.mark.parametrize("t,n_slots,pads", [(1, 1, ()), (7, 6, (0, 3)), (300, 300, (5,)), (64, 40, ())])
def test_kv_write_gpu(cache_dtype, t, n_slots, pads):
    check_kv_write(write_kv_cache, t, 512, 64, BF16, cache_dtype, block=64, num_blocks=16, n_slots=n_slots,
                   pads=pads, k_scale=0.01, seed=t, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype,cache_dtype", [(FP16, FP16), (FP32, FP32), (FP16, FP8_DTYPE)])
def test_kv_write_gpu_other_dtypes(kv_dtype, cache_dtype):
    check_kv_write(write_kv_cache, 33, 512, 64, kv_dtype, cache_dtype, block=64, num_blocks=4, pads=(7,),
                   k_scale=0.02, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("out_dtype", [BF16, FP8_DTYPE])
@pytest.mark.parametrize("t,h", [(1, 16), (64, 16), (1, 128), (96, 128)])
def test_stage_gpu(out_dtype, t, h):
    check_stage(stage_query, t, h, 128, 512, 64, BF16, out_dtype, q_scale=0.01, seed=t + h, device="cuda")


@gpu
@needs_cuda
def test_dispatch_picks_triton_on_cuda():
    kv = torch.zeros(2, 576, dtype=BF16, device="cuda")
    assert kv_write_uses_triton(kv, torch.zeros(2, 64, 576, dtype=FP8_DTYPE, device="cuda"))
    assert not kv_write_uses_triton(kv, torch.zeros(2, 64, 1152, dtype=BF16, device="cuda")[..., :576])
    assert stage_uses_triton(kv)


@gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [BF16, FP8_DTYPE])
def test_cuda_graph_capture(cache_dtype):
    """Both launches capture (no host sync) and a replay on new inputs matches eager."""
    t, h = 8, 16
    kv, weight, positions, cache, slots = make_kv_case(t, 512, 64, BF16, cache_dtype, 64, 4, t, (3,), 5, "cuda")
    q_nope, w_uk, q_pe, _ = make_stage_case(t, h, 128, 512, 64, BF16, 5, "cuda")
    cs = cos_sin(64, "cuda")
    out_dtype = cache_dtype
    q_out = torch.empty(t, h, 576, dtype=out_dtype, device="cuda")

    def step():
        write_kv_cache(kv, weight, EPS, positions, cs, cache, slots, 0.02)
        stage_query(q_nope, w_uk, q_pe, positions, cs, out_dtype, 0.03, out=q_out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator(device="cuda").manual_seed(9)
    for x in (kv, q_nope, q_pe):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
    positions.copy_(torch.randint(0, MAX_POS, (t,), generator=g, device="cuda"))
    slots.copy_(torch.randperm(255, device="cuda")[:t])
    graph.replay()
    torch.cuda.synchronize()
    eager_cache = poisoned(cache.shape, cache_dtype, "cuda")
    write_kv_cache(kv, weight, EPS, positions, cs, eager_cache, slots, 0.02)
    eager_q = stage_query(q_nope, w_uk, q_pe, positions, cs, out_dtype, 0.03)
    flat, eager_flat = bits(cache.view(-1, 576)), bits(eager_cache.view(-1, 576))
    assert torch.equal(flat[slots.long()], eager_flat[slots.long()])
    assert torch.equal(bits(q_out), bits(eager_q))
