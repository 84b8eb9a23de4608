"""Prefix caching for the DeepSeek-V4 family: whole per-request states snapshotted at block
boundaries, found by the prefix's block hash.

A V4 / V4.1 request's cache is its state object (model/v4/state.py, model/v41/state.py): the
sliding-window rows, the open compressor windows, the compressed entries and indexer keys,
V4.1's engram history. The window rows and the open windows are overwritten as the request
grows, so no cached page restores a prefix the way R1's pages do (server/kv_cache.py).
Instead a request's state is cloned at selected block boundaries of its prompt and kept under
the block hash of the prefix up to that boundary (the same sha256 chain R1 uses). A new
request whose hash chain reaches a snapshot starts from a clone of it, at the longest such
boundary strictly inside its prompt (one token must be computed for logits). The clone is the
state a cold run has at that boundary, so everything after it is the same computation: the
cold run also splits its forward at the boundary to take the snapshot, which makes a hit's
logits bit-identical to the cold run's.

Which boundaries (:meth:`PrefixSnapshots._boundaries`; prompt tokens only):

- ``⌊(P − 1)/bs⌋·bs``, the last boundary strictly inside the prompt: the longest hit the same
  prompt re-sent, or an n > 1 sibling, can use;
- ``⌊P/bs⌋·bs``, the prompt's last full block, when P is a multiple of bs: a prompt that
  extends this one (the next turn of a chat) hits all of it;
- where the prompt leaves the prompts of earlier requests (the end of its leading blocks that
  another request's prompt had, from a bounded directory of prompt block hashes): a shared
  system prompt or document gets a snapshot at its end on the second request, later ones hit;
- every ``MLASERVE_V4_PREFIX_SNAPSHOT_INTERVAL`` tokens (0: none): checkpoints inside long
  prompts, so a preempted long prefill, or a prompt diverging inside one, resumes from there.

Not every full block, as vLLM caches pages: a snapshot at n tokens holds n tokens' worth of
entries (they grow by concatenation, so each snapshot's tensors are its own), which would
make a prompt's snapshots quadratic in its length. Generated tokens are not snapshotted:
their hash is known only after sampling (a step later under async scheduling), and the next
chat turn still hits the previous prompt's boundaries.

Memory. A snapshot at n tokens holds, in every KV-cache group, the pages a running request of
n tokens holds (its live window pages, its compressed-entry and indexer-key pages, one state
page), from the same pools as running requests, so the byte budget is never over-committed.
That counts it in full, which is what it holds: V4's ``clone`` is a deep copy, and V4.1's
shares tensors with the live state only until that state's next forward replaces them. An
idle snapshot's pages count as free, like R1's cached-free pages: an allocation that needs
them evicts whole snapshots, least recently used first (``BlockPool.reclaim``), so a
snapshot never makes a request wait or be preempted. The window and state pools have
``snapshot_slots`` extra requests' pages (server/v4_kv_specs.py) so that snapshots have room
while ``max_num_seqs`` requests run.

Ordering. The block manager's :class:`PrefixSnapshots` decides everything during
``schedule()`` (ids and hashes only); each output carries the step's :class:`SnapshotOps` to
the runner's :class:`SnapshotStore`, which holds the states and applies them in this order:
drops (evicted snapshots, before a forward can need their memory), restores (clones into the
admitted requests' states), then the forwards, cloning states at the planned boundaries. A
snapshot planned in one ``schedule()`` is hit only from the next one on (the runner runs steps
in order, so it exists by then); snapshots restored or planned in a pass are pinned for the
rest of that pass. Prompt-logprob requests take snapshots but never hit: every prompt
position's logits must be computed (R1 refuses those hits too).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from server.kv_cache_spec import NULL_BLOCK, KVCacheSpec
from server.sequence import Sequence

SEEN_BLOCKS_LIMIT = 1 << 16  # prompt block hashes remembered to find where prompts diverge


def snapshot_interval(tokens: int, block_size: int) -> int:
    """The checkpoint interval in tokens, rounded up to whole blocks (0: none)."""
    return -(-tokens // block_size) * block_size if tokens > 0 else 0


def describe_snapshot_policy(interval: int, block_size: int, slots: int) -> str:
    """The start-up log's account of where snapshots are kept."""
    every = snapshot_interval(interval, block_size)
    return (f"whole-state snapshots at {block_size}-token block boundaries of prompts (the last inside the "
            f"prompt, its last full block, where it leaves earlier prompts"
            f"{f', every {every} tokens' if every else ''}), in the KV pools (window and state pools have "
            f"room for {slots} more), least recently used evicted first")


@dataclass
class SnapshotOps:
    """One step's snapshot work for the runner (hex keys: plain values on any wire)."""

    restores: dict[int, str] = field(default_factory=dict)  # seq_id -> snapshot to start from
    takes: dict[int, list[tuple[int, str]]] = field(default_factory=dict)  # seq_id -> [(position, key)]
    drops: list[str] = field(default_factory=list)  # evicted snapshots


@dataclass
class _Snapshot:
    num_tokens: int
    pages: list[list[int]]  # per group, the page ids it holds
    pinned: bool = True  # not evictable (restored or planned in the current pass)


class PrefixSnapshots:
    """The block manager's side: which snapshots exist, their pages, the boundary policy."""

    def __init__(self, specs: SequenceABC[KVCacheSpec], pools: list, block_size: int,
                 hash_upto: Callable[[Sequence, int], list[bytes]], interval: int = 0) -> None:
        self._specs = list(specs)
        self._pools = pools
        self.block_size = block_size
        self._hash_upto = hash_upto
        self.interval = snapshot_interval(interval, block_size)
        self._index: OrderedDict[bytes, _Snapshot] = OrderedDict()  # least recently used first
        self._seen: OrderedDict[bytes, str] = OrderedDict()  # prompt block hash -> first request id
        self._divergence: dict[int, int] = {}  # seq_id -> where its prompt leaves earlier prompts
        self._pinned: list[bytes] = []
        self._ops = SnapshotOps()
        for g, pool in enumerate(pools):
            pool.reclaim = functools.partial(self._evict_for, g)

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> set[str]:
        return {k.hex() for k in self._index}

    # ---- admission ---------------------------------------------------------------------------
    def find(self, seq: Sequence, max_blocks: int) -> tuple[int, bytes | None]:
        """(tokens, key) of the longest snapshot at a boundary of at most ``max_blocks``
        blocks of ``seq``; (0, None) when there is none."""
        if not self._index or max_blocks <= 0:
            return 0, None
        hashes = self._hash_upto(seq, max_blocks)
        for n in range(max_blocks, 0, -1):
            snap = self._index.get(hashes[n - 1])
            if snap is not None:
                return n * self.block_size, hashes[n - 1]
        return 0, None

    def pages_taken_by(self, hit, group: int) -> int:
        """Free-counted pages a hit makes unavailable: the snapshot's own, while it is pinned."""
        snap = self._index.get(hit.snapshot)
        return 0 if snap is None or snap.pinned else len(snap.pages[group])

    def admit(self, seq: Sequence, hit) -> None:
        """A sequence's first allocation: note its prompt and set its tables (from ``hit``)."""
        self._note_prompt(seq, hit.num_tokens)
        if not hit:
            seq.block_tables = [[] for _ in self._pools]
            return
        snap = self._index.get(hit.snapshot)
        if snap is None or snap.num_tokens != hit.num_tokens:
            raise RuntimeError(f"snapshot for {seq!r} is no longer cached; look it up again")
        self._pin(hit.snapshot, snap)
        self._index.move_to_end(hit.snapshot)
        n = hit.num_tokens
        seq.block_tables = [[NULL_BLOCK] * spec.first_live_block(n) for spec in self._specs]
        seq.num_computed_tokens = n
        seq.num_committed_blocks = n // self.block_size
        self._ops.restores[seq.seq_id] = hit.snapshot.hex()

    def forget(self, seq: Sequence) -> None:
        self._divergence.pop(seq.seq_id, None)

    def _note_prompt(self, seq: Sequence, hit_tokens: int) -> None:
        full = seq.num_prompt_tokens // self.block_size
        if full == 0:
            return
        hashes = self._hash_upto(seq, full)[:full]
        shared = 0
        while shared < full and self._seen.get(hashes[shared], seq.request_id) != seq.request_id:
            shared += 1
        if shared * self.block_size > hit_tokens:
            self._divergence[seq.seq_id] = shared * self.block_size
        for h in hashes:
            if h in self._seen:
                self._seen.move_to_end(h)
            else:
                self._seen[h] = seq.request_id
        while len(self._seen) > SEEN_BLOCKS_LIMIT:
            self._seen.popitem(last=False)

    # ---- the end of a scheduling pass -------------------------------------------------------
    def end_pass(self, entries) -> SnapshotOps:
        """Plan the snapshots the scheduled chunks cross, unpin, and hand out the step's ops. The
        planned ones enter the index only now, so only later passes can hit them."""
        bs = self.block_size
        for entry in entries:
            seq = entry.seq
            end = min(entry.start_pos + entry.num_new_tokens - entry.num_placeholder_tokens, seq.num_prompt_tokens)
            for b in self._boundaries(seq, entry.start_pos, end):
                key = self._hash_upto(seq, b // bs)[b // bs - 1]
                if key not in self._index and self._reserve(key, b):
                    self._ops.takes.setdefault(seq.seq_id, []).append((b, key.hex()))
        for key in self._pinned:
            snap = self._index.get(key)
            if snap is not None and snap.pinned:
                snap.pinned = False
                for pool, pages in zip(self._pools, snap.pages):
                    pool.num_reclaimable += len(pages)
        self._pinned.clear()
        ops, self._ops = self._ops, SnapshotOps()
        return ops

    def _boundaries(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The kept boundaries in ``(start, end]`` (see the module docstring)."""
        bs, p = self.block_size, seq.num_prompt_tokens
        wanted = {(p - 1) // bs * bs, p // bs * bs, self._divergence.get(seq.seq_id, 0)}
        return [b for b in range((start // bs + 1) * bs, end + 1, bs)
                if b in wanted or (self.interval and b % self.interval == 0)]

    def _reserve(self, key: bytes, num_tokens: int) -> bool:
        need = [spec.num_blocks_for(num_tokens) - spec.first_live_block(num_tokens) for spec in self._specs]
        if any(n > pool.num_free for n, pool in zip(need, self._pools)):
            return False  # never wait or preempt for a snapshot
        pages = [[pool.take_fresh() for _ in range(n)] for n, pool in zip(need, self._pools)]
        self._index[key] = _Snapshot(num_tokens, pages)
        self._pinned.append(key)
        return True

    # ---- eviction ----------------------------------------------------------------------------
    def _pin(self, key: bytes, snap: _Snapshot) -> None:
        if not snap.pinned:
            snap.pinned = True
            for pool, pages in zip(self._pools, snap.pages):
                pool.num_reclaimable -= len(pages)
            self._pinned.append(key)

    def _evict(self, key: bytes) -> None:
        snap = self._index.pop(key)
        for pool, pages in zip(self._pools, snap.pages):
            if not snap.pinned:
                pool.num_reclaimable -= len(pages)
            for page in pages:
                pool.release(page)
        self._ops.drops.append(key.hex())

    def _evict_for(self, group: int) -> None:
        """Free pages of ``group`` by evicting the least recently used idle snapshot there."""
        for key, snap in self._index.items():
            if not snap.pinned and snap.pages[group]:
                self._evict(key)
                return
        raise RuntimeError(f"KV group {group}: free pages counted for snapshots that hold none")

    def reset(self) -> None:
        """Evict every idle snapshot (pinned ones go at the end of their pass)."""
        for key in [k for k, s in self._index.items() if not s.pinned]:
            self._evict(key)

    def check(self, group: int, counts: list[int]) -> None:
        """Add the snapshots' pages of ``group`` to ``counts``; assert the reclaimable count."""
        idle = 0
        for snap in self._index.values():
            for page in snap.pages[group]:
                counts[page] += 1
            idle += 0 if snap.pinned else len(snap.pages[group])
        assert self._pools[group].num_reclaimable == idle, "reclaimable pages differ from the idle snapshots'"


class SnapshotStore:
    """The runner's side: the snapshot states themselves, by hex key."""

    def __init__(self) -> None:
        self.states: dict[str, object] = {}

    def __len__(self) -> int:
        return len(self.states)

    def keys(self) -> set[str]:
        return set(self.states)

    def drop(self, keys) -> None:
        for key in keys:
            if (state := self.states.pop(key, None)) is not None:
                state.release()

    def restore(self, key: str):
        return self.states[key].clone()

    def forward(self, forward: Callable, ids: torch.Tensor, state, rows: list[int], start: int,
                takes: list[tuple[int, str]]) -> torch.Tensor | None:
        """``forward(ids, state, rows)`` over a chunk starting at position ``start``, split at each
        planned boundary so that the state there is cloned; the pieces' logits, in row order."""
        parts, lo = [], 0
        for cut, key in [(b - start, k) for b, k in takes] + [(len(ids), None)]:
            if cut > lo:
                out = forward(ids[lo:cut], state, [r - lo for r in rows if lo <= r < cut])
                if out is not None:
                    parts.append(out)
                lo = cut
            if key is not None:
                if state.num_tokens != start + cut:
                    raise RuntimeError(f"snapshot at {start + cut}: the state is at {state.num_tokens}")
                self.states[key] = state.clone()
        return torch.cat(parts) if parts else None
