"""A deterministic stand-in for ``server.async_engine.AsyncEngine``, for HTTP-layer tests.

It has the engine's interface (``generate`` yielding cumulative ``RequestOutput``s, ``abort``,
``stats``, ``is_healthy``) and its rules (rejects bad requests before the first output,
honours ``max_tokens``/``n``/``stop``/``stop_token_ids``/``min_tokens``/``logprobs``/
``prompt_logprobs``, holds back a possible stop-string prefix, frees KV blocks on finish and
abort). Generated tokens cycle through a fixed sentence, so tests can predict every text.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator

from server.config import EngineConfig
from server.errors import InvalidRequestError
from server.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.sampling_params import SamplingParams

PATTERN_TEXT = " the quick brown fox jumps over the lazy dog."


@dataclass
class FakeModelConfig:
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]


class FakeEngine:
    def __init__(self, tokenizer, *, max_model_len: int = 256, served_model_name: str = "fake-model",
                 num_blocks: int = 4096, block_size: int = 16, step_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.served_model_name = served_model_name
        self.engine_config = EngineConfig(model="/fake/checkpoint", served_model_name=served_model_name,
                                          max_model_len=max_model_len, block_size=block_size,
                                          served_model_names=(served_model_name, "fake-alias"))
        self.model_config = FakeModelConfig(vocab_size=tokenizer.vocab_size,
                                            max_position_embeddings=max_model_len,
                                            eos_token_ids=[tokenizer.eos_token_id])
        self.pattern = tokenizer.encode(PATTERN_TEXT, add_special_tokens=False)
        self.step_delay = step_delay
        self.block_size = block_size
        self.num_blocks = num_blocks
        # test hooks
        self.reject_next: str | None = None  # next generate() raises InvalidRequestError(this)
        self.fail_after_steps: int | None = None  # raise RuntimeError after this many outputs
        self.healthy = True
        # bookkeeping
        self.aborted: list[str] = []
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.max_concurrent = 0
        self._blocks: dict[str, int] = {}  # running request -> blocks held
        self._waiting: set[str] = set()
        self._aborting: set[str] = set()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    # -- the engine interface

    def expected_token(self, prompt_len: int, seq: int, step: int) -> int:
        return self.pattern[(prompt_len + seq + step) % len(self.pattern)]

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        self._validate(prompt_token_ids, params)
        self.requests.append((request_id, list(prompt_token_ids), params))
        arrival = time.monotonic()
        n_prompt = len(prompt_token_ids)
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        self._waiting.add(request_id)
        try:
            while self._free_blocks() < self._blocks_for(n_prompt):
                await asyncio.sleep(0.001)
            self._waiting.discard(request_id)
            self._blocks[request_id] = self._blocks_for(n_prompt)
            self.max_concurrent = max(self.max_concurrent, len(self._blocks))
            self._prompt_tokens += n_prompt
            seqs = [_Seq(i) for i in range(params.n)]
            prompt_lps = self._prompt_logprobs(prompt_token_ids, params.prompt_logprobs)
            step = 0
            while True:
                await asyncio.sleep(self.step_delay)
                if request_id in self._aborting:
                    return
                if self.fail_after_steps is not None and step >= self.fail_after_steps:
                    raise RuntimeError("fake engine failure")
                for s in seqs:
                    if s.finish_reason is None:
                        self._advance(s, n_prompt, step, params, max_new)
                step += 1
                self._blocks[request_id] = self._blocks_for(n_prompt + sum(len(s.ids) for s in seqs))
                outputs = [s.output(self.tokenizer, params) for s in seqs]
                done = all(s.finish_reason is not None for s in seqs)
                yield RequestOutput(
                    request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                    outputs=outputs, finished=done, prompt_logprobs=prompt_lps, arrival_time=arrival)
                if done:
                    return
        finally:
            self._release(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._aborting.add(request_id)
        self._release(request_id)

    def stats(self) -> dict:
        used = sum(self._blocks.values())
        return {"num_running": len(self._blocks), "num_waiting": len(self._waiting),
                "kv_cache_usage": used / self.num_blocks, "num_free_blocks": self.num_blocks - used,
                "num_total_blocks": self.num_blocks, "prompt_tokens_total": self._prompt_tokens,
                "generation_tokens_total": self._generation_tokens, "num_preemptions": 0}

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    def health_problem(self) -> str | None:
        return None if self.healthy else "The fake engine is down."

    async def shutdown(self) -> None:
        self.healthy = False

    # -- internals

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if self.reject_next is not None:
            msg, self.reject_next = self.reject_next, None
            raise InvalidRequestError(msg)
        if not ids:
            raise InvalidRequestError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens exceeds max_model_len {self.max_model_len}")
        if any(not 0 <= t < self.model_config.vocab_size for t in ids):
            raise InvalidRequestError("token id out of vocabulary")

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _free_blocks(self) -> int:
        return self.num_blocks - sum(self._blocks.values())

    def _release(self, request_id: str) -> None:
        self._blocks.pop(request_id, None)
        self._waiting.discard(request_id)

    def _advance(self, s: "_Seq", n_prompt: int, step: int, params: SamplingParams, max_new: int) -> None:
        tok = self.expected_token(n_prompt, s.index, step)
        s.ids.append(tok)
        self._generation_tokens += 1
        if params.logprobs is not None:
            s.logprobs.append(self._logprob(tok, params.logprobs, step))
        if tok in params.stop_token_ids and len(s.ids) >= params.min_tokens:
            s.finish_reason, s.stop_reason = "stop", tok
        elif len(s.ids) >= max_new:
            s.finish_reason = "length"

    def _logprob(self, tok: int, k: int, position: int) -> TokenLogprob:
        lp = -0.25 * (1 + position % 3)
        top = {tok: lp} if k > 0 else {}
        for alt in range(k - 1):
            top.setdefault((tok + 1 + alt) % self.model_config.vocab_size, lp - 1.0 - alt)
        return TokenLogprob(token_id=tok, logprob=lp, rank=1, top=top)

    def _prompt_logprobs(self, ids: list[int], k: int | None) -> list[TokenLogprob | None] | None:
        if k is None:
            return None
        return [None] + [self._logprob(t, k, i) for i, t in enumerate(ids[1:], start=1)]


class _Seq:
    def __init__(self, index: int) -> None:
        self.index = index
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.final: CompletionOutput | None = None

    def output(self, tokenizer, params: SamplingParams) -> CompletionOutput:
        if self.final is not None:
            return self.final
        ids = [t for t in self.ids if not (t in params.stop_token_ids and not params.include_stop_str_in_output)]
        text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if self.finish_reason is None:
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                pos, stop = min(hits)
                text = text[:pos + (len(stop) if params.include_stop_str_in_output else 0)]
                self.finish_reason, self.stop_reason = "stop", stop
            elif params.stop:  # hold back a tail that could still become a stop string
                text = text[:max(0, len(text) - (max(len(s) for s in params.stop) - 1))]
        out = CompletionOutput(index=self.index, text=text, token_ids=list(self.ids),
                               logprobs=list(self.logprobs) if params.logprobs is not None else None,
                               finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        if self.finish_reason is not None:
            self.final = out
        return out
