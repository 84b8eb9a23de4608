"""Paged KV-cache block manager: per-layer-group page pools, prefix caching, preemption.

The runner owns the KV tensors; this module only hands out page ids. The cache is a list of
layer groups (server/kv_cache_spec.py), each with a :class:`KVCacheSpec` and its own pool
of pages; a sequence holds one block table per group (``seq.block_tables``). Every id in
``range(pool)`` may be handed out: the runner allocates one page more per layer and keeps
the last one as the scratch page of padding rows (CUDA graphs).

The scheduler talks to the manager through spec-independent calls only:
``find_prefix(seq)`` (a :class:`PrefixHit`: how many tokens are cached, and the pages that
restore them in every group), ``can_allocate`` / ``allocate(seq, num_new_tokens, hit)``,
``holds_pages_for`` (the per-decode fast check), ``capacity_tokens``, ``free`` (finish or
preemption by recompute), ``commit_full_blocks`` after each step, and
``whole_cache_shortfall`` at admission. A page released while a step that reads it is in
flight is safe: steps run in order on the device, so its next owner writes it later. What differs between kinds of
cache (page shapes, pages that die as a sequence grows, which hits can be restored) is
asked of the spec; see server/kv_cache_spec.py for what a new spec implements.

Prefix caching. A *full* block of known tokens gets a hash that identifies the whole token
prefix up to its end: ``sha256(parent_hash ‖ int64 token ids)`` (the first block has no
parent). sha256 rather than Python's ``hash``: a 64-bit non-cryptographic hash lets a
client craft a colliding prompt and read another request's KV. Hashes live on the sequence
(``Sequence.block_hashes``), are computed once (tokens are append-only) and name the same
tokens in every group (all groups share ``block_size``).

A block's hash is *registered* (``commit_full_blocks``) only after a step covering it was
scheduled, so a later step that reuses it runs after the step that writes it (the GPU runs
steps in order). Lifecycle of a page, per group pool:

    free, unhashed ──allocate──▶ in use (ref ≥ 1) ──commit──▶ in use, hashed
    in use, hashed ──last ref freed──▶ cached-free (LRU) ──hit──▶ in use again
    cached-free ──needed for a fresh allocation──▶ evicted (hash dropped) ──▶ in use

Fresh allocations take never-hashed free pages first and evict cached-free ones, least
recently freed first, only when none are left. A sequence's pages are freed tail first, so
the tail of a prompt is evicted before its (more shareable) head. Pages a spec declares dead
(``first_live_block``, e.g. outside a sliding window) are released the same way while the
sequence runs, leaving ``NULL_BLOCK`` in its table.

Hit rule: at admission a sequence reuses the longest prefix of whole blocks that *every*
group can restore (each spec's ``cached_prefix_blocks``, iterated to a common fixed point;
a group that cannot restore its state refuses the hit by answering 0), but at most
``(num_tokens - 1) // block_size`` blocks, so at least the last known token is computed and
produces logits (vLLM does the same). A 256-token prompt with blocks of 64 therefore hits 192
tokens; a longer prompt sharing those 256 tokens hits 256. Shared pages are read-only: a
sequence only writes positions ≥ its num_computed_tokens, which lie past its hit blocks.

Caches whose state no page restores (a spec with ``restores_by_snapshot``: the DeepSeek-V4
family) are prefix-cached by whole state snapshots at block boundaries instead
(server/v4_prefix_cache.py): the same hashes, counters and hit rule; a hit names a snapshot,
the sequence gets fresh pages for its restored state, and idle snapshots' pages count as free
(``BlockPool.num_reclaimable``) and are evicted whole when an allocation needs them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence as SequenceABC
from dataclasses import dataclass

from server import envs

from server.kv_cache_spec import (
    NULL_BLOCK, FullAttentionSpec, KVCacheGroup, KVCacheSpec, max_tokens_per_seq, plan_groups,
)
from server.sequence import Sequence
from server.v4_prefix_cache import PrefixSnapshots, SnapshotOps


def hash_block_tokens(parent_hash: bytes | None, token_ids: SequenceABC[int]) -> bytes:
    """The prefix-cache key of a full block: sha256 over the parent key and int64 token ids."""
    payload = array("q", token_ids).tobytes()
    return hashlib.sha256((parent_hash or b"") + payload).digest()


@dataclass(frozen=True)
class PrefixHit:
    """A prefix-cache hit: ``num_tokens`` cached tokens (whole blocks) and, per group, the
    block-table head that restores them (``NULL_BLOCK`` where the spec needs no page); or,
    for a snapshot-restored cache, the key of the state snapshot (``blocks`` empty)."""

    num_tokens: int = 0
    blocks: tuple[tuple[int, ...], ...] = ()
    snapshot: bytes | None = None

    def __bool__(self) -> bool:
        return self.num_tokens > 0


NO_HIT = PrefixHit()


class BlockPool:
    """One group's pages: reference counts, the hash registry and the two free lists."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # Free pages that hold nothing reusable; popped from the end (lowest ids first at start).
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free pages that still hold a registered prefix; first entry = evicted first.
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        # Pages held by idle state snapshots (server/v4_prefix_cache.py): counted free;
        # ``reclaim()`` evicts one snapshot to return some of them.
        self.num_reclaimable = 0
        self.reclaim: Callable[[], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached) + self.num_reclaimable

    def take_fresh(self) -> int:
        while not self.free_plain and not self.free_cached and self.num_reclaimable:
            self.reclaim()
        if self.free_plain:
            block = self.free_plain.pop()
        else:
            block, _ = self.free_cached.popitem(last=False)
            del self.hash_to_block[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def take_cached(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_cached[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        ref = self.ref_counts[block] - 1
        if ref < 0:
            raise RuntimeError(f"block {block} freed more often than allocated")
        self.ref_counts[block] = ref
        if ref == 0:
            if self.block_hash[block] is not None:
                self.free_cached[block] = None
            else:
                self.free_plain.append(block)

    def register(self, block: int, h: bytes) -> bool:
        """Register ``block`` under ``h`` unless either is registered already."""
        if self.block_hash[block] is not None or h in self.hash_to_block:
            return False
        self.block_hash[block] = h
        self.hash_to_block[h] = block
        return True

    def reset(self) -> None:
        self.free_plain.extend(self.free_cached)
        self.free_cached.clear()
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks

    def check(self, counts: list[int]) -> None:
        assert counts == self.ref_counts, "ref counts differ from the block tables"
        plain = set(self.free_plain)
        assert len(plain) == len(self.free_plain), "a block is twice in the free list"
        cached = set(self.free_cached)
        assert not plain & cached, "a block is in both free lists"
        free = {b for b in range(self.num_blocks) if counts[b] == 0}
        assert plain | cached == free, "free lists differ from the unreferenced blocks"
        assert all(self.block_hash[b] is None for b in plain), "a plain-free block has a hash"
        assert all(self.block_hash[b] is not None for b in cached), "a cached-free block has no hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} with another hash"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block), "orphan block hash"


class BlockManager:
    """Allocates KV pages of every layer group to sequences; ids only, the runner owns the tensors.

    ``BlockManager(num_blocks, block_size)`` is one full-attention group of ``num_blocks``
    pages; ``specs`` (with ``max_num_seqs``) plans one pool per spec (``plan_groups``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 specs: SequenceABC[KVCacheSpec] | None = None, max_num_seqs: int = 1,
                 snapshot_interval: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        specs = list(specs) if specs is not None else [FullAttentionSpec(block_size)]
        if not specs or any(s.block_size != block_size for s in specs):
            raise ValueError(f"every KV cache spec must have block_size {block_size}: {specs}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups: list[KVCacheGroup] = plan_groups(specs, num_blocks, max_num_seqs)
        self._specs = [g.spec for g in self.groups]
        self._pools = [BlockPool(g.num_blocks) for g in self.groups]
        # Every group's table covers block_size positions per entry (the base num_blocks_for).
        self._token_paged = all(type(s).num_blocks_for is KVCacheSpec.num_blocks_for for s in self._specs)
        self._pages_die = any(type(s).first_live_block is not KVCacheSpec.first_live_block for s in self._specs)
        # Prefix-cache counters (tokens), for metrics: queried at admission, and hit.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.snapshots: PrefixSnapshots | None = None
        if enable_prefix_caching and any(s.restores_by_snapshot for s in self._specs):
            self.snapshots = PrefixSnapshots(self._specs, self._pools, block_size, self._hash_upto,
                                             snapshot_interval)

    @classmethod
    def from_config(cls, config, num_blocks: int, specs: SequenceABC[KVCacheSpec] | None = None) -> "BlockManager":
        """Build from an EngineConfig (block_size, enable_prefix_caching, max_num_seqs)."""
        return cls(num_blocks, config.block_size, config.enable_prefix_caching, specs, config.max_num_seqs,
                   envs.MLASERVE_V4_PREFIX_SNAPSHOT_INTERVAL)

    # ------------------------------------------------------------------ accounting
    @property
    def num_total_blocks(self) -> int:
        return sum(p.num_blocks for p in self._pools)

    @property
    def num_free_blocks(self) -> int:
        """Pages no sequence holds (cached-free ones included: they are evictable)."""
        return sum(p.num_free for p in self._pools)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free pages that still restore a prefix (cached pages, idle snapshots' pages)."""
        return sum(len(p.free_cached) + p.num_reclaimable for p in self._pools)

    @property
    def usage(self) -> float:
        """Fraction of pages held by sequences in the fullest pool (vLLM's kv_cache_usage_perc)."""
        return max(1.0 - p.num_free / p.num_blocks for p in self._pools)

    def ref_count(self, block_id: int, group: int = 0) -> int:
        return self._pools[group].ref_counts[block_id]

    def is_cached(self, block_id: int, group: int = 0) -> bool:
        """Whether the page is registered in the prefix cache."""
        return self._pools[group].block_hash[block_id] is not None

    def whole_cache_shortfall(self, num_tokens: int) -> tuple[int, int] | None:
        """(pages needed, pages in the pool) of the first group that could never hold a
        sequence of ``num_tokens`` tokens even alone; None when every group can."""
        for spec, pool in zip(self._specs, self._pools):
            need = spec.max_blocks_per_seq(num_tokens)
            if need > pool.num_blocks:
                return need, pool.num_blocks
        return None

    @property
    def max_tokens_per_seq(self) -> int | None:
        """Longest sequence the cache holds alone (None: any length)."""
        return max_tokens_per_seq(self.groups)

    def describe(self) -> str:
        """One line per group for the start-up log: kind, layers, pages, bytes per token."""
        return "; ".join(f"{type(g.spec).__name__} ({g.spec.num_layers} layers, {g.spec.dtype}): {g.num_blocks} "
                         f"pages of {self.block_size} tokens, {g.spec.bytes_per_token:g} bytes/token"
                         for g in self.groups)

    # ------------------------------------------------------------------ prefix lookup
    def _hash_upto(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Extend seq.block_hashes to its first ``num_blocks`` full blocks (all known tokens)."""
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if i else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The cached prefix this sequence can reuse now (no side effects).

        Empty when prefix caching is off, the sequence already holds pages or asks for prompt
        logprobs (every prompt position must be computed, as in vLLM). At most
        ``(num_tokens - 1) // block_size`` blocks: the last known token is always computed.
        """
        if not self.enable_prefix_caching or seq.block_tables:
            return NO_HIT
        if seq.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if self.snapshots is not None:
            num_tokens, key = self.snapshots.find(seq, max_blocks)
            return PrefixHit(num_tokens, (), key) if key is not None else NO_HIT
        if max_blocks <= 0 or not any(p.hash_to_block for p in self._pools):
            return NO_HIT
        hashes = self._hash_upto(seq, max_blocks)
        n = max_blocks
        while n > 0:  # every group's longest restorable hit, down to a common length
            start = n
            for spec, pool in zip(self._specs, self._pools):
                registry = pool.hash_to_block
                n = min(n, spec.cached_prefix_blocks(lambda i, r=registry: hashes[i] in r, n))
            if n == start or len(self._pools) == 1:
                break
        if n == 0:
            return NO_HIT
        blocks = []
        for spec, pool in zip(self._specs, self._pools):
            table = [NULL_BLOCK] * n
            for i in spec.restored_blocks(n):
                table[i] = pool.hash_to_block[hashes[i]]
            blocks.append(tuple(table))
        return PrefixHit(n * self.block_size, tuple(blocks))

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """``find_prefix`` as the first group's page ids (the whole hit for one-group caches)."""
        hit = self.find_prefix(seq)
        return list(hit.blocks[0]) if hit else []

    def _as_hit(self, cached: PrefixHit | SequenceABC[int]) -> PrefixHit:
        if isinstance(cached, PrefixHit):
            return cached
        if not cached:
            return NO_HIT
        if len(self._pools) != 1:
            raise ValueError("a list of cached page ids only describes a one-group cache; pass find_prefix()'s hit")
        return PrefixHit(len(cached) * self.block_size, (tuple(cached),))

    # ------------------------------------------------------------------ allocation
    def _needs(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit):
        """Per group: (pages to take, pages this allocation releases as dead)."""
        out = []
        for g, (spec, pool) in enumerate(zip(self._specs, self._pools)):
            if hit.snapshot is not None:  # fresh pages for the restored state; the snapshot gets pinned
                computed = hit.num_tokens
                table = (NULL_BLOCK,) * spec.first_live_block(computed)
                take = self.snapshots.pages_taken_by(hit, g)
            elif hit:
                computed, table = hit.num_tokens, hit.blocks[g]
                take = sum(1 for b in table if b != NULL_BLOCK and pool.ref_counts[b] == 0)
            else:
                computed = seq.num_computed_tokens
                table = seq.block_tables[g] if seq.block_tables else ()
                take = 0
            take += max(0, spec.num_blocks_for(computed + num_new_tokens) - len(table))
            released = 0
            for i in range(min(spec.first_live_block(computed), len(table)) - 1, -1, -1):
                b = table[i]
                if b == NULL_BLOCK:
                    break
                released += pool.ref_counts[b] == 1
            out.append((take, released))
        return out

    def holds_pages_for(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the pages the sequence holds already cover ``num_new_tokens`` more positions
        in every group (then ``allocate`` would take nothing: most decode steps)."""
        tables = seq.block_tables
        if not tables:
            return False
        end = seq.num_computed_tokens + num_new_tokens
        if self._token_paged:  # the scheduler's hot path: no spec calls
            limit = -(-end // self.block_size)
            for table in tables:
                if len(table) < limit:
                    return False
            return True
        return all(spec.num_blocks_for(end) <= len(table) for spec, table in zip(self._specs, tables))

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          cached: PrefixHit | SequenceABC[int] = ()) -> int:
        """Free pages (all groups) an ``allocate(seq, num_new_tokens, cached)`` would consume."""
        return sum(take for take, _ in self._needs(seq, num_new_tokens, self._as_hit(cached)))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: PrefixHit | SequenceABC[int] = ()) -> bool:
        needs = self._needs(seq, num_new_tokens, self._as_hit(cached))
        return all(take <= pool.num_free + released for (take, released), pool in zip(needs, self._pools))

    def capacity_tokens(self, seq: Sequence) -> int:
        """How many new tokens of this (running) sequence fit now in every group."""
        fit = None
        for g, (spec, pool) in enumerate(zip(self._specs, self._pools)):
            held = len(seq.block_tables[g]) if seq.block_tables else 0
            cap = spec.max_tokens(held + pool.num_free)
            if cap is not None:
                fit = cap - seq.num_computed_tokens if fit is None else min(fit, cap - seq.num_computed_tokens)
        return max(0, fit) if fit is not None else 1 << 62

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: PrefixHit | SequenceABC[int] = ()) -> None:
        """Grow every block table to cover ``num_computed_tokens + num_new_tokens`` positions.

        ``cached`` (``find_prefix``'s hit in the same scheduling pass) is only for a sequence
        that holds no pages: it becomes the head of its tables and its ``num_computed_tokens``
        becomes ``hit.num_tokens``. Pages the specs declare dead go back to their pools first.
        Does not advance num_computed_tokens otherwise (the scheduler does). Raises if the
        pages don't fit: check ``can_allocate`` first.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        hit = self._as_hit(cached)
        if not self.can_allocate(seq, num_new_tokens, hit):
            raise RuntimeError(
                f"out of KV blocks: {seq!r} needs {self.num_blocks_needed(seq, num_new_tokens, hit)}, "
                f"{self.num_free_blocks} free"
            )
        if not seq.block_tables:
            if seq.num_computed_tokens:
                raise RuntimeError(f"{seq!r} has computed tokens but no blocks")
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += hit.num_tokens
            if self.snapshots is not None:
                self.snapshots.admit(seq, hit)
            elif hit:
                self._take_cached(seq, hit)
            else:
                seq.block_tables = [[] for _ in self._pools]
        elif hit:
            raise RuntimeError(f"cached blocks can only start an empty block table: {seq!r}")
        computed = seq.num_computed_tokens
        for spec, pool, table in zip(self._specs, self._pools, seq.block_tables):
            self._release_dead(spec, pool, table, computed)
            for _ in range(spec.num_blocks_for(computed + num_new_tokens) - len(table)):
                table.append(pool.take_fresh())

    @staticmethod
    def _release_dead(spec: KVCacheSpec, pool, table: list[int], computed: int) -> None:
        for i in range(min(spec.first_live_block(computed), len(table)) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            pool.release(table[i])
            table[i] = NULL_BLOCK

    @property
    def pages_die(self) -> bool:
        """Whether some group's pages die as a sequence grows (``release_dead_blocks`` has work)."""
        return self._pages_die

    def release_dead_blocks(self, seq: Sequence) -> None:
        """Return the pages the specs declare dead (e.g. behind a sliding window) now, not at the
        sequence's next allocation: a request that waits for budget mid-prefill then holds only
        its window (the scheduler calls this for every running sequence once per step)."""
        if self._pages_die and seq.block_tables:
            for spec, pool, table in zip(self._specs, self._pools, seq.block_tables):
                self._release_dead(spec, pool, table, seq.num_computed_tokens)

    def _take_cached(self, seq: Sequence, hit: PrefixHit) -> None:
        hashes = seq.block_hashes
        for pool, table in zip(self._pools, hit.blocks):
            for i, block in enumerate(table):
                if block != NULL_BLOCK and (i >= len(hashes) or pool.block_hash[block] != hashes[i]):
                    raise RuntimeError(f"block {block} is no longer cached for {seq!r}; look it up again")
        for pool, table in zip(self._pools, hit.blocks):
            for block in table:
                if block != NULL_BLOCK:
                    pool.take_cached(block)
        seq.block_tables = [list(table) for table in hit.blocks]
        seq.num_computed_tokens = hit.num_tokens
        seq.num_committed_blocks = hit.num_tokens // self.block_size

    def free(self, seq: Sequence) -> None:
        """Release the sequence's pages (each table tail first) and reset its cache position."""
        for pool, table in zip(self._pools, seq.block_tables):
            for block in reversed(table):
                if block != NULL_BLOCK:
                    pool.release(block)
        seq.block_tables = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        if self.snapshots is not None:
            self.snapshots.forget(seq)

    # ------------------------------------------------------------------ prefix cache
    def commit_full_blocks(self, seq: Sequence) -> int:
        """Register the sequence's blocks that are now full of known, scheduled tokens.

        Call after each step (Scheduler.update_after_step does). A page whose prefix is
        already registered under another page id (two sequences computed the same prefix
        at once) stays unregistered and is plain-freed later. Returns how many pages were
        newly registered (all groups).
        """
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = seq.num_committed_blocks
        if num_full <= start:
            return 0
        seq.num_committed_blocks = num_full
        if not self.enable_prefix_caching:
            return 0
        hashes = self._hash_upto(seq, num_full)
        registered = 0
        for spec, pool, table in zip(self._specs, self._pools, seq.block_tables):
            if not spec.caches_blocks:
                continue
            for i in range(start, min(num_full, len(table))):
                if table[i] != NULL_BLOCK and pool.register(table[i], hashes[i]):
                    registered += 1
        return registered

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix (e.g. after new weights are loaded). Pages in use stay in use."""
        for pool in self._pools:
            pool.reset()
        if self.snapshots is not None:
            self.snapshots.reset()

    def end_snapshot_pass(self, entries) -> SnapshotOps | None:
        """The end of a ``schedule()``: the step's snapshot work for the runner (None: no snapshots)."""
        return self.snapshots.end_pass(entries) if self.snapshots is not None else None

    # ------------------------------------------------------------------ debugging
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the allocator's bookkeeping matches the live sequences' block tables."""
        seqs = list(seqs)
        for seq in seqs:
            assert len(seq.block_tables) in (0, len(self._pools)), f"{seq!r} has {len(seq.block_tables)} tables"
        for g, (spec, pool) in enumerate(zip(self._specs, self._pools)):
            counts = [0] * pool.num_blocks
            for seq in seqs:
                table = seq.block_tables[g] if seq.block_tables else []
                live = [b for b in table if b != NULL_BLOCK]
                assert len(set(live)) == len(live), f"{seq!r} holds a block twice: {table}"
                assert spec.num_blocks_for(seq.num_computed_tokens) <= len(table), f"{seq!r} computed past its blocks"
                for block in live:
                    counts[block] += 1
            if self.snapshots is not None:
                self.snapshots.check(g, counts)
            pool.check(counts)
