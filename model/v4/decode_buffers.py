"""The inputs of the V4 family's batched decode (``model.decode``), eager or in persistent buffers.

:class:`DecodeInputs` is what one step of B one-token decodes reads besides the token ids:
the :class:`~model.v4.cache_pool.BatchIndex` (positions, ring bases, page tables) and, for
V4.1, the engram hash ids (hashed on the host from each request's look-back); ``histories``
(V4.1's new look-backs) go back into the states after the forward.

:class:`DecodeBuffers` holds the same tensors at fixed addresses for the largest captured
batch, with fixed page-table widths (``CachePools.page_widths``: the entries a request of
``--max-model-len`` tokens can have), so every gather of a captured graph has one shape.
:meth:`DecodeBuffers.fill` copies a step's n rows in and pads rows n … b − 1 of the captured
size b: position 0, the scratch unit in every ring base and page table, token 0, hash ids 0.
A padding row therefore writes only the scratch unit and reads only it (its window row at
position 0 is the one it just wrote; it has no visible entries), and nothing a real row
reads is written by it: per-row math never mixes rows, and real rows mask every row past
their own lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.v4.cache_pool import SCRATCH_UNIT, BatchIndex, CachePools


@dataclass
class DecodeInputs:
    index: BatchIndex
    hash_ids: torch.Tensor | None = None  # V4.1 engram: [B, engram layers, columns]
    histories: list[list[int]] | None = None  # V4.1: each request's look-back after this token


class DecodeBuffers:
    """Persistent decode inputs for up to ``max_batch`` rows; ``hash_shape``: the per-row
    shape of V4.1's engram hash ids (None: no engram layers)."""

    def __init__(self, pools: CachePools, max_batch: int, page_widths: dict[str, int], device: torch.device,
                 hash_shape: tuple[int, ...] | None = None) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.max_batch = max_batch
        self.input_ids = zeros(max_batch)
        self.positions = zeros(max_batch)
        self.ring_base = {name: zeros(max_batch) for name, p in pools.items() if p.ring}
        self.page_tables = {name: zeros(max_batch, page_widths[name]) + SCRATCH_UNIT
                            for name, p in pools.items() if not p.ring}
        self.hash_ids = None if hash_shape is None else zeros(max_batch, *hash_shape)

    def fill(self, input_ids: torch.Tensor, inputs: DecodeInputs, batch: int) -> None:
        """Copy the n = len(input_ids) rows of a step in and pad rows n … ``batch`` − 1."""
        n = input_ids.shape[0]
        if not n <= batch <= self.max_batch:
            raise ValueError(f"{n} decode rows do not fit a captured batch of {batch} (at most {self.max_batch})")
        index = inputs.index
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(index.positions)
        for name, base in self.ring_base.items():
            base[:n].copy_(index.ring_base[name])
        for name, table in self.page_tables.items():
            width = index.page_tables[name].shape[1]
            if width > table.shape[1]:
                raise ValueError(f"row pool {name}: {width} pages, more than the captured {table.shape[1]}")
            table[:n, :width].copy_(index.page_tables[name])
            table[:n, width:].fill_(SCRATCH_UNIT)
        if self.hash_ids is not None:
            self.hash_ids[:n].copy_(inputs.hash_ids)
        self.pad(n, batch)

    def pad(self, start: int, stop: int) -> None:
        """Make rows ``start`` … ``stop`` − 1 padding rows (see the module doc)."""
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        for base in self.ring_base.values():
            base[start:stop].fill_(SCRATCH_UNIT)  # the scratch unit's first row (SCRATCH_UNIT · R = 0)
        for table in self.page_tables.values():
            table[start:stop].fill_(SCRATCH_UNIT)
        if self.hash_ids is not None:
            self.hash_ids[start:stop].zero_()

    def view(self, batch: int) -> tuple[torch.Tensor, DecodeInputs]:
        """(token ids, inputs) of the first ``batch`` rows: views, so a graph captured on them
        reads whatever :meth:`fill` wrote last."""
        index = BatchIndex(self.positions[:batch], {k: v[:batch] for k, v in self.ring_base.items()},
                           {k: v[:batch] for k, v in self.page_tables.items()})
        return self.input_ids[:batch], DecodeInputs(index, None if self.hash_ids is None else self.hash_ids[:batch])
