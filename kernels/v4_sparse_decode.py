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

:func:`v4_sparse_decode` runs the Triton kernel (``kernels/v4_sparse_decode_triton.py``) on
CUDA and this reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.v4_cache_formats import (V4_DATA_BYTES, V4_NUM_SCALES, V4_RECORD_BYTES, V4_SCALE_BYTES,
                                      pack_v4_records, unpack_v41_entries, unpack_v41_window_rows)
from kernels.weight_formats import e8m0_to_float

MAX_SCOPES = 2
HEAD_DIM = 512
RECORD_BYTES = {"v4": V4_RECORD_BYTES, "v41_window": 512 + 16, "v41_entry": 256 + 32}


def v4_cache_view(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """MODEL1 pages (``pack_v4_records``) as the uint8 [num_pages, page_size, 584] cache view
    a scope takes (the page stride stays the padded page; FlashMLA gets ``.unsqueeze(2)``)."""
    return pages[:, : page_size * V4_RECORD_BYTES].view(pages.shape[0], page_size, V4_RECORD_BYTES)


def pack_v4_cache(rows: torch.Tensor) -> torch.Tensor:
    """Rows [num_pages, page_size, 512] → the V4 cache view (:func:`v4_cache_view`)."""
    return v4_cache_view(pack_v4_records(rows), rows.shape[1])


def v4_cache_parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 [pages, page_size, 576], exponents uint8 [pages, page_size, 7]) of a V4 cache view."""
    pages, page_size, _ = cache.shape
    flat = cache.as_strided((pages, page_size * V4_RECORD_BYTES), (cache.stride(0), 1))
    data = flat[:, : page_size * V4_DATA_BYTES].reshape(pages, page_size, V4_DATA_BYTES)
    scales = flat[:, page_size * V4_DATA_BYTES:].reshape(pages, page_size, V4_SCALE_BYTES)
    return data, scales[..., :V4_NUM_SCALES]


def unpack_records(cache: torch.Tensor, record: str) -> torch.Tensor:
    """A scope's cache [pages, page_size, bytes] → float32 rows [pages, page_size, 512]."""
    if record == "v4":
        data, exps = v4_cache_parts(cache)
        return _dequant_v4(data, exps)
    if record == "v41_window":
        return unpack_v41_window_rows(cache)
    return unpack_v41_entries(cache)


def _dequant_v4(data: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    nope = data[..., :448].contiguous().view(torch.float8_e4m3fn).float()
    nope = (nope.unflatten(-1, (7, 64)) * e8m0_to_float(exps).unsqueeze(-1)).flatten(-2)
    return torch.cat([nope, data[..., 448:].contiguous().view(torch.bfloat16).float()], dim=-1)


@dataclass(frozen=True)
class SparseKV:
    """One key set: a paged cache of ``record`` format and the requests' picks into it."""

    cache: torch.Tensor  # uint8 [num_pages, page_size, RECORD_BYTES[record]]
    indices: torch.Tensor  # int32 [B, s_q, k]: page * page_size + slot, -1 = none
    record: str  # "v4", "v41_window" or "v41_entry"
    lengths: torch.Tensor | None = None  # int32 [B]: only indices[b, :, :lengths[b]] count

    @property
    def page_size(self) -> int:
        return self.cache.shape[1]


def check_inputs(q: torch.Tensor, scopes: Sequence[SparseKV], sinks: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices; one line naming the tensor on a mismatch."""
    if q.dim() != 4 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q must be [B, s_q, H, {HEAD_DIM}], got {tuple(q.shape)}")
    if not 1 <= len(scopes) <= MAX_SCOPES:
        raise ValueError(f"sparse decode takes 1 or {MAX_SCOPES} key scopes, got {len(scopes)}")
    bsz, s_q, heads, _ = q.shape
    for i, sc in enumerate(scopes):
        if sc.record not in RECORD_BYTES:
            raise ValueError(f"scopes[{i}].record {sc.record!r} is not one of {sorted(RECORD_BYTES)}")
        want = RECORD_BYTES[sc.record]
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


def gather_records(scope: SparseKV, flat: torch.Tensor) -> torch.Tensor:
    """float32 [..., 512] of the records ``flat`` (valid record numbers) of ``scope``'s cache."""
    cache = scope.cache
    if scope.record == "v4":
        data, exps = v4_cache_parts(cache)
        return _dequant_v4(data.reshape(-1, V4_DATA_BYTES)[flat], exps.reshape(-1, exps.shape[-1])[flat])
    pages, page_size, nbytes = cache.shape
    rows = cache.as_strided((pages, page_size, nbytes), cache.stride()).reshape(-1, nbytes)[flat]
    return unpack_v41_window_rows(rows) if scope.record == "v41_window" else unpack_v41_entries(rows)


def scope_keys(scope: SparseKV) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys float32 [B, s_q, k, 512] with zeros where invalid, valid bool [B, s_q, k])."""
    idx = scope.indices
    valid = idx >= 0
    if scope.lengths is not None:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        valid &= pos.view(1, 1, -1) < scope.lengths.view(-1, 1, 1)
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    keys = gather_records(scope, safe)
    return torch.where(valid.unsqueeze(-1), keys, torch.zeros((), device=keys.device)), valid


def v4_sparse_decode_reference(q: torch.Tensor, scopes: Sequence[SparseKV], sinks: torch.Tensor | None,
                               softmax_scale: float, compute_dtype: torch.dtype = torch.float32,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, s_q, H, 512] bf16, lse [B, s_q, H] float32), computed in ``compute_dtype``
    (float32; float64 for checks) from dequantized gathered records. Returns the output in
    ``compute_dtype`` too when that is float64 (a check wants the unrounded values)."""
    check_inputs(q, scopes, sinks)
    parts = [scope_keys(sc) for sc in scopes]
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
    if compute_dtype == torch.float64:
        return out, lse
    return out.to(torch.bfloat16), lse.float()
