"""Per-request decode state of a DeepSeek-V4 model, one object per layer.

A request's state is a :class:`V4RequestState`: ``num_tokens`` (positions consumed so far)
and one :class:`V4LayerState` per decoder layer. Each forward call appends a chunk of the
request's tokens at positions ``num_tokens …``; one-shot prefill, chunked prefill with any
chunk boundaries and token-by-token decode leave the same state and give the same logits.
The state only grows forward: it cannot be rewound, so speculative decoding needs
:meth:`V4RequestState.clone` snapshots.

What a layer holds:

- ``window`` (:class:`WindowState`, every layer): the K = V rows (after kv_norm and RoPE) of
  the last ``sliding_window − 1`` positions. A chunk's queries attend those rows plus the
  chunk's own rows; query t sees positions (t − sliding_window, t].
- ``compressor`` (:class:`CompressorState`, CSA and HCA layers) and ``indexer`` (CSA only,
  the lightning indexer's own compressor at ``index_head_dim``). Windows of ``ratio`` = m
  tokens are aligned to absolute positions: window w covers positions w·m … w·m + m − 1.
  The state holds

  * ``pending_kv`` / ``pending_gate`` [p < m, c]: the raw ``kv_proj`` / ``gate_proj`` rows of
    the open window (positions ``num_entries·m …``), gate without the position bias;
  * ``prev_kv`` / ``prev_gate`` [m, c/2] (overlapping CSA windows only): the first half (Ca)
    of the last completed window, gate with the position bias added — entry w pools window
    w − 1's Ca with window w's Cb, so this is what the next entry needs;
  * ``entries`` [n, d]: the compressed entries emitted so far (pooled, kv_norm'ed, RoPE'd at
    position w·m). For the indexer these are the indexer keys.

  Emission rule: the step that consumes position t with (t + 1) % m == 0 closes window
  w = (t + 1)/m − 1 and appends entry w. Entry w is visible to query t iff (w + 1)·m ≤ t + 1,
  so it is usable in the same step that emits it.

A paged engine can store ``window`` as a ring of ``sliding_window`` rows and ``entries`` in
pages of compressed rows; the open-window tensors are fixed-size per request.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch


@dataclass
class WindowState:
    """The last ``window − 1`` raw K = V rows; they cover positions [end − n, end)."""

    window: int
    rows: torch.Tensor | None = None
    end: int = 0

    def attend_and_append(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [n + T, d] and their positions for a chunk's T new rows; keeps the last window − 1."""
        keys = kv if self.rows is None else torch.cat([self.rows, kv], dim=0)
        first = self.end - (0 if self.rows is None else self.rows.shape[0])
        positions = torch.arange(first, first + keys.shape[0], device=kv.device)
        keep = max(keys.shape[0] - (self.window - 1), 0)
        self.rows = keys[keep:].clone() if keep else keys  # a copy, so a long chunk's rows are freed
        self.end += kv.shape[0]
        return keys, positions


def split_complete_windows(pending_kv: torch.Tensor | None, pending_gate: torch.Tensor | None, kv: torch.Tensor,
                           gate: torch.Tensor, ratio: int) -> tuple[torch.Tensor, ...]:
    """Open-window rows + a chunk's rows -> ``(kv [n_w, ratio, c], gate [n_w, ratio, c], the
    rows left pending, their gates)``. Windows are aligned to absolute positions, so the
    pending rows always start a window. The leftovers are copies: they never pin the chunk."""
    if pending_kv is not None:
        kv = torch.cat([pending_kv, kv], dim=0)
        gate = torch.cat([pending_gate, gate], dim=0)
    usable = (kv.shape[0] // ratio) * ratio
    shape = (usable // ratio, ratio, kv.shape[-1])
    return kv[:usable].reshape(shape), gate[:usable].reshape(shape), kv[usable:].clone(), gate[usable:].clone()


@dataclass
class CompressorState:
    """Open window, CSA overlap half and emitted entries of one compressor (see module doc)."""

    ratio: int
    overlap: bool
    pending_kv: torch.Tensor | None = None
    pending_gate: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]

    def take_complete_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append a chunk's raw rows to the open window and split off the completed windows.

        Returns ``(kv [n_w, m, c], gate [n_w, m, c], index of the first new entry)``; the rows
        of a still-open window stay pending.
        """
        kv_w, gate_w, self.pending_kv, self.pending_gate = split_complete_windows(
            self.pending_kv, self.pending_gate, kv, gate, self.ratio)
        return kv_w, gate_w, self.num_entries

    def append_entries(self, new: torch.Tensor) -> torch.Tensor:
        """Add newly emitted entries [n_w, d]; returns every entry so far [n, d]."""
        self.entries = new if self.entries is None else torch.cat([self.entries, new], dim=0)
        return self.entries


@dataclass
class V4LayerState:
    window: WindowState
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass
class V4RequestState:
    """All layers' state of one request; ``num_tokens`` is the next position."""

    layers: list[V4LayerState] = field(default_factory=list)
    num_tokens: int = 0

    def clone(self) -> V4RequestState:
        """An independent copy (a snapshot to roll speculative tokens back to)."""
        return copy.deepcopy(self)
