"""Completions and chat completions: request validation, engine requests, SSE streaming.

Each prompt of a request is one engine request; several prompts run concurrently. A client
that goes away (mid-stream or while waiting for a non-streamed answer) aborts its engine
requests, which frees their KV blocks. The FastAPI app that routes to these handlers, and
the error contract, live in ``server/api.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import suppress
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.admission import AdmissionLimits, check_chat, check_completion, check_messages
from server.errors import EngineDeadError, InvalidRequestError, ServerStoppingError
from server.metrics import ServerMetrics
from server.outputs import RequestOutput
from server.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, ChatResponseMessage,
    CompletionRequest,
    CompletionResponse, CompletionResponseChoice, ErrorInfo, ErrorResponse, SamplingFields, UsageInfo, random_id,
)
from server.logprobs import chat_logprobs, completion_logprobs
from server.sampling_params import SamplingParams
from server.streaming import ChatStreamFormatter, CompletionStreamFormatter, StreamFormatter

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    if err_type is None:
        err_type = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                    500: "InternalServerError"}.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status)).model_dump()


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


# ----------------------------------------------------------------------------- engine requests


class EngineRequest:
    """One engine request: pulls cumulative outputs, times them, aborts if left unfinished."""

    def __init__(self, engine, metrics: ServerMetrics, prompt_ids: list[int], params: SamplingParams,
                 request_id: str, prompt_text: str | None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.params = params
        self._gen = engine.generate(prompt_ids, params, request_id, prompt=prompt_text)
        self._timer = metrics.request_timer()
        self._num_tokens = 0
        self.finished = False
        self._closed = False

    def decoded_prompt(self, tokenizer) -> str:
        """The prompt as text (for echo), decoded once when the request came as token ids."""
        if self.prompt_text is None:
            self.prompt_text = tokenizer.decode(self.prompt_ids, skip_special_tokens=False)
        return self.prompt_text

    async def next(self) -> RequestOutput | None:
        """The next cumulative output, or None once the engine has no more."""
        if self.finished:
            return None
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            self.finished = True
            return None
        self._timer.on_queue_time(out.queue_time)
        total = sum(len(o.token_ids) for o in out.outputs)
        self._timer.on_tokens(total - self._num_tokens)
        self._num_tokens = total
        if out.finished:
            self.finished = True
            self._timer.on_finish([o.finish_reason or "stop" for o in out.outputs])
        return out

    async def close(self) -> None:
        """Abort in the engine unless it finished; release the generator. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.finished = True
            self._timer.on_finish(["abort"] * self.params.n)
            try:
                await self.engine.abort(self.request_id)
            except EngineDeadError:
                logger.debug("abort of %s skipped: the engine is gone", self.request_id)
        aclose = getattr(self._gen, "aclose", None)  # async generators have it; plain iterators may not
        if aclose is not None:
            await aclose()


async def close_all(reqs: list["EngineRequest"]) -> None:
    await asyncio.gather(*(r.close() for r in reqs))


async def _open_all(engine, metrics: ServerMetrics, prompts: list[tuple[str | None, list[int]]],
                    params: SamplingParams, request_id: str, suffixed: bool) -> list[EngineRequest]:
    """One EngineRequest per prompt; if the engine refuses one at submission, the others are
    aborted before the error propagates."""
    reqs: list[EngineRequest] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = f"{request_id}-{i}" if suffixed else request_id
            reqs.append(EngineRequest(engine, metrics, ids, params, rid, text))
    except BaseException:
        await close_all(reqs)
        raise
    return reqs


async def _gather_or_cancel(coros) -> list:
    """asyncio.gather that, when one fails (or we are cancelled), cancels and awaits the rest,
    so no task is left inside an engine generator that the caller is about to close."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _finish(req: EngineRequest, first: RequestOutput | None) -> RequestOutput:
    out = first
    while not req.finished:
        out = await req.next() or out
    if out is None:
        raise RuntimeError(f"engine returned no output for request {req.request_id}")
    return out


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (its cleanup aborts)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    with suppress(asyncio.CancelledError):
        await work_task
    logger.info("client disconnected; request aborted")
    return Response(status_code=499)


class SSEResponse(StreamingResponse):
    """A server-sent-events response that stops as soon as the client disconnects and then
    runs ``on_close`` (which aborts the engine requests), even if streaming never began.

    Starlette's StreamingResponse under ASGI >= 2.4 only notices a disconnect when a write
    fails, and then leaves the generator for the garbage collector to close.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
            if stream in done and not isinstance(stream.exception(), OSError):
                stream.result()  # re-raise a real error; OSError is the client going away
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            await self.body_iterator.aclose()
            await self._on_close()


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# ----------------------------------------------------------------------------- the app


class OpenAIServer:
    """Per-app state and the request handlers (routes are thin wrappers in build_app)."""

    def __init__(self, engine, log_requests: bool = False) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.log_requests = log_requests
        first = engine.served_model_name
        self.model_names = [first] + [n for n in engine.engine_config.served_model_names if n != first]
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.metrics = ServerMetrics(engine.stats, first)
        self.limits = AdmissionLimits.for_engine(engine)

    # -- validation helpers

    def check_model(self, name: str | None) -> str:
        if name and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return self.model_names[0]

    def check_token_ids(self, ids: list[int], what: str = "prompt") -> None:
        if not ids:
            raise APIError(400, f"The {what} is empty: it must contain at least one token.", what)
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise APIError(400, f"Token id {t} in the {what} is out of vocabulary "
                                    f"(vocabulary size {self.vocab_size}).", what)

    def check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        n = len(ids)
        if n >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, your request has {n} input tokens. Please reduce the length "
                                "of the input.", "prompt")
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise APIError(400, f"'{param}' is too large: {max_tokens}. This model's maximum context length "
                                f"is {self.max_model_len} tokens and your request has {n} input tokens "
                                f"({max_tokens} > {self.max_model_len} - {n}).", param)

    @staticmethod
    def check_stream_options(req: SamplingFields) -> None:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        if req.logit_bias:
            for key in req.logit_bias:
                if not str(key).lstrip("-").isdigit():
                    raise APIError(400, f"logit_bias keys must be token ids, got {key!r}.", "logit_bias")

    @staticmethod
    def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            stop=req.stop or [], stop_token_ids=req.stop_token_ids or [], seed=req.seed,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        if req.logit_bias:
            kw["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        return SamplingParams(**kw)

    def log_request(self, request_id: str, body: SamplingFields, prompt_lens: list[int]) -> None:
        if body.model_extra:
            logger.debug("request %s: ignoring unknown fields %s", request_id, sorted(body.model_extra))
        if self.log_requests:
            logger.info("request %s: prompt tokens %s, params %s", request_id, prompt_lens,
                        body.model_dump(exclude_unset=True, exclude={"prompt", "messages"}))

    # -- completions

    def completion_prompts(self, prompt, add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            items: list = [prompt]
        elif not prompt:
            raise APIError(400, "The prompt is empty.", "prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        out = []
        for p in items:
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
                out.append((p, ids))
            else:
                out.append((None, list(p)))
            self.check_token_ids(out[-1][1])
        return out

    async def completions(self, body: CompletionRequest, raw: Request):
        model = self.check_model(body.model)
        check_completion(body, self.limits)
        self.check_stream_options(body)
        if body.suffix:
            raise APIError(400, "suffix is not supported by this server.", "suffix")
        prompts = self.completion_prompts(body.prompt, body.add_special_tokens)
        prompt_lp = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_lp = max(body.logprobs, prompt_lp or 0)
        params = self.sampling_params(body, body.max_tokens, body.logprobs, prompt_lp)
        for _, ids in prompts:
            self.check_length(ids, params.max_tokens, "max_tokens")
        request_id = random_id("cmpl")
        self.log_request(request_id, body, [len(ids) for _, ids in prompts])
        reqs = await _open_all(self.engine, self.metrics, prompts, params, request_id, suffixed=True)
        fmt = CompletionStreamFormatter(self.tokenizer, body, request_id, model, reqs) if body.stream else None
        return await self._respond(raw, reqs, fmt, lambda finals: self._completion_response(
            body, request_id, model, reqs, finals))

    async def _respond(self, raw: Request, reqs: list[EngineRequest], fmt: "StreamFormatter | None",
                       build: Callable[[list[RequestOutput]], JSONResponse]) -> Response:
        """Wait for every request's first output (the engine rejects bad requests there: 400),
        then stream, or collect the final outputs; a client disconnect at any point aborts."""

        async def work() -> Response:
            handed_to_stream = False
            try:
                firsts = await _gather_or_cancel(r.next() for r in reqs)
                if fmt is not None:
                    handed_to_stream = True
                    return SSEResponse(self._stream(reqs, firsts, fmt), on_close=lambda: close_all(reqs))
                finals = await _gather_or_cancel(_finish(r, f) for r, f in zip(reqs, firsts))
            finally:
                if not handed_to_stream:
                    await close_all(reqs)
            return build(finals)

        return await _cancel_on_disconnect(raw, work())

    def _completion_response(self, body: CompletionRequest, request_id: str, model: str,
                             reqs: list[EngineRequest], finals: list[RequestOutput]) -> JSONResponse:
        choices, completion_tokens = [], 0
        for p, (req, out) in enumerate(zip(reqs, finals)):
            for o in sorted(out.outputs, key=lambda o: o.index):
                completion_tokens += len(o.token_ids)
                text, lp = o.text, None
                if body.echo:
                    text = req.decoded_prompt(self.tokenizer) + text
                if body.logprobs is not None:
                    ids, lps = list(o.token_ids), list(o.logprobs or [])
                    if body.echo:
                        ids = list(req.prompt_ids) + ids
                        lps = list(out.prompt_logprobs or [None] * len(req.prompt_ids)) + lps
                    lp = completion_logprobs(self.tokenizer, ids, lps, body.logprobs, 0)
                choices.append(CompletionResponseChoice(index=p * body.n + o.index, text=text, logprobs=lp,
                                                        finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        resp = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump())

    # -- chat

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool) -> tuple[str, list[int]]:
        if not messages:
            raise APIError(400, "messages must contain at least one message.", "messages")
        check_messages(messages)
        if not self.tokenizer.chat_template:
            raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", "messages")
        conv = []
        for m in messages:
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type in ("image_url", "input_image", "image"):
                        raise APIError(400, f"Content part type {part.type!r}: vision input is not supported "
                                            "(this server serves text models only).", "messages")
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"Unsupported content part type {part.type!r}: only text is "
                                            "supported.", "messages")
                    texts.append(part.text)
                content = "\n".join(texts)
            else:
                content = m.content or ""
            msg = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            conv.append(msg)
        # Template errors (raise_exception in the template, bad syntax) are InvalidRequestError: 400.
        text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self.check_token_ids(ids)
        return text, ids

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        model = self.check_model(body.model)
        check_chat(body, self.limits)
        self.check_stream_options(body)
        top = None
        if body.logprobs:
            top = body.top_logprobs or 0
        text, ids = self.chat_prompt(body.messages, body.add_generation_prompt, body.add_special_tokens)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.sampling_params(body, max_tokens, top, None)
        self.check_length(ids, max_tokens, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
        request_id = random_id("chatcmpl")
        self.log_request(request_id, body, [len(ids)])
        reqs = await _open_all(self.engine, self.metrics, [(text, ids)], params, request_id, suffixed=False)
        fmt = ChatStreamFormatter(self.tokenizer, body, request_id, model, reqs) if body.stream else None
        return await self._respond(raw, reqs, fmt, lambda finals: self._chat_response(
            body, request_id, model, reqs[0], finals[0]))

    def _chat_response(self, body: ChatCompletionRequest, request_id: str, model: str, req: EngineRequest,
                       out: RequestOutput) -> JSONResponse:
        choices = []
        for o in sorted(out.outputs, key=lambda o: o.index):
            lp = None
            if body.logprobs:
                lp = chat_logprobs(self.tokenizer, o.token_ids, o.logprobs, body.top_logprobs or 0)
            choices.append(ChatCompletionResponseChoice(
                index=o.index, message=ChatResponseMessage(content=o.text), logprobs=lp,
                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        completion_tokens = sum(len(o.token_ids) for o in out.outputs)
        usage = UsageInfo(prompt_tokens=len(req.prompt_ids), completion_tokens=completion_tokens,
                          total_tokens=len(req.prompt_ids) + completion_tokens)
        return JSONResponse(ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                                   usage=usage).model_dump())

    # -- streaming (shared by completions and chat)

    async def _stream(self, reqs: list[EngineRequest], firsts: list[RequestOutput | None],
                      fmt: "StreamFormatter") -> AsyncIterator[str]:
        """Merge the engine requests' outputs into one SSE stream; abort all on exit.

        Outputs are cumulative, so only the newest one per request is kept: a slow client
        gets larger deltas instead of an ever-growing queue.
        """
        latest: dict[int, RequestOutput] = {}
        done: set[int] = set()
        errors: list[tuple[int, Exception]] = []
        changed = asyncio.Event()

        async def pump(i: int, req: EngineRequest, out: RequestOutput | None) -> None:
            try:
                while out is not None:
                    latest[i] = out
                    changed.set()
                    out = await req.next()
            except Exception as e:  # forwarded to the client as an error event, not swallowed
                errors.append((i, e))
            done.add(i)
            changed.set()

        tasks = [asyncio.create_task(pump(i, r, f)) for i, (r, f) in enumerate(zip(reqs, firsts))]
        try:
            for chunk in fmt.start():
                yield _sse(chunk)
            while True:
                await changed.wait()
                changed.clear()
                for i in sorted(latest):
                    for chunk in fmt.on_output(i, latest.pop(i)):
                        yield _sse(chunk)
                if errors:
                    i, err = errors[0]
                    logger.error("request %s failed mid-stream: %r", reqs[i].request_id, err)
                    status = 400 if isinstance(err, InvalidRequestError) else (
                        503 if isinstance(err, ServerStoppingError) else 500)
                    yield _sse(error_body(status, str(err)))
                    break
                if len(done) == len(tasks) and not latest:
                    for chunk in fmt.finish():
                        yield _sse(chunk)
                    break
            yield _sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await close_all(reqs)
