"""Fused MLA KV-cache write: RMSNorm + RoPE + (FP8 quantization) + scatter, one pass per token.

``kv_a_proj_with_mqa`` gives each token [latent (kv_lora) ‖ rope part]. The cache entry is
[rms_norm(latent) ‖ rope(rope part)] (docs/architecture.md, "MLA latent cache"), e4m3 with the
layer's ``k_scale`` for an FP8 cache. Unfused that is a norm, a rope, two quantizations and an index_copy — five
launches and three round trips through memory per layer; the Triton kernel reads the row
once and writes the cache entry plus the two compute-dtype results the prefill path needs.

Rounding follows the torch composition exactly: norm and rope in fp32, rounded to the
compute dtype (what the prefill path sees), and *those* values are quantized (``x / k_scale``
by IEEE division, saturated to ±448, round-to-nearest-even). So the cache always equals
``quantize(returned values)`` bit for bit; only the norm's fp32 sum order differs from torch.

Slot -1 marks a padding row: it is written to the cache's last slot, which the runner keeps
as scratch (no masking by value, so shapes are fixed and the launch is CUDA-graph safe).
Rows past ``len(slot_mapping)`` (TP padding) are normalized and rotated but not written.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_per_tensor
from kernels.rmsnorm import rms_norm_reference
from kernels.rope import apply_rope_interleaved_reference

try:  # the GPU path needs Triton; the CPU reference does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CACHE_DTYPES = COMPUTE_DTYPES + (FP8_DTYPE,)


def _check(kv, norm_weight, positions, cos_sin_cache, kv_cache, slot_mapping) -> tuple[int, int]:
    """Validate shapes and dtypes; returns (kv_lora, rope)."""
    if kv.dim() != 2 or norm_weight.dim() != 1:
        raise ValueError(f"kv must be [T, kv_lora+rope] and norm_weight [kv_lora]; got "
                         f"{tuple(kv.shape)} and {tuple(norm_weight.shape)}")
    if kv.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"kv must be bf16/fp16/fp32, got {kv.dtype}")
    t, width = kv.shape
    lora = norm_weight.shape[0]
    rope = width - lora
    if rope <= 0 or rope % 2:
        raise ValueError(f"kv width {width} minus kv_lora {lora} must be a positive even rope dim")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope:
        raise ValueError(f"cos_sin_cache must be [max_pos, {rope}], got {tuple(cos_sin_cache.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(f"kv_cache must be [num_blocks, block, {width}], got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} is not one of {CACHE_DTYPES}")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [{t}], got {tuple(positions.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > t:
        raise ValueError(f"slot_mapping must be 1-D with at most {t} entries, got {tuple(slot_mapping.shape)}")
    return lora, rope


def write_kv_cache_reference(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, composed from the unfused torch references."""
    lora, _ = _check(kv, norm_weight, positions, cos_sin_cache, kv_cache, slot_mapping)
    kv_c = rms_norm_reference(kv[:, :lora], norm_weight, eps)
    k_pe = apply_rope_interleaved_reference(kv[:, lora:], positions, cos_sin_cache)
    n = slot_mapping.shape[0]
    entries = torch.cat([kv_c[:n], k_pe[:n]], dim=-1)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    slots = torch.where(slot_mapping >= 0, slot_mapping, flat.shape[0] - 1).long()
    if kv_cache.dtype == FP8_DTYPE:  # index_copy has no fp8 kernel: move the bytes
        flat.view(torch.uint8).index_copy_(0, slots, quantize_per_tensor(entries, k_scale).view(torch.uint8))
    else:
        flat.index_copy_(0, slots, entries.to(kv_cache.dtype))
    return kv_c, k_pe


if triton is not None:
    _SAT = tl.constexpr(FP8_MAX)  # e4m3's largest finite value

    @triton.jit
    def _kv_write_kernel(
        KV, W, POS, CS, CACHE, SLOTS, OUT_C, OUT_PE,
        n_slots, cache_rows, stride_kv, stride_cs, stride_oc, stride_ope, eps, k_scale,
        LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_LORA: tl.constexpr, BLOCK_HALF: tl.constexpr,
        FP8: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        src = KV + row * stride_kv
        # Latent: RMSNorm in fp32, rounded to the compute dtype like the reference.
        cols = tl.arange(0, BLOCK_LORA)
        cmask = cols < LORA
        x = tl.load(src + cols, mask=cmask, other=0.0).to(tl.float32)
        mean_sq = tl.math.div_rn(tl.sum(x * x, 0), LORA * 1.0)  # IEEE ops throughout, as torch
        inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        kv_c = (w * (x * inv_rms)).to(OUT_C.dtype.element_ty)
        tl.store(OUT_C + row * stride_oc + cols, kv_c, mask=cmask)
        # Rope part: interleaved pairs (x[2i], x[2i+1]) rotated by the position's angle i.
        HALF: tl.constexpr = ROPE // 2
        i = tl.arange(0, BLOCK_HALF)
        imask = i < HALF
        cs = CS + tl.load(POS + row).to(tl.int64) * stride_cs
        cos = tl.load(cs + i, mask=imask, other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF + i, mask=imask, other=0.0).to(tl.float32)
        x_even = tl.load(src + LORA + 2 * i, mask=imask, other=0.0).to(tl.float32)
        x_odd = tl.load(src + LORA + 2 * i + 1, mask=imask, other=0.0).to(tl.float32)
        pe_even = (x_even * cos - x_odd * sin).to(OUT_PE.dtype.element_ty)
        pe_odd = (x_odd * cos + x_even * sin).to(OUT_PE.dtype.element_ty)
        tl.store(OUT_PE + row * stride_ope + 2 * i, pe_even, mask=imask)
        tl.store(OUT_PE + row * stride_ope + 2 * i + 1, pe_odd, mask=imask)
        # Cache entry: rows past n_slots are TP padding (no write); slot -1 → scratch slot.
        write = row < n_slots
        slot = tl.load(SLOTS + row, mask=write, other=0).to(tl.int64)
        slot = tl.where(slot >= 0, slot, cache_rows - 1)
        dst = CACHE + slot * (LORA + ROPE)
        if FP8:
            c_val = tl.clamp(tl.math.div_rn(kv_c.to(tl.float32), k_scale), -_SAT, _SAT)
            e_val = tl.clamp(tl.math.div_rn(pe_even.to(tl.float32), k_scale), -_SAT, _SAT)
            o_val = tl.clamp(tl.math.div_rn(pe_odd.to(tl.float32), k_scale), -_SAT, _SAT)
        else:
            c_val, e_val, o_val = kv_c, pe_even, pe_odd
        ty = CACHE.dtype.element_ty
        tl.store(dst + cols, c_val.to(ty), mask=cmask & write)
        tl.store(dst + LORA + 2 * i, e_val.to(ty), mask=imask & write)
        tl.store(dst + LORA + 2 * i + 1, o_val.to(ty), mask=imask & write)


def write_kv_cache_triton(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel (CUDA, or CPU under TRITON_INTERPRET=1); same contract as the reference."""
    if triton is None:
        raise RuntimeError("the fused KV-cache write needs the triton package")
    lora, rope = _check(kv, norm_weight, positions, cos_sin_cache, kv_cache, slot_mapping)
    if not kv_cache.is_contiguous():
        raise ValueError("the fused KV-cache write needs a contiguous kv_cache")
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    t = kv.shape[0]
    kv_c = torch.empty(t, lora, dtype=kv.dtype, device=kv.device)
    k_pe = torch.empty(t, rope, dtype=kv.dtype, device=kv.device)
    if t == 0:
        return kv_c, k_pe
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    slots = slot_mapping if slot_mapping.numel() else slot_mapping.new_zeros(1)  # never read then
    block_lora = triton.next_power_of_2(lora)
    _kv_write_kernel[(t,)](
        kv, norm_weight, positions, cs, kv_cache, slots, kv_c, k_pe,
        slot_mapping.shape[0], kv_cache.shape[0] * kv_cache.shape[1], kv.stride(0), cs.stride(0),
        kv_c.stride(0), k_pe.stride(0), float(eps), float(k_scale),
        LORA=lora, ROPE=rope, BLOCK_LORA=block_lora, BLOCK_HALF=triton.next_power_of_2(rope // 2),
        FP8=kv_cache.dtype == FP8_DTYPE, num_warps=4 if block_lora >= 512 else 1,
        enable_fp_fusion=False,  # separate mul/sub roundings, as torch does: bit-equal rope
    )
    return kv_c, k_pe


def triton_supports(kv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``write_kv_cache`` takes the fused kernel for these tensors."""
    return (triton is not None and kv.is_cuda and kv_cache.is_cuda and kv.dtype in COMPUTE_DTYPES
            and kv_cache.dtype in CACHE_DTYPES and kv_cache.is_contiguous())


def write_kv_cache(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalize, rotate, (quantize) and scatter ``kv`` [T, kv_lora+rope] into ``kv_cache``.

    Returns (kv_c_normed [T, kv_lora], k_pe_rotated [T, rope]) in kv's dtype. The fused
    Triton kernel on CUDA (no host sync: graph-capturable), the torch reference otherwise.
    """
    if triton_supports(kv, kv_cache):
        return write_kv_cache_triton(kv, norm_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping, k_scale)
    return write_kv_cache_reference(kv, norm_weight, eps, positions, cos_sin_cache, kv_cache, slot_mapping, k_scale)


__all__ = ["write_kv_cache", "write_kv_cache_reference", "write_kv_cache_triton", "triton_supports"]
