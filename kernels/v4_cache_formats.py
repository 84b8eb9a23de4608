"""Byte layouts of the DeepSeek-V4 / V4.1 attention caches (torch references, any device).

Every cache is ``uint8 [num_pages, page_size, record_bytes]`` (a view: a page may be padded)
addressed by flat indices ``page * page_size + slot``. Three record formats:

* ``v4`` — V4's 584-byte record, FlashMLA's "MODEL1" layout, so one tensor feeds FlashMLA's
  sparse decode and ours. A page holds ``page_size`` 576-byte data rows (448 e4m3 values of
  the non-rotated dims, then the 64 rotated dims as bf16), then ``page_size`` 8-byte scale
  rows (7 UE8M0 exponents, one per 64 non-rotated dims, and a pad byte), then padding up to a
  multiple of 576 bytes. The tensor view is ``[num_pages, page_size, 584]`` with page stride
  :func:`v4_page_bytes` (``584 x page_size`` is the record count, not the data order).
* ``v41_window`` — V4.1's window rows, 528 bytes: 512 e4m3 values (rotated dims included),
  then 16 UE8M0 exponents, one per 32 values (``kernels.microscaling.quantize_mxfp8``).
* ``v41_entry`` — V4.1's compressed entries, 288 bytes: 512 e2m1 codes packed two a byte
  (even index in the low nibble, as ``kernels.weight_formats.pack_fp4``), then 32 e4m3
  scales, one per 16 values (``fake_quant_fp4(x, 16, "e4m3")``'s rounding).

A UE8M0 byte ``b`` means ``2^(b-127)``. The unpackers return float32 rows of 512 dims.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_MAX, pow2_ceil
from kernels.microscaling import dequantize_mxfp8, quantize_mxfp8
from kernels.weight_formats import FP4_MAX, e8m0_to_float, float_to_fp4_codes, fp4_codes_to_float, pack_fp4, unpack_fp4

HEAD_DIM = 512
V4_NOPE, V4_ROPE, V4_TILE = 448, 64, 64
V4_DATA_BYTES = V4_NOPE + 2 * V4_ROPE  # 576
V4_SCALE_BYTES = 8  # 7 exponents + 1 pad
V4_RECORD_BYTES = V4_DATA_BYTES + V4_SCALE_BYTES  # 584
V41_WINDOW_BLOCK, V41_WINDOW_BYTES = 32, 512 + 16
V41_ENTRY_BLOCK, V41_ENTRY_BYTES = 16, 256 + 32
RECORD_BYTES = {"v4": V4_RECORD_BYTES, "v41_window": V41_WINDOW_BYTES, "v41_entry": V41_ENTRY_BYTES}
_MIN_AMAX = 1e-4  # an all-zero block still gets a finite, normal scale
_FP4_E4M3_MIN_AMAX = FP4_MAX * 2.0**-9


def v4_page_bytes(page_size: int) -> int:
    """Bytes of one V4 page: the records rounded up to a multiple of 576."""
    return -(-page_size * V4_RECORD_BYTES // V4_DATA_BYTES) * V4_DATA_BYTES


def _check_rows(rows: torch.Tensor, what: str) -> None:
    if rows.shape[-1] != HEAD_DIM:
        raise ValueError(f"{what} needs rows of {HEAD_DIM} dims, got shape {tuple(rows.shape)}")


def pack_v4_records(rows: torch.Tensor) -> torch.Tensor:
    """float rows [num_pages, page_size, 512] → the V4 cache ``uint8 [num_pages, page_size, 584]``
    (a strided view of padded pages). Dims 0..447 are e4m3 with one power-of-two scale per 64
    (``2^ceil(log2(max(amax, 1e-4) / 448))``), dims 448..511 bf16."""
    _check_rows(rows, "pack_v4_records")
    if rows.dim() != 3:
        raise ValueError(f"pack_v4_records needs [num_pages, page_size, 512], got {tuple(rows.shape)}")
    pages, page_size, _ = rows.shape
    flat = torch.zeros(pages, v4_page_bytes(page_size), dtype=torch.uint8, device=rows.device)
    data = flat[:, : page_size * V4_DATA_BYTES].view(pages, page_size, V4_DATA_BYTES)
    scales = flat[:, page_size * V4_DATA_BYTES : page_size * V4_RECORD_BYTES].view(pages, page_size, V4_SCALE_BYTES)
    nope = rows[..., :V4_NOPE].float().reshape(pages, page_size, V4_NOPE // V4_TILE, V4_TILE)
    scale = pow2_ceil(nope.abs().amax(-1, keepdim=True).clamp_min(_MIN_AMAX) * (1.0 / FP8_MAX))
    q = (nope / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    data[..., :V4_NOPE] = q.reshape(pages, page_size, V4_NOPE).view(torch.uint8)
    data[..., V4_NOPE:] = rows[..., V4_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    exponent = torch.log2(scale.squeeze(-1)).round().to(torch.int32) + 127
    scales[..., : V4_NOPE // V4_TILE] = exponent.to(torch.uint8)
    return flat[:, : page_size * V4_RECORD_BYTES].view(pages, page_size, V4_RECORD_BYTES)


def v4_cache_parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 [pages, page_size, 576], exponents uint8 [pages, page_size, 7]) of a V4 cache."""
    if cache.dim() != 3 or cache.shape[-1] != V4_RECORD_BYTES or cache.dtype != torch.uint8:
        raise ValueError(f"a V4 cache is uint8 [pages, page_size, {V4_RECORD_BYTES}], got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(1) != V4_RECORD_BYTES:
        raise ValueError("a V4 cache page must be contiguous (stride(1) == 584, stride(2) == 1)")
    pages, page_size, _ = cache.shape
    flat = cache.as_strided((pages, page_size * V4_RECORD_BYTES), (cache.stride(0), 1))
    data = flat[:, : page_size * V4_DATA_BYTES].reshape(pages, page_size, V4_DATA_BYTES)
    scales = flat[:, page_size * V4_DATA_BYTES :].reshape(pages, page_size, V4_SCALE_BYTES)
    return data, scales[..., : V4_NOPE // V4_TILE]


def unpack_v4_records(cache: torch.Tensor) -> torch.Tensor:
    """The V4 cache → float32 rows [num_pages, page_size, 512]."""
    data, exps = v4_cache_parts(cache)
    pages, page_size, _ = data.shape
    nope = data[..., :V4_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    nope = nope.reshape(pages, page_size, V4_NOPE // V4_TILE, V4_TILE) * e8m0_to_float(exps).unsqueeze(-1)
    rope = data[..., V4_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(pages, page_size, V4_NOPE), rope], dim=-1)


def pack_v41_window_rows(rows: torch.Tensor) -> torch.Tensor:
    """float rows [..., 512] → uint8 [..., 528]: e4m3 values, then one UE8M0 byte per 32."""
    _check_rows(rows, "pack_v41_window_rows")
    q, exps = quantize_mxfp8(rows, V41_WINDOW_BLOCK)
    return torch.cat([q.view(torch.uint8), exps], dim=-1)


def unpack_v41_window_rows(records: torch.Tensor) -> torch.Tensor:
    if records.shape[-1] != V41_WINDOW_BYTES:
        raise ValueError(f"V4.1 window rows are {V41_WINDOW_BYTES} bytes, got {records.shape[-1]}")
    q = records[..., :HEAD_DIM].contiguous().view(torch.float8_e4m3fn)
    return dequantize_mxfp8(q, records[..., HEAD_DIM:], V41_WINDOW_BLOCK)


def pack_v41_entries(entries: torch.Tensor) -> torch.Tensor:
    """float entries [..., 512] → uint8 [..., 288]: packed e2m1 codes, then one e4m3 scale per 16
    (amax / 6 rounded to e4m3, as ``fake_quant_fp4(x, 16, "e4m3")``)."""
    _check_rows(entries, "pack_v41_entries")
    b = entries.float().reshape(*entries.shape[:-1], HEAD_DIM // V41_ENTRY_BLOCK, V41_ENTRY_BLOCK)
    scale = (b.abs().amax(-1, keepdim=True).clamp_min(_FP4_E4M3_MIN_AMAX) / FP4_MAX).to(torch.float8_e4m3fn)
    codes = float_to_fp4_codes((b / scale.float()).clamp(-FP4_MAX, FP4_MAX)).reshape(entries.shape)
    return torch.cat([pack_fp4(codes).view(torch.uint8), scale.squeeze(-1).view(torch.uint8)], dim=-1)


def unpack_v41_entries(records: torch.Tensor) -> torch.Tensor:
    if records.shape[-1] != V41_ENTRY_BYTES:
        raise ValueError(f"V4.1 entries are {V41_ENTRY_BYTES} bytes, got {records.shape[-1]}")
    values = fp4_codes_to_float(unpack_fp4(records[..., : HEAD_DIM // 2].contiguous()))
    scale = records[..., HEAD_DIM // 2 :].contiguous().view(torch.float8_e4m3fn).float()
    blocks = values.reshape(*values.shape[:-1], HEAD_DIM // V41_ENTRY_BLOCK, V41_ENTRY_BLOCK)
    return (blocks * scale.unsqueeze(-1)).reshape(values.shape)


def unpack_records(cache: torch.Tensor, record: str) -> torch.Tensor:
    """Any of the three caches [pages, page_size, bytes] → float32 rows [pages, page_size, 512]."""
    if record == "v4":
        return unpack_v4_records(cache)
    if record == "v41_window":
        return unpack_v41_window_rows(cache)
    if record == "v41_entry":
        return unpack_v41_entries(cache)
    raise ValueError(f"unknown cache record format {record!r}; one of {sorted(RECORD_BYTES)}")
