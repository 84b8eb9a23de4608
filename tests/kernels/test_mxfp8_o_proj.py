"""V4.1's MXFP8 output projection (kernels/mxfp8_o_proj.py): inverse RoPE → wo_a → wo_b.

CPU (CI): the reference's inverse RoPE is the model's (bit for bit), and the quantized
composition stays close to HF's unquantized one; the fused inverse-RoPE + MXFP8 kernel and
the three-launch path under TRITON_INTERPRET=1, byte for byte against the reference.
GPU (``-m gpu``): V4.1-Flash TP1 and TP8 shard shapes, eager and CUDA-graph replays.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from kernels.mxfp8_o_proj import inverse_rope_reference, o_proj_reference
from kernels.weight_formats import dequantize_fp8_blocks, quantize_fp8_blocks
from model.v4.rope import apply_trailing_rope
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH
from tests.kernels.test_mxfp8_gemm import capture, run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def quantize_weight(w):
    return quantize_fp8_blocks(w, (32, 32))  # V4.1's 32×32 UE8M0 blocks


def make_case(t, heads, head_dim, rope, groups, rank, hidden, seed=0, device="cpu", dtype=torch.bfloat16):
    """Attention output, RoPE tables rounded to its dtype (as the model does) and MXFP8 weights."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(t, heads, head_dim, generator=g) * 2
    o = o + torch.sign(o) * 1e-3
    angles = torch.rand(t, rope // 2, generator=g) * 1000
    wa = quantize_weight(torch.randn(groups * rank, heads * head_dim // groups, generator=g) * 0.03)
    wb = quantize_weight(torch.randn(hidden, groups * rank, generator=g) * 0.03)
    wa, wb = (tuple(x.to(device) for x in w) for w in (wa, wb))
    return (o.to(dtype).to(device), angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device), wa, wb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inverse_rope_is_the_models(dtype):
    o, cos, sin, _, _ = make_case(5, 3, 64, 16, 1, 32, 32, dtype=dtype)
    ref = inverse_rope_reference(o, cos, sin)
    assert torch.equal(ref, apply_trailing_rope(o, cos, sin, inverse=True))
    assert torch.equal(ref[..., :48], o[..., :48])
    back = apply_trailing_rope(ref.float(), cos.float(), sin.float())
    assert rel_err(back, o.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_reference_close_to_unquantized_projection():
    """HF's path: bf16 o', bf16 z, no activation quantization (same weights)."""
    groups, rank = 2, 64
    o, cos, sin, wa, wb = make_case(9, 4, 128, 32, groups, rank, 96, dtype=torch.float32)
    out = o_proj_reference(o, cos, sin, wa, wb, groups)
    op = inverse_rope_reference(o, cos, sin).reshape(9, groups, -1)
    z = torch.einsum("tgk,grk->tgr", op, dequantize_fp8_blocks(*wa, (32, 32)).reshape(groups, rank, -1))
    hf = z.reshape(9, -1).bfloat16().float() @ dequantize_fp8_blocks(*wb, (32, 32)).t()
    assert out.shape == (9, 96) and out.dtype == torch.float32
    assert 1e-4 < rel_err(out, hf) < 5e-2  # two MXFP8 activation roundings, nothing else


def test_validation():
    o, cos, sin, wa, wb = make_case(3, 4, 64, 16, 2, 32, 32)
    with pytest.raises(ValueError, match="wo_a"):
        o_proj_reference(o, cos, sin, wa, wb, groups=4)
    with pytest.raises(ValueError, match="wo_b"):
        o_proj_reference(o, cos, sin, wa, quantize_weight(torch.randn(32, 96)), groups=2)


_INTERPRET_SCRIPT = INTERPRETER_PATCH + textwrap.dedent(
    """
    import torch
    from kernels.microscaling import quantize_mxfp8
    from kernels.mxfp8_o_proj import inverse_rope_reference, mxfp8_o_proj, o_proj_reference
    from kernels.mxfp8_quant_triton import inverse_rope_quantize_mxfp8_triton
    from tests.kernels.test_mxfp8_o_proj import make_case, rel_err

    for t, dtype in [(1, torch.bfloat16), (129, torch.bfloat16), (6, torch.float32)]:
        o, cos, sin, wa, wb = make_case(t, 4, 128, 32, 2, 64, 96, seed=t, dtype=dtype)
        q, s = inverse_rope_quantize_mxfp8_triton(o, cos, sin)
        rq, rs = quantize_mxfp8(inverse_rope_reference(o, cos, sin).reshape(t, -1))
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs), t
        out = mxfp8_o_proj(o, cos, sin, wa, wb, 2)
        ref = o_proj_reference(o, cos, sin, wa, wb, 2)
        assert out.dtype == dtype and out.shape == (t, 96)
        assert rel_err(out, ref) < 1e-3, (t, rel_err(out, ref))  # fp32 sum order may move a bf16 z ulp
    print("interpreter ok")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_fused_path_under_interpreter():
    run_interpreted(_INTERPRET_SCRIPT)


# V4.1-Flash: 64 heads × 512 (rope 64) in 8 groups → 1024 each, hidden 5120; TP8 holds 8 heads, 1 group
FLASH_TP = {"tp1": (64, 8), "tp8": (8, 1)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tp", sorted(FLASH_TP))
@pytest.mark.parametrize("tokens", [1, 129, 2048])
def test_gpu_fused_o_proj_matches_reference(tp, tokens):
    from kernels.microscaling import quantize_mxfp8
    from kernels.mxfp8_o_proj import mxfp8_o_proj
    from kernels.mxfp8_quant_triton import inverse_rope_quantize_mxfp8_triton

    heads, groups = FLASH_TP[tp]
    o, cos, sin, wa, wb = make_case(tokens, heads, 512, 64, groups, 1024, 5120, seed=tokens, device="cuda")
    q, s = inverse_rope_quantize_mxfp8_triton(o, cos, sin)
    rq, rs = quantize_mxfp8(inverse_rope_reference(o, cos, sin).reshape(tokens, -1))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    ref = o_proj_reference(o, cos, sin, wa, wb, groups)
    out = mxfp8_o_proj(o, cos, sin, wa, wb, groups)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2

    static = [o.clone(), cos.clone(), sin.clone()]
    graph, captured = capture(lambda: mxfp8_o_proj(*static, wa, wb, groups))
    o2, cos2, sin2, _, _ = make_case(tokens, heads, 512, 64, groups, 1024, 5120, seed=tokens + 1, device="cuda")
    for dst, src in zip(static, (o2, cos2, sin2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, mxfp8_o_proj(o2, cos2, sin2, wa, wb, groups))
