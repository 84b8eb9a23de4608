"""MXFP4 routed experts (DeepSeek-V4.1): torch references and the e2m1 → e4m3 scale fold.

Weights: per expert ``w13`` = gate rows then up rows [E, 2I, D] and ``w2`` [E, D, I], stored as
MXFP4 (e2m1 codes, two per byte, one E8M0 scale per 32 along K; ``kernels.weight_formats``).
Expert math is V4.1's: ``h = silu(min(g, L)) · clamp(u, −L, L) · routing_weight`` (plain SwiGLU
when L ≤ 0), then ``y = w2 · h``; the routed outputs of a token are summed in fp32.

Two GPU paths (``kernels.mxfp4_moe_triton``), each with its torch reference here:

* **W4A16** (any CUDA GPU): codes → bf16 in registers, scale applied exactly, bf16 MMA.
  Reference: the model's own bf16 math on the dequantized weights (dequantization is exact in
  bf16), so on CPU the reference equals ``model.v41.moe.Expert`` bit for bit.
* **W4A8** (SM90 FP8 tensor cores): e2m1 values are exact in e4m3, and the scales are powers of
  two, so within a K span of 128 each 32-group's scale is folded into the e4m3 value relative
  to the span's largest scale: ``q = e4m3(v · 2^(s_i − s_max))`` and one fp32 product by
  ``2^(s_max − 127)`` per span ("promotion" once per 128, not per 32). Activations are e4m3
  with one fp32 scale (amax/448, optionally a power of two) per token per 128 along K; the
  intermediate ``h`` is quantized the same way in the gate/up epilogue.

The fold is exact while ``s_i − s_max ≥ −8``: ``v · 2^shift`` has its lowest bit at
``2^(shift−1)`` and e4m3 subnormals reach ``2^−9``. Below that the value is rounded to nearest
even in e4m3 (the hardware convert): shift −9 .. −12 lose low bits (error ≤ 2^−10 · 2^(s_max−127),
under 1/3000 of the span's largest |w|, which exceeds 3 · 2^(s_max−127)); shift ≤ −13 flushes
the group to zero (its values were all under 1/2000 of the span's largest |w|). Zero groups (scale floor) are exact at
any shift. :func:`fold_underflow_fraction` measures how often it happens for a checkpoint.

The W4A8 reference is therefore: x quantized per token per 128 (``kernels.fp8``), weights =
the folded e4m3 values times their span scale (= the dequantized weights exactly when no
group is below shift −8), products in fp32, h quantized per 128, y cast to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import FP8_DTYPE, dequantize_per_token_group, quantize_per_token_group
from kernels.weight_formats import (
    E8M0_BIAS,
    MXFP4_GROUP,
    dequantize_mxfp4,
    fp4_codes_to_float,
    unpack_fp4,
)

SPAN = 128  # K span of one promotion = activation scale group
EXACT_MIN_SHIFT = -8  # folds with s_i - s_max >= this are exact in e4m3
FOLD_LUT_ROWS = 14  # fold tables for s_max - s_i = 0 .. 13; 13 and beyond flush every code to zero


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4/V4.1 expert activation: ``silu(min(g, L)) · clamp(u, −L, L)``; plain SwiGLU if L ≤ 0."""
    if limit > 0:
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale


def fold_shifts(scale: torch.Tensor, span: int = SPAN) -> tuple[torch.Tensor, torch.Tensor]:
    """E8M0 scales [..., K/32] → (shift s_i − s_max int32 [..., K/32], span max byte uint8 [..., K/span])."""
    b = _scale_bytes(scale).to(torch.int32)
    per = span // MXFP4_GROUP
    if b.shape[-1] % per:
        raise ValueError(f"MXFP4 scale has {b.shape[-1]} groups, not a multiple of {per} (K span {span})")
    smax = b.reshape(*b.shape[:-1], -1, per).amax(dim=-1)
    return b - smax.repeat_interleave(per, dim=-1), smax.to(torch.uint8)


def fold_mxfp4_to_e4m3(packed: torch.Tensor, scale: torch.Tensor,
                       span: int = SPAN) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [..., N, K/2] + [..., N, K/32] → (e4m3 [..., N, K], span scale bytes uint8 [..., N, K/span]).

    ``w ≈ e4m3 · 2^(byte − 127)`` per span; the cast rounds to nearest even (exact unless a
    group sits more than 8 binades below its span's top, see the module docstring)."""
    values = fp4_codes_to_float(unpack_fp4(packed))
    shift, smax = fold_shifts(scale, span)
    factor = torch.exp2(shift.clamp_min(-30).float()).repeat_interleave(MXFP4_GROUP, dim=-1)
    return (values * factor).to(FP8_DTYPE), smax


def w4a8_weight_reference(packed: torch.Tensor, scale: torch.Tensor, span: int = SPAN) -> torch.Tensor:
    """The weights the W4A8 kernel multiplies by, as fp32 [..., N, K]."""
    q, smax = fold_mxfp4_to_e4m3(packed, scale, span)
    return q.float() * torch.exp2(smax.float() - E8M0_BIAS).repeat_interleave(span, dim=-1)


def fold_underflow_fraction(scale: torch.Tensor, span: int = SPAN) -> float:
    """Fraction of 32-groups more than 8 binades below their span's top (s_i − s_max < −8): an
    upper bound on the inexact folds, since all-zero groups (floor scale) count but stay exact."""
    shift, _ = fold_shifts(scale, span)
    return (shift < EXACT_MIN_SHIFT).float().mean().item() if shift.numel() else 0.0


def fold_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [14, 2]: row k holds the e4m3 bytes of the e2m1 magnitudes 0..7 times 2^−k, four
    bytes a word (magnitude m in byte m % 4 of word m // 4), cast with the reference's RNE.

    The W4A8 kernel turns codes into folded e4m3 by looking bytes up in the row of
    ``min(s_max − s_i, 13)`` (one PRMT per four codes on the GPU, :func:`fold_bytes_lut`), so
    its fold equals :func:`fold_mxfp4_to_e4m3` at every shift. Device ops only (graph-safe)."""
    k = torch.arange(FOLD_LUT_ROWS, device=device, dtype=torch.float32)
    m = torch.arange(8, device=device)
    normal = torch.exp2((m >> 1).float() - 1) * (1 + (m & 1).float() / 2)
    mag = torch.where(m >= 2, normal, (m == 1).float() * 0.5)
    b = (mag[None, :] * torch.exp2(-k)[:, None]).to(FP8_DTYPE).view(torch.uint8).to(torch.int32)
    return (b.reshape(FOLD_LUT_ROWS, 2, 4) << (8 * torch.arange(4, device=device, dtype=torch.int32))).sum(-1).to(
        torch.int32)


def prmt(a: torch.Tensor, b: torch.Tensor, sel: int | torch.Tensor) -> torch.Tensor:
    """PTX ``prmt.b32`` (default mode) on int64 tensors holding 32-bit words: output byte i is
    byte ``sel[4i+2:4i]`` of the 8 bytes {b, a} (a = bytes 0..3), or that byte's sign bit
    replicated when ``sel`` bit 4i+3 is set; selector bits above 15 are ignored."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    sel = torch.as_tensor(sel, dtype=torch.int64, device=src.device)
    out = torch.zeros_like(src)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> ((nib & 7) * 8)) & 0xFF
        byte = torch.where((nib & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out = out | (byte << (8 * i))
    return out


def fold_bytes_lut(word: torch.Tensor, tlo: torch.Tensor, thi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A8 kernel's code → e4m3 step on a 32-bit word of 4 packed bytes (8 codes), in
    torch int64 ops mirroring its PTX instruction for instruction; ``tlo``/``thi`` a
    :func:`fold_lut` row. Returns (e4m3 of the 4 low nibbles, e4m3 of the 4 high nibbles),
    byte i of each from byte i of ``word``: 9 ALU ops per 8 codes (prmt reads only the low 16
    bits of its selector, so one mask serves both halves)."""
    sel = word & 0x77777777
    a = prmt(tlo, thi, sel)  # [e(L0), e(H0), e(L1), e(H1)] magnitudes (selector bits 0-15)
    b = prmt(tlo, thi, sel >> 16)  # [e(L2), e(H2), e(L3), e(H3)]
    lo = prmt(a, b, 0x6420) | ((word << 4) & 0x80808080)  # low-nibble sign bits 3 → 7
    hi = prmt(a, b, 0x7531) | (word & 0x80808080)
    return lo, hi


def pair_columns(x: torch.Tensor, span: int = SPAN) -> torch.Tensor:
    """[..., K] → [..., K] with each span's even columns first, then its odd ones: the order
    in which the kernels meet the low and high nibbles of the packed weights."""
    k = x.shape[-1]
    if k % span:
        raise ValueError(f"K={k} is not a multiple of the span {span}")
    return x.reshape(*x.shape[:-1], k // span, span // 2, 2).transpose(-1, -2).reshape(x.shape).contiguous()


def unpair_columns(x: torch.Tensor, span: int = SPAN) -> torch.Tensor:
    """Inverse of :func:`pair_columns`."""
    k = x.shape[-1]
    return x.reshape(*x.shape[:-1], k // span, 2, span // 2).transpose(-1, -2).reshape(x.shape).contiguous()


def check_mxfp4_experts(x: torch.Tensor, w13, w13_scale, w2, w2_scale) -> tuple[int, int, int]:
    """Validate stacked MXFP4 experts against x [T, D]; returns (E, D, I)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, D/2] and w2 [E, D, I/2] (packed FP4), got "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, half_d = w13.shape
    d, inter = 2 * half_d, two_i // 2
    if two_i % 2 or tuple(w2.shape) != (e, d, inter // 2) or x.shape[1] != d:
        raise ValueError(f"inconsistent MXFP4 expert shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if tuple(w13_scale.shape) != (e, two_i, d // MXFP4_GROUP) or tuple(w2_scale.shape) != (e, d, inter // MXFP4_GROUP):
        raise ValueError(f"MXFP4 scales {tuple(w13_scale.shape)}, {tuple(w2_scale.shape)} do not match one per "
                         f"{MXFP4_GROUP} of w13 [E={e}, {two_i}, {d}], w2 [E={e}, {d}, {inter}]")
    if w13.dtype not in (torch.int8, torch.uint8) or w2.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"packed FP4 experts must be int8/uint8 bytes, got {w13.dtype}, {w2.dtype}")
    return e, d, inter


def moe_mxfp4_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    mode: str = "w4a16",
    expert_offset: int = 0,
    ue8m0: bool = False,
) -> torch.Tensor:
    """Σ over the chosen local experts of ``w2 · (swiglu(w1·x, w3·x) · weight)`` → fp32 [T, D].

    ``w4a16``: the model's math in x's dtype on the dequantized weights (gate, up and y rounded
    to x's dtype, the SwiGLU in fp32). ``w4a8``: the W4A8 kernel's operands (module docstring)
    with fp32 products; y rounded to x's dtype. Only the used experts are dequantized."""
    if mode not in ("w4a8", "w4a16"):
        raise ValueError(f"unknown MXFP4 reference mode {mode!r}; w4a8 or w4a16")
    e_local, _, inter = check_mxfp4_experts(x, w13, w13_scale, w2, w2_scale)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids - expert_offset
    if mode == "w4a8":
        xq = dequantize_per_token_group(*quantize_per_token_group(x, SPAN, ue8m0=ue8m0), SPAN)
    for e in torch.unique(local).tolist():
        if e < 0 or e >= e_local:
            continue
        token, slot = torch.nonzero(local == e, as_tuple=True)
        wt = topk_weights[token, slot, None].float()
        if mode == "w4a16":
            w13e = dequantize_mxfp4(w13[e], w13_scale[e], dtype=x.dtype)
            w2e = dequantize_mxfp4(w2[e], w2_scale[e], dtype=x.dtype)
            xe = x[token]
            gate, up = F.linear(xe, w13e[:inter]).float(), F.linear(xe, w13e[inter:]).float()
            h = (wt * swiglu(gate, up, limit)).to(x.dtype)
            y = F.linear(h, w2e)
        else:
            w13e = w4a8_weight_reference(w13[e], w13_scale[e])
            w2e = w4a8_weight_reference(w2[e], w2_scale[e])
            gate, up = (xq[token] @ w13e.t()).chunk(2, dim=-1)
            h = wt * swiglu(gate, up, limit)
            hq = dequantize_per_token_group(*quantize_per_token_group(h, SPAN, ue8m0=ue8m0), SPAN)
            y = (hq @ w2e.t()).to(x.dtype)
        out.index_add_(0, token, y.float())
    return out


def moe_mxfp4_reference_every_expert(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    expert_offset: int = 0,
) -> torch.Tensor:
    """:func:`moe_mxfp4_reference` (``w4a16``) without host syncs or data-dependent shapes, for
    CUDA-graph capture where the Triton kernels cannot run (D or I not a multiple of 128):
    every local expert on every row, each row keeping its chosen experts' outputs, added in
    ascending expert order as the reference does. Reads and dequantizes every local expert."""
    e_local, _, inter = check_mxfp4_experts(x, w13, w13_scale, w2, w2_scale)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids - expert_offset
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    for e in range(e_local):
        picked = local == e
        wt = torch.where(picked, topk_weights.float(), zero).sum(dim=-1, keepdim=True)
        w13e = dequantize_mxfp4(w13[e], w13_scale[e], dtype=x.dtype)
        w2e = dequantize_mxfp4(w2[e], w2_scale[e], dtype=x.dtype)
        gate, up = F.linear(x, w13e[:inter]).float(), F.linear(x, w13e[inter:]).float()
        y = F.linear((wt * swiglu(gate, up, limit)).to(x.dtype), w2e).float()
        out += torch.where(picked.any(dim=-1, keepdim=True), y, zero)
    return out


__all__ = [
    "EXACT_MIN_SHIFT",
    "SPAN",
    "check_mxfp4_experts",
    "FOLD_LUT_ROWS",
    "fold_bytes_lut",
    "fold_lut",
    "fold_mxfp4_to_e4m3",
    "fold_shifts",
    "fold_underflow_fraction",
    "moe_mxfp4_reference",
    "moe_mxfp4_reference_every_expert",
    "pair_columns",
    "prmt",
    "swiglu",
    "unpair_columns",
    "w4a8_weight_reference",
]
