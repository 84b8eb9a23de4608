"""One generated sequence: its tokens, its place in the KV cache and its scheduling state.

A request with ``n`` completions becomes ``n`` sequences that share ``request_id`` and are
told apart by ``index``. Sequences are plain objects (``__slots__``) because the engine
creates one per completion and the scheduler touches every running one each step.

Token bookkeeping (the scheduler's contract, see server/scheduler.py):

- ``all_token_ids`` = prompt ‖ outputs: every *known* token.
- ``num_computed_tokens``: positions whose KV is in the cache **or is being written by a
  step that schedule() already handed out**. It runs ahead of the GPU on purpose.
- ``num_pending_tokens``: tokens a scheduled step will sample for this sequence that have
  not been appended yet (0 at rest; 1 or 2 while steps are in flight with async
  scheduling). Positions ``num_tokens .. num_tokens + num_pending_tokens - 1`` exist as
  placeholders: the runner fills them on the device from the previous step's samples.
"""

from __future__ import annotations

import enum
import time

from server.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never run yet, in the waiting queue
    RUNNING = "running"  # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # lost its blocks (recompute), back in the waiting queue
    FINISHED = "finished"  # stopped, length-limited or aborted; holds nothing


class Sequence:
    __slots__ = (
        "seq_id",
        "request_id",
        "index",
        "prompt_token_ids",
        "output_token_ids",
        "sampling_params",
        "arrival_time",
        "status",
        "block_tables",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_pending_tokens",
        "num_preemptions",
        "finish_reason",
        "stop_reason",
        "max_output_tokens",
        "block_hashes",
        "num_committed_blocks",
        "_token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        index: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        # One table per KV-cache layer group (server/kv_cache_spec.py), empty while the
        # sequence holds no pages: page ids holding positions 0, bs, 2*bs, ... of that group.
        self.block_tables: list[list[int]] = []
        self.num_computed_tokens = 0
        # Prefix-cache hit (tokens) at the first admission; what usage reports as cached.
        self.num_cached_tokens = 0
        self.num_pending_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None
        # Set by Scheduler.add_seq: max_tokens, or what is left of max_model_len.
        self.max_output_tokens: int | None = None
        # Owned by BlockManager: hash chain of this sequence's full blocks of known tokens
        # (valid forever: tokens are append-only), and how many of its blocks have been
        # offered to the prefix cache.
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self._token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def block_table(self) -> list[int]:
        """The first layer group's block table (the only group of today's models)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt ‖ outputs. The list is the sequence's own storage: read it, don't mutate it."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self._token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}#{self.index}, "
            f"{self.status.value}, tokens={self.num_tokens} (prompt {self.num_prompt_tokens}), "
            f"computed={self.num_computed_tokens}, pending={self.num_pending_tokens}, "
            f"blocks={len(self.block_table)})"
        )
