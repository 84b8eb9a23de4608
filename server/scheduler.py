"""Continuous-batching scheduler: waiting/running queues, token budget, chunked prefill,
preemption by recompute and prefix-cache admission.

Each ``schedule()`` plans one engine step:

1. **Decodes** — running sequences with exactly one token left to compute (their last
   sampled token, or a placeholder for a token still being sampled), oldest first.
2. **Running prefills** — running sequences still computing their prompt, next chunk each.
3. **Admissions** — waiting sequences, first come first served, only if nothing was
   preempted in this step; a head that does not fit (blocks or, without chunked prefill,
   budget) blocks the ones behind it.

Every entry costs its ``num_new_tokens`` of ``max_num_batched_tokens``; with chunked
prefill a prefill takes what is left of the budget and continues next step. Decodes come
first so prefills never starve them, and the budget is at least ``max_num_seqs`` (checked).

Out of blocks for a running sequence: the newest running sequence not yet scheduled in this
step is preempted by recompute (blocks freed, num_computed_tokens = 0, put at the front of
the waiting queue, output tokens kept: its next prefill covers prompt ‖ outputs, largely
from the prefix cache); if that is the sequence itself, it just waits. A running prefill
first shrinks its chunk to what fits. Since a sequence's whole length must fit the cache
(checked in add_seq), the first sequence planned in a step always gets its blocks, at worst
by preempting all the others: no livelock.

n > 1: the ``n`` sequences of a request share the prompt's full blocks through the prefix
cache. With prefix caching on, a sibling is not admitted while another sibling is running
and has not yet committed the prompt's shareable blocks (``(prompt_len - 1) // block_size``
of them): typically the first sibling prefills the prompt, the others are admitted one step
after its last prefill chunk, reuse those blocks (ref count + 1) and compute only the tail
(≤ block_size tokens) in blocks of their own. Without prefix caching nothing is shared.

How the engine drives it
------------------------
``num_computed_tokens`` is advanced by ``schedule()`` itself (optimistically), and a
sequence whose step will sample gets ``num_pending_tokens += 1``; ``update_after_step``
appends the sampled tokens, decrements the pending count and commits newly full blocks to
the prefix cache. It returns the sequences that received a token; the engine checks stop
conditions on them (EOS, stop strings, max_tokens, max_model_len) and calls
``finish_seq(seq, reason)``.

Synchronous loop::

    while scheduler.has_unfinished():
        out = scheduler.schedule()
        sampled = runner.execute(out)            # {seq_id: token} for entries with .sample
        for seq in scheduler.update_after_step(out, sampled): check_stop(seq)

Async scheduling (``--async-scheduling``): at most one output may be outstanding (scheduled,
not yet updated) when ``schedule()`` is called; the scheduler raises otherwise. Loop::

    prev = None
    while scheduler.has_unfinished() or prev is not None:
        out = scheduler.schedule()               # may plan on top of prev's pending tokens
        runner.launch(out)                       # placeholders read prev's sampled tensor
        if prev is not None:
            for seq in scheduler.update_after_step(prev, runner.wait(prev)): check_stop(seq)
        prev = out if out.scheduled else None

A decode entry with ``num_placeholder_tokens == 1`` feeds the token the previous output is
sampling for that sequence (unknown on the host when planned): the runner takes it from that
step's device output. A sequence finished/aborted after being planned is skipped by
``update_after_step``; a sequence whose pending tokens already exhaust its max_tokens or
max_model_len is not planned again. Blocks freed while a step that writes them is in flight
are safe because steps run in order on the device and a block is read only at positions its
(new) owner wrote later.

Outputs with no entries are not tracked: passing them to update_after_step is a no-op.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.config import EngineConfig, EngineConfigError
from server.errors import InvalidRequestError
from server.kv_cache import BlockManager
from server.sequence import Sequence, SequenceStatus
from server.v4_prefix_cache import SnapshotOps

DEFAULT_CHUNKED_BATCHED_TOKENS = 8192


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute positions ``start_pos .. start_pos + num_new_tokens - 1``.

    Input ids: ``seq.all_token_ids[start_pos : start_pos + num_new_tokens - num_placeholder_tokens]``
    followed by the ``num_placeholder_tokens`` (0 or 1) token(s) the previous, still
    pending output samples for this sequence. KV goes to ``seq.block_tables`` (one per
    KV-cache layer group, long enough for every position). ``sample``: the chunk reaches the
    end of the sequence's tokens, so the runner samples a token from its last position and
    returns it under ``seq.seq_id``.
    """

    seq: Sequence
    num_new_tokens: int
    start_pos: int
    sample: bool = True
    num_placeholder_tokens: int = 0

    @property
    def seq_len(self) -> int:
        """Context length after this step (cached + new tokens)."""
        return self.start_pos + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One engine step. ``scheduled`` holds the decodes first (``num_decodes`` of them, one token
    each), then prefill chunks. ``preempted_seq_ids`` and ``finished_seq_ids`` (finished or
    aborted since the previous non-empty output) tell a runner with per-sequence state what
    to drop; both are carried to the next output when this one has no entries.
    ``prefix_snapshots``: the step's state-snapshot work (DeepSeek-V4 family prefix caching,
    server/v4_prefix_cache.py), on every output, empty or not; None for paged caches."""

    step_id: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    num_batched_tokens: int = 0
    preempted_seq_ids: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    prefix_snapshots: SnapshotOps | None = None

    @property
    def decodes(self) -> list[ScheduledSeq]:
        return self.scheduled[: self.num_decodes]

    @property
    def prefills(self) -> list[ScheduledSeq]:
        return self.scheduled[self.num_decodes:]

    @property
    def is_decode_only(self) -> bool:
        return bool(self.scheduled) and self.num_decodes == len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def resolve_max_num_batched_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The step token budget: the flag, else 8192 with chunked prefill, else max(8192, max_model_len)."""
    budget = config.max_num_batched_tokens
    if budget is None:
        if config.enable_chunked_prefill:
            budget = DEFAULT_CHUNKED_BATCHED_TOKENS
        else:
            budget = max(DEFAULT_CHUNKED_BATCHED_TOKENS, max_model_len)
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise EngineConfigError(
            f"--max-num-batched-tokens: ({budget}) is smaller than max_model_len ({max_model_len}), so "
            "long prompts could never be scheduled without chunked prefill; raise it or enable "
            "chunked prefill"
        )
    if budget < config.max_num_seqs:
        raise EngineConfigError(
            f"--max-num-batched-tokens: ({budget}) must be at least --max-num-seqs ({config.max_num_seqs})"
        )
    return budget


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        if block_manager.block_size != config.block_size:
            raise ValueError(
                f"block manager block_size {block_manager.block_size} != config block_size {config.block_size}"
            )
        if block_manager.enable_prefix_caching != config.enable_prefix_caching:
            raise ValueError("block manager and config disagree on enable_prefix_caching")
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(config, max_model_len)
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_outstanding = 2 if config.async_scheduling else 1
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # admission order: last = newest
        self._requests: dict[str, list[Sequence]] = {}  # unfinished sequences per request
        self._outstanding: deque[SchedulerOutput] = deque()
        self._finished_ids: list[int] = []
        self._preempted_ids: list[int] = []
        self._step_id = 0
        self.num_preemptions = 0  # total, for metrics

    # ------------------------------------------------------------------ queues
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def get_seqs(self, request_id: str) -> list[Sequence]:
        """The request's unfinished sequences (empty when unknown or done)."""
        return list(self._requests.get(request_id, ()))

    def add_seq(self, seq: Sequence) -> None:
        """Queue a new sequence; raises InvalidRequestError if it can never run."""
        if seq.status is not SequenceStatus.WAITING or seq.block_tables or seq.num_computed_tokens:
            raise ValueError(f"only fresh sequences can be added, got {seq!r}")
        if any(s.seq_id == seq.seq_id for s in self._requests.get(seq.request_id, ())):
            raise ValueError(f"sequence id {seq.seq_id} already queued")
        prompt_len = seq.num_prompt_tokens
        if prompt_len == 0:
            raise InvalidRequestError("The prompt must contain at least one token.")
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"prompt has {prompt_len} tokens, which leaves no room for the completion. Please "
                    "reduce the length of the prompt."
                )
            max_tokens = self.max_model_len - prompt_len
        elif prompt_len + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} "
                "in the completion). Please reduce the length of the messages or completion."
            )
        bm = self.block_manager
        # The last sampled token never needs KV.
        short = bm.whole_cache_shortfall(prompt_len + max_tokens - 1)
        if short is not None:
            raise InvalidRequestError(
                f"The request needs up to {prompt_len + max_tokens} tokens of KV cache ({short[0]} blocks of "
                f"{bm.block_size}), more than the whole cache holds ({short[1]} blocks). Please "
                "reduce the length of the prompt or of max_tokens."
            )
        seq.max_output_tokens = max_tokens
        self.waiting.append(seq)
        self._requests.setdefault(seq.request_id, []).append(seq)

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        """End a sequence in any state (the engine's stop checks, or abort); frees its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq.seq_id]
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._finished_ids.append(seq.seq_id)
        siblings = self._requests.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self._requests[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request with reason "abort"; returns them."""
        seqs = self.get_seqs(request_id)
        for seq in seqs:
            self.finish_seq(seq, "abort")
        return seqs

    # ------------------------------------------------------------------ planning
    def _tokens_left(self, seq: Sequence) -> int:
        return seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens

    def _may_schedule(self, seq: Sequence) -> bool:
        """False when the tokens already being sampled end the sequence (async look-ahead)."""
        if seq.num_output_tokens + seq.num_pending_tokens < seq.max_output_tokens and (
            seq.num_tokens + seq.num_pending_tokens < self.max_model_len
        ):
            return True
        if seq.num_pending_tokens == 0:
            raise RuntimeError(f"{seq!r} reached its length limit; the engine must finish_seq it")
        return False

    def _plan(self, seq: Sequence, num_new: int, entries: list[ScheduledSeq], scheduled: set[int]) -> None:
        start = seq.num_computed_tokens
        end = start + num_new
        sample = end == seq.num_tokens + seq.num_pending_tokens
        entries.append(ScheduledSeq(seq, num_new, start, sample, max(0, end - seq.num_tokens)))
        seq.num_computed_tokens = end
        if sample:
            seq.num_pending_tokens += 1
        scheduled.add(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._preempted_ids.append(seq.seq_id)

    def _reserve(self, seq: Sequence, num_new: int, shrink: bool, scheduled: set[int]) -> int:
        """Allocate blocks for ``num_new`` tokens of a running sequence, preempting newer ones
        as needed. Returns the tokens reserved (fewer if ``shrink``), 0 if ``seq`` was preempted."""
        bm = self.block_manager
        if bm.holds_pages_for(seq, num_new):
            return num_new  # fits in the pages it holds (most decode steps)
        while True:
            if bm.can_allocate(seq, num_new):
                bm.allocate(seq, num_new)
                return num_new
            if shrink:
                fit = min(num_new, bm.capacity_tokens(seq))
                if fit > 0:
                    bm.allocate(seq, fit)
                    return fit
            victim = next(s for s in reversed(self.running.values()) if s.seq_id not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return 0

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """n > 1: wait until a running sibling has committed the prompt's shareable blocks."""
        if not self.block_manager.enable_prefix_caching:
            return False
        shareable = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        if shareable == 0:
            return False
        return any(
            s is not seq and s.status is SequenceStatus.RUNNING and s.num_committed_blocks < shareable
            for s in self._requests.get(seq.request_id, ())
        )

    def schedule(self) -> SchedulerOutput:
        if len(self._outstanding) >= self.max_outstanding:
            raise RuntimeError(
                f"schedule() called with {len(self._outstanding)} output(s) not yet passed to "
                f"update_after_step (at most {self.max_outstanding - 1} allowed"
                f"{'' if self.max_outstanding > 1 else ' without --async-scheduling'})"
            )
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        scheduled: set[int] = set()
        num_preempted_before = self.num_preemptions
        running = list(self.running.values())
        if self.block_manager.pages_die:
            for seq in running:
                self.block_manager.release_dead_blocks(seq)

        for seq in running:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._tokens_left(seq) != 1:
                continue
            if not self._may_schedule(seq):
                continue
            if self._reserve(seq, 1, False, scheduled):
                self._plan(seq, 1, decodes, scheduled)
                budget -= 1

        for seq in running:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in scheduled:
                continue
            left = self._tokens_left(seq)
            if left <= 1:  # decodes skipped above (length limit reached while pending)
                continue
            if left > budget and not self.enable_chunked_prefill:
                continue
            num_new = self._reserve(seq, min(left, budget), self.enable_chunked_prefill, scheduled)
            if num_new:
                self._plan(seq, num_new, prefills, scheduled)
                budget -= num_new

        if self.num_preemptions == num_preempted_before:
            budget = self._admit(budget, prefills, scheduled)

        out = SchedulerOutput(step_id=self._step_id, scheduled=decodes + prefills, num_decodes=len(decodes))
        self._step_id += 1
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.prefix_snapshots = self.block_manager.end_snapshot_pass(out.scheduled)
        if out.scheduled:
            out.preempted_seq_ids, self._preempted_ids = self._preempted_ids, []
            out.finished_seq_ids, self._finished_ids = self._finished_ids, []
            self._outstanding.append(out)
        return out

    def _admit(self, budget: int, entries: list[ScheduledSeq], scheduled: set[int]) -> int:
        bm = self.block_manager
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted while a step samples for it: wait for the token
                break
            self._may_schedule(seq)  # raises if the engine failed to finish it
            if self._waits_for_sibling(seq):
                skipped.append(self.waiting.popleft())
                continue
            hit = bm.find_prefix(seq)
            left = seq.num_tokens - hit.num_tokens
            if left > budget and not self.enable_chunked_prefill:
                break
            num_new = min(left, budget)
            if not bm.can_allocate(seq, num_new, hit):
                break
            self.waiting.popleft()
            bm.allocate(seq, num_new, hit)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running[seq.seq_id] = seq
            self._plan(seq, num_new, entries, scheduled)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    # ------------------------------------------------------------------ results
    def update_after_step(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Apply a step's sampled tokens (``{seq_id: token_id}`` for every entry with ``sample``).

        Returns the sequences that received a token, for the engine's stop checks. Outputs
        must be passed once each, in the order schedule() returned them.
        """
        if not output.scheduled:
            return []
        if not self._outstanding or self._outstanding[0] is not output:
            raise RuntimeError("update_after_step: outputs must be applied once each, in schedule order")
        self._outstanding.popleft()
        updated: list[Sequence] = []
        commit = self.block_manager.commit_full_blocks
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            if entry.sample:
                token = sampled.get(seq.seq_id)
                if token is None:
                    raise KeyError(f"no sampled token for sequence {seq.seq_id} in step {output.step_id}")
                seq.append_token(int(token))
                seq.num_pending_tokens -= 1
                updated.append(seq)
            if seq.status is SequenceStatus.RUNNING:
                commit(seq)
        return updated

    # ------------------------------------------------------------------ debugging
    def all_unfinished(self) -> list[Sequence]:
        return list(self.running.values()) + list(self.waiting)

    def check_invariants(self) -> None:
        """Assert queue and block bookkeeping are consistent (tests call this every step)."""
        for seq in self.running.values():
            assert seq.status is SequenceStatus.RUNNING, seq
        for seq in self.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), seq
            assert not seq.block_tables and seq.num_computed_tokens == 0, seq
        assert len(self.running) <= self.max_num_seqs
        queued = {s.seq_id for s in self.all_unfinished()}
        tracked = {s.seq_id for seqs in self._requests.values() for s in seqs}
        assert queued == tracked, "request index differs from the queues"
        self.block_manager.check_invariants(self.running.values())
