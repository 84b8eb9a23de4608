"""BlockManager: paged allocation, ref counts, prefix caching and LRU eviction (ids only, no
tensors); a test-only sliding-window spec through the same manager API and the scheduler; the
runner's tensors and capacity from the specs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from server.config import EngineConfig
from server.kv_cache import BlockManager, hash_block_tokens
from server.kv_cache_spec import NULL_BLOCK, FullAttentionSpec, KVCacheSpec, max_num_blocks
from server.sampling_params import SamplingParams
from server.scheduler import Scheduler
from server.sequence import Sequence

BS = 64


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", tokens)


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> list[int]:
    """Admit like the scheduler does: reuse the cached prefix, allocate the rest, mark it computed."""
    hits = bm.lookup_prefix(seq)
    if num_new is None:
        num_new = seq.num_tokens - len(hits) * bm.block_size
    bm.allocate(seq, num_new, hits)
    seq.num_computed_tokens += num_new
    return hits


def test_allocate_covers_computed_plus_new_and_free_returns_everything():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = make_seq(0, list(range(9)))
    assert bm.can_allocate(seq, 9)
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 7 and bm.usage == pytest.approx(0.3)
    seq.num_computed_tokens = 9
    bm.allocate(seq, 3)  # 12 positions: still 3 blocks
    assert len(seq.block_table) == 3
    bm.allocate(seq, 4)  # 13 positions: a 4th block
    assert len(seq.block_table) == 4
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_total_blocks == 10 and bm.usage == 0.0
    bm.check_invariants([])


def test_out_of_blocks_is_refused_and_raises():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(0, list(range(12)))
    assert not bm.can_allocate(seq, 12)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(seq, 12)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_hash_is_deterministic_and_chained():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, (1, 2, 3)) and len(a) == 32
    assert a != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(a, [5]) != hash_block_tokens(hash_block_tokens(None, [9]), [5])
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_prefix_hit_rules_256_tokens_block_64():
    """A fully cached 256-token prompt hits 192 (the last token must be computed); a longer
    prompt that shares those 256 tokens hits all 256; a different first block hits nothing."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    prefix = [7 + i % 50 for i in range(256)]
    a = make_seq(0, prefix)
    assert admit(bm, a) == []
    assert bm.commit_full_blocks(a) == 4

    same = make_seq(1, prefix)
    hits = bm.lookup_prefix(same)
    assert hits == a.block_table[:3]
    admit(bm, same)
    assert same.num_computed_tokens == 256 and same.block_table[:3] == a.block_table[:3]
    assert same.block_table[3] != a.block_table[3]

    longer = make_seq(2, prefix + [1, 2, 3])
    assert bm.lookup_prefix(longer) == a.block_table

    other = make_seq(3, [99] + prefix[1:])
    assert bm.lookup_prefix(other) == []
    assert bm.prefix_cache_queries == 512 and bm.prefix_cache_hits == 192
    for b in a.block_table[:3]:
        assert bm.ref_count(b) == 2
    bm.check_invariants([a, same])


def test_hits_revive_cached_free_blocks_and_are_counted_as_consumption():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = make_seq(0, list(range(16)))
    admit(bm, a)
    bm.commit_full_blocks(a)
    bm.free(a)
    assert bm.num_free_blocks == 5 and bm.num_cached_free_blocks == 4

    b = make_seq(1, list(range(16)) + [100])
    hits = bm.lookup_prefix(b)
    assert len(hits) == 4
    # 4 revived + 1 fresh block for position 16
    assert bm.num_blocks_needed(b, 1, hits) == 5 and bm.can_allocate(b, 1, hits)
    assert not bm.can_allocate(b, 5, hits)
    bm.allocate(b, 1, hits)
    assert b.num_computed_tokens == 16 and b.num_committed_blocks == 4
    assert bm.num_free_blocks == 0
    bm.check_invariants([b])
    bm.free(b)
    assert bm.num_free_blocks == 5
    bm.check_invariants([])


def test_lru_eviction_prefers_plain_blocks_then_oldest_freed_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(0, [1] * 8)  # 2 blocks
    b = make_seq(1, [2] * 8)  # 2 blocks
    admit(bm, a)
    admit(bm, b)
    bm.commit_full_blocks(a)
    bm.commit_full_blocks(b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # freed first: evicted first, its tail block before its head block
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 4

    c = make_seq(2, [3] * 12)  # needs 3 fresh blocks: 2 plain, then a's tail block
    admit(bm, c)
    assert a_blocks[1] in c.block_table and a_blocks[0] not in c.block_table
    assert not bm.is_cached(a_blocks[1]) and bm.is_cached(a_blocks[0])
    # a's head still hits (1 block), b's prefix is intact (its hit rule allows 1 of 2 blocks)
    assert bm.lookup_prefix(make_seq(3, [1] * 8 + [5])) == a_blocks[:1]
    assert bm.lookup_prefix(make_seq(4, [2] * 8 + [5])) == b_blocks
    d = make_seq(5, [4] * 4)  # evicts a's head next
    admit(bm, d)
    assert d.block_table == a_blocks[:1]
    assert bm.lookup_prefix(make_seq(6, [1] * 8 + [5])) == []
    bm.check_invariants([c, d])
    bm.free(c)
    bm.free(d)
    assert bm.num_free_blocks == 6
    bm.check_invariants([])


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(0, list(range(12)))
    admit(bm, a)
    assert bm.commit_full_blocks(a) == 0
    assert bm.lookup_prefix(make_seq(1, list(range(12)))) == []
    bm.free(a)
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 8


def test_duplicate_prefix_computed_twice_registers_once_and_frees_cleanly():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(0, list(range(9))), make_seq(1, list(range(9)))
    admit(bm, a)
    admit(bm, b)  # nothing registered yet: computes everything itself
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.commit_full_blocks(a) == 2
    assert bm.commit_full_blocks(b) == 0
    bm.free(b)
    assert bm.num_cached_free_blocks == 0  # b's copies are plain-freed
    bm.free(a)
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_commit_only_registers_full_blocks_of_known_computed_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, list(range(10)))
    bm.allocate(seq, 6)
    seq.num_computed_tokens = 6  # a chunk: block 0 full, block 1 half
    assert bm.commit_full_blocks(seq) == 1 and seq.num_committed_blocks == 1
    bm.allocate(seq, 4)
    seq.num_computed_tokens = 10
    assert bm.commit_full_blocks(seq) == 1  # block 1; block 2 holds 2 of 4
    # async look-ahead: position 10 is a placeholder (sampled token not known yet)
    bm.allocate(seq, 2)
    seq.num_computed_tokens = 12
    seq.append_token(50)  # only one of the two new tokens is known
    assert bm.commit_full_blocks(seq) == 0
    seq.append_token(51)
    assert bm.commit_full_blocks(seq) == 1
    assert bm.lookup_prefix(make_seq(1, list(range(10)) + [50, 51, 0])) == seq.block_table[:3]
    bm.free(seq)
    bm.check_invariants([])


def test_reset_prefix_cache_forgets_hashes_but_keeps_blocks_in_use():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(0, list(range(9))), make_seq(1, [5] * 9)
    admit(bm, a)
    admit(bm, b)
    bm.commit_full_blocks(a)
    bm.commit_full_blocks(b)
    bm.free(b)
    bm.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 3
    assert bm.lookup_prefix(make_seq(2, list(range(9)))) == []
    bm.check_invariants([a])
    bm.free(a)
    assert bm.num_free_blocks == 6
    bm.check_invariants([])


def test_stale_cached_blocks_are_refused():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(0, list(range(8)))
    admit(bm, a)
    bm.commit_full_blocks(a)
    bm.free(a)
    b = make_seq(1, list(range(8)) + [9])
    hits = bm.lookup_prefix(b)
    bm.reset_prefix_cache()
    with pytest.raises(RuntimeError, match="no longer cached"):
        bm.allocate(b, 1, hits)


def test_bad_arguments():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError):
        bm.allocate(make_seq(0, [1]), -1)


# ----------------------------------------------------------------------------- a second kind of spec

@dataclass(frozen=True)
class ToySlidingWindowSpec(KVCacheSpec):
    """Test-only: attends to the last ``window`` positions; pages wholly before the window die."""

    window: int = 6
    entry_width: int = 8

    @property
    def page_shape(self):
        return (self.block_size, self.entry_width)

    def first_live_block(self, num_computed_tokens):
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def cached_prefix_blocks(self, is_cached, max_blocks):
        for n in range(max_blocks, 0, -1):
            if all(is_cached(i) for i in range(self.first_live_block(n * self.block_size), n)):
                return n
        return 0

    def restored_blocks(self, num_hit_blocks):
        return range(self.first_live_block(num_hit_blocks * self.block_size), num_hit_blocks)


def hybrid(num_blocks: int, window: int = 6) -> BlockManager:
    specs = [FullAttentionSpec(4, layer_ids=(0,)), ToySlidingWindowSpec(4, layer_ids=(1,), window=window)]
    return BlockManager(num_blocks, 4, specs=specs)


def prefill_in_chunks(bm: BlockManager, seq: Sequence, chunk: int) -> None:
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        bm.allocate(seq, n)
        seq.num_computed_tokens += n
        bm.commit_full_blocks(seq)


def test_sliding_window_pages_go_back_to_the_pool_as_the_sequence_grows():
    window_only = BlockManager(3, 4, specs=[ToySlidingWindowSpec(4, layer_ids=(0,), window=6)])
    seq = make_seq(0, list(range(40)))  # 10 blocks of positions; the window spans at most 3 pages
    prefill_in_chunks(window_only, seq, 2)
    table = seq.block_tables[0]
    # the last chunk (38, 39) attends from position 33 on: blocks 8 and 9 are all that is held
    assert len(table) == 10 and table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table[8:]
    window_only.check_invariants([seq])
    assert not BlockManager(3, 4).can_allocate(make_seq(1, list(range(40))), 40)  # full attention: 10 pages
    window_only.free(seq)
    assert seq.block_tables == [] and window_only.num_free_blocks == 3
    window_only.check_invariants([])


def test_hybrid_groups_allocate_free_and_hit_through_one_api():
    bm = hybrid(num_blocks=6)
    a = make_seq(0, list(range(16)))
    prefill_in_chunks(bm, a, 4)
    full, window = a.block_tables
    assert len(full) == 4 and NULL_BLOCK not in full
    assert window[0] == NULL_BLOCK and NULL_BLOCK not in window[1:]  # block 0 left the window at 12
    bm.check_invariants([a])
    bm.free(a)
    assert bm.num_free_blocks == 12 and bm.num_cached_free_blocks == 8  # every page of a keeps its hash

    b = make_seq(1, list(range(16)) + [99])
    hit = bm.find_prefix(b)
    # 4 blocks: full attention restores all of them, the window group only blocks 2 and 3
    # (positions 11..15 are what position 16 attends to).
    assert hit.num_tokens == 16 and hit.blocks[0] == tuple(full)
    assert hit.blocks[1] == (NULL_BLOCK, NULL_BLOCK, window[2], window[3])
    assert bm.lookup_prefix(b) == full
    bm.allocate(b, 1, hit)
    b.num_computed_tokens += 1
    assert b.block_tables[1][:2] == [NULL_BLOCK, NULL_BLOCK] and b.num_committed_blocks == 4
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])


def test_hybrid_hit_is_what_every_group_can_restore():
    """The groups' LRU orders differ (the window group freed block 0 early); evictions then
    shorten the hit to what both groups restore, and to nothing once the window group lost
    the blocks every shorter hit needs."""
    bm = hybrid(num_blocks=4)
    a = make_seq(0, list(range(16)))
    prefill_in_chunks(bm, a, 4)
    bm.free(a)
    probe = make_seq(1, list(range(16)) + [99])
    filler = make_seq(2, [500, 501, 502, 503])
    bm.allocate(filler, 4)  # evicts full block 3 (tail first) and window block 0 (freed first)
    hit = bm.find_prefix(probe)
    assert hit.num_tokens == 12 and hit.blocks[1][0] == NULL_BLOCK and NULL_BLOCK not in hit.blocks[1][1:]
    more = make_seq(3, [600, 601, 602, 603])
    bm.allocate(more, 4)  # full block 2 and window block 3 go
    # full attention could restore 2 blocks, but the window needs block 0 for any hit <= 2: refused
    assert not bm.find_prefix(probe)
    bm.check_invariants([filler, more])


@dataclass(frozen=True)
class ToyStateSpec(KVCacheSpec):
    """Test-only: one fixed page of per-request state, overwritten as the request runs."""

    state_width: int = 32
    caches_blocks = False

    @property
    def page_shape(self):
        return (self.state_width,)

    def pool_blocks(self, num_blocks, max_num_seqs):
        return max_num_seqs

    def num_blocks_for(self, num_tokens):
        return 1 if num_tokens else 0

    def max_tokens(self, pool_blocks):
        return None

    def cached_prefix_blocks(self, is_cached, max_blocks):
        return 0  # the state after n blocks is gone: refuse every hit


def test_a_group_that_cannot_restore_its_state_refuses_prefix_hits():
    specs = [FullAttentionSpec(4, layer_ids=(0,)), ToyStateSpec(4, layer_ids=(1,))]
    bm = BlockManager(8, 4, specs=specs, max_num_seqs=2)
    assert [g.num_blocks for g in bm.groups] == [8, 2] and bm.max_tokens_per_seq == 32
    a = make_seq(0, list(range(12)))
    prefill_in_chunks(bm, a, 4)
    assert [len(t) for t in a.block_tables] == [3, 1]
    b = make_seq(1, list(range(12)) + [5])
    assert bm.is_cached(a.block_tables[0][0]) and not bm.find_prefix(b)  # full attention alone would hit 12
    admit(bm, b)
    c = make_seq(2, [9])
    assert not bm.can_allocate(c, 1)  # both state pages are taken
    bm.check_invariants([a, b])
    bm.free(a)
    assert bm.can_allocate(c, 1)
    bm.free(b)
    bm.check_invariants([])


def test_capacity_from_the_specs():
    specs = [FullAttentionSpec(64, layer_ids=tuple(range(3)), entry_width=576)]  # bf16
    per_block = 3 * 64 * 576 * 2
    assert specs[0].bytes_per_block == per_block and specs[0].bytes_per_token == 3 * 576 * 2
    assert max_num_blocks(specs, 10 * per_block + 5, 8) == 10 and max_num_blocks(specs, per_block - 1, 8) == 0
    specs.append(ToySlidingWindowSpec(64, layer_ids=(3,), entry_width=32))
    both = per_block + 64 * 32 * 2
    assert max_num_blocks(specs, 7 * both, 8) == 7


def test_scheduler_runs_a_hybrid_cache_unchanged():
    """Scheduler + a full-attention group and a sliding-window group: chunked prefill, shared
    prefixes, preemption; invariants hold every step and every page comes back."""
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    specs = [FullAttentionSpec(4, layer_ids=(0,)), ToySlidingWindowSpec(4, layer_ids=(1,), window=6)]
    bm = BlockManager.from_config(config, 12, specs)
    sched = Scheduler(config, bm, max_model_len=64)
    shared = list(range(1, 13))
    seqs = [Sequence(i, f"r{i}", shared + [50 + i] * (i + 1), SamplingParams(max_tokens=12)) for i in range(6)]
    for s in seqs:
        sched.add_seq(s)
    saw_released = False
    for _ in range(400):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for seq in sched.update_after_step(out, {e.seq.seq_id: 7 for e in out.scheduled if e.sample}):
            if seq.num_output_tokens >= 12:
                sched.finish_seq(seq, "length")
        sched.check_invariants()
        saw_released |= any(s.block_tables and NULL_BLOCK in s.block_tables[1] for s in sched.running.values())
    assert not sched.has_unfinished() and all(s.num_output_tokens == 12 for s in seqs)
    assert saw_released and bm.num_free_blocks == bm.num_total_blocks == 24
    assert bm.prefix_cache_hits > 0 and sched.num_preemptions > 0
    bm.check_invariants([])


def test_runner_cache_tensors_and_capacity_follow_the_spec():
    """One full-attention group over every layer: [num_blocks + 1, block_size, entry] per layer
    (the last page is the runner's scratch page), and --kv-cache-memory-bytes buys exactly
    budget // (layers * block_size * entry * element size) blocks."""
    import torch

    from model.loader import load_model
    from server.cli import bundled_model_dir
    from server.runner import ModelRunner, determine_num_blocks, model_kv_cache_specs

    model = load_model(bundled_model_dir(), dtype="float32", progress=False)
    mc = model.config
    config = EngineConfig(block_size=16, device="cpu", kv_cache_memory_bytes=10**6)
    (spec,) = model_kv_cache_specs(mc, config, model.dtype)
    assert isinstance(spec, FullAttentionSpec) and spec.layer_ids == tuple(range(mc.num_hidden_layers))
    per_block = mc.num_hidden_layers * 16 * mc.kv_cache_entry_dim * 4
    assert spec.bytes_per_block == per_block
    assert determine_num_blocks(config, mc, model.dtype, torch.device("cpu")) == 10**6 // per_block
    runner = ModelRunner(model, config, 7, torch.device("cpu"))
    assert len(runner.kv_caches) == mc.num_hidden_layers
    assert all(c.shape == (8, 16, mc.kv_cache_entry_dim) and c.dtype == torch.float32 for c in runner.kv_caches)
