"""DeepSeek-V4 / V4.1 sparse decode attention: the contract and its torch reference.

Per request b, query token t and head h, one softmax over the keys of one or two *scopes*
(V4: the sliding-window rows ‖ the selected compressed entries), each a paged cache of
quantized 512-dim latent records (``kernels.v4_cache_formats``) and an index list
``indices[b, t, :]`` of flat record numbers ``page * page_size + slot`` (−1 = none; only the
first ``lengths[b]`` count when a scope has lengths; an HCA layer's "all visible" entries are
the list 0..n−1 with its length). K = V = the dequantized record (MQA: one KV head for all
query heads), logits ``q·k · softmax_scale``; a per-head sink logit only enlarges the
denominator. FlashMLA's conventions, so its sparse decode can be checked and timed on the
same tensors:

- ``lse`` is the log-sum-exp of the key logits (natural log, sink excluded);
- ``out = softmax(logits) · V · 1 / (1 + exp(sink − lse))`` = ``softmax([logits, sink])[:-1] · V``;
- a query with no valid key gets ``out = 0`` and ``lse = +inf``.

Two cache layouts feed the same scopes: FlashMLA's MODEL1 pages (:func:`v4_cache_view`, what
its kernel and the benchmark read) and caches that keep one record per row, such as the V4
family's row pools (:func:`row_record_cache`: one-record pages, record number = row number;
for V4 a 584-byte ``pack_v4_rows`` record is exactly a one-token MODEL1 page). Rows kept in
bf16 (``--kv-cache-dtype auto``) are the ``bf16`` record: the row's bytes as they are.

The kernels take 512-dim latents (``HEAD_DIM``; V4 records with 64 bf16 RoPE dims); this
reference reads the records at any width (the tiny test models), with the output in bf16 for
a 16-bit q and in the compute dtype otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.v4_cache_formats import (V4_RECORD_BYTES, V4_ROPE_DIMS, pack_v4_records, unpack_v41_entries,
                                      unpack_v41_window_rows, unpack_v4_rows, v41_entry_bytes, v41_window_row_bytes,
                                      v4_row_bytes, v4_row_scale_tile)

MAX_SCOPES = 2
HEAD_DIM = 512
RECORD_BYTES = {"v4": V4_RECORD_BYTES, "v41_window": 512 + 16, "v41_entry": 256 + 32, "bf16": 2 * 512}


def v4_cache_view(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """MODEL1 pages (``pack_v4_records``) as the uint8 [num_pages, page_size, 584] cache view
    a scope takes (the page stride stays the padded page; FlashMLA gets ``.unsqueeze(2)``)."""
    return pages[:, : page_size * V4_RECORD_BYTES].view(pages.shape[0], page_size, V4_RECORD_BYTES)


def pack_v4_cache(rows: torch.Tensor) -> torch.Tensor:
    """Rows [num_pages, page_size, 512] → the V4 cache view (:func:`v4_cache_view`)."""
    return v4_cache_view(pack_v4_records(rows), rows.shape[1])


def row_record_cache(rows: torch.Tensor) -> torch.Tensor:
    """A cache of one record per row, uint8 [num_rows, bytes] (contiguous), as the scope cache
    view [num_rows, 1, bytes]: record number = row number, any record format."""
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"row records must be uint8 [rows, bytes], got {rows.dtype} {tuple(rows.shape)}")
    return rows.view(rows.shape[0], 1, rows.shape[1])


def record_bytes(record: str, dim: int = HEAD_DIM, rope_dims: int = V4_ROPE_DIMS) -> int:
    """Bytes of one ``record`` of ``dim`` values (``rope_dims``: V4's trailing bf16 dims)."""
    if record == "v4":
        return v4_row_bytes(dim, rope_dims)
    if record == "bf16":
        return 2 * dim
    return v41_window_row_bytes(dim) if record == "v41_window" else v41_entry_bytes(dim)


def v4_cache_parts(cache: torch.Tensor, dim: int = HEAD_DIM, rope_dims: int = V4_ROPE_DIMS
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 [pages, page_size, dim + rope_dims], exponents uint8 [pages, page_size,
    scales]) of a V4 cache view (576 and 7 at 512 dims): a page holds every token's data
    bytes, then every token's scale bytes."""
    pages, page_size, nbytes = cache.shape
    data_bytes, nope = dim + rope_dims, dim - rope_dims
    flat = cache.as_strided((pages, page_size * nbytes), (cache.stride(0), 1))
    data = flat[:, : page_size * data_bytes].reshape(pages, page_size, data_bytes)
    scales = flat[:, page_size * data_bytes:].reshape(pages, page_size, nbytes - data_bytes)
    return data, scales[..., : nope // v4_row_scale_tile(nope)]


def _dequant_v4(data: torch.Tensor, exps: torch.Tensor, dim: int, rope_dims: int) -> torch.Tensor:
    return unpack_v4_rows(torch.cat([data, exps], dim=-1), dim, rope_dims)


def unpack_records(cache: torch.Tensor, record: str, dim: int = HEAD_DIM, rope_dims: int = V4_ROPE_DIMS
                   ) -> torch.Tensor:
    """A scope's cache [pages, page_size, bytes] → float32 rows [pages, page_size, dim]."""
    if record == "v4":
        return _dequant_v4(*v4_cache_parts(cache, dim, rope_dims), dim, rope_dims)
    if record == "v41_window":
        return unpack_v41_window_rows(cache)
    if record == "bf16":
        return bf16_record_rows(cache)
    return unpack_v41_entries(cache)


def bf16_record_rows(records: torch.Tensor) -> torch.Tensor:
    """``bf16`` records uint8 [..., 2·d] → float32 rows [..., d]."""
    return records.contiguous().view(torch.bfloat16).float()


@dataclass(frozen=True)
class SparseKV:
    """One key set: a paged cache of ``record`` format and the requests' picks into it."""

    cache: torch.Tensor  # uint8 [num_pages, page_size, RECORD_BYTES[record]]
    indices: torch.Tensor  # int32 [B, s_q, k]: page * page_size + slot, -1 = none
    record: str  # "v4", "v41_window", "v41_entry" or "bf16"
    lengths: torch.Tensor | None = None  # int32 [B]: only indices[b, :, :lengths[b]] count
    rope_dims: int = V4_ROPE_DIMS  # "v4" records: the trailing bf16 dims (64 for the kernels)

    @property
    def page_size(self) -> int:
        return self.cache.shape[1]


def check_inputs(q: torch.Tensor, scopes: Sequence[SparseKV], sinks: torch.Tensor | None,
                 head_dim: int | None = HEAD_DIM) -> None:
    """Shapes, dtypes and devices; one line naming the tensor on a mismatch. ``head_dim``: the
    latent width the caller reads (None: any, the reference)."""
    if q.dim() != 4 or (head_dim is not None and q.shape[-1] != head_dim):
        raise ValueError(f"q must be [B, s_q, H, {head_dim or 'd'}], got {tuple(q.shape)}")
    if not 1 <= len(scopes) <= MAX_SCOPES:
        raise ValueError(f"sparse decode takes 1 or {MAX_SCOPES} key scopes, got {len(scopes)}")
    bsz, s_q, heads, dim = q.shape
    for i, sc in enumerate(scopes):
        if sc.record not in RECORD_BYTES:
            raise ValueError(f"scopes[{i}].record {sc.record!r} is not one of {sorted(RECORD_BYTES)}")
        if sc.record == "v4" and head_dim is not None and sc.rope_dims != V4_ROPE_DIMS:
            raise ValueError(f"scopes[{i}].rope_dims must be {V4_ROPE_DIMS} for {head_dim}-dim V4 records, "
                             f"got {sc.rope_dims}")
        want = record_bytes(sc.record, dim, sc.rope_dims)
        if sc.cache.dtype != torch.uint8 or sc.cache.dim() != 3 or sc.cache.shape[-1] != want:
            raise ValueError(f"scopes[{i}].cache must be uint8 [pages, page_size, {want}] for {sc.record!r}, got "
                             f"{sc.cache.dtype} {tuple(sc.cache.shape)}")
        if sc.cache.stride(2) != 1 or sc.cache.stride(1) != want:
            raise ValueError(f"scopes[{i}].cache must have contiguous records within a page")
        if sc.indices.dtype != torch.int32 or sc.indices.dim() != 3 or tuple(sc.indices.shape[:2]) != (bsz, s_q):
            raise ValueError(f"scopes[{i}].indices must be int32 [{bsz}, {s_q}, k], got "
                             f"{sc.indices.dtype} {tuple(sc.indices.shape)}")
        if sc.lengths is not None and (sc.lengths.dtype != torch.int32 or tuple(sc.lengths.shape) != (bsz,)):
            raise ValueError(f"scopes[{i}].lengths must be int32 [{bsz}], got {sc.lengths.dtype} "
                             f"{tuple(sc.lengths.shape)}")
        for name, t in (("cache", sc.cache), ("indices", sc.indices), ("lengths", sc.lengths)):
            if t is not None and t.device != q.device:
                raise ValueError(f"scopes[{i}].{name} is on {t.device}, q on {q.device}")
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,)):
        raise ValueError(f"sinks must be float32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")


def gather_records(scope: SparseKV, flat: torch.Tensor, dim: int = HEAD_DIM) -> torch.Tensor:
    """float32 [..., dim] of the records ``flat`` (valid record numbers) of ``scope``'s cache."""
    cache = scope.cache
    if scope.record == "v4":
        data, exps = v4_cache_parts(cache, dim, scope.rope_dims)
        return _dequant_v4(data.reshape(-1, data.shape[-1])[flat], exps.reshape(-1, exps.shape[-1])[flat], dim,
                           scope.rope_dims)
    pages, page_size, nbytes = cache.shape
    rows = cache.as_strided((pages, page_size, nbytes), cache.stride()).reshape(-1, nbytes)[flat]
    if scope.record == "bf16":
        return bf16_record_rows(rows)
    return unpack_v41_window_rows(rows) if scope.record == "v41_window" else unpack_v41_entries(rows)


def scope_keys(scope: SparseKV, dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys float32 [B, s_q, k, dim] with zeros where invalid, valid bool [B, s_q, k])."""
    idx = scope.indices
    valid = idx >= 0
    if scope.lengths is not None:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        valid &= pos.view(1, 1, -1) < scope.lengths.view(-1, 1, 1)
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    keys = gather_records(scope, safe, dim)
    return torch.where(valid.unsqueeze(-1), keys, torch.zeros((), device=keys.device)), valid


def v4_sparse_decode_reference(q: torch.Tensor, scopes: Sequence[SparseKV], sinks: torch.Tensor | None,
                               softmax_scale: float, compute_dtype: torch.dtype | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, s_q, H, d], lse [B, s_q, H] float32), computed in ``compute_dtype`` (float32, or
    float64 for a float64 q; float64 for checks) from dequantized gathered records. The output
    is bf16 for a 16-bit q (the kernels' contract) and in ``compute_dtype`` otherwise, or when
    that is float64 (a check wants the unrounded values)."""
    check_inputs(q, scopes, sinks, head_dim=None)
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    parts = [scope_keys(sc, q.shape[-1]) for sc in scopes]
    keys = torch.cat([k for k, _ in parts], dim=2).to(compute_dtype)  # [B, s_q, K, 512]
    valid = torch.cat([v for _, v in parts], dim=2)
    logits = torch.einsum("bthd,btkd->bthk", q.to(compute_dtype), keys) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, s_q, H]
    lonely = lse == float("-inf")
    probs = torch.exp(logits - torch.where(lonely, torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.einsum("bthk,btkd->bthd", probs, keys)
    if sinks is not None:
        out = out * torch.sigmoid(lse - sinks.to(compute_dtype).view(1, 1, -1)).unsqueeze(-1)
    out = out.masked_fill(lonely.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(lonely, float("inf"))
    if compute_dtype == torch.float64 or q.dtype not in (torch.bfloat16, torch.float16):
        return out, lse
    return out.to(torch.bfloat16), lse.float()
