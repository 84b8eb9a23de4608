"""KV-cache specs: what one group of layers stores per token, and how its pages live and die.

The KV cache is a list of *layer groups*. Each group has a :class:`KVCacheSpec` and a pool of
pages of its own; every page holds ``block_size`` token positions of every layer in the group
(all groups share ``block_size``, which is also the prefix-cache granularity: one block hash
names the same tokens in every group). A sequence holds one block table per group
(``Sequence.block_tables[g]``; entry ``i`` covers positions ``i*block_size ..``). The block
manager (server/kv_cache.py) is generic: it asks the spec, never the kind of attention.

Today there is one kind, :class:`FullAttentionSpec`: MLA's latent cache, ``entry_width`` =
kv_lora_rank + qk_rope_head_dim = 576 values per token per layer, bf16 or FP8.

What a spec implements
----------------------
Sizing (memory planning in ``server.runner.determine_num_blocks``; the runner's tensors):

- ``page_shape``: one layer's page; the runner allocates ``[pool + 1, *page_shape]`` per
  layer in ``layer_ids`` (the extra page is its scratch page for padding rows).
- ``bytes_per_block`` (all layers of the group) and ``bytes_per_token``.
- ``pool_blocks(num_blocks, max_num_seqs)``: pages of this group's pool when the cache is
  planned for ``num_blocks`` blocks (the token-proportional unit: ``num_blocks * block_size``
  tokens of full-attention context). Memory planning finds the largest ``num_blocks`` whose
  groups fit the byte budget.
- ``max_blocks_per_seq(num_tokens)``: most pages one sequence of that length holds at once
  (admission refuses a request that could never fit); ``max_tokens(pages)``: the longest
  sequence that many pages hold (None: any; it caps max_model_len and chunk sizes).

Life of a sequence's pages (allocation, growth, preemption):

- ``num_blocks_for(num_tokens)``: the block-table length that covers positions
  ``[0, num_tokens)``.
- ``first_live_block(num_computed_tokens)``: table entries before it are no longer read by
  any later step; the manager returns them to the pool as the sequence grows and leaves
  :data:`NULL_BLOCK` in their place. Full attention: 0 (nothing dies).
- Preemption frees every page of every group (recompute); nothing spec-specific.

Prefix caching (all groups must agree, or the hit is refused):

- ``caches_blocks``: whether full blocks of this group are registered under their hashes.
- ``cached_prefix_blocks(is_cached, max_blocks)``: the largest ``n <= max_blocks`` such that
  this group's state after ``n`` full blocks can be restored from cached pages
  (``is_cached(i)``: block ``i``'s hash is registered in this group's pool). It must return the
  largest such ``n`` (the manager iterates the groups to a common fixed point) and 0 is always
  allowed.
- ``restored_blocks(n)``: which table entries of such a hit come from the cache; the others
  stay :data:`NULL_BLOCK`.
- ``restores_by_snapshot``: a group whose state no pages can restore (True) switches the whole
  cache to state snapshots kept at block boundaries (server/v4_prefix_cache.py): a hit then
  restores every group from one snapshot, and ``cached_prefix_blocks`` is not asked.

How future specs plug in (nothing in the scheduler changes):

- *Sliding window* (window ``W``): ``first_live_block(c) = max(0, c - W + 1) // block_size``;
  ``cached_prefix_blocks`` scans down from ``max_blocks`` for the first ``n`` whose window
  blocks ``first_live_block(n*bs) .. n-1`` are all cached; ``restored_blocks(n)`` is that range.
  Its kernels must never read a :data:`NULL_BLOCK` entry (they lie outside the window).
- *Compressed* (one entry per ``m`` tokens, ``m`` dividing ``block_size``): full attention's
  behaviour with ``page_shape = (block_size // m, width)``; a block boundary is an entry
  boundary, so hits restore exactly.
- *Fixed per-request state* (recurrent / SSM-like, or a compressor's open window):
  ``num_blocks_for(n) = 1 if n else 0``, ``pool_blocks = max_num_seqs``,
  ``max_blocks_per_seq = 1``, ``max_tokens = None``, ``caches_blocks = False`` and
  ``cached_prefix_blocks`` returns 0: the state after ``n`` blocks was overwritten, so no
  page restores it; ``restores_by_snapshot`` = True makes hits come from state snapshots.

server/v4_kv_specs.py implements the sliding-window, compressed and per-request-state specs for
the DeepSeek-V4 family. tests/server/test_kv_cache.py defines a sliding-window spec in the test itself and runs it
through the same manager API.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

NULL_BLOCK = -1  # a block-table entry whose page went back to the pool (never read again)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base class; see the module docstring for what a subclass implements."""

    block_size: int
    dtype: torch.dtype = torch.bfloat16
    layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    # ---- sizing
    @property
    def page_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def bytes_per_block(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * math.prod(self.page_shape) * elt

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def pool_blocks(self, num_blocks: int, max_num_seqs: int) -> int:
        return num_blocks

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        return self.num_blocks_for(num_tokens)

    def max_tokens(self, pool_blocks: int) -> int | None:
        """Longest sequence a pool of ``pool_blocks`` pages holds (None: any length)."""
        return pool_blocks * self.block_size

    # ---- page lifetime
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_live_block(self, num_computed_tokens: int) -> int:
        return 0

    # ---- prefix caching
    caches_blocks = True
    restores_by_snapshot = False

    def cached_prefix_blocks(self, is_cached: Callable[[int], bool], max_blocks: int) -> int:
        n = 0
        while n < max_blocks and is_cached(n):
            n += 1
        return n

    def restored_blocks(self, num_hit_blocks: int) -> range:
        return range(num_hit_blocks)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every past position is attended: ``entry_width`` values per token per layer (MLA: the
    576-wide compressed latent ‖ rope key). Pages live until the sequence is freed; a prefix
    hit is the longest chain of cached blocks."""

    entry_width: int = 576

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.entry_width)


@dataclass(frozen=True)
class KVCacheGroup:
    """One layer group as planned: its spec and the pages of its pool."""

    spec: KVCacheSpec
    num_blocks: int

    @property
    def num_bytes(self) -> int:
        return self.spec.bytes_per_block * self.num_blocks


def plan_groups(specs: list[KVCacheSpec], num_blocks: int, max_num_seqs: int) -> list[KVCacheGroup]:
    """The pools for a cache planned at ``num_blocks`` blocks (see ``KVCacheSpec.pool_blocks``)."""
    return [KVCacheGroup(s, s.pool_blocks(num_blocks, max_num_seqs)) for s in specs]


def max_tokens_per_seq(groups: list[KVCacheGroup]) -> int | None:
    """Longest sequence a cache planned as ``groups`` holds alone (None: any length)."""
    caps = [c for c in (g.spec.max_tokens(g.num_blocks) for g in groups) if c is not None]
    return min(caps) if caps else None


def max_num_blocks(specs: list[KVCacheSpec], budget_bytes: int, max_num_seqs: int) -> int:
    """The largest ``num_blocks`` whose pools fit ``budget_bytes`` (0 if not even one block)."""

    def cost(n: int) -> int:
        return sum(g.num_bytes for g in plan_groups(specs, n, max_num_seqs))

    if cost(1) > budget_bytes:
        return 0
    lo, hi = 1, 2
    while cost(hi) <= budget_bytes:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:  # nothing grows with num_blocks: any count fits
            raise ValueError("KV cache specs do not grow with the number of blocks")
    while hi - lo > 1:  # cost(lo) fits, cost(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget_bytes else (lo, mid)
    return lo
