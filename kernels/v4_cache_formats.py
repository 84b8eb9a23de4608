"""Packed cache records of DeepSeek-V4 and V4.1 (``--kv-cache-dtype fp8``), as torch references.

V4.1 trains with its cache roundings (kernels/microscaling.py), so these records are lossless
for it: packing the *unrounded* rows and unpacking gives exactly the fake-quantized rows the
model computes with (``unpack(pack(x)) == fake_quant(x)`` bitwise). Each record is one row of
uint8, values first, then the scales:

=================  ======================================  ==========  ==============
record             values                                  scales      bytes (d = 512)
=================  ======================================  ==========  ==============
V4.1 window row    e4m3, d                                 ue8m0 / 32  d + d/32 = 528
V4.1 entry         e2m1 pairs, d/2 (even index low nibble) e4m3 / 16   d/2 + d/16 = 288
V4.1 indexer key   e2m1 pairs, d/2                         ue8m0 / 32  64 + 4 = 68 (d 128)
=================  ======================================  ==========  ==============

V4 keeps bf16 rows in its reference, so its record is lossy: FlashMLA's "MODEL1" layout, which
its SM90 sparse decode reads, so the same pages feed both kernels. A page of ``page_size``
tokens holds first every token's 576 data bytes (448 e4m3 no-RoPE dims, scaled per 64 dims, then
the 64 RoPE dims as bf16), then every token's 8 scale bytes (7 ue8m0 + 1 pad), and is padded
to a multiple of 576 bytes — 584 B per token before padding. Scales are powers of two
``2^ceil(log2(amax / 448))`` (:func:`kernels.microscaling.quantize_mxfp8`'s rule).
"""

from __future__ import annotations

import torch

from kernels.microscaling import dequantize_fp4_blocks, dequantize_mxfp8, quantize_fp4_blocks, quantize_mxfp8
from kernels.weight_formats import e8m0_to_float, float_to_e8m0, pack_fp4, unpack_fp4

V41_WINDOW_BLOCK = 32
V41_ENTRY_BLOCK = 16
V41_INDEX_KEY_BLOCK = 32

V4_DIM, V4_NOPE_DIMS, V4_ROPE_DIMS, V4_SCALE_TILE = 512, 448, 64, 64
V4_NUM_SCALES = V4_NOPE_DIMS // V4_SCALE_TILE  # 7
V4_DATA_BYTES = V4_NOPE_DIMS + 2 * V4_ROPE_DIMS  # 576
V4_SCALE_BYTES = V4_NUM_SCALES + 1  # 8 (one pad byte)
V4_RECORD_BYTES = V4_DATA_BYTES + V4_SCALE_BYTES  # 584
V4_PAGE_ALIGN = 576


def _check_dim(x: torch.Tensor, block: int, what: str) -> int:
    d = x.shape[-1]
    if d % block or d % 2:
        raise ValueError(f"{what}: the row width ({d}) must be a multiple of {block}")
    return d


# ---- V4.1 -----------------------------------------------------------------------------------
def v41_window_row_bytes(dim: int) -> int:
    return dim + dim // V41_WINDOW_BLOCK


def pack_v41_window_rows(rows: torch.Tensor) -> torch.Tensor:
    """Window K=V rows [..., d] → uint8 [..., d + d/32]: e4m3 values, then one ue8m0 byte per 32."""
    _check_dim(rows, V41_WINDOW_BLOCK, "V4.1 window rows")
    q, scale = quantize_mxfp8(rows, V41_WINDOW_BLOCK)
    return torch.cat([q.view(torch.uint8), scale], dim=-1)


def unpack_v41_window_rows(records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., d + d/32] → rows [..., d] in ``dtype``."""
    d = records.shape[-1] * V41_WINDOW_BLOCK // (V41_WINDOW_BLOCK + 1)
    q = records[..., :d].contiguous().view(torch.float8_e4m3fn)
    return dequantize_mxfp8(q, records[..., d:], V41_WINDOW_BLOCK).to(dtype)


def _pack_fp4_rows(rows: torch.Tensor, block: int, scale_format: str) -> torch.Tensor:
    codes, scale = quantize_fp4_blocks(rows, block, scale_format)
    if scale_format == "e4m3":
        scale_bytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    else:  # powers of two: the exponent byte
        scale_bytes = float_to_e8m0(scale).view(torch.uint8)
    return torch.cat([pack_fp4(codes).view(torch.uint8), scale_bytes], dim=-1)


def _unpack_fp4_rows(records: torch.Tensor, block: int, scale_format: str, dtype: torch.dtype) -> torch.Tensor:
    d = records.shape[-1] * 2 * block // (block + 2)
    codes = unpack_fp4(records[..., : d // 2])
    scale_bytes = records[..., d // 2:]
    if scale_format == "e4m3":
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        scale = e8m0_to_float(scale_bytes)
    return dequantize_fp4_blocks(codes, scale, block).to(dtype)


def v41_entry_bytes(dim: int) -> int:
    return dim // 2 + dim // V41_ENTRY_BLOCK


def pack_v41_entries(rows: torch.Tensor) -> torch.Tensor:
    """Compressed entries [..., d] → uint8 [..., d/2 + d/16]: e2m1 pairs, then an e4m3 scale per 16."""
    _check_dim(rows, V41_ENTRY_BLOCK, "V4.1 compressed entries")
    return _pack_fp4_rows(rows, V41_ENTRY_BLOCK, "e4m3")


def unpack_v41_entries(records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _unpack_fp4_rows(records, V41_ENTRY_BLOCK, "e4m3", dtype)


def v41_index_key_bytes(dim: int) -> int:
    return dim // 2 + dim // V41_INDEX_KEY_BLOCK


def pack_v41_index_keys(rows: torch.Tensor) -> torch.Tensor:
    """Indexer keys [..., d] → uint8 [..., d/2 + d/32]: e2m1 pairs, then a ue8m0 byte per 32."""
    _check_dim(rows, V41_INDEX_KEY_BLOCK, "V4.1 indexer keys")
    return _pack_fp4_rows(rows, V41_INDEX_KEY_BLOCK, "ue8m0")


def unpack_v41_index_keys(records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _unpack_fp4_rows(records, V41_INDEX_KEY_BLOCK, "ue8m0", dtype)


# ---- V4 (FlashMLA MODEL1 pages) -------------------------------------------------------------
def v4_page_bytes(page_size: int) -> int:
    """Bytes of one MODEL1 page of ``page_size`` tokens, padded to a multiple of 576."""
    return -(-page_size * V4_RECORD_BYTES // V4_PAGE_ALIGN) * V4_PAGE_ALIGN


def pack_v4_records(rows: torch.Tensor) -> torch.Tensor:
    """Rows [num_pages, page_size, 512] → uint8 pages [num_pages, v4_page_bytes(page_size)]
    (the pad bytes are zero)."""
    if rows.dim() != 3 or rows.shape[-1] != V4_DIM:
        raise ValueError(f"V4 records: rows must be [num_pages, page_size, {V4_DIM}], got {tuple(rows.shape)}")
    num_pages, page_size, _ = rows.shape
    q, scale = quantize_mxfp8(rows[..., :V4_NOPE_DIMS], V4_SCALE_TILE)
    rope = rows[..., V4_NOPE_DIMS:].to(torch.bfloat16).contiguous().view(torch.uint8)
    data = torch.cat([q.view(torch.uint8), rope], dim=-1)  # [P, S, 576]
    scales = torch.cat([scale, scale.new_zeros(num_pages, page_size, 1)], dim=-1)  # [P, S, 8]
    pages = rows.new_zeros(num_pages, v4_page_bytes(page_size), dtype=torch.uint8)
    pages[:, : page_size * V4_DATA_BYTES] = data.reshape(num_pages, -1)
    pages[:, page_size * V4_DATA_BYTES: page_size * V4_RECORD_BYTES] = scales.reshape(num_pages, -1)
    return pages


def unpack_v4_records(pages: torch.Tensor, page_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pages [num_pages, v4_page_bytes(page_size)] → rows [num_pages, page_size, 512]."""
    num_pages = pages.shape[0]
    data = pages[:, : page_size * V4_DATA_BYTES].reshape(num_pages, page_size, V4_DATA_BYTES)
    scales = pages[:, page_size * V4_DATA_BYTES: page_size * V4_RECORD_BYTES].reshape(
        num_pages, page_size, V4_SCALE_BYTES)[..., :V4_NUM_SCALES]
    nope = dequantize_mxfp8(data[..., :V4_NOPE_DIMS].contiguous().view(torch.float8_e4m3fn), scales, V4_SCALE_TILE)
    rope = data[..., V4_NOPE_DIMS:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).to(dtype)


def v4_pages_as_flashmla(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The [num_pages, page_size, 1, 584] e4m3 view of MODEL1 pages that FlashMLA's sparse decode
    takes (page stride = the padded page)."""
    return pages.view(torch.float8_e4m3fn)[:, : page_size * V4_RECORD_BYTES].view(
        pages.shape[0], page_size, 1, V4_RECORD_BYTES)


# ---- V4 row records (any head width; a pool row per token) ----------------------------------
def v4_row_scale_tile(nope_dims: int) -> int:
    """The no-RoPE dims per ue8m0 scale: 64, or all of them when there are fewer (tiny models)."""
    if nope_dims % V4_SCALE_TILE and nope_dims > V4_SCALE_TILE:
        raise ValueError(f"V4 records: {nope_dims} no-RoPE dims are not a multiple of {V4_SCALE_TILE}")
    return min(nope_dims, V4_SCALE_TILE)


def v4_row_bytes(dim: int, rope_dims: int) -> int:
    """Bytes of one row record: e4m3 no-RoPE dims, bf16 RoPE dims, the scales padded to 8."""
    nope = dim - rope_dims
    return nope + 2 * rope_dims + -(-(nope // v4_row_scale_tile(nope)) // 8) * 8


def pack_v4_rows(rows: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """Rows [..., d] → uint8 [..., v4_row_bytes]: one MODEL1 record per row (the 576 data bytes,
    then the scale bytes, for d = 512), for caches that keep a row per token."""
    nope = rows.shape[-1] - rope_dims
    tile = v4_row_scale_tile(nope)
    q, scale = quantize_mxfp8(rows[..., :nope], tile)
    rope = rows[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    pad = v4_row_bytes(rows.shape[-1], rope_dims) - nope - 2 * rope_dims - scale.shape[-1]
    return torch.cat([q.view(torch.uint8), rope, scale, scale.new_zeros(*scale.shape[:-1], pad)], dim=-1)


def unpack_v4_rows(records: torch.Tensor, dim: int, rope_dims: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., v4_row_bytes] → rows [..., dim] in ``dtype``."""
    nope = dim - rope_dims
    tile = v4_row_scale_tile(nope)
    data_end = nope + 2 * rope_dims
    scales = records[..., data_end:data_end + nope // tile]
    values = dequantize_mxfp8(records[..., :nope].contiguous().view(torch.float8_e4m3fn), scales, tile)
    rope = records[..., nope:data_end].contiguous().view(torch.bfloat16).float()
    return torch.cat([values, rope], dim=-1).to(dtype)


def v4_index_key_bytes(dim: int) -> int:
    return dim + 4


def pack_v4_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """V4 indexer keys [..., d] → uint8 [..., d + 4]: e4m3 values, then one float32 scale
    (amax · fp32(1/448)) per key.

    The scale multiplies by the reciprocal, as CUDA torch computes a division by a Python
    scalar (CPU torch divides): the same bits on every device, and the fused kernel's."""
    scale = keys.float().abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / 448.0)
    q = (keys.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def unpack_v4_index_keys(records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    d = records.shape[-1] - 4
    scale = records[..., d:].contiguous().view(torch.float32)
    return (records[..., :d].contiguous().view(torch.float8_e4m3fn).float() * scale).to(dtype)
