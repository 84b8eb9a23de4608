"""Weight codecs of V4/V4.1 checkpoints: exact E8M0 and e2m1 decoding, nibble order, and
quantize -> dequantize round trips on random non-zero data."""

from __future__ import annotations

import pytest
import torch

from kernels.weight_formats import (
    E8M0_DTYPE,
    FP8_BLOCK,
    MXFP4,
    QuantizedWeight,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    e8m0_to_float,
    float_to_e8m0,
    float_to_fp4_codes,
    fp4_codes_to_float,
    pack_fp4,
    quantize,
    quantize_fp8_blocks,
    quantize_mxfp4,
    unpack_fp4,
)


def test_e8m0_bytes_decode_to_powers_of_two():
    b = torch.tensor([0, 1, 120, 126, 127, 128, 131, 254], dtype=torch.uint8)
    want = torch.tensor([2.0**-127, 2.0**-126, 2.0**-7, 0.5, 1.0, 2.0, 16.0, 2.0**127])
    assert torch.equal(e8m0_to_float(b.view(E8M0_DTYPE)), want)
    assert torch.equal(e8m0_to_float(b), want)
    assert torch.equal(float_to_e8m0(want).view(torch.uint8), b)
    f32 = torch.tensor([0.25, 3.0])  # R1-style float32 scales pass through
    assert torch.equal(e8m0_to_float(f32), f32)


def test_e2m1_code_table():
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert torch.equal(fp4_codes_to_float(codes), want)
    nonzero = torch.tensor([i for i in range(16) if i % 8])
    assert torch.equal(float_to_fp4_codes(want[nonzero]), codes[nonzero])  # every non-zero value round-trips
    assert float_to_fp4_codes(torch.tensor([-0.0])).item() == 0  # -0 is stored as +0


def test_low_nibble_is_the_even_index():
    # byte 0x7A: low nibble 0xA (-1.0) is k=0, high nibble 0x7 (6.0) is k=1
    packed = torch.tensor([[0x7A, 0x21]], dtype=torch.uint8).view(torch.int8)
    assert unpack_fp4(packed).tolist() == [[0xA, 0x7, 0x1, 0x2]]
    assert torch.equal(fp4_codes_to_float(unpack_fp4(packed)), torch.tensor([[-1.0, 6.0, 0.5, 1.0]]))
    assert torch.equal(pack_fp4(torch.tensor([[0xA, 0x7, 0x1, 0x2]], dtype=torch.uint8)), packed)


def test_fp4_rounds_to_nearest_ties_to_even_code():
    x = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.75, -5.0])
    got = fp4_codes_to_float(float_to_fp4_codes(x))
    assert got.tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0]


def test_mxfp4_exact_on_representable_values():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(1, 16, (6, 64), generator=gen, dtype=torch.uint8)
    codes[codes == 8] = 9  # -0 would come back as +0
    codes[:, ::32] = 7  # each group holds a 6.0, so its scale is exactly the group factor
    exps = torch.randint(-8, 4, (6, 2), generator=gen).float()
    w = fp4_codes_to_float(codes) * torch.exp2(exps).repeat_interleave(32, dim=1)
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 32)
    assert scale.dtype == E8M0_DTYPE and scale.shape == (6, 2)
    assert torch.equal(scale.view(torch.uint8).long(), (exps + 127).long())
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(dequantize_mxfp4(packed, scale), w)


def test_mxfp4_round_trip_random():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 40, 96, generator=gen) * 0.05 + 1e-3
    q = quantize(w, MXFP4, (1, 32))
    assert q.shape == (3, 40, 96) and q.data.shape == (3, 40, 48) and q.scale.shape == (3, 40, 3)
    back = q.dequantize()
    group_amax = w.abs().reshape(3, 40, 3, 32).amax(-1).repeat_interleave(32, dim=-1)
    # the widest e2m1 gap (4..6) is 2 scaled units; scale <= amax/3, so the error is <= amax/3
    assert ((back - w).abs() <= group_amax / 3 + 1e-7).all()
    assert (back - w).abs().mean() < 0.15 * w.abs().mean()
    assert (back != 0).float().mean() > 0.8


@pytest.mark.parametrize("block", [(128, 128), (32, 32), (1, 32)])
def test_fp8_blocks_ue8m0_round_trip(block):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 160, generator=gen) * 0.02 + 1e-4  # ragged against 128-blocks
    q8, scale = quantize_fp8_blocks(w, block, "ue8m0")
    assert q8.dtype == torch.float8_e4m3fn and scale.dtype == E8M0_DTYPE
    assert scale.shape == (-(-96 // block[0]), -(-160 // block[1]))
    s = e8m0_to_float(scale)
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # powers of two
    back = dequantize_fp8_blocks(q8, scale, block)
    assert ((back - w).abs() <= w.abs() / 16 + s.max() * 2.0**-9).all()
    # representable input comes back exactly
    assert torch.equal(dequantize_fp8_blocks(*quantize_fp8_blocks(back, block), block), back)


def test_fp8_blocks_float32_scales_r1_style():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    q8, scale = quantize_fp8_blocks(w, (32, 32), "float32")
    assert scale.dtype == torch.float32 and scale.shape == (2, 2)
    assert torch.allclose(scale, w.abs().reshape(2, 32, 2, 32).amax((1, 3)) / 448)
    assert (dequantize_fp8_blocks(q8, scale, (32, 32)) - w).abs().max() <= w.abs().max() / 16


def test_quantized_weight_record_and_stacked_experts():
    w = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(4)) * 0.1
    q = quantize(w, FP8_BLOCK, (32, 32))
    assert isinstance(q, QuantizedWeight) and q.format == FP8_BLOCK and q.block == (32, 32)
    assert q.shape == (2, 64, 64) and q.scale.shape == (2, 2, 2)
    assert torch.equal(q.dequantize(), torch.stack([quantize(m, FP8_BLOCK, (32, 32)).dequantize() for m in w]))
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize(w, "int4", (1, 32))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.ones(4, 48))
