"""KV-cache specs of the DeepSeek-V4 family: sliding window, compressed entries, indexer keys,
per-request compressor state — and their record sizes per ``--kv-cache-dtype``.

A V4 / V4.1 request keeps four kinds of cache (model/v4/state.py, model/v41/state.py):

- every layer: the K = V rows of the last ``sliding_window − 1`` positions
  (:class:`SlidingWindowSpec`: pages wholly before the window go back to the pool as the
  request grows);
- compressor layers (V4: CSA m = 4 and HCA m = 128 layers; V4.1: only the KV-source layers,
  m = 2 and 1, shared by the layers that read them): one compressed entry per m tokens
  (:class:`CompressedSpec`);
- indexer keys, one per m tokens (V4: CSA layers; V4.1: beside each KV source's entries)
  (:class:`IndexerKeySpec`);
- the open compressor window's raw rows and V4's CSA overlap half: a fixed amount per request
  (:class:`PerRequestStateSpec`).

Record sizes (bytes per row / entry; ``auto`` keeps rows in the model dtype, the reference):

=====================  ===============================  ===================================
                       auto                              fp8
=====================  ===============================  ===================================
V4 window / entry      head_dim · elt                    nope e4m3 + rope bf16 + ue8m0 scale
                                                         per 64 nope dims, padded to 8 (584)
V4 indexer key         index_head_dim · elt              index_head_dim e4m3 + fp32 scale (132)
V4.1 window row        head_dim · elt                    e4m3 in 32-blocks, ue8m0 scales, rope
                                                         dims included (528)
V4.1 compressed entry  head_dim · elt                    e2m1 in 16-blocks, e4m3 scales (288)
V4.1 indexer key       index_head_dim · elt              e2m1 in 32-blocks, ue8m0 scales (68)
=====================  ===============================  ===================================

(the numbers in brackets: the released flash shapes, head_dim 512, rope 64, index 128).

Storage: the rows live in the model's shared row pools on the device (model/v4/cache_pool.py:
rings for the window and the open compressor windows, pages for entries and keys), stored
in these record formats (``fp8``: kernels/v4_cache_formats.py through model/v4/cache_codecs.py;
``auto``: the model dtype, V4.1's values already rounded to its FP8/FP4 grids, QAT-style);
these specs are the block manager's accounting of them, rounded up to whole pages, so
capacity, admission and preemption follow the memory budget. The per-request state is the
rings of raw compressor rows (model dtype for V4, float32 for V4.1), whatever the cache dtype.

Prefix caching: the compressor state and the window are overwritten as a request grows, so no
group's pages restore a prefix (every spec's ``cached_prefix_blocks`` is 0). Hits restore a
whole state snapshot taken at a block boundary instead (server/v4_prefix_cache.py);
:class:`PerRequestStateSpec` says so (``restores_by_snapshot``). A snapshot at ``n`` tokens
holds, in every group, the pages a running request of ``n`` tokens holds; the window and
state pools get ``snapshot_slots`` requests' worth of extra pages so snapshots have room
even when ``max_num_seqs`` requests run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.v4.cache_pool import PoolPlan
from server.kv_cache_spec import KVCacheGroup, KVCacheSpec


def _pages(n: int, per_page: int) -> int:
    return -(-n // per_page)


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """``row_bytes`` per token per layer for the last ``window − 1`` positions; pages wholly
    before the window go back to the pool (at each step, ``BlockManager.release_dead_blocks``).

    ``max_chunk_tokens`` (the step's token budget) sizes the pool: between steps a request holds
    at most ``window_pages`` (+1 of rounding) and a step adds at most its chunks' pages (+1 per
    request for a straddled page), so the window is never what makes a request wait (the
    token-proportional specs are)."""

    window: int = 128
    row_bytes: int = 0
    max_chunk_tokens: int = 0
    snapshot_slots: int = 0  # prefix-cache snapshots with room for their window (beyond max_num_seqs)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.row_bytes)

    @property
    def window_pages(self) -> int:
        """Most pages one request holds between steps (the window may straddle a page)."""
        return _pages(max(self.window - 1, 1), self.block_size) + 1

    def pool_blocks(self, num_blocks: int, max_num_seqs: int) -> int:
        return (max_num_seqs * (self.window_pages + 2) + _pages(self.max_chunk_tokens, self.block_size)
                + self.snapshot_slots * self.window_pages)

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        return min(self.num_blocks_for(num_tokens), self.window_pages + _pages(self.max_chunk_tokens, self.block_size))

    def max_tokens(self, pool_blocks: int) -> int | None:
        return None

    def first_live_block(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    caches_blocks = False

    def cached_prefix_blocks(self, is_cached: Callable[[int], bool], max_blocks: int) -> int:
        return 0


@dataclass(frozen=True)
class CompressedSpec(KVCacheSpec):
    """One ``entry_bytes`` entry per ``ratio`` tokens per layer. A page holds
    ``max(1, block_size // ratio)`` entries; only complete windows have an entry, so a request
    of ``n`` tokens holds ``⌈(n // ratio) / entries_per_page⌉`` pages."""

    ratio: int = 4
    entry_bytes: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio < 1 or (self.block_size % self.ratio and self.ratio % self.block_size):
            raise ValueError(f"compress ratio {self.ratio} and --block-size {self.block_size}: one must divide "
                             "the other")

    @property
    def entries_per_page(self) -> int:
        return max(1, self.block_size // self.ratio)

    @property
    def tokens_per_page(self) -> int:
        return self.entries_per_page * self.ratio

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.entries_per_page, self.entry_bytes)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.tokens_per_page

    def pool_blocks(self, num_blocks: int, max_num_seqs: int) -> int:
        return _pages(num_blocks * self.block_size, self.tokens_per_page)

    def num_blocks_for(self, num_tokens: int) -> int:
        return _pages(num_tokens // self.ratio, self.entries_per_page)

    def max_tokens(self, pool_blocks: int) -> int | None:
        return pool_blocks * self.tokens_per_page + self.ratio - 1

    caches_blocks = False

    def cached_prefix_blocks(self, is_cached: Callable[[int], bool], max_blocks: int) -> int:
        return 0


@dataclass(frozen=True)
class IndexerKeySpec(CompressedSpec):
    """The lightning indexer's keys: one per ``ratio`` tokens, like a compressed entry."""


@dataclass(frozen=True)
class PerRequestStateSpec(KVCacheSpec):
    """``state_bytes`` per running request, whatever its length (the open compressor windows),
    and per prefix-cache snapshot (``snapshot_slots`` more pages)."""

    state_bytes: int = 0
    snapshot_slots: int = 0

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (max(self.state_bytes, 1),)

    @property
    def bytes_per_block(self) -> int:
        return self.state_bytes

    @property
    def bytes_per_token(self) -> float:
        return 0.0

    def pool_blocks(self, num_blocks: int, max_num_seqs: int) -> int:
        return max_num_seqs + self.snapshot_slots

    def num_blocks_for(self, num_tokens: int) -> int:
        return 1 if num_tokens else 0

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        return 1

    def max_tokens(self, pool_blocks: int) -> int | None:
        return None

    caches_blocks = False
    restores_by_snapshot = True

    def cached_prefix_blocks(self, is_cached: Callable[[int], bool], max_blocks: int) -> int:
        return 0


# ---- record sizes -------------------------------------------------------------------------
def _v4_fp8_record(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    return nope + 2 * rope_dim + _pages(_pages(nope, 64), 8) * 8


def _fp8_blocks32(dim: int) -> int:
    return dim + _pages(dim, 32)


def _fp4_blocks(dim: int, block: int) -> int:
    return _pages(dim, 2) + _pages(dim, block)


def v4_family_kv_cache_specs(model_config, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype,
                             max_num_batched_tokens: int, snapshot_slots: int = 0) -> list[KVCacheSpec]:
    """The layer groups of a V4 (``V4Config``) or V4.1 (``V41Config``) model; ``snapshot_slots``
    (prefix caching) sizes the window and state pools for that many snapshots too."""
    c = model_config
    elt = torch.empty(0, dtype=model_dtype).element_size()
    fp8 = kv_cache_dtype.startswith("fp8")
    n = c.num_hidden_layers
    u8 = torch.uint8
    v41 = c.model_type != "deepseek_v4"
    if v41:
        row = _fp8_blocks32(c.head_dim) if fp8 else c.head_dim * elt
        entry = _fp4_blocks(c.head_dim, 16) if fp8 else c.head_dim * elt
        key = _fp4_blocks(c.index_head_dim, 32) if fp8 else c.index_head_dim * elt
        compressed = {layer: c.compress_ratios[layer] for layer in c.kv_source_layer_ids}
        indexed = dict(compressed)
        # The ring of the open group's fp32 kv and gate rows (ratio 1 closes every group at once).
        state = sum(m * c.head_dim * 4 * 2 for m in compressed.values() if m > 1)
    else:
        row = _v4_fp8_record(c.head_dim, c.qk_rope_head_dim) if fp8 else c.head_dim * elt
        entry = row
        key = c.index_head_dim + 4 if fp8 else c.index_head_dim * elt
        compressed = {i: m for i, (kind, m) in enumerate(zip(c.layer_kinds, c.compress_ratios)) if kind != "sliding"}
        indexed = {i: m for i, m in compressed.items() if c.layer_kinds[i] == "csa"}
        state = 0
        for i, m in compressed.items():
            overlap = c.layer_kinds[i] == "csa"
            for dim in (c.head_dim, c.index_head_dim) if overlap else (c.head_dim,):
                # Rings of raw kv + gate rows: the open window, and for CSA's overlapping windows
                # the previous one too (2m rows of the [Ca | Cb] width).
                state += (2 * m * 2 * dim if overlap else m * dim) * elt * 2
    specs: list[KVCacheSpec] = [SlidingWindowSpec(block_size, u8, tuple(range(n)), window=c.sliding_window,
                                                  row_bytes=row, max_chunk_tokens=max_num_batched_tokens,
                                                  snapshot_slots=snapshot_slots)]
    for ratio in sorted(set(compressed.values())):
        layers = tuple(i for i, m in compressed.items() if m == ratio)
        specs.append(CompressedSpec(block_size, u8, layers, ratio=ratio, entry_bytes=entry))
    for ratio in sorted(set(indexed.values())):
        layers = tuple(i for i, m in indexed.items() if m == ratio)
        specs.append(IndexerKeySpec(block_size, u8, layers, ratio=ratio, entry_bytes=key))
    specs.append(PerRequestStateSpec(block_size, u8, (), state_bytes=state, snapshot_slots=snapshot_slots))
    return specs


def v4_pool_plan(groups: list[KVCacheGroup]) -> PoolPlan:
    """The model's fixed row-pool sizes (model/v4/cache_pool.py) from the planned groups: a
    ring unit per state page (running requests and snapshots), and per compressed-entry /
    indexer-key group one pool page per block, holding that block's entries."""
    states, pages = 0, {}
    for g in groups:
        if isinstance(g.spec, PerRequestStateSpec):
            states = g.num_blocks
        elif isinstance(g.spec, CompressedSpec):
            kind = "keys" if isinstance(g.spec, IndexerKeySpec) else "entries"
            pages[kind, g.spec.ratio] = (g.num_blocks, g.spec.entries_per_page)
    return PoolPlan(states, pages)


def v4_capacity(groups: list[KVCacheGroup], max_model_len: int) -> dict:
    """``bytes_per_token`` (compressed entries and indexer keys, all layers),
    ``fixed_bytes_per_request`` (sliding-window pages and compressor state) and
    ``max_concurrency`` at ``max_model_len``, of the planned layer groups."""
    per_token = sum(g.spec.bytes_per_token for g in groups if isinstance(g.spec, CompressedSpec))
    fixed = 0
    for g in groups:
        if isinstance(g.spec, SlidingWindowSpec):
            fixed += g.spec.window_pages * g.spec.bytes_per_block
        elif isinstance(g.spec, PerRequestStateSpec):
            fixed += g.spec.state_bytes
    # The window's pool is sized for every running request (SlidingWindowSpec), so the
    # token-proportional pools and the per-request state pool (max_num_seqs) bound it.
    concurrency = min((g.num_blocks - getattr(g.spec, "snapshot_slots", 0))
                      // max(1, g.spec.max_blocks_per_seq(max_model_len - 1))
                      for g in groups if not isinstance(g.spec, SlidingWindowSpec))
    return {"bytes_per_token": per_token, "fixed_bytes_per_request": fixed, "max_concurrency": concurrency,
            "max_model_len": max_model_len}


def describe_v4_capacity(groups: list[KVCacheGroup], max_model_len: int) -> str:
    """Bytes per token, fixed bytes per request and the concurrency at ``max_model_len``."""
    c = v4_capacity(groups, max_model_len)
    return (f"{c['bytes_per_token']:g} bytes per token (compressed entries and indexer keys), "
            f"{c['fixed_bytes_per_request']} fixed bytes per request (sliding window and compressor state); "
            f"maximum concurrency at max_model_len {max_model_len}: {c['max_concurrency']} requests")
