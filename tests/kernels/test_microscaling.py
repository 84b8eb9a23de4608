"""Microscaling fake-quant references: exact grid values, round-trip properties, random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import pow2_ceil
from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0, round_to_e2m1
from kernels.weight_formats import E2M1_MAGNITUDES as FP4_E2M1_GRID


def _random(shape, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    return x + torch.sign(x) * 1e-3  # never exactly zero


def test_pow2_ceil_exact():
    t = torch.tensor([1.0, 1.0000001, 0.75, 3.0, 4.0, 2.0**-20 * 1.5, 448.0])
    assert torch.equal(pow2_ceil(t), torch.tensor([1.0, 2.0, 1.0, 4.0, 4.0, 2.0**-19, 512.0]))


def test_e2m1_rounding_ties_to_even_code():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 0.26, -0.3, -2.9, 6.0, -6.0, 0.1])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, -0.5, -3.0, 6.0, -6.0, 0.0])
    assert torch.equal(round_to_e2m1(x), want)


def test_fp4_ue8m0_exact_grid_values():
    # amax 6 -> scale exactly 1: every grid value survives, midpoints round as e2m1 does.
    row = torch.tensor(list(FP4_E2M1_GRID) * 2 + [-v for v in FP4_E2M1_GRID] * 2)
    assert torch.equal(fake_quant_fp4(row[None], 32, "ue8m0")[0], row)
    # amax 3 -> scale 2^ceil(log2(0.5)) = 0.5: x/0.5 = [6, 1.5, 0.5, 0.6 -> 0.5]
    blk = torch.tensor([3.0, 0.75, 0.25, 0.3] + [0.0] * 28)
    out = fake_quant_fp4(blk, 32, "ue8m0")
    assert torch.equal(out[:4], torch.tensor([3.0, 0.75, 0.25, 0.25]))


def test_fp4_e4m3_scale_is_e4m3_rounded():
    blk = torch.tensor([5.0] + [1.0] * 15)
    out = fake_quant_fp4(blk, 16, "e4m3")
    scale = torch.tensor(5.0 / 6.0).to(torch.float8_e4m3fn).float()  # 0.8125
    assert scale.item() == 0.8125
    assert torch.equal(out, round_to_e2m1((blk / scale).clamp(-6, 6)) * scale)


def test_fp8_exact_values():
    # amax 448 -> scale 1; 1.0625 is a tie between 1.0 and 1.125 -> even mantissa (1.0).
    blk = torch.tensor([448.0, 1.0625, 1.1875, -3.0] + [0.5] * 28)
    out = fake_quant_fp8_ue8m0(blk, 32)
    assert torch.equal(out[:4], torch.tensor([448.0, 1.0, 1.25, -3.0]))


@pytest.mark.parametrize("kind", ["fp8", "fp4_ue8m0", "fp4_e4m3"])
def test_random_inputs_land_on_the_grid(kind):
    x = _random((5, 3, 64), seed=1)
    block = 16 if kind == "fp4_e4m3" else 32
    if kind == "fp8":
        q = fake_quant_fp8_ue8m0(x, block)
    else:
        q = fake_quant_fp4(x, block, kind.split("_")[1])
    assert q.shape == x.shape and q.dtype == x.dtype
    b, qb = x.view(5, 3, -1, block), q.view(5, 3, -1, block)
    amax = b.abs().amax(-1, keepdim=True)
    if kind == "fp8":
        scale = pow2_ceil(amax / 448.0)
        assert torch.equal((qb / scale).to(torch.float8_e4m3fn).float(), qb / scale)
        rel = ((qb - b).abs() / b.abs()).max()
        assert rel <= 2.0**-4  # e4m3: 3 mantissa bits, half an ulp
    else:
        if kind == "fp4_ue8m0":
            scale = pow2_ceil(amax / 6.0)
        else:
            scale = (amax / 6.0).to(torch.float8_e4m3fn).float()
        grid = torch.tensor(FP4_E2M1_GRID)
        on_grid = ((qb / scale).abs().unsqueeze(-1) == grid).any(-1)
        assert on_grid.all()
        assert ((qb - b).abs() <= scale * 1.0 + 1e-6).all()  # ≤ half the widest step (2)
    assert not torch.equal(q, x)


@pytest.mark.parametrize("kind", ["fp8", "fp4_ue8m0"])
def test_power_of_two_quant_is_idempotent(kind):
    x = _random((7, 96), seed=2)
    f = (lambda t: fake_quant_fp8_ue8m0(t, 32)) if kind == "fp8" else (lambda t: fake_quant_fp4(t, 32, "ue8m0"))
    once = f(x)
    assert torch.equal(f(once), once)


def test_sign_symmetry_and_bf16_dtype():
    x = _random((4, 64), seed=3)
    assert torch.equal(fake_quant_fp4(-x, 32, "ue8m0"), -fake_quant_fp4(x, 32, "ue8m0"))
    assert torch.equal(fake_quant_fp8_ue8m0(-x), -fake_quant_fp8_ue8m0(x))
    xb = x.bfloat16()
    assert fake_quant_fp8_ue8m0(xb).dtype == torch.bfloat16


def test_unblockable_width_passes_through():
    x = _random((3, 24), seed=4)
    assert fake_quant_fp8_ue8m0(x, 32) is x
    assert fake_quant_fp4(x, 16, "e4m3") is x


def test_all_zero_block_stays_zero():
    z = torch.zeros(2, 32)
    assert torch.equal(fake_quant_fp8_ue8m0(z), z)
    assert torch.equal(fake_quant_fp4(z, 16, "e4m3"), z)
