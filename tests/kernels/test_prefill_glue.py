"""The fused glue kernels of the prefill path (kernels/fused_glue.py's switch): add + RMSNorm,
the in-place query RoPE, MLA's K/V assembly and SiLU·mul.

CPU (CI): each torch reference against independent float64 math, the dispatch (CPU and
``unfused_glue`` take the references), and the four Triton kernels under TRITON_INTERPRET=1
on tiny random shapes, in one subprocess, with every fresh ``torch.empty`` NaN-poisoned so an
element a kernel does not write shows up. GPU (``-m gpu``): the same checks at real shapes
(V2-Lite and R1 widths, 8192-token steps), the caching allocator poisoned with NaN first, and
CUDA-graph capture (the norm and SiLU·mul also run inside decode graphs).

Exactness: RoPE, K/V assembly and the residual sum are bit-equal to torch; the norm may
differ by one ulp (fp32 sum order), SiLU·mul by one ulp (fp32 exp).
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_reference
from kernels.activation import triton_supports as silu_uses_triton
from kernels.fused_glue import unfused_glue
from kernels.mla_prefill import assemble_prefill_kv, assemble_prefill_kv_reference
from kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm
from kernels.rmsnorm import triton_supports as norm_uses_triton
from kernels.rope import apply_rope_inplace, apply_rope_inplace_reference, apply_rope_interleaved_reference
from tests.kernels.test_mla_fused_kernels import (
    EPS, MAX_POS, assert_rounded, bits, cos_sin, exact_norm, exact_rope, pair_magnitude, run_under_interpreter,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_within_ulps(actual, expected, dtype, ulps=1):
    """|actual - expected| <= ulps ulps of ``dtype`` at |expected| (NaN fails)."""
    fi = torch.finfo(dtype)
    err = (actual.double() - expected.double()).abs()
    bound = ulps * fi.eps * (expected.double().abs() + fi.tiny)
    assert not actual.isnan().any() and (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


# ----------------------------------------------------------------------------- cases (CPU, interpreter, GPU)


def check_norm(impl, t, n, dtype, residual=True, lead=(), row_pad=0, seed=0, device="cpu"):
    """``impl`` (an add_rms_norm-like function) on x [*lead, t, n] (rows ``row_pad`` wider than n
    when given: a strided view) against the reference."""
    g = _gen(seed)
    x = (torch.randn(*lead, t, n + row_pad, generator=g) * 3).to(dtype)[..., :n]
    r = torch.randn(*lead, t, n, generator=g).to(dtype) if residual else None
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    x_dev, r_dev, w_dev = (None if a is None else a.to(device) for a in (x, r, w))
    out, res = impl(x_dev, r_dev, w_dev, EPS)
    out, res = out.cpu(), res.cpu()
    ref_out, ref_res = add_rms_norm_reference(x, r, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype and res.shape == x.shape
    assert torch.equal(bits(res), bits(ref_res.contiguous())), "the residual sum differs from torch's x + residual"
    # The fp32 sum order may differ: one ulp of a 16-bit dtype, a few of fp32 (whose own
    # rounding no longer hides the statistic's).
    assert_within_ulps(out, ref_out, dtype, ulps=1 if dtype.itemsize == 2 else 8)
    assert_rounded(out, exact_norm(ref_res, w), dtype, half_ulps=3)


def check_rope_inplace(impl, t, h, d, rope, dtype, head_pad=0, seed=0, device="cpu"):
    """``impl`` rotates the tail of rows 1..t of a [t + 2, h, d + head_pad] buffer's
    [..., :d] view; everything else must stay as it was, bit for bit."""
    g = _gen(seed)
    buf = torch.randn(t + 2, h, d + head_pad, generator=g).to(dtype).to(device)
    x = buf[1 : t + 1, :, :d]
    positions = torch.randint(0, MAX_POS, (t,), generator=g)
    positions[0] = MAX_POS - 1
    cs = cos_sin(rope)
    before = buf.cpu().clone()
    got = impl(x, positions.to(device), cs.to(device))
    assert got.data_ptr() == x.data_ptr() and got.shape == x.shape
    after = buf.cpu()
    want = before.clone()
    tail = want[1 : t + 1, :, d - rope : d]
    tail.copy_(apply_rope_interleaved_reference(tail.clone(), positions, cs))
    assert torch.equal(bits(after), bits(want)), "rotated tail differs from torch, or a byte outside it changed"


def check_assemble(impl, tk, h, nope, dv, rope, v_width, dtype, strided_pe=False, seed=0, device="cpu"):
    """``impl`` (an assemble_prefill_kv-like function) against the reference, bit for bit; k_pe
    a column slice of [latent ‖ k_pe] rows when ``strided_pe`` (the cached-prefix layout)."""
    g = _gen(seed)
    kv = torch.randn(tk, h * (nope + dv), generator=g).to(dtype).view(tk, h, nope + dv)
    latent = torch.randn(tk, 40 + rope, generator=g).to(dtype)
    k_pe = latent[:, 40:] if strided_pe else latent[:, 40:].contiguous()
    k, v = impl(kv.to(device), k_pe.to(device), nope, v_width)
    ref_k, ref_v = assemble_prefill_kv_reference(kv, k_pe, nope, v_width)
    assert k.shape == (tk, h, nope + rope) and v.shape == (tk, h, v_width)
    assert torch.equal(bits(k.cpu()), bits(ref_k)) and torch.equal(bits(v.cpu()), bits(ref_v.contiguous()))
    if v_width > dv:
        assert not v.cpu()[..., dv:].bool().any(), "padding columns must be zeros"


def check_silu(impl, t, inter, dtype, seed=0, device="cpu"):
    g = _gen(seed)
    x = (torch.randn(t, 2 * inter, generator=g) * 4).to(dtype)
    got = impl(x.to(device)).cpu()
    ref = silu_and_mul_reference(x)
    assert got.shape == (t, inter) and got.dtype == dtype
    # e^-g may differ from torch's by an fp32 ulp: silu's rounding, then the product's, can
    # each move one ulp.
    assert_within_ulps(got, ref, dtype, ulps=2)


# ----------------------------------------------------------------------------- CPU: references


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_add_rms_norm_reference_vs_exact_math(dtype):
    g = _gen(1)
    x, r = (torch.randn(9, 48, generator=g) * 3).to(dtype), torch.randn(9, 48, generator=g).to(dtype)
    w = (torch.rand(48, generator=g) + 0.5).to(dtype)
    out, res = add_rms_norm_reference(x, r, w, EPS)
    assert torch.equal(res, x + r)
    assert_rounded(out, exact_norm(res, w), dtype)
    out1, same = add_rms_norm_reference(x, None, w, EPS)
    assert same is x and torch.equal(out1, rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_rope_inplace_reference_vs_exact_math(dtype):
    g = _gen(2)
    x = torch.randn(6, 3, 40, generator=g).to(dtype)
    positions = torch.randint(0, MAX_POS, (6,), generator=g)
    cs = cos_sin(16)
    before = x.clone()
    assert apply_rope_inplace_reference(x, positions, cs) is x
    assert torch.equal(x[..., :24], before[..., :24])
    rot = exact_rope(before[..., 24:], positions, cs)
    assert_rounded(x[..., 24:], rot, dtype, pair_magnitude(rot))


def test_assemble_kv_reference_layout():
    g = _gen(3)
    kv = torch.randn(5, 3, 10 + 6, generator=g)
    k_pe = torch.randn(5, 4, generator=g)
    k, v = assemble_prefill_kv_reference(kv, k_pe, 10, 14)
    for t in range(5):
        for h in range(3):
            assert torch.equal(k[t, h], torch.cat([kv[t, h, :10], k_pe[t]]))
            assert torch.equal(v[t, h], torch.cat([kv[t, h, 10:], torch.zeros(8)]))
    k2, v2 = assemble_prefill_kv_reference(kv, k_pe, 10, 6)
    assert torch.equal(k2, k) and torch.equal(v2, kv[..., 10:])


def test_silu_and_mul_reference_vs_exact_math():
    x = torch.randn(7, 2 * 33, generator=_gen(4)).to(BF16)
    g, u = x.double().chunk(2, dim=-1)
    assert_rounded(silu_and_mul_reference(x), g / (1 + torch.exp(-g)) * u, BF16, half_ulps=3)


def test_cpu_dispatch_is_the_reference():
    """On CPU (and inside ``unfused_glue`` anywhere) every dispatch takes its torch reference."""
    x = torch.randn(4, 2, 24, generator=_gen(5)).to(BF16)
    assert not norm_uses_triton(x) and not silu_uses_triton(x)
    w = torch.rand(24, generator=_gen(6)).to(BF16)
    for ctx in (torch.no_grad(), unfused_glue()):
        with ctx:
            assert all(torch.equal(a, b) for a, b in zip(add_rms_norm(x, x, w, EPS),
                                                          add_rms_norm_reference(x, x, w, EPS)))
            assert torch.equal(silu_and_mul(x), silu_and_mul_reference(x))
            pos, cs = torch.arange(4), cos_sin(8)
            assert torch.equal(apply_rope_inplace(x.clone(), pos, cs), apply_rope_inplace_reference(x.clone(), pos, cs))
            kv, pe = x.reshape(4, 2, 24), torch.randn(4, 8, generator=_gen(7)).to(BF16)
            assert all(torch.equal(a, b) for a, b in zip(assemble_prefill_kv(kv, pe, 16, 16),
                                                          assemble_prefill_kv_reference(kv, pe, 16, 16)))


def test_input_validation():
    x = torch.zeros(3, 2, 24)
    with pytest.raises(ValueError, match="positions must be"):
        apply_rope_inplace(x, torch.arange(4), cos_sin(8))
    with pytest.raises(ValueError, match="even rope"):
        apply_rope_inplace(x, torch.arange(3), torch.zeros(10, 7))
    with pytest.raises(ValueError, match="do not fit"):
        assemble_prefill_kv(x, torch.zeros(3, 8), 16, 4)
    with pytest.raises(TypeError, match="share a dtype"):
        assemble_prefill_kv(x, torch.zeros(3, 8, dtype=BF16), 16, 8)
    with pytest.raises(ValueError, match="k_pe"):
        assemble_prefill_kv(x, torch.zeros(2, 8), 16, 8)


# ----------------------------------------------------------------------------- CPU: the Triton kernels

# Fresh buffers start as NaN, so an element a kernel leaves unwritten fails the comparison.
POISON_EMPTY = """
import torch
_empty, _empty_like = torch.empty, torch.empty_like
def _poison(t):
    if t.is_floating_point() and t.numel():
        t.view(torch.uint8).fill_(0x7F) if t.element_size() == 1 else t.fill_(float("nan"))
    return t
torch.empty = lambda *a, **k: _poison(_empty(*a, **k))
torch.empty_like = lambda *a, **k: _poison(_empty_like(*a, **k))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be run")
def test_triton_kernels_under_interpreter():
    """Norm widths 48/40 (non-power-of-two, strided rows, 3-D), RoPE 16 of 40 dims over 3 heads
    (strided heads, rows sliced out of a larger buffer), K/V assembly with v padded and not,
    k_pe strided, 20 heads (two head blocks), SiLU·mul at I 33 and 1100 (two column blocks)."""
    run_under_interpreter(POISON_EMPTY + textwrap.dedent("""
        from tests.kernels.test_prefill_glue import check_norm, check_rope_inplace, check_assemble, check_silu
        from kernels.rmsnorm import add_rms_norm_triton
        from kernels.rope import apply_rope_inplace_triton
        from kernels.mla_prefill import assemble_prefill_kv_triton
        from kernels.activation import silu_and_mul_triton
        BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
        check_norm(add_rms_norm_triton, 5, 48, BF16)
        check_norm(add_rms_norm_triton, 3, 40, FP16, residual=False, row_pad=8, seed=1)
        check_norm(add_rms_norm_triton, 2, 48, BF16, lead=(2,), seed=2)
        check_norm(add_rms_norm_triton, 4, 40, FP32, seed=3)
        check_rope_inplace(apply_rope_inplace_triton, 5, 3, 40, 16, BF16, head_pad=8)
        check_rope_inplace(apply_rope_inplace_triton, 4, 20, 24, 16, FP32, seed=1)
        check_assemble(assemble_prefill_kv_triton, 5, 3, 24, 20, 16, 40, BF16)
        check_assemble(assemble_prefill_kv_triton, 3, 20, 16, 16, 8, 16, FP16, strided_pe=True, seed=1)
        check_assemble(assemble_prefill_kv_triton, 2, 2, 16, 24, 16, 24, FP32, strided_pe=True, seed=2)
        check_silu(silu_and_mul_triton, 4, 33, BF16)
        check_silu(silu_and_mul_triton, 2, 1100, FP16, seed=1)
        print("interpreter ok")
        """))


# ----------------------------------------------------------------------------- GPU


def poison_cuda_allocator(nbytes: int = 2 << 30) -> None:
    """Leave NaN in the caching allocator's free blocks, so fresh buffers the kernels do not
    fully write hold NaN (best effort: the allocator may still hand out other memory)."""
    torch.cuda.empty_cache()
    torch.full((nbytes // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()


@gpu
@needs_cuda
@pytest.mark.parametrize("t,n,residual", [(8192, 2048, True), (8192, 2048, False), (37, 7168, True),
                                          (5, 512, False), (300, 1536, False), (1, 2048, True)])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_add_rms_norm_gpu(t, n, residual, dtype):
    poison_cuda_allocator()
    assert norm_uses_triton(torch.empty(1, n, dtype=dtype, device="cuda"))
    check_norm(add_rms_norm, t, n, dtype, residual=residual, seed=t, device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("t,h", [(8192, 16), (300, 128), (1, 16)])
def test_rope_inplace_gpu(t, h):
    check_rope_inplace(apply_rope_inplace, t, h, 192, 64, BF16, seed=t)
    check_rope_inplace(apply_rope_inplace, 33, h, 192, 64, BF16, head_pad=64, seed=h)  # a strided q view


@gpu
@needs_cuda
@pytest.mark.parametrize("tk,h", [(8192, 16), (700, 128), (1, 16)])
@pytest.mark.parametrize("v_width", [192, 128])
@pytest.mark.parametrize("strided_pe", [False, True])
def test_assemble_kv_gpu(tk, h, v_width, strided_pe):
    poison_cuda_allocator()
    check_assemble(assemble_prefill_kv, tk, h, 128, 128, 64, v_width, BF16, strided_pe=strided_pe, seed=tk,
                   device="cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("t,inter", [(8192, 2816), (8192, 1408), (3, 10944), (1, 256)])
def test_silu_and_mul_gpu(t, inter):
    poison_cuda_allocator()
    assert silu_uses_triton(torch.empty(1, 2 * inter, dtype=BF16, device="cuda"))
    check_silu(silu_and_mul, t, inter, BF16, seed=t, device="cuda")


@gpu
@needs_cuda
def test_dispatch_on_cuda_and_the_switch():
    x = torch.randn(4, 64, device="cuda", dtype=BF16)
    assert norm_uses_triton(x) and silu_uses_triton(x)
    assert not norm_uses_triton(x.float())  # fp32 norms (V4) stay on the reference
    with unfused_glue():
        assert not norm_uses_triton(x) and not silu_uses_triton(x)


@gpu
@needs_cuda
def test_norm_and_silu_capture_in_a_cuda_graph():
    """Decode graphs run the norm and SiLU·mul too: both capture, and a replay on new inputs
    matches eager."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8, 2048, device="cuda", dtype=BF16, generator=g)
    r = torch.randn(8, 2048, device="cuda", dtype=BF16, generator=g)
    w = torch.rand(2048, device="cuda", dtype=BF16, generator=g) + 0.5
    gu = torch.randn(8, 2 * 1408, device="cuda", dtype=BF16, generator=g)

    def step():
        return add_rms_norm(x, r, w, EPS), silu_and_mul(gu)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, res), h = step()
    for t in (x, r, gu):
        t.copy_(torch.randn(t.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    (e_out, e_res), e_h = step()
    assert torch.equal(out, e_out) and torch.equal(res, e_res) and torch.equal(h, e_h)
