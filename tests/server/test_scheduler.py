"""Scheduler: FCFS admission, token budget, chunked prefill, decode priority, preemption by
recompute, prefix-cache admission, n > 1 sharing, aborts, async look-ahead, and a randomized
run checked against a simulated paged KV cache."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from server.config import EngineConfig, EngineConfigError
from server.errors import InvalidRequestError
from server.kv_cache import BlockManager
from server.sampling_params import SamplingParams
from server.scheduler import Scheduler, SchedulerOutput
from server.sequence import Sequence, SequenceStatus

REPO = Path(__file__).resolve().parents[2]
VOCAB = 50
EOS = 0


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 128,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int | None = 64,
    chunked: bool = True,
    prefix_caching: bool = True,
    async_scheduling: bool = False,
) -> Scheduler:
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    return Scheduler(config, BlockManager.from_config(config, num_blocks), max_model_len)


_next_id = iter(range(10**9))


def make_seq(
    prompt, max_tokens: int | None = 16, request_id: str | None = None, index: int = 0, n: int = 1
) -> Sequence:
    seq_id = next(_next_id)
    if isinstance(prompt, int):  # distinct per sequence: no accidental prefix hits
        prompt = [1 + (seq_id * 13 + i) % 97 for i in range(prompt)]
    return Sequence(seq_id, request_id or f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, n=n), index=index)


def sampled_for(out: SchedulerOutput, token: int = 7) -> dict[int, int]:
    return {e.seq.seq_id: token for e in out.scheduled if e.sample}


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_after_step(out, sampled_for(out, token))
    sched.check_invariants()
    return out


def summary(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(e.seq.seq_id, e.start_pos, e.num_new_tokens) for e in out.scheduled]


# ---------------------------------------------------------------------------- admission


def test_fcfs_admission_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=3)
    seqs = [make_seq(5) for _ in range(5)]
    for s in seqs:
        sched.add_seq(s)
    out = step(sched)
    assert [e.seq for e in out.scheduled] == seqs[:3]
    assert all(e.sample and e.start_pos == 0 and e.num_new_tokens == 5 for e in out.scheduled)
    assert sched.num_running == 3 and sched.num_waiting == 2
    out = step(sched)
    assert out.is_decode_only and out.num_decodes == 3 and out.num_batched_tokens == 3
    sched.finish_seq(seqs[1], "stop")
    out = step(sched)
    assert [e.seq for e in out.decodes] == [seqs[0], seqs[2]]
    assert [e.seq for e in out.prefills] == [seqs[3]]
    assert out.finished_seq_ids == [seqs[1].seq_id]


def test_decode_tokens_are_appended_and_positions_advance():
    sched = make_scheduler()
    seq = make_seq(6)
    sched.add_seq(seq)
    step(sched, token=11)
    assert seq.output_token_ids == [11] and seq.num_computed_tokens == 6 and seq.num_pending_tokens == 0
    out = sched.schedule()
    (entry,) = out.scheduled
    assert (entry.start_pos, entry.num_new_tokens, entry.seq_len, entry.num_placeholder_tokens) == (6, 1, 7, 0)
    assert seq.all_token_ids[entry.start_pos] == 11
    assert sched.update_after_step(out, {seq.seq_id: 12}) == [seq]
    assert seq.all_token_ids[-2:] == [11, 12] and seq.num_computed_tokens == 7


def test_without_chunked_prefill_a_prompt_over_the_remaining_budget_waits():
    sched = make_scheduler(max_num_batched_tokens=128, max_model_len=128, chunked=False)
    a, b, c = make_seq(100, max_tokens=4), make_seq(60, max_tokens=4), make_seq(10, max_tokens=4)
    for s in (a, b, c):
        sched.add_seq(s)
    out = step(sched)
    assert summary(out) == [(a.seq_id, 0, 100)]  # b does not fit and blocks c (FCFS)
    out = step(sched)
    assert summary(out) == [(a.seq_id, 100, 1), (b.seq_id, 0, 60), (c.seq_id, 0, 10)]


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=128)
    seq = make_seq(40, max_tokens=4)
    sched.add_seq(seq)
    starts = []
    for _ in range(3):
        out = step(sched)
        (entry,) = out.scheduled
        starts.append((entry.start_pos, entry.num_new_tokens, entry.sample))
        assert out.num_batched_tokens == entry.num_new_tokens
    assert starts == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 40


def test_decodes_first_and_never_starved_by_prefills():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=256, num_blocks=128)
    short = [make_seq(3, max_tokens=50) for _ in range(4)]
    for s in short:
        sched.add_seq(s)
    step(sched)
    big = make_seq(200, max_tokens=4)
    sched.add_seq(big)
    for i in range(5):
        out = step(sched)
        assert [e.seq for e in out.decodes] == short
        assert [e.seq for e in out.prefills] == [big]
        assert out.prefills[0].num_new_tokens == 12 and out.prefills[0].start_pos == 12 * i
        assert out.num_batched_tokens == 16 and not out.is_decode_only


def test_running_prefills_go_before_new_admissions():
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_seq(30, max_tokens=2), make_seq(5, max_tokens=2)
    sched.add_seq(a)
    step(sched)
    sched.add_seq(b)
    out = step(sched)
    assert summary(out) == [(a.seq_id, 16, 14), (b.seq_id, 0, 2)]


def test_budget_must_cover_max_num_seqs_and_max_model_len_without_chunking():
    with pytest.raises(EngineConfigError, match="max-num-seqs"):
        make_scheduler(max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(EngineConfigError, match="chunked prefill"):
        make_scheduler(max_num_batched_tokens=64, max_model_len=128, chunked=False)
    unchunked = make_scheduler(max_num_batched_tokens=None, chunked=False, max_model_len=10000)
    assert unchunked.max_num_batched_tokens == 10000
    assert make_scheduler(max_num_batched_tokens=None).max_num_batched_tokens == 8192


def test_requests_that_can_never_run_are_rejected():
    sched = make_scheduler(max_model_len=32, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 32"):
        sched.add_seq(make_seq(20, max_tokens=13))
    sched.add_seq(make_seq(20, max_tokens=12))
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        sched.add_seq(make_seq(32, max_tokens=None))
    unbounded = make_seq(20, max_tokens=None)
    sched.add_seq(unbounded)
    assert unbounded.max_output_tokens == 12
    with pytest.raises(InvalidRequestError, match="at least one token"):
        sched.add_seq(make_seq([], max_tokens=1))
    small = make_scheduler(max_model_len=128, num_blocks=4)  # 16 tokens of KV in all
    small.add_seq(make_seq(10, max_tokens=7))  # 16 positions need KV
    with pytest.raises(InvalidRequestError, match="whole cache"):
        small.add_seq(make_seq(10, max_tokens=8))
    assert small.num_waiting == 1


# ---------------------------------------------------------------------------- preemption


def test_preemption_takes_the_newest_requeues_it_first_and_keeps_its_tokens():
    # 8 blocks of 4 tokens; three 8-token prompts take 6 blocks, position 8 needs a 3rd each.
    sched = make_scheduler(num_blocks=8, max_model_len=32)
    a, b, c = (make_seq(8, max_tokens=16) for _ in range(3))
    for s in (a, b, c):
        sched.add_seq(s)
    step(sched, token=5)
    waiting_behind = make_seq(8, max_tokens=4)
    sched.add_seq(waiting_behind)
    out = step(sched, token=6)
    assert out.preempted_seq_ids == [c.seq_id]  # the newest running one
    assert [e.seq for e in out.scheduled] == [a, b]  # and nothing is admitted in this step
    assert c.status is SequenceStatus.PREEMPTED and c.block_table == [] and c.num_computed_tokens == 0
    assert list(sched.waiting) == [c, waiting_behind]  # front of the queue
    assert c.output_token_ids == [5]  # tokens kept
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    # a decoding sequence that needs a block preempts the newest other one, never a scheduled one
    for _ in range(7):  # positions 9..15; at 12 a and b take the 2 blocks c gave back (evicting them)
        out = step(sched, token=6)
        assert [e.seq for e in out.scheduled] == [a, b] and not out.preempted_seq_ids
    out = step(sched, token=6)  # position 16: no block left, a preempts b
    assert [e.seq for e in out.scheduled] == [a] and out.preempted_seq_ids == [b.seq_id]
    assert list(sched.waiting) == [b, c, waiting_behind]
    # once a is done, b and c come back in order and prefill prompt + outputs; b's first 3
    # blocks are still in the prefix cache (its tail block went to a right after b freed it,
    # tail first), c's were evicted; waiting_behind finds no room left
    tokens_b, tokens_c = list(b.all_token_ids), list(c.all_token_ids)
    sched.finish_seq(a, "stop")
    out = step(sched, token=9)
    assert summary(out) == [(b.seq_id, 12, len(tokens_b) - 12), (c.seq_id, 0, len(tokens_c))]
    assert all(e.sample for e in out.scheduled)
    assert b.all_token_ids == tokens_b + [9] and c.all_token_ids == tokens_c + [9]
    assert b.num_cached_tokens == 0  # usage reports the first admission's hit


def test_running_prefill_shrinks_its_chunk_before_preempting_and_then_yields_to_decodes():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=8, max_model_len=24)
    a, big = make_seq(4, max_tokens=8), make_seq(20, max_tokens=1)
    sched.add_seq(a)
    step(sched)
    sched.add_seq(big)
    assert summary(step(sched)) == [(a.seq_id, 4, 1), (big.seq_id, 0, 7)]
    assert summary(step(sched)) == [(a.seq_id, 5, 1), (big.seq_id, 7, 7)]
    assert sched.block_manager.num_free_blocks == 0
    out = step(sched)  # big wants 6 more tokens, only the 2 slots of its last block are left
    assert summary(out) == [(a.seq_id, 6, 1), (big.seq_id, 14, 2)] and not out.preempted_seq_ids
    out = step(sched)  # nothing left for big: it is the newest, so it steps back itself
    assert summary(out) == [(a.seq_id, 7, 1)] and out.preempted_seq_ids == [big.seq_id]
    assert big.status is SequenceStatus.PREEMPTED and list(sched.waiting) == [big]


def test_a_sequence_alone_that_cannot_get_a_block_waits_instead_of_stealing_scheduled_ones():
    sched = make_scheduler(num_blocks=4, max_model_len=16, max_num_batched_tokens=16)
    a, b = make_seq(8, max_tokens=8), make_seq(7, max_tokens=8)
    sched.add_seq(a)
    sched.add_seq(b)
    step(sched)  # 4 blocks used
    out = step(sched)  # a needs a 3rd block: preempts b (newest)
    assert out.preempted_seq_ids == [b.seq_id] and [e.seq for e in out.scheduled] == [a]
    sched.check_invariants()


# ---------------------------------------------------------------------------- prefix cache


def test_prefix_cache_hit_counts_with_block_64():
    sched = make_scheduler(num_blocks=64, block_size=64, max_model_len=1024, max_num_batched_tokens=2048)
    prefix = [3 + i % 90 for i in range(256)]
    first = make_seq(prefix, max_tokens=2)
    sched.add_seq(first)
    step(sched)
    sched.finish_seq(first, "length")
    same, longer = make_seq(prefix, max_tokens=2), make_seq(prefix + [5, 6, 7], max_tokens=2)
    sched.add_seq(same)
    sched.add_seq(longer)
    out = step(sched)
    assert summary(out) == [(same.seq_id, 192, 64), (longer.seq_id, 256, 3)]
    assert same.num_cached_tokens == 192 and longer.num_cached_tokens == 256
    assert sched.block_manager.prefix_cache_hits == 448


def test_prefix_cache_off_hits_nothing():
    sched = make_scheduler(prefix_caching=False)
    a = make_seq(20, max_tokens=2)
    sched.add_seq(a)
    step(sched)
    b = make_seq(20, max_tokens=2)
    sched.add_seq(b)
    out = step(sched)
    assert out.prefills[0].start_pos == 0 and b.num_cached_tokens == 0


def test_n_siblings_admitted_together_share_the_prompt_blocks():
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=64)
    prompt = [2 + i for i in range(18)]  # 4 full blocks + 2 tokens; shareable: (18-1)//4 = 4
    sibs = [make_seq(prompt, max_tokens=3, request_id="req", index=i, n=3) for i in range(3)]
    other = make_seq(5, max_tokens=3)
    for s in sibs + [other]:
        sched.add_seq(s)
    out = step(sched)
    # sibling 0 prefills; 1 and 2 wait for its blocks, the next request is not held up
    assert summary(out) == [(sibs[0].seq_id, 0, 18), (other.seq_id, 0, 5)]
    assert list(sched.waiting) == sibs[1:]
    out = step(sched)
    assert [e.seq for e in out.prefills] == sibs[1:]
    assert all(e.start_pos == 16 and e.num_new_tokens == 2 for e in out.prefills)
    shared = sibs[0].block_table[:4]
    for s in sibs[1:]:
        assert s.block_table[:4] == shared and s.num_cached_tokens == 16
    bm = sched.block_manager
    assert all(bm.ref_count(b) == 3 for b in shared)
    assert len({s.block_table[4] for s in sibs}) == 3  # tails are private
    for s in sibs + [other]:
        sched.finish_seq(s, "length")
    assert bm.num_free_blocks == bm.num_total_blocks
    sched.check_invariants()


def test_n_siblings_with_a_short_prompt_are_admitted_at_once():
    sched = make_scheduler()
    sibs = [make_seq(3, max_tokens=3, request_id="q", index=i, n=2) for i in range(2)]
    for s in sibs:
        sched.add_seq(s)
    assert [e.seq for e in step(sched).scheduled] == sibs


# ---------------------------------------------------------------------------- finish / abort


def _state_zoo():
    """A scheduler holding sequences in every state: waiting, prefilling, decoding, preempted."""
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=16, max_model_len=48)
    decoding = make_seq(4, max_tokens=30)
    sched.add_seq(decoding)
    step(sched)
    newest = make_seq(6, max_tokens=30)
    sched.add_seq(newest)
    step(sched)
    prefilling = make_seq(30, max_tokens=2)
    sched.add_seq(prefilling)
    step(sched)
    waiting = make_seq(40, max_tokens=2)
    sched.add_seq(waiting)
    for _ in range(20):
        step(sched)
        if any(s.status is SequenceStatus.PREEMPTED for s in sched.waiting):
            break
    return sched, [decoding, newest, prefilling, waiting]


def test_abort_or_finish_in_every_state_leaks_nothing():
    sched, seqs = _state_zoo()
    states = {s.status for s in sched.all_unfinished()}
    assert SequenceStatus.PREEMPTED in states and SequenceStatus.RUNNING in states
    for s in seqs:
        aborted = sched.abort(s.request_id)
        assert aborted == [s] and s.finish_reason == "abort" and s.block_table == []
        sched.check_invariants()
    assert not sched.has_unfinished()
    assert sched.abort("unknown") == [] and sched.abort(seqs[0].request_id) == []
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_abort_of_a_request_with_siblings_and_finish_is_idempotent():
    sched = make_scheduler()
    sibs = [make_seq(9, max_tokens=4, request_id="x", index=i, n=2) for i in range(2)]
    for s in sibs:
        sched.add_seq(s)
    step(sched)
    sched.finish_seq(sibs[0], "stop")
    sched.finish_seq(sibs[0], "abort")
    assert sibs[0].finish_reason == "stop"
    assert sched.abort("x") == [sibs[1]]
    assert sched.get_seqs("x") == [] and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_the_engine_must_finish_sequences_at_their_length_limit():
    sched = make_scheduler()
    seq = make_seq(3, max_tokens=1)
    sched.add_seq(seq)
    step(sched)
    with pytest.raises(RuntimeError, match="finish_seq"):
        sched.schedule()


# ---------------------------------------------------------------------------- step protocol


def test_sync_mode_refuses_a_second_outstanding_output_and_out_of_order_updates():
    sched = make_scheduler()
    sched.add_seq(make_seq(4))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="async-scheduling"):
        sched.schedule()
    other = SchedulerOutput(step_id=99, scheduled=list(out.scheduled))
    with pytest.raises(RuntimeError, match="schedule order"):
        sched.update_after_step(other, sampled_for(other))
    with pytest.raises(KeyError):
        sched.update_after_step(out, {})
    assert sched.update_after_step(SchedulerOutput(step_id=5), {}) == []  # empty outputs are not tracked


def test_finished_ids_reach_the_runner_even_across_empty_steps():
    sched = make_scheduler()
    a = make_seq(4, max_tokens=2)
    sched.add_seq(a)
    step(sched)
    sched.finish_seq(a, "stop")
    empty = sched.schedule()
    assert empty.is_empty and empty.finished_seq_ids == []
    b = make_seq(4)
    sched.add_seq(b)
    out = step(sched)
    assert out.finished_seq_ids == [a.seq_id] and out.scheduled[0].seq is b
    assert step(sched).finished_seq_ids == []


def test_async_schedule_plans_on_pending_tokens():
    sched = make_scheduler(async_scheduling=True)
    seq = make_seq(5, max_tokens=3)
    sched.add_seq(seq)
    out0 = sched.schedule()
    assert seq.num_pending_tokens == 1 and seq.num_computed_tokens == 5
    out1 = sched.schedule()  # step 0's token is not known yet
    (e1,) = out1.scheduled
    assert (e1.start_pos, e1.num_new_tokens, e1.num_placeholder_tokens, e1.sample) == (5, 1, 1, True)
    assert out1.is_decode_only and seq.num_pending_tokens == 2
    with pytest.raises(RuntimeError, match="not yet passed"):
        sched.schedule()
    assert sched.update_after_step(out0, {seq.seq_id: 21}) == [seq]
    out2 = sched.schedule()  # 1 known output + 1 pending < 3: still planned
    (e2,) = out2.scheduled
    assert (e2.start_pos, e2.num_placeholder_tokens) == (6, 1) and seq.all_token_ids[5] == 21
    sched.update_after_step(out1, {seq.seq_id: 22})
    out3 = sched.schedule()  # 2 known + 1 pending = max_tokens: not planned again
    assert out3.is_empty
    sched.update_after_step(out2, {seq.seq_id: 23})
    assert seq.output_token_ids == [21, 22, 23]
    sched.finish_seq(seq, "length")
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_async_token_of_a_finished_sequence_is_dropped():
    sched = make_scheduler(async_scheduling=True)
    seq = make_seq(5, max_tokens=10)
    sched.add_seq(seq)
    out0 = sched.schedule()
    out1 = sched.schedule()
    sched.update_after_step(out0, {seq.seq_id: EOS})
    sched.finish_seq(seq, "stop")  # the engine saw EOS; out1 still computes for it
    assert sched.update_after_step(out1, {seq.seq_id: 4}) == []
    assert seq.output_token_ids == [EOS] and not sched.has_unfinished()


# ---------------------------------------------------------------------------- randomized run


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context it read from the cache."""
    return (sum(context[-4:]) * 31 + len(context) * 7 + context[0]) % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        tok = next_token(ctx)
        out.append(tok)
        ctx.append(tok)
        if tok == EOS:
            break
    return out


class FakeRunner:
    """Writes each step's tokens into a simulated paged cache, then reads every context back
    from the block tables, so a wrong block, a stale prefix hit or a lost token fails."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.cache: dict[tuple[int, int], int] = {}
        self.prev_sampled: dict[int, int] = {}

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.block_size], pos % self.block_size

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        contexts = []
        for e in out.scheduled:
            seq = e.seq
            assert len(seq.block_table) * self.block_size >= e.seq_len
            known = e.num_new_tokens - e.num_placeholder_tokens
            history = seq.all_token_ids[: e.start_pos + known]
            if e.num_placeholder_tokens:
                assert e.num_placeholder_tokens == 1 and e.num_new_tokens == 1
                history = history + [self.prev_sampled[seq.seq_id]]
            assert len(history) == e.seq_len
            for pos in range(e.start_pos, e.seq_len):
                self.cache[self.slot(seq, pos)] = history[pos]
            contexts.append((e, history))
        sampled = {}
        for e, history in contexts:
            read = [self.cache.get(self.slot(e.seq, p)) for p in range(e.seq_len)]
            assert read == history, f"KV of {e.seq!r} is wrong"
            if e.sample:
                sampled[e.seq.seq_id] = next_token(read)
        self.prev_sampled = sampled
        return sampled


def run_random_workload(seed: int, async_scheduling: bool, prefix_caching: bool, chunked: bool, steps: int = 300):
    rng = random.Random(seed)
    bs = 4
    max_model_len = 64
    budget = 32 if chunked else 64
    sched = make_scheduler(
        num_blocks=rng.choice([16, 24, 40]), block_size=bs, max_model_len=max_model_len, max_num_seqs=6,
        max_num_batched_tokens=budget, chunked=chunked, prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
    )
    runner = FakeRunner(bs)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    requests: dict[str, list[Sequence]] = {}
    aborted: set[str] = set()
    pending_out = None

    def apply(out, sampled):
        for seq in sched.update_after_step(out, sampled):
            if seq.output_token_ids[-1] == EOS:
                sched.finish_seq(seq, "stop")
            elif seq.num_output_tokens >= seq.max_output_tokens:
                sched.finish_seq(seq, "length")

    for i in range(steps * 2):
        arriving = i < steps
        if arriving and rng.random() < 0.35:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 25)]
            prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 12))]
            max_tokens = rng.randrange(1, min(20, max_model_len - len(prompt)) + 1)
            n = rng.choice([1, 1, 2, 3])
            rid = f"req{i}"
            seqs = [make_seq(prompt, max_tokens=max_tokens, request_id=rid, index=k, n=n) for k in range(n)]
            for s in seqs:
                sched.add_seq(s)
            requests[rid] = seqs
        if arriving and requests and rng.random() < 0.08:
            rid = rng.choice(sorted(requests))
            if sched.abort(rid):
                aborted.add(rid)
        if arriving and rng.random() < 0.02:
            sched.block_manager.reset_prefix_cache()
        out = sched.schedule()
        sampled = runner.execute(out)
        sched.check_invariants()
        if async_scheduling:
            if pending_out is not None:
                apply(*pending_out)
            pending_out = (out, sampled) if out.scheduled else None
        else:
            apply(out, sampled)
        sched.check_invariants()
        if not arriving and not sched.has_unfinished() and pending_out is None:
            break
    assert not sched.has_unfinished() and pending_out is None, "workload did not drain"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    bm.check_invariants([])
    finished = 0
    for rid, seqs in requests.items():
        for s in seqs:
            ref = reference_output(s.prompt_token_ids, s.sampling_params.max_tokens)
            if rid in aborted and s.finish_reason == "abort":
                assert s.output_token_ids == ref[: s.num_output_tokens]
            else:
                assert s.output_token_ids == ref and s.finish_reason in ("stop", "length")
                finished += 1
    assert finished > 20
    return sched


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_workload_matches_reference_and_frees_everything(seed, async_scheduling):
    sched = run_random_workload(seed, async_scheduling, prefix_caching=True, chunked=True)
    assert sched.block_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("prefix_caching,chunked", [(False, True), (True, False), (False, False)])
def test_random_workload_other_modes(prefix_caching, chunked):
    for async_scheduling in (False, True):
        run_random_workload(11, async_scheduling, prefix_caching, chunked, steps=200)


def test_random_workloads_exercise_preemption():
    total = sum(run_random_workload(s, False, True, True).num_preemptions for s in range(4))
    assert total > 0


# ---------------------------------------------------------------------------- benchmark smoke


def test_bench_scheduler_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_scheduler", REPO / "benchmarks" / "bench_scheduler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.run(batch=8, steps=3, warmup=1, vocab=512, prompt_len=16, with_sampler=True)
    assert result["steps"] == 3 and result["ms_per_step"] > 0
    assert "ms/step" in capsys.readouterr().out
