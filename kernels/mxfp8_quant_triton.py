"""Fused MXFP8 activation quantization (Triton): x [M, K] → e4m3 [M, K] + UE8M0 bytes [M, K/32].

Bit-identical to ``kernels.microscaling.quantize_mxfp8`` (the reference and the rule):
``byte = 127 + ceil(log2(max(amax, 1e-4) · fp32(1/448)))`` from the IEEE bits, then
``q = RNE_e4m3(clamp(x · 2^(127−byte), ±448))``. Multiplying by the power of two is exact,
so it equals the reference's division.

The e4m3 rounding is done on the integer bits (:func:`e4m3_rne_bits`) instead of a
``.to(float8)`` cast: Triton 3.6's interpreter casts values just under a power of two a whole
binade low (125.9 → 64), so only integer rounding can be checked byte for byte on CPU, and the
same code then runs on the GPU. The helpers are shared with the GEMM's quantizing epilogue
(kernels/mxfp8_gemm.py), so both produce the same bytes by construction.
"""

from __future__ import annotations

import torch

try:  # the CPU reference does not need Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

MX_BLOCK = 32


if triton is not None:

    @triton.jit
    def ue8m0_byte(amax):
        """UE8M0 byte of ``2^ceil(log2(max(amax, 1e-4) / 448))`` (fp32 amax ≥ 0), as int32."""
        t = tl.maximum(amax, 1e-4) * 0.002232142857142857  # fp32(1/448), as the reference multiplies
        bits = t.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def pow2_from_byte(byte):
        """fp32 ``2^(byte−127)`` built from the bits (byte in 1..254; byte 0 gives 0.0)."""
        return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def round_to_bf16(x):
        """fp32 ``x`` rounded to the nearest bf16 (ties to even), still as fp32 (finite x).

        Integer rounding for the interpreter's sake (its bf16 cast is not RNE); a later
        ``.to(bfloat16)`` of the result is exact under any rounding."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_rne_bits(y):
        """e4m3 byte of fp32 ``y`` (|y| ≤ 448), round to nearest even, as int32 in 0..255."""
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # normal e4m3 (|y| ≥ 2^-6): keep 3 of 23 mantissa bits, ties to even, carry into the
        # exponent; then move the exponent bias from 127 to 7.
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal e4m3: round |y| · 2^9 to an integer (8 becomes the smallest normal, code 8)
        shift = tl.minimum(141 - (mag >> 23), 31)
        full = (mag & 0x7FFFFF) | 0x800000
        sub = (full + (1 << (shift - 1)) - 1 + ((full >> shift) & 1)) >> shift
        return tl.where(mag >= (121 << 23), normal, sub) | sign

    @triton.jit
    def quantize_blocks(x, inv_scale):
        """e4m3 bytes (int32) of fp32 ``x`` [..., 32] times its blocks' ``2^-e`` [..., 1]."""
        return e4m3_rne_bits(tl.clamp(x * inv_scale, -448.0, 448.0))

    @triton.jit
    def _mxfp8_quant_kernel(
        X, Y, S, COS, SIN, M, K, stride_xm, stride_ym, stride_sm, stride_cm,
        BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr,
        ROUND_BF16: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BLOCKS, 32]
        m_ok = rm < M
        ok = m_ok[:, None, None] & (cols < K)[None, :, :]
        row = rm.to(tl.int64)[:, None, None] * stride_xm
        x = tl.load(X + row + cols[None, :, :], mask=ok, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCKS, 32]
        if ROPE:  # inverse-rotate the interleaved pairs of each head's last ROPE dims
            d = cols % HEAD_DIM
            in_rope = d >= HEAD_DIM - ROPE
            i = tl.where(in_rope, (d - (HEAD_DIM - ROPE)) // 2, 0)[None, :, :]
            rope_ok = ok & in_rope[None, :, :]
            partner = tl.load(X + row + (cols ^ 1)[None, :, :], mask=rope_ok, other=0.0).to(tl.float32)
            cs_row = rm.to(tl.int64)[:, None, None] * stride_cm
            c = tl.load(COS + cs_row + i, mask=rope_ok, other=0.0).to(tl.float32)
            sn = -tl.load(SIN + cs_row + i, mask=rope_ok, other=0.0).to(tl.float32)
            even = ((cols & 1) == 0)[None, :, :]
            rot = tl.where(even, x * c - partner * sn, x * c + partner * sn)
            if ROUND_BF16:
                rot = round_to_bf16(rot)
            x = tl.where(in_rope[None, :, :], rot, x)
        byte = ue8m0_byte(tl.max(tl.abs(x), 2))  # [BLOCK_M, BLOCKS]
        q = quantize_blocks(x, pow2_from_byte(254 - byte)[:, :, None])
        y_offs = rm.to(tl.int64)[:, None, None] * stride_ym + cols[None, :, :]
        tl.store(Y + y_offs, q.to(tl.uint8), mask=ok)
        s_ok = m_ok[:, None] & (blocks < K // 32)[None, :]
        tl.store(S + rm.to(tl.int64)[:, None] * stride_sm + blocks[None, :], byte.to(tl.uint8), mask=s_ok)


def _launch(x2: torch.Tensor, cos=None, sin=None, head_dim: int = 0, rope: int = 0):
    m, k = x2.shape
    y = torch.empty(m, k, dtype=torch.uint8, device=x2.device)
    s = torch.empty(m, k // MX_BLOCK, dtype=torch.uint8, device=x2.device)
    if m:
        blocks = min(triton.next_power_of_2(k // MX_BLOCK), 16)
        block_m = max(1, min(64, 4096 // (blocks * MX_BLOCK)))
        grid = (triton.cdiv(m, block_m), triton.cdiv(k // MX_BLOCK, blocks))
        cs = cos if cos is not None else x2
        _mxfp8_quant_kernel[grid](
            x2, y, s, cs, sin if sin is not None else x2, m, k, x2.stride(0), y.stride(0), s.stride(0), cs.stride(0),
            BLOCK_M=block_m, BLOCKS=blocks, HEAD_DIM=max(head_dim, 1), ROPE=rope,
            ROUND_BF16=x2.dtype == torch.bfloat16, num_warps=4,
            enable_fp_fusion=False)  # separate mul/sub roundings, as torch: bit-equal rotation
    return y.view(torch.float8_e4m3fn), s


def _rows(x2: torch.Tensor) -> torch.Tensor:
    """The [rows, K] operand, checked, contiguous in K."""
    if triton is None:
        raise RuntimeError("the MXFP8 quantization kernel needs the triton package")
    if x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"cannot quantize {x2.dtype} activations to MXFP8")
    if x2.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP8 needs the last dim ({x2.shape[-1]}) to be a multiple of {MX_BLOCK}")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_mxfp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (bf16/fp16/fp32, K a multiple of 32) → (e4m3 [..., K], uint8 [..., K/32])."""
    y, s = _launch(_rows(x.reshape(-1, x.shape[-1])))
    return y.reshape(x.shape), s.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK)


def inverse_rope_quantize_mxfp8_triton(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output o [T, H, D] (bf16/fp32) → MXFP8 o' [T, H·D] + bytes [T, H·D/32], where o'
    rotates each head's last ``2·cos.shape[-1]`` dims (interleaved pairs) by the negative angle
    in fp32 and rounds them to o's dtype, then quantizes: one pass over o.

    cos, sin [T, R/2] are the tokens' RoPE tables (any float dtype, as the model rounds them).
    """
    if o.dim() != 3:
        raise ValueError(f"o must be [T, heads, head_dim], got {tuple(o.shape)}")
    if o.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"the fused inverse RoPE takes bf16 or fp32 o, got {o.dtype}")
    t, _, d = o.shape
    half = cos.shape[-1]
    if cos.shape != (t, half) or sin.shape != (t, half) or 2 * half > d:
        raise ValueError(f"cos/sin must be [{t}, rope/2] with rope ≤ {d}; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    return _launch(_rows(o.reshape(t, -1)), cos.contiguous(), sin.contiguous(), head_dim=d, rope=2 * half)


__all__ = ["MX_BLOCK", "inverse_rope_quantize_mxfp8_triton", "quantize_mxfp8_triton"]
