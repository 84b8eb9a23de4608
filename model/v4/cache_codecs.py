"""The row codecs of ``--kv-cache-dtype fp8`` for the DeepSeek-V4 family's pools
(model/v4/cache_pool.py), on the packed records of kernels/v4_cache_formats.py.

V4.1: window rows e4m3 + ue8m0 per 32, compressed entries e2m1 + e4m3 per 16, indexer keys
e2m1 + ue8m0 per 32 — the roundings the model trains with, so reading a record back gives
the same values as ``auto`` (which fake-quantizes and keeps the model dtype). V4: window rows
and compressed entries as MODEL1 records (no-RoPE dims e4m3 + ue8m0 per 64, RoPE dims bf16),
indexer keys e4m3 + one float32 scale; V4's reference keeps model-dtype rows, so these are
lossy.
"""

from __future__ import annotations

import torch

from kernels import v4_cache_formats as fmt
from model.v4.cache_pool import RowCodec


def v4_fp8_row_codec(dim: int, rope_dims: int, dtype: torch.dtype) -> RowCodec:
    return RowCodec(dim, fmt.v4_row_bytes(dim, rope_dims), torch.uint8, lambda x: fmt.pack_v4_rows(x, rope_dims),
                    lambda r: fmt.unpack_v4_rows(r, dim, rope_dims, dtype), "v4_row")


def v4_fp8_index_key_codec(dim: int, dtype: torch.dtype) -> RowCodec:
    return RowCodec(dim, fmt.v4_index_key_bytes(dim), torch.uint8, fmt.pack_v4_index_keys,
                    lambda r: fmt.unpack_v4_index_keys(r, dtype), "v4_key")


def v41_fp8_codecs(config, dtype: torch.dtype) -> tuple[RowCodec, RowCodec, RowCodec]:
    """(window row, compressed entry, indexer key) codecs of a V4.1 config; a width the
    records cannot hold is one ValueError line naming the flag."""
    d, k = config.head_dim, config.index_head_dim
    if d % fmt.V41_WINDOW_BLOCK or d % fmt.V41_ENTRY_BLOCK or k % fmt.V41_INDEX_KEY_BLOCK:
        raise ValueError(f"--kv-cache-dtype fp8: head_dim {d} / index_head_dim {k} are not multiples of the "
                         "records' 32 / 16 / 32-value blocks")
    return (RowCodec(d, fmt.v41_window_row_bytes(d), torch.uint8, fmt.pack_v41_window_rows,
                     lambda r: fmt.unpack_v41_window_rows(r, dtype), "v41_window"),
            RowCodec(d, fmt.v41_entry_bytes(d), torch.uint8, fmt.pack_v41_entries,
                     lambda r: fmt.unpack_v41_entries(r, dtype), "v41_entry"),
            RowCodec(k, fmt.v41_index_key_bytes(k), torch.uint8, fmt.pack_v41_index_keys,
                     lambda r: fmt.unpack_v41_index_keys(r, dtype), "v41_key"))
