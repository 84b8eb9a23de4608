"""Shared row pools behind the DeepSeek-V4 family's per-request caches.

Every kind of cached row (window K = V rows, the raw rows of open compressor windows,
compressed entries, indexer keys) lives in one :class:`RowPool`: a tensor
``data`` [layers, units, rows_per_unit, width] shared by all requests, for a group of layers
that advance together. A request's :class:`RowLease` owns units of each pool:

- ring pools: one unit of R rows per request; position p is row ``p % R`` of it. Windows
  (R = sliding_window) and open compressor windows (R = ratio, or 2·ratio where V4's CSA
  windows overlap, so the previous window's first half is still there when a window closes);
- paged pools: rows 0, 1, … of a growing list (compressed entries, indexer keys) in pages of
  R rows, listed in the lease's page table.

Appending a row writes it in place (a full pool doubles: amortized O(1) per row). A batch of
requests reads its rows with one gather through flat row indices (``unit·R + row``): fixed
buffers plus index tensors and lengths, the layout a CUDA graph can replay. Unit 0 of every
pool belongs to nobody: batched writes that must not land (a request whose compressor window
did not close this step) go there. Unwritten rows are poisoned (NaN, or 0xFF bytes, which
decode to NaN) so that a read past a length shows up; readers mask what they gather.

Rows are stored through a :class:`RowCodec`: the model dtype, or a packed FP8/FP4 record of
``--kv-cache-dtype fp8`` (kernels/v4_cache_formats.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

SCRATCH_UNIT = 0


@dataclass(frozen=True)
class RowCodec:
    """How rows of ``dim`` values are stored: ``encode`` [..., dim] → [..., width] of ``dtype``
    and ``decode`` back to values. ``decode(encode(x))`` is what every reader sees, the
    request's own new rows included."""

    dim: int
    width: int
    dtype: torch.dtype
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]


def plain_codec(dim: int, dtype: torch.dtype, round_values: Callable | None = None) -> RowCodec:
    """Rows kept as ``dim`` values of ``dtype`` (after ``round_values``, e.g. V4.1's fake quant)."""
    def encode(x: torch.Tensor) -> torch.Tensor:
        return (x if round_values is None else round_values(x)).to(dtype)
    return RowCodec(dim, dim, dtype, encode, lambda s: s)


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(0xFF) if not t.dtype.is_floating_point else t.fill_(float("nan"))


class RowPool:
    """Rows of many requests for ``num_layers`` layers; see the module doc."""

    def __init__(self, name: str, num_layers: int, rows_per_unit: int, ring: bool, codec: RowCodec,
                 device: torch.device | str, initial_units: int = 8) -> None:
        self.name, self.num_layers, self.rows_per_unit, self.ring, self.codec = (
            name, num_layers, rows_per_unit, ring, codec)
        self.data = _poison(torch.empty(num_layers, max(initial_units, 2), rows_per_unit, codec.width,
                                        dtype=codec.dtype, device=device))
        self._free = list(range(self.data.shape[1] - 1, SCRATCH_UNIT, -1))

    @property
    def num_units(self) -> int:
        return self.data.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            old = self.num_units
            self.data = torch.cat([self.data, _poison(torch.empty_like(self.data))], dim=1)
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def release(self, units: list[int]) -> None:
        self._free.extend(units)

    def flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s rows as [units·R, width] (a view)."""
        return self.data[layer].view(-1, self.codec.width)

    def put(self, layer: int, rows: torch.Tensor, stored: torch.Tensor) -> None:
        """Write encoded rows ``stored`` [..., width] at flat row indices ``rows`` [...]."""
        self.flat(layer)[rows] = stored

    def get(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Decoded values [..., dim] at flat row indices ``rows`` [...]."""
        return self.codec.decode(self.flat(layer)[rows])


class RowLease:
    """One request's units in every pool of a :class:`CachePools`; they go back to the pools
    when the lease is garbage (the request's state was dropped)."""

    def __init__(self, pools: CachePools) -> None:
        self.pools = pools
        self.units: dict[str, list[int]] = {name: [p.allocate()] if p.ring else [] for name, p in pools.items()}
        weakref.finalize(self, _release_units, pools, self.units)

    def reserve(self, name: str, num_rows: int) -> None:
        """Make paged pool ``name`` hold rows [0, num_rows) for this request."""
        pool, pages = self.pools[name], self.units[name]
        while len(pages) * pool.rows_per_unit < num_rows:
            pages.append(pool.allocate())

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Flat row indices of rows (ring: positions) [start, end) of pool ``name``."""
        pool = self.pools[name]
        r = pool.rows_per_unit
        idx = torch.arange(start, end)
        if pool.ring:
            if end - start > r:
                raise ValueError(f"{name}: {end - start} rows do not fit a ring of {r}")
            flat = self.units[name][0] * r + idx % r
        else:
            flat = torch.tensor(self.units[name], dtype=torch.long)[idx // r] * r + idx % r
        return flat.to(pool.data.device)

    def copy(self) -> RowLease:
        """A new lease holding a copy of every row this one holds."""
        other = RowLease(self.pools)
        for name, units in self.units.items():
            if not self.pools[name].ring:
                other.reserve(name, len(units) * self.pools[name].rows_per_unit)
            data = self.pools[name].data
            src = torch.tensor(units, dtype=torch.long, device=data.device)
            dst = torch.tensor(other.units[name], dtype=torch.long, device=data.device)
            data[:, dst] = data[:, src]
        return other

    def unit_table(self, name: str, width: int) -> list[int]:
        """This request's units of pool ``name`` padded with the scratch unit to ``width``."""
        units = self.units[name]
        return units + [SCRATCH_UNIT] * (width - len(units))


def _release_units(pools: CachePools, units: dict[str, list[int]]) -> None:
    for name, held in units.items():
        pools[name].release(held)


class CachePools(dict):
    """The pools of one model (name → :class:`RowPool`), made once per model and cache dtype."""

    def add(self, pool: RowPool) -> RowPool:
        self[pool.name] = pool
        return pool

    def lease(self) -> RowLease:
        return RowLease(self)

    def num_bytes(self) -> int:
        return sum(p.data.numel() * p.data.element_size() for p in self.values())


@dataclass
class BatchIndex:
    """Where a batch of B requests' rows are, for a step that adds one token to each: the
    new tokens' ``positions`` [B], each ring pool's unit base (``unit·R``) [B] and each paged
    pool's page table [B, pages] (padded with the scratch unit). Built once per step, shared
    by every layer."""

    positions: torch.Tensor
    ring_base: dict[str, torch.Tensor]
    page_tables: dict[str, torch.Tensor]

    @classmethod
    def build(cls, pools: CachePools, leases: list[RowLease], positions: list[int],
              device: torch.device) -> BatchIndex:
        ring, paged = {}, {}
        for name, pool in pools.items():
            if pool.ring:
                ring[name] = torch.tensor([le.units[name][0] * pool.rows_per_unit for le in leases],
                                          dtype=torch.long).to(device)
            else:
                width = max(1, max(len(le.units[name]) for le in leases))
                paged[name] = torch.tensor([le.unit_table(name, width) for le in leases],
                                           dtype=torch.long).to(device)
        return cls(torch.tensor(positions, dtype=torch.long).to(device), ring, paged)

    def ring_rows(self, pools: CachePools, name: str, positions: torch.Tensor) -> torch.Tensor:
        """Flat rows [B, K] of ring pool ``name`` at positions [B, K] (any integers)."""
        return self.ring_base[name].unsqueeze(-1) + positions.remainder(pools[name].rows_per_unit)

    def paged_rows(self, pools: CachePools, name: str, index: torch.Tensor) -> torch.Tensor:
        """Flat rows of paged pool ``name`` for row numbers ``index`` [B, K] (0 ≤ index <
        pages·R; rows past a request's length land on its pages' tail or the scratch unit)."""
        r = pools[name].rows_per_unit
        return self.page_tables[name].gather(1, index // r) * r + index % r

    def gather_prefix(self, pools: CachePools, name: str, layer: int, counts: torch.Tensor) -> torch.Tensor:
        """Decoded rows [B, N, dim] of paged pool ``name`` (N = :meth:`capacity`): each request's
        first ``counts`` [B] rows, zero after (so unwritten, poisoned rows never reach a product)."""
        index = torch.arange(self.capacity(pools, name), device=counts.device).expand(counts.shape[0], -1)
        rows = pools[name].get(layer, self.paged_rows(pools, name, index))
        visible = (index < counts.unsqueeze(-1)).unsqueeze(-1)
        return torch.where(visible, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def capacity(self, pools: CachePools, name: str) -> int:
        """Rows the page tables of paged pool ``name`` address (the padded gather width)."""
        return self.page_tables[name].shape[1] * pools[name].rows_per_unit
