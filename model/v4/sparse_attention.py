"""The V4 family's batched decode attention through a sparse-decode backend
(kernels/attention/v4_sparse_decode.py), reading the row pools' packed records in place.

With ``--kv-cache-dtype fp8`` every pool row is one record (model/v4/cache_codecs.py): V4's
window rows and compressed entries are 584-byte MODEL1 records (``pack_v4_rows``), V4.1's
window rows 528-byte and entries 288-byte records. A pool layer's rows ``[units·R, bytes]``
are then a scope cache of one-record pages (``row_record_cache``) whose record numbers are the
pools' flat rows (``unit·R + row``, :class:`~model.v4.cache_pool.BatchIndex`), so a step's
attention is two index tensors over the pools, with no gather and dequantization of padded
[B, L, d] rows in torch:

- the window scope: each request's ring rows at positions (p − window, p], −1 before 0;
- the entry scope: the indexer's picks (−1 = none), or, where every visible entry is
  attended (V4's HCA layers), all of a request's entry rows with its count as the length.

Index tensors are built from the step's device tensors with device ops only (no host sync).
The backend is chosen once per model and cache (:func:`choose_sparse_decode`); ``None``
keeps the torch path of padded gathers (model/v4/attention.py), the one for rows kept in
the model dtype and the default on a CPU.

A prefill chunk's attention likewise reads the pools in place through a sparse-prefill
backend (:func:`choose_sparse_prefill`; kernels/attention/v4_sparse_prefill.py): the ring rows
of the window before the chunk, the chunk's own rows, and the request's entry rows with the
indexer's picks (or, for V4's HCA, every visible entry) — records or model-dtype rows.
"""

from __future__ import annotations

import logging

import torch

from kernels.attention import (AttentionSpec, BackendUnavailable, V4SparseDecodeBackend, V4SparsePrefillBackend,
                               select_v4_decode_backend, select_v4_prefill_backend)
from kernels.attention.v4_sparse_decode import V4_CACHE_DTYPE
from kernels.attention.v4_kv_write import write_rows
from kernels.v4_kv_write import RowNorm, RowStore, RowTarget
from kernels.v4_sparse_decode import SparseKV, row_record_cache
from kernels.v4_sparse_prefill import StoredRows
from model.v4.cache_pool import BatchIndex, CachePools, RowPool

logger = logging.getLogger(__name__)


def choose_sparse_decode(requested: str, kv_cache_dtype: str, device: torch.device, num_heads: int,
                         head_dim: int, rope_dim: int, page_rows: int, dtype: torch.dtype,
                         formats: tuple[str, ...]) -> V4SparseDecodeBackend | None:
    """The sparse-decode backend of a model's batched decode (``--attention-backend``), or None
    for the torch path of padded gathers: ``auto`` takes a backend for packed records on a
    GPU, ``torch`` the reference backend for packed records (the padded path otherwise).
    A backend that cannot run here raises ``BackendUnavailable`` naming the flag."""
    packed = kv_cache_dtype.startswith("fp8")
    device = torch.device(device)
    if not packed or (requested == "auto" and device.type != "cuda"):
        if not packed and requested not in ("auto", "torch"):
            raise BackendUnavailable(f"--attention-backend {requested}: the V4 sparse decode backends read packed "
                                     f"cache records (--kv-cache-dtype fp8), got --kv-cache-dtype {kv_cache_dtype}")
        why = f"{device.type} device" if packed else f"--kv-cache-dtype {kv_cache_dtype}: rows in the model dtype"
        logger.info("V4 sparse decode backend: none, torch attention on padded gathers (%s: %s)", requested, why)
        return None
    spec = AttentionSpec(device, V4_CACHE_DTYPE, num_heads, head_dim, rope_dim, page_rows, head_dim**-0.5, dtype)
    return select_v4_decode_backend(requested, spec, formats)


def choose_sparse_prefill(requested: str, kv_cache_dtype: str, device: torch.device, num_heads: int,
                          head_dim: int, rope_dim: int, dtype: torch.dtype,
                          formats: tuple[str, ...]) -> V4SparsePrefillBackend | None:
    """The sparse-prefill backend of a model's chunks (``--prefill-attention-backend``), or None
    for the model's torch attention: ``auto`` takes the Triton kernel where it runs (a GPU),
    ``torch`` none. A backend that cannot run here raises ``BackendUnavailable`` naming the flag."""
    packed = kv_cache_dtype.startswith("fp8")
    spec = AttentionSpec(torch.device(device), V4_CACHE_DTYPE if packed else dtype, num_heads, head_dim, rope_dim, 1,
                         head_dim**-0.5, dtype)
    return select_v4_prefill_backend(requested, spec, formats if packed else ())


def stored_rows(pool: RowPool, layer: int, record: str, rope_dims: int = 64) -> StoredRows:
    """Pool layer ``layer``'s rows as a prefill backend reads them: ``record`` records, or
    model-dtype rows when the pool keeps values (``--kv-cache-dtype auto``)."""
    return StoredRows(pool.flat(layer), record if pool.codec.dtype == torch.uint8 else "rows", rope_dims)


def window_key_positions(batch: BatchIndex, window: int) -> torch.Tensor:
    """[B, window]: the positions (p − window, p] each request's new token attends."""
    p = batch.positions
    return p.unsqueeze(-1) - (window - 1) + torch.arange(window, device=p.device)


def write_window_row(pool: RowPool, layer: int, batch: BatchIndex, pools: CachePools, raw: torch.Tensor,
                     norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor, kv_write: str = "auto") -> None:
    """Store B new window rows ``RoPE(norm(raw))`` (raw [B, d] at ``batch.positions``, cos/sin
    there) in ring pool ``pool``, encoded by its codec (kernels/v4_kv_write.py)."""
    write_rows(raw, norm, cos, sin, RowStore(pool.flat(layer), pool.codec.encode, pool.codec.format),
               RowTarget(batch.positions, pool.rows_per_unit, ring_base=batch.ring_base[pool.name]), kv_write)


def window_scope(pool: RowPool, layer: int, batch: BatchIndex, pools: CachePools, window: int, record: str,
                 rope_dims: int = 64) -> SparseKV:
    """The window rows of B requests (already stored this step) as a scope over ``pool``."""
    key_pos = window_key_positions(batch, window)
    rows = batch.ring_rows(pools, pool.name, key_pos)
    idx = torch.where(key_pos >= 0, rows, torch.full_like(rows, -1))
    return SparseKV(row_record_cache(pool.flat(layer)), idx.to(torch.int32).unsqueeze(1), record,
                    rope_dims=rope_dims)


def entry_scope(pool: RowPool, layer: int, batch: BatchIndex, pools: CachePools, record: str,
                picks: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                rope_dims: int = 64) -> SparseKV:
    """The compressed entries of B requests as a scope over paged pool ``pool``: ``picks`` [B, k]
    (entry numbers, −1 = none), or every entry with ``counts`` [B] as the lengths."""
    if picks is None:
        index = torch.arange(batch.capacity(pools, pool.name), device=counts.device).expand(counts.shape[0], -1)
        idx, lengths = batch.paged_rows(pools, pool.name, index), counts.to(torch.int32)
    else:
        rows = batch.paged_rows(pools, pool.name, picks.clamp_min(0))
        idx, lengths = torch.where(picks >= 0, rows, torch.full_like(rows, -1)), None
    return SparseKV(row_record_cache(pool.flat(layer)), idx.to(torch.int32).unsqueeze(1), record, lengths,
                    rope_dims=rope_dims)


def sparse_attend(backend: V4SparseDecodeBackend, q: torch.Tensor, scopes: list[SparseKV], sinks: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """o [B, H, d] in q's dtype for one query token per request q [B, H, d]."""
    out, _ = backend.decode(q.unsqueeze(1), [s for s in scopes if s.indices.shape[-1]], sinks, scale)
    return out.squeeze(1).to(q.dtype)
