"""EngineCore: the engine loop body — scheduler + runner + detokenization + stop checks.

Used in-process by the offline ``LLM`` API and inside the engine process by
``AsyncEngine``. ``step()`` returns small :class:`RequestDelta` messages (plain lists and
numbers, no tensors) that front ends accumulate into cumulative ``RequestOutput`` objects.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from distributed.comm import collective_counts
from distributed.parallel_state import ParallelConfig, destroy_distributed
from model.config import ModelConfig
from server import engine_parallel
from server.config import EngineConfig
from server.errors import InvalidRequestError
from server.kv_cache import BlockManager
from server.outputs import TokenLogprob
from server.runner import PendingStep, StepResult
from server.runner_setup import build_runner, check_v4_family_parallel, resolve_device
from server.sampling_params import MAX_LOGPROBS, SamplingParams
from server.scheduler import Scheduler, SchedulerOutput
from server.sequence import Sequence
from server.tokenizer import IncrementalDetokenizer, Tokenizer
from server.tp_worker import start_tp_workers
from server.warmup import warm_up

logger = logging.getLogger(__name__)


@dataclass
class SeqDelta:
    """What one sequence gained in a step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestDelta:
    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, complete
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time: float | None = None  # seconds from add_request to first scheduling; sent once


@dataclass
class _RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    prompt_logprobs: list[TokenLogprob | None] | None
    prompt_logprobs_sent: bool = False
    num_unfinished: int = 0
    arrival: float = 0.0
    queue_time: float | None = None
    queue_time_sent: bool = False


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int, max_logprobs: int = MAX_LOGPROBS) -> None:
    """Raise InvalidRequestError for a request the engine can never serve (the API process
    checks this before sending; the engine checks again)."""
    if not prompt_token_ids:
        raise InvalidRequestError("The prompt must contain at least one token.")
    for t in prompt_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab_size:
            raise InvalidRequestError(f"Token id {t} is out of vocabulary (vocab size {vocab_size}).")
    params.validate(max_logprobs)
    for t in params.logit_bias or ():
        if t >= vocab_size:
            raise InvalidRequestError(f"logit_bias token id {t} is out of vocabulary (vocab size {vocab_size}).")
    n, m = len(prompt_token_ids), params.max_tokens
    if (m is None and n >= max_model_len) or (m is not None and n + m > max_model_len):
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + (m or 0)} tokens ({n} in the messages, {m or 0} in the completion). "
            "Please reduce the length of the messages or completion."
        )


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: str, dp_rank: int = 0) -> None:
        self.config = config
        self.device = resolve_device(config)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        par = None
        self.workers = None
        self.dp_sync = None
        agree = None
        if config.world_size > 1:
            check_v4_family_parallel(config, model_dir)
            par = self._join_parallel_group(model_dir, dp_rank)
            agree = engine_parallel.agree_num_blocks
        setup = build_runner(config, model_dir, self.device, par=par, agree_num_blocks=agree, progress=True)
        self.model, self.runner = setup.model, setup.runner
        self.model_config: ModelConfig = self.model.config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir)
        self.max_model_len = setup.max_model_len
        num_blocks = setup.num_blocks
        self.block_manager = BlockManager.from_config(config, num_blocks, self.runner.kv_cache_specs)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        if config.tensor_parallel_size > 1:
            self.runner.plan_broadcaster = engine_parallel.PlanBroadcaster()
        self.ran_model = False  # whether the last step() ran a forward (DEP lockstep)
        self._requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()
        self._pending: tuple[SchedulerOutput, PendingStep] | None = None  # async scheduling
        self._aborted: list[RequestDelta] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info("KV cache: %d blocks of %d tokens (%s): %s", num_blocks, config.block_size, config.kv_cache_dtype,
                    self.block_manager.describe())
        warm_up(self)

    def _join_parallel_group(self, model_dir: str, dp_rank: int):
        """Start this DP group's TP workers, join the process groups, return the model's view."""
        engine_parallel.check_supported(self.config)
        pcfg = ParallelConfig.from_engine_config(self.config)
        rank = dp_rank * self.config.tensor_parallel_size
        local_rank = rank % pcfg.local_world_size
        self.workers = start_tp_workers(self.config, model_dir, dp_rank, on_failure=self._worker_died)
        engine_parallel.init_engine_rank(self.config, rank, local_rank)
        self.device = engine_parallel.engine_device(self.config, local_rank)
        if self.config.data_parallel_size > 1:
            self.dp_sync = engine_parallel.DPSync()
        return engine_parallel.parallel_context(self.config)

    def _worker_died(self, failure) -> None:
        # A TP peer is gone: collectives would hang or fail. End this process at once; the
        # API process sees the pipe close, fails in-flight requests and exits non-zero.
        if getattr(self, "_shutting_down", False):
            return  # workers exiting during our own shutdown are not a failure
        logger.error("TP worker died (%s); stopping the engine", failure.describe())
        os._exit(1)

    def shutdown(self) -> None:
        self._shutting_down = True
        if self.runner.plan_broadcaster is not None:
            self.runner.plan_broadcaster.stop()
        if self.workers is not None:
            self.workers.join(timeout=30)
        if self.config.world_size > 1:
            destroy_distributed()

    # ---- requests -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.config.max_logprobs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        seqs = [
            Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, index=i) for i in range(params.n)
        ]
        added = []
        try:
            for seq in seqs:
                self.scheduler.add_seq(seq)
                added.append(seq)
        except InvalidRequestError:
            for seq in added:
                self.scheduler.finish_seq(seq, "abort")
            raise
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output,
            )
            for _ in seqs
        ]
        plp = [None] + [None] * (len(prompt_token_ids) - 1) if params.prompt_logprobs is not None else None
        self._requests[request_id] = _RequestState(
            request_id, list(prompt_token_ids), params, seqs, detoks, plp, num_unfinished=len(seqs),
            arrival=time.monotonic(),
        )
        self.prompt_tokens_total += len(prompt_token_ids)

    def abort(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self.scheduler.abort(request_id)
        self.runner.release([s.seq_id for s in state.seqs])  # sampling state, V4 request states
        deltas = [SeqDelta(i, finish_reason="abort") for i, s in enumerate(state.seqs)
                  if s.finish_reason in (None, "abort")]
        self._aborted.append(RequestDelta(request_id, deltas, finished=True))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None or bool(self._aborted)

    # ---- the loop body ------------------------------------------------------------------------
    @property
    def step_profiler(self):
        return self.runner.step_profiler

    def step(self) -> list[RequestDelta]:
        """Run one engine step; returns the deltas of every request that changed."""
        if not self.runner.step_profiler.enabled:
            return self._step()
        t0 = time.perf_counter()
        deltas = self._step()
        self.runner.step_profiler.end_engine_step(time.perf_counter() - t0)
        return deltas

    def _note_first_scheduling(self, out: SchedulerOutput) -> None:
        now = None
        for entry in out.prefills:  # a first scheduling is an admission: a prefill chunk
            state = self._requests.get(entry.seq.request_id)
            if state is not None and state.queue_time is None:
                now = now or time.monotonic()
                state.queue_time = now - state.arrival

    def _step(self) -> list[RequestDelta]:
        deltas, self._aborted = self._aborted, []
        if not self.config.async_scheduling:
            out = self.scheduler.schedule()
            self._note_first_scheduling(out)
            self.ran_model = not out.is_empty
            result = self.runner.execute(out)  # an empty output just drops finished seqs' state
            return deltas + self._process(out, result) if not out.is_empty else deltas
        # Async: plan and launch step N+1 before step N's tokens are read back or applied
        # (placeholders, filled on the device); then read N's tokens (by now the GPU is busy
        # with N+1) and apply them while N+1 runs. Steps that need host-side token history run
        # synchronously instead (ModelRunner.can_overlap).
        out = self.scheduler.schedule()
        self._note_first_scheduling(out)
        self.ran_model = not out.is_empty
        prev = self._pending
        step = self.runner.launch(out, prev[1] if prev is not None else None)
        self._pending = (out, step) if not out.is_empty else None
        if prev is not None:
            deltas += self._process(prev[0], self.runner.collect(prev[1]))
        return deltas

    def _process(self, out: SchedulerOutput, result: StepResult) -> list[RequestDelta]:
        touched: dict[str, RequestDelta] = {}

        def delta_for(state: _RequestState) -> RequestDelta:
            d = touched.get(state.request_id)
            if d is None:
                d = touched[state.request_id] = RequestDelta(
                    state.request_id, [], num_cached_tokens=state.seqs[0].num_cached_tokens
                )
                if state.queue_time is not None and not state.queue_time_sent:
                    d.queue_time, state.queue_time_sent = state.queue_time, True
            return d

        for seq_id, (first, entries) in result.prompt_logprobs.items():
            state = self._state_of(out, seq_id)
            if state is not None and state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                for j, e in enumerate(entries):
                    if first + j < len(state.prompt_logprobs):
                        state.prompt_logprobs[first + j] = e
        requests, logprobs = self._requests, result.logprobs
        num_tokens = 0
        for seq in self.scheduler.update_after_step(out, result.sampled):
            state = requests.get(seq.request_id)
            if state is None:
                continue
            token = seq.output_token_ids[-1]
            num_tokens += 1
            detok = state.detoks[seq.index]
            # A stopping EOS / stop token is kept in token_ids but not in the text (as vLLM).
            reason = self._token_stop_reason(seq, token)
            stop_str = None
            if reason is None:
                text, stop_str = detok.add_tokens((token,))
                reason = self._text_stop_reason(seq, stop_str)
            else:
                text = ""
            sd = SeqDelta(seq.index, text, [token])
            if logprobs:
                lp = logprobs.get(seq.seq_id)
                if lp is not None:
                    sd.logprobs = [lp]
            if reason is not None:
                sd.finish_reason, sd.stop_reason = reason
                if stop_str is None:
                    sd.text += detok.flush()
                self.scheduler.finish_seq(seq, sd.finish_reason)
                self.runner.release([seq.seq_id])
                state.num_unfinished -= 1
            d = touched.get(state.request_id)
            (d if d is not None else delta_for(state)).seqs.append(sd)
        self.generation_tokens_total += num_tokens
        for request_id, d in touched.items():  # only a request that changed can have finished
            state = requests[request_id]
            if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                state.prompt_logprobs_sent = True
                d.prompt_logprobs = state.prompt_logprobs
            if state.num_unfinished == 0:
                d.finished = True
                del requests[request_id]
        return list(touched.values())

    def _state_of(self, out: SchedulerOutput, seq_id: int) -> _RequestState | None:
        for entry in out.scheduled:
            if entry.seq.seq_id == seq_id:
                return self._requests.get(entry.seq.request_id)
        return None

    def _token_stop_reason(self, seq: Sequence, token: int):
        """EOS or a stop token id, once ``min_tokens`` outputs exist."""
        p = seq.sampling_params
        if seq.num_output_tokens < p.min_tokens:
            return None
        if token in p.stop_token_ids:
            return "stop", token
        if not p.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop", None
        return None

    def _text_stop_reason(self, seq: Sequence, stop_str: str | None):
        if stop_str is not None:
            return "stop", stop_str
        if seq.max_output_tokens is not None and seq.num_output_tokens >= seq.max_output_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    # ---- introspection ------------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "collectives": self._collective_counts(),
            **({"step_profile": self.runner.step_profiler.summary()} if self.runner.step_profiler.enabled else {}),
        }

    def _collective_counts(self) -> dict[str, int]:
        if self.config.world_size == 1:
            return {}
        return {k: v for k, v in collective_counts().items() if v}
