"""What the engine hands back for a request: plain dataclasses that cross process boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: the chosen token's logprob, and {token_id: logprob} of the top-k
# alternatives (which always include the chosen token when k > 0, as vLLM does).
@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int = 1
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences of a request, cumulative up to now."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after an engine step (cumulative, like vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # prompt_logprobs[0] is None (the first token has no context), as in vLLM.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    # Monotonic timestamps for metrics (seconds): arrival, first token, last token.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time: float | None = None  # seconds waiting before the engine first scheduled it


class OutputAccumulator:
    """Folds an engine's per-step deltas (server.engine_core.RequestDelta) into the
    cumulative :class:`RequestOutput` that APIs hand out."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int,
                 want_logprobs: bool, arrival_time: float) -> None:
        self.output = RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            outputs=[CompletionOutput(i, "", [], [] if want_logprobs else None) for i in range(n)],
            arrival_time=arrival_time,
        )

    def apply(self, delta, now: float) -> RequestOutput:
        out = self.output
        for sd in delta.seqs:
            c = out.outputs[sd.index]
            c.text += sd.text
            c.token_ids.extend(sd.token_ids)
            if sd.logprobs and c.logprobs is not None:
                c.logprobs.extend(sd.logprobs)
            if sd.finish_reason is not None and c.finish_reason is None:
                c.finish_reason, c.stop_reason = sd.finish_reason, sd.stop_reason
            if sd.token_ids:
                if out.first_token_time is None:
                    out.first_token_time = now
                out.last_token_time = now
        if delta.queue_time is not None:
            out.queue_time = delta.queue_time
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = list(delta.prompt_logprobs)
        out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
        if delta.finished:
            out.finished = True
            for c in out.outputs:
                if c.finish_reason is None:
                    c.finish_reason = "abort"
        return out
