"""SSE chunk formatting for streamed completions and chat completions.

A formatter turns the cumulative ``RequestOutput`` of each prompt into OpenAI stream chunks:
the text and tokens added since the last chunk, logprobs for those tokens, a finish reason
once, and the final usage chunk when ``stream_options.include_usage`` asks for it.
"""

from __future__ import annotations

from server.logprobs import chat_logprobs, completion_logprobs
from server.outputs import CompletionOutput, RequestOutput
from server.protocol import (
    ChatCompletionRequest, ChatCompletionStreamChoice, ChatCompletionStreamResponse, CompletionRequest,
    CompletionResponseChoice, CompletionStreamResponse, DeltaMessage, SamplingFields, UsageInfo,
)


def _chunk_dict(chunk, drop_delta_nones: bool = False) -> dict:
    d = chunk.model_dump()
    if d.get("usage") is None:
        d.pop("usage", None)
    if drop_delta_nones:
        for c in d["choices"]:
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
    return d


class StreamFormatter:
    """Turns cumulative outputs into per-choice deltas (text, tokens, logprobs) and chunks.

    Assumes the engine's cumulative text only grows (it holds back a possible stop-string
    prefix rather than retracting text already emitted).
    """

    def __init__(self, tokenizer, body: SamplingFields, request_id: str, model: str, reqs: list) -> None:
        """``reqs``: the handler's engine requests, one per prompt (``prompt_ids``,
        ``decoded_prompt(tokenizer)``)."""
        self.tokenizer, self.body, self.request_id, self.model, self.reqs = tokenizer, body, request_id, model, reqs
        self.n = body.n
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        self.sent_chars: dict[int, int] = {}  # choice index -> characters already sent
        self.sent_tokens: dict[int, int] = {}  # choice index -> tokens already sent
        self.finished_choices: set[int] = set()
        self.last_outputs: dict[int, RequestOutput] = {}

    def start(self) -> list[dict]:
        return []

    def on_output(self, p: int, out: RequestOutput) -> list[dict]:
        self.last_outputs[p] = out
        chunks = []
        for o in sorted(out.outputs, key=lambda o: o.index):
            idx = p * self.n + o.index
            first = idx not in self.sent_tokens
            c0, k0 = self.sent_chars.get(idx, 0), self.sent_tokens.get(idx, 0)
            newly_finished = o.finished and idx not in self.finished_choices
            if not first and len(o.token_ids) == k0 and len(o.text) == c0 and not newly_finished:
                continue
            if o.finished:
                self.finished_choices.add(idx)
            self.sent_chars[idx], self.sent_tokens[idx] = len(o.text), len(o.token_ids)
            usage = None
            if self.continuous_usage:
                pt = len(self.reqs[p].prompt_ids)
                usage = UsageInfo(prompt_tokens=pt, completion_tokens=len(o.token_ids),
                                  total_tokens=pt + len(o.token_ids))
            chunks.append(self.make_chunk(p, idx, o, o.text[c0:], k0, first, out, usage))
        return chunks

    def usage(self) -> UsageInfo:
        prompt = sum(len(r.prompt_ids) for r in self.reqs)
        completion = sum(len(o.token_ids) for out in self.last_outputs.values() for o in out.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def make_chunk(self, p: int, idx: int, o: CompletionOutput, delta_text: str, k0: int, first: bool,
                   out: RequestOutput, usage: UsageInfo | None) -> dict:
        raise NotImplementedError

    def usage_chunk(self, response_cls) -> list[dict]:
        if not self.include_usage:
            return []
        return [_chunk_dict(response_cls(id=self.request_id, model=self.model, choices=[], usage=self.usage()))]

    def finish(self) -> list[dict]:
        raise NotImplementedError


class CompletionStreamFormatter(StreamFormatter):
    body: CompletionRequest

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.text_offsets: dict[int, int] = {}  # choice index -> next text_offset

    def make_chunk(self, p, idx, o, delta_text, k0, first, out, usage):
        req = self.reqs[p]
        echo = first and self.body.echo
        lp = None
        if self.body.logprobs is not None:
            ids, lps = list(o.token_ids[k0:]), list((o.logprobs or [])[k0:])
            if echo:
                ids = list(req.prompt_ids) + ids
                lps = list(out.prompt_logprobs or [None] * len(req.prompt_ids)) + lps
            offset = self.text_offsets.get(idx, 0)
            lp = completion_logprobs(self.tokenizer, ids, lps, self.body.logprobs, offset)
            self.text_offsets[idx] = offset + sum(len(t) for t in lp.tokens)
        if echo:
            delta_text = req.decoded_prompt(self.tokenizer) + delta_text
        choice = CompletionResponseChoice(index=idx, text=delta_text, logprobs=lp,
                                          finish_reason=o.finish_reason, stop_reason=o.stop_reason)
        return _chunk_dict(CompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice],
                                                    usage=usage))

    def finish(self):
        return self.usage_chunk(CompletionStreamResponse)


class ChatStreamFormatter(StreamFormatter):
    body: ChatCompletionRequest

    def start(self):
        """Every choice opens with a role-only delta, as OpenAI and vLLM do."""
        chunks = []
        for i in range(self.n):
            choice = ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            chunk = ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice])
            chunks.append(_chunk_dict(chunk, drop_delta_nones=True))
        return chunks

    def make_chunk(self, p, idx, o, delta_text, k0, first, out, usage):
        lp = None
        if self.body.logprobs:
            lp = chat_logprobs(self.tokenizer, o.token_ids[k0:], (o.logprobs or [])[k0:], self.body.top_logprobs or 0)
        delta = DeltaMessage(content=delta_text) if delta_text or not o.finished else DeltaMessage()
        choice = ChatCompletionStreamChoice(index=idx, delta=delta, logprobs=lp,
                                            finish_reason=o.finish_reason, stop_reason=o.stop_reason)
        chunk = ChatCompletionStreamResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)
        return _chunk_dict(chunk, drop_delta_nones=True)

    def finish(self):
        return self.usage_chunk(ChatCompletionStreamResponse)
