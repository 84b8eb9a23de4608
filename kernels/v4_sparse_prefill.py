"""DeepSeek-V4 / V4.1 sparse prefill attention: the contract and its torch reference.

One request's prefill chunk: T query tokens at positions ``start … start + T − 1`` (any
start; a chunk may straddle compressor windows), H query heads, one shared K = V head of d
dims. Token t at position p attends, in one softmax with its head's sink logit (which only
enlarges the denominator: ``softmax([logits, sink])[:-1] · V``, as the decode contract of
``kernels.v4_sparse_decode``):

- its sliding window, the rows at positions (p − window, p]: the request's cached rows before
  the chunk (positions < start, read where they are stored) and the chunk's own rows (given as
  the model sees them: its cache rounding applied, in q's dtype);
- its compressed entries (when the layer has them): its own picks (entry numbers [T, k],
  −1 = none; V4's CSA and every V4.1 layer with entries) or, without picks, every entry w
  with w < (p + 1) // ratio (V4's HCA: an entry is usable from the step that completes it).

Logits are ``q·k · scale``. Rows are read as stored (:class:`StoredRows`): one record per pool
row of ``kernels.v4_sparse_decode``'s formats (``v4``: MODEL1; ``v41_window``; ``v41_entry``)
or values in the model dtype (``rows``: ``--kv-cache-dtype auto``). Every token has a visible
key (its own row), so no row is lonely.

This reference gathers and dequantizes the rows once per chunk and attends ``query_block``
queries at a time over their window slice and all entries with a mask (the bias layout of
model/v4/attention.py); the Triton kernel is kernels/v4_sparse_prefill_triton.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.v4_cache_formats import V4_ROPE_DIMS, unpack_v41_entries, unpack_v41_window_rows, unpack_v4_rows

STORED_FORMATS = ("v4", "v41_window", "v41_entry", "rows")
QUERY_BLOCK = 256


@dataclass(frozen=True)
class StoredRows:
    """A pool layer's rows as stored: uint8 records [rows, bytes] of ``record``, or values
    [rows, d] (``record`` = ``rows``)."""

    cache: torch.Tensor
    record: str
    rope_dims: int = V4_ROPE_DIMS  # "v4" records: the trailing bf16 dims

    def read(self, rows: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """Values [len(rows), dim] in ``dtype`` of flat rows ``rows``."""
        picked = self.cache[rows.long()]
        if self.record == "rows":
            return picked.to(dtype)
        if self.record == "v4":
            return unpack_v4_rows(picked, dim, self.rope_dims, dtype)
        unpack = unpack_v41_window_rows if self.record == "v41_window" else unpack_v41_entries
        return unpack(picked, dtype)


@dataclass(frozen=True)
class PrefillWindow:
    """A chunk's sliding-window keys."""

    chunk: torch.Tensor  # [T, d]: the chunk's own rows, q's dtype
    cached: StoredRows  # the request's window rows before the chunk
    rows: torch.Tensor  # int [P]: flat rows of positions start − P … start − 1, P = min(start, size − 1)
    size: int  # the sliding window


@dataclass(frozen=True)
class PrefillEntries:
    """A chunk's compressed entries: ``picks`` per token, or all visible ones (``ratio``)."""

    stored: StoredRows
    rows: torch.Tensor  # int [n]: flat rows of entries 0 … n − 1
    picks: torch.Tensor | None = None  # int [T, k]: entry numbers, −1 = none
    ratio: int = 0  # without picks: entry w visible to position p iff w < (p + 1) // ratio


def check_prefill_inputs(q: torch.Tensor, start: int, window: PrefillWindow, entries: PrefillEntries | None,
                         sinks: torch.Tensor | None) -> None:
    """Shapes, formats and devices; one line naming the tensor on a mismatch."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, d], got {tuple(q.shape)}")
    t, heads, dim = q.shape
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if tuple(window.chunk.shape) != (t, dim):
        raise ValueError(f"window.chunk must be [{t}, {dim}], got {tuple(window.chunk.shape)}")
    want = min(start, window.size - 1)
    if window.rows.dim() != 1 or window.rows.shape[0] != want:
        raise ValueError(f"window.rows must list the {want} cached positions before the chunk, got "
                         f"{tuple(window.rows.shape)}")
    scopes = [("window.cached", window.cached)]
    if entries is not None:
        scopes.append(("entries.stored", entries.stored))
        if entries.picks is None and entries.ratio < 1:
            raise ValueError("entries need picks or a compress ratio >= 1")
        if entries.picks is not None and (entries.picks.dim() != 2 or entries.picks.shape[0] != t):
            raise ValueError(f"entries.picks must be [{t}, k], got {tuple(entries.picks.shape)}")
        if entries.rows.dim() != 1:
            raise ValueError(f"entries.rows must be [n], got {tuple(entries.rows.shape)}")
    for name, s in scopes:
        if s.record not in STORED_FORMATS:
            raise ValueError(f"{name}.record {s.record!r} is not one of {STORED_FORMATS}")
        if s.cache.dim() != 2 or (s.record != "rows" and s.cache.dtype != torch.uint8):
            raise ValueError(f"{name}.cache must be [rows, width] (uint8 for records), got {s.cache.dtype} "
                             f"{tuple(s.cache.shape)}")
        if s.cache.device != q.device:
            raise ValueError(f"{name}.cache is on {s.cache.device}, q on {q.device}")
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,)):
        raise ValueError(f"sinks must be float32 [{heads}], got {sinks.dtype} {tuple(sinks.shape)}")


def entry_visibility(entries: PrefillEntries, positions: torch.Tensor, num_entries: int) -> torch.Tensor:
    """bool [len(positions), n]: which entries each query sees (``positions``: the queries'
    positions; with picks, their rows of ``entries.picks`` in the same order)."""
    if entries.picks is None:
        w = torch.arange(num_entries, device=positions.device)
        return w[None, :] < ((positions[:, None] + 1) // entries.ratio)
    picks = entries.picks.long()
    visible = torch.zeros(picks.shape[0], num_entries + 1, dtype=torch.bool, device=picks.device)
    visible.scatter_(-1, torch.where(picks >= 0, picks, torch.full_like(picks, num_entries)), True)
    return visible[:, :num_entries]


def v4_sparse_prefill_reference(q: torch.Tensor, start: int, window: PrefillWindow, entries: PrefillEntries | None,
                                sinks: torch.Tensor | None, softmax_scale: float,
                                compute_dtype: torch.dtype | None = None, query_block: int = QUERY_BLOCK
                                ) -> torch.Tensor:
    """out [T, H, d]: in q's dtype, or in ``compute_dtype`` when that is float64 (a check wants
    the unrounded values); computed in float32 (float64 for a float64 q) by default."""
    check_prefill_inputs(q, start, window, entries, sinks)
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    t, heads, dim = q.shape
    cached = window.cached.read(window.rows, dim, compute_dtype)
    keys = torch.cat([cached, window.chunk.to(compute_dtype)])  # positions start − P … start + T − 1
    first = start - cached.shape[0]
    key_pos = torch.arange(first, start + t, device=q.device)
    positions = torch.arange(start, start + t, device=q.device)
    ent = None
    if entries is not None and entries.rows.shape[0]:
        ent = entries.stored.read(entries.rows, dim, compute_dtype)
    out = torch.empty(t, heads, dim, dtype=compute_dtype, device=q.device)
    for a in range(0, t, query_block):
        b = min(a + query_block, t)
        lo = max(0, start + a - window.size + 1 - first)  # the first key row a query of the block sees
        hi = start + b - first
        diff = positions[a:b, None] - key_pos[None, lo:hi]
        visible = (diff >= 0) & (diff < window.size)
        block_keys = keys[lo:hi]
        if ent is not None:
            sub = PrefillEntries(entries.stored, entries.rows, None if entries.picks is None else entries.picks[a:b],
                                 entries.ratio)
            visible = torch.cat([visible, entry_visibility(sub, positions[a:b], ent.shape[0])], dim=1)
            block_keys = torch.cat([block_keys, ent])
        logits = torch.einsum("thd,kd->htk", q[a:b].to(compute_dtype), block_keys) * softmax_scale
        logits = logits.masked_fill(~visible.unsqueeze(0), float("-inf"))
        if sinks is not None:
            sink = sinks.to(compute_dtype).view(heads, 1, 1).expand(heads, b - a, 1)
            logits = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., : block_keys.shape[0]]
        out[a:b] = torch.einsum("htk,kd->thd", probs, block_keys)
    return out if compute_dtype == torch.float64 else out.to(q.dtype)
