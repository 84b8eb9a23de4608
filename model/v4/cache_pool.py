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

Appending a row writes it in place. Under the server a pool is sized once at start-up from
the block manager's plan (:class:`PoolPlan`: the units every spec got from the memory
budget), so its tensor never moves (CUDA graphs keep its address) and the pools never hold
more than the budget; a pool made without a plan (a model used on its own: tests, training
checks, the start-up profiling run) doubles when full instead. A batch of requests reads its
rows with one gather through flat row indices (``unit·R + row``): fixed buffers plus index
tensors and lengths, the layout a CUDA graph can replay. Unit 0 of every
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
SPARE_UNITS = 1  # per pool beyond the plan: a DP rank's throwaway dummy forward (not accounted)


@dataclass(frozen=True)
class PoolPlan:
    """Fixed pool sizes from the block manager's plan (server/v4_kv_specs.py): ring pools hold
    ``states`` requests (running ones and prefix-cache snapshots); the paged pool of each
    (kind, ratio) (kind ``entries`` or ``keys``, one row per ``ratio`` tokens) holds ``pages``
    pages of ``rows`` rows — the spec's blocks, one pool page per block, so a request of n
    tokens holds exactly the pages the block manager gave it."""

    states: int
    pages: dict[tuple[str, int], tuple[int, int]]

    def paged(self, name: str, kind: str, ratio: int) -> tuple[int, int]:
        """(pages, rows per page) of paged pool ``name``."""
        if (kind, ratio) not in self.pages:
            raise ValueError(f"row pool {name}: the KV-cache plan has no {kind} group of ratio {ratio}")
        return self.pages[kind, ratio]


@dataclass(frozen=True)
class RowCodec:
    """How rows of ``dim`` values are stored: ``encode`` [..., dim] → [..., width] of ``dtype``
    and ``decode`` back to values. ``decode(encode(x))`` is what every reader sees, the
    request's own new rows included. ``format`` names the encoding for the fused decode
    writes (kernels/v4_kv_write_triton.py ``FORMATS``)."""

    dim: int
    width: int
    dtype: torch.dtype
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    format: str = "plain"


def plain_codec(dim: int, dtype: torch.dtype, round_values: Callable | None = None,
                format: str = "plain") -> RowCodec:
    """Rows kept as ``dim`` values of ``dtype`` (after ``round_values``, e.g. V4.1's fake quant,
    whose encoding ``format`` names)."""
    def encode(x: torch.Tensor) -> torch.Tensor:
        return (x if round_values is None else round_values(x)).to(dtype)
    return RowCodec(dim, dim, dtype, encode, lambda s: s, format)


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(0xFF) if not t.dtype.is_floating_point else t.fill_(float("nan"))


class RowPool:
    """Rows of many requests for ``num_layers`` layers; see the module doc."""

    def __init__(self, name: str, num_layers: int, rows_per_unit: int, ring: bool, codec: RowCodec,
                 device: torch.device | str, initial_units: int = 8, ratio: int = 1, fixed: bool = False) -> None:
        """``ratio``: tokens per row of a paged pool (its rows per request grow as n // ratio);
        ``fixed``: exactly ``initial_units`` units (the scratch unit included), never more."""
        self.name, self.num_layers, self.rows_per_unit, self.ring, self.codec = (
            name, num_layers, rows_per_unit, ring, codec)
        self.ratio, self.fixed = ratio, fixed
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
            if self.fixed:
                raise RuntimeError(f"row pool {self.name}: all {self.num_units - 1} units are in use (sized once "
                                   "from the KV-cache plan; the block manager admits no more)")
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
    on :meth:`release` (the runner drops a state) or when the lease is garbage."""

    def __init__(self, pools: CachePools) -> None:
        self.pools = pools
        self.units: dict[str, list[int]] = {}
        try:
            for name, p in pools.items():
                self.units[name] = [p.allocate()] if p.ring else []
        finally:  # a full fixed pool raised: what was taken goes back with the lease
            self._release = weakref.finalize(self, _release_units, pools, self.units)

    def release(self) -> None:
        """Give every unit back now (once; the lease holds nothing after)."""
        self._release()

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
        held.clear()


class CachePools(dict):
    """The pools of one model (name → :class:`RowPool`), made once per model and cache dtype:
    of the fixed sizes of ``plan``, or growing on demand without one."""

    def __init__(self, plan: PoolPlan | None = None) -> None:
        super().__init__()
        self.plan = plan

    def add(self, pool: RowPool) -> RowPool:
        self[pool.name] = pool
        return pool

    def ring(self, name: str, num_layers: int, rows: int, codec: RowCodec, device) -> RowPool:
        """A ring pool of ``rows`` rows per request (one unit each)."""
        if self.plan is None:
            return self.add(RowPool(name, num_layers, rows, True, codec, device))
        units = self.plan.states + SPARE_UNITS + 1  # + the scratch unit
        return self.add(RowPool(name, num_layers, rows, True, codec, device, units, fixed=True))

    def paged(self, name: str, kind: str, ratio: int, num_layers: int, page_rows: int, codec: RowCodec,
              device) -> RowPool:
        """A paged pool of one row per ``ratio`` tokens (``kind``: ``entries`` or ``keys``), in
        pages of ``page_rows`` rows — or of the plan's pages and rows per page."""
        if self.plan is None:
            return self.add(RowPool(name, num_layers, page_rows, False, codec, device, ratio=ratio))
        pages, rows = self.plan.paged(name, kind, ratio)
        return self.add(RowPool(name, num_layers, rows, False, codec, device, pages + SPARE_UNITS + 1, ratio=ratio,
                                fixed=True))

    def num_free(self) -> dict[str, int]:
        """Free units per pool (a pool with nothing leased has all but the scratch unit free)."""
        return {name: p.num_free for name, p in self.items()}

    def lease(self) -> RowLease:
        return RowLease(self)

    def num_bytes(self) -> int:
        return sum(p.data.numel() * p.data.element_size() for p in self.values())

    def page_widths(self, max_tokens: int) -> dict[str, int]:
        """Page-table width of every paged pool that a request of up to ``max_tokens`` tokens
        needs: the fixed gather shapes of a captured decode."""
        return {name: max(1, -(-(max_tokens // p.ratio) // p.rows_per_unit))
                for name, p in self.items() if not p.ring}


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
              device: torch.device, page_widths: dict[str, int] | None = None) -> BatchIndex:
        """``page_widths``: fixed page-table widths (:meth:`CachePools.page_widths`); default:
        the widest lease of the batch."""
        ring, paged = {}, {}
        for name, pool in pools.items():
            if pool.ring:
                ring[name] = torch.tensor([le.units[name][0] * pool.rows_per_unit for le in leases],
                                          dtype=torch.long).to(device)
            else:
                width = max(1, max(len(le.units[name]) for le in leases))
                if page_widths is not None:
                    if width > page_widths[name]:
                        raise ValueError(f"row pool {name}: a request holds {width} pages, more than the "
                                         f"{page_widths[name]} of --max-model-len")
                    width = page_widths[name]
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
