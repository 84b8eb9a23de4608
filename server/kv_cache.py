"""Paged KV-cache block allocator with prefix caching.

The runner owns the KV tensors ([num_blocks, block_size, 576] per layer); this module only
hands out block ids. Every id in ``range(num_blocks)`` may be handed out: a runner that
needs a scratch page (padding rows of a CUDA graph) allocates ``num_blocks + 1`` pages and
keeps the last one for itself.

Prefix caching. A *full* block of known tokens gets a hash that identifies the whole token
prefix up to its end: ``sha256(parent_hash ‖ int64 token ids)`` (the first block has no
parent). sha256 rather than Python's ``hash``: a 64-bit non-cryptographic hash lets a
client craft a colliding prompt and read another request's KV. Hashes live on the sequence
(``Sequence.block_hashes``) and are computed once, since tokens are append-only.

A block's hash is *registered* (``commit_full_blocks``) only after a step covering it was
scheduled, so a later step that reuses it runs after the step that writes it (the GPU runs
steps in order). Lifecycle of a block:

    free, unhashed ──allocate──▶ in use (ref ≥ 1) ──commit──▶ in use, hashed
    in use, hashed ──last ref freed──▶ cached-free (LRU) ──hit──▶ in use again
    cached-free ──needed for a fresh allocation──▶ evicted (hash dropped) ──▶ in use

Fresh allocations take never-hashed free blocks first and evict cached-free ones, least
recently freed first, only when none are left. A sequence's blocks are freed tail first, so
the tail of a prompt is evicted before its (more shareable) head.

Hit rule: at admission a sequence reuses the longest chain of registered blocks matching
its tokens, but at most ``(num_tokens - 1) // block_size`` blocks, so at least the last
known token is computed and produces logits (vLLM does the same). A 256-token prompt with
blocks of 64 therefore hits 192 tokens; a longer prompt sharing those 256 tokens hits 256.
Shared blocks are read-only: a sequence only writes positions ≥ its num_computed_tokens,
which lie past its hit blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence as SequenceABC

from server.sequence import Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: SequenceABC[int]) -> bytes:
    """The prefix-cache key of a full block: sha256 over the parent key and int64 token ids."""
    payload = array("q", token_ids).tobytes()
    return hashlib.sha256((parent_hash or b"") + payload).digest()


class BlockManager:
    """Allocates KV blocks to sequences; ids only, the runner owns the tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # Free blocks that hold nothing reusable; popped from the end (lowest ids first at start).
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that still hold a registered prefix; first entry = evicted first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # Prefix-cache counters (tokens), for metrics: queried at admission, and hit.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @classmethod
    def from_config(cls, config, num_blocks: int) -> "BlockManager":
        """Build with ``config.block_size`` and ``config.enable_prefix_caching`` (an EngineConfig)."""
        return cls(num_blocks, config.block_size, config.enable_prefix_caching)

    # ------------------------------------------------------------------ accounting
    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached-free ones included: they are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self._num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered in the prefix cache."""
        return self._block_hash[block_id] is not None

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids this sequence can reuse now (no side effects).

        Empty when prefix caching is off or the sequence already holds blocks. At most
        ``(num_tokens - 1) // block_size`` blocks: the last known token is always computed.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        if seq.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed (as vLLM does)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if max_blocks <= 0 or not self._hash_to_block:
            return []
        hits: list[int] = []
        for h in self._hash_upto(seq, max_blocks):
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # ------------------------------------------------------------------ allocation
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceABC[int] = ()) -> int:
        """Free blocks an ``allocate(seq, num_new_tokens, cached_blocks)`` would consume."""
        if cached_blocks:
            computed = len(cached_blocks) * self.block_size
            held = len(cached_blocks)
            revived = sum(1 for b in cached_blocks if self._ref_counts[b] == 0)
        else:
            computed = seq.num_computed_tokens
            held = len(seq.block_table)
            revived = 0
        fresh = max(0, self.blocks_for_tokens(computed + num_new_tokens) - held)
        return fresh + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceABC[int] = ()) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, cached_blocks) <= self.num_free_blocks

    def capacity_tokens(self, seq: Sequence) -> int:
        """How many new tokens of this (running) sequence fit now: slack of its last block + free blocks."""
        slack = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return slack + self.num_free_blocks * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceABC[int] = ()) -> None:
        """Grow seq.block_table to cover ``num_computed_tokens + num_new_tokens`` positions.

        ``cached_blocks`` (from ``lookup_prefix`` in the same scheduling pass) is only for a
        sequence that holds no blocks: they become the head of its table and its
        ``num_computed_tokens`` becomes ``len(cached_blocks) * block_size``. Does not advance
        num_computed_tokens otherwise (the scheduler does). Raises if the blocks don't fit:
        check ``can_allocate`` first.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be non-negative, got {num_new_tokens}")
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            raise RuntimeError(
                f"out of KV blocks: {seq!r} needs {self.num_blocks_needed(seq, num_new_tokens, cached_blocks)}, "
                f"{self.num_free_blocks} free"
            )
        if not seq.block_table:
            if seq.num_computed_tokens:
                raise RuntimeError(f"{seq!r} has computed tokens but no blocks")
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(cached_blocks) * self.block_size
        if cached_blocks:
            self._take_cached(seq, cached_blocks)
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_fresh())

    def _take_cached(self, seq: Sequence, cached_blocks: SequenceABC[int]) -> None:
        if seq.block_table:
            raise RuntimeError(f"cached blocks can only start an empty block table: {seq!r}")
        hashes = seq.block_hashes
        for i, block in enumerate(cached_blocks):
            h = self._block_hash[block]
            if h is None or i >= len(hashes) or hashes[i] != h:
                raise RuntimeError(f"block {block} is no longer cached for {seq!r}; look it up again")
            if self._ref_counts[block] == 0:
                del self._free_cached[block]
            self._ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(cached_blocks) * self.block_size
        seq.num_committed_blocks = len(cached_blocks)

    def _take_fresh(self) -> int:
        if self._free_plain:
            block = self._free_plain.pop()
        else:
            block, _ = self._free_cached.popitem(last=False)
            del self._hash_to_block[self._block_hash[block]]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (tail first) and reset its cache position."""
        for block in reversed(seq.block_table):
            ref = self._ref_counts[block] - 1
            if ref < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._ref_counts[block] = ref
            if ref == 0:
                if self._block_hash[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    # ------------------------------------------------------------------ prefix cache
    def commit_full_blocks(self, seq: Sequence) -> int:
        """Register the sequence's blocks that are now full of known, scheduled tokens.

        Call after each step (Scheduler.update_after_step does). A block whose prefix is
        already registered under another block id (two sequences computed the same prefix
        at once) stays unregistered and is plain-freed later. Returns how many blocks were
        newly registered.
        """
        num_full = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * self.block_size)
        num_full //= self.block_size
        start = seq.num_committed_blocks
        if num_full <= start:
            return 0
        seq.num_committed_blocks = num_full
        if not self.enable_prefix_caching:
            return 0
        hashes = self._hash_upto(seq, num_full)
        registered = 0
        for i in range(start, num_full):
            block = seq.block_table[i]
            h = hashes[i]
            if self._block_hash[block] is None and h not in self._hash_to_block:
                self._block_hash[block] = h
                self._hash_to_block[h] = block
                registered += 1
        return registered

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix (e.g. after new weights are loaded). Blocks in use stay in use."""
        for block in self._free_cached:
            self._free_plain.append(block)
        self._free_cached.clear()
        self._hash_to_block.clear()
        self._block_hash = [None] * self._num_blocks

    # ------------------------------------------------------------------ debugging
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the allocator's bookkeeping matches the live sequences' block tables."""
        counts = [0] * self._num_blocks
        for seq in seqs:
            table = seq.block_table
            assert len(set(table)) == len(table), f"{seq!r} holds a block twice: {table}"
            assert seq.num_computed_tokens <= len(table) * self.block_size, f"{seq!r} computed past its blocks"
            for block in table:
                counts[block] += 1
        assert counts == self._ref_counts, "ref counts differ from the block tables"
        plain = set(self._free_plain)
        assert len(plain) == len(self._free_plain), "a block is twice in the free list"
        cached = set(self._free_cached)
        assert not plain & cached, "a block is in both free lists"
        free = {b for b in range(self._num_blocks) if counts[b] == 0}
        assert plain | cached == free, "free lists differ from the unreferenced blocks"
        assert all(self._block_hash[b] is None for b in plain), "a plain-free block has a hash"
        assert all(self._block_hash[b] is not None for b in cached), "a cached-free block has no hash"
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h, f"hash map points at block {b} with another hash"
        assert sum(h is not None for h in self._block_hash) == len(self._hash_to_block), "orphan block hash"
