"""Admission limits: what one request may ask for, checked before anything is tokenized,
allocated or enqueued, so that no single request can wedge the engine.

Every rejection is an :class:`InvalidRequestError` naming the field (``param``); the HTTP
layer turns it into vLLM's 400 body. The limits follow from the engine's settings
(``--max-model-len``, ``--max-num-seqs``, ``--max-logprobs``) or are fixed constants below;
the README's "Request limits" table lists them all. The request body size is checked even
earlier, by :class:`BodySizeLimit`, before the JSON is parsed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 64  # entries of `stop`
MAX_STOP_STRING_CHARS = 1024  # characters in one stop string
MAX_STOP_TOKEN_IDS = 1024  # entries of `stop_token_ids`
MAX_LOGIT_BIAS_ENTRIES = 1024  # entries of `logit_bias` (its values: [-100, 100])
MAX_CHAT_MESSAGES = 4096  # entries of `messages`
# The sequences one request fans out to (prompts × n) are capped at this or --max-num-seqs,
# whichever is larger: every sequence waits in the scheduler's queue and is detokenized.
MIN_SEQUENCES_PER_REQUEST = 1024
DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class AdmissionLimits:
    max_model_len: int
    vocab_size: int
    max_num_seqs: int = 256
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    @classmethod
    def for_engine(cls, engine) -> AdmissionLimits:
        cfg = engine.engine_config
        return cls(max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
                   max_num_seqs=cfg.max_num_seqs, max_logprobs=cfg.max_logprobs)

    @property
    def max_n(self) -> int:
        """``n`` / ``best_of``: at most --max-num-seqs (more could never run at once anyway)."""
        return self.max_num_seqs

    @property
    def max_sequences(self) -> int:
        return max(self.max_num_seqs, MIN_SEQUENCES_PER_REQUEST)


def _bad(param: str, message: str) -> None:
    raise InvalidRequestError(message, param=param)


def _int_in(value, param: str, lo: int, hi: int) -> None:
    if value is not None and not lo <= value <= hi:
        _bad(param, f"{param} must be between {lo} and {hi}, got {value}.")


def _float_in(value, param: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value):
        _bad(param, f"{param} must be a finite number, got {value}.")
    if value < lo or value > hi or (lo_open and value == lo):
        _bad(param, f"{param} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}.")


def check_text(text: str, param: str) -> None:
    """Strings must be valid Unicode: JSON can carry lone surrogates (``"\\ud800"``) that no
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        _bad(param, f"{param} contains text that is not valid UTF-8 (a lone surrogate).")


def check_sampling(req, limits: AdmissionLimits, num_prompts: int = 1) -> None:
    """The sampling fields shared by completions and chat (``server.protocol.SamplingFields``)."""
    _int_in(req.n, "n", 1, limits.max_n)
    best_of = getattr(req, "best_of", None)
    if best_of is not None:
        if best_of < req.n:
            _bad("best_of", f"best_of must be greater than or equal to n, got n={req.n} and best_of={best_of}.")
        _int_in(best_of, "best_of", 1, limits.max_n)
        if best_of > req.n:
            _bad("best_of", "best_of > n is not supported by this server (as vLLM V1); set best_of = n.")
    if num_prompts * req.n > limits.max_sequences:
        _bad("n", f"The request fans out to {num_prompts} prompt(s) x n={req.n} = {num_prompts * req.n} "
                  f"sequences; at most {limits.max_sequences} are allowed per request.")
    _int_in(req.seed, "seed", INT64_MIN, INT64_MAX)
    _float_in(req.temperature, "temperature", 0.0, math.inf)
    _float_in(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    if req.top_k is not None and req.top_k not in (-1, 0):
        _int_in(req.top_k, "top_k", 1, INT64_MAX)  # larger than the vocabulary: no filtering
    _float_in(req.min_p, "min_p", 0.0, 1.0)
    _float_in(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _float_in(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _float_in(req.repetition_penalty, "repetition_penalty", 0.0, math.inf, lo_open=True)
    _int_in(req.min_tokens, "min_tokens", 0, limits.max_model_len)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        _bad("stop", f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed.")
    for s in stop:
        if not s:
            _bad("stop", "stop strings must not be empty.")
        if len(s) > MAX_STOP_STRING_CHARS:
            _bad("stop", f"a stop string has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} are allowed.")
        check_text(s, "stop")
    ids = req.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        _bad("stop_token_ids", f"stop_token_ids has {len(ids)} entries; at most {MAX_STOP_TOKEN_IDS} are allowed.")
    for t in ids:
        if not 0 <= t < limits.vocab_size:
            _bad("stop_token_ids", f"stop_token_ids: token id {t} is out of vocabulary "
                                   f"(vocabulary size {limits.vocab_size}).")
    bias = req.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        _bad("logit_bias", f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed.")
    for key, value in bias.items():
        text = str(key)
        if not text.lstrip("-").isdigit() or len(text) > 20:
            _bad("logit_bias", f"logit_bias keys must be token ids, got {key!r}.")
        if not 0 <= int(text) < limits.vocab_size:
            _bad("logit_bias", f"logit_bias: token id {text} is out of vocabulary (vocabulary size "
                               f"{limits.vocab_size}).")
        _float_in(value, "logit_bias", -100.0, 100.0)


def check_max_tokens(value, param: str, limits: AdmissionLimits) -> None:
    """Before tokenizing: a value that no prompt could satisfy (the prompt-dependent rule,
    prompt + max_tokens <= --max-model-len, is checked once the prompt is tokenized)."""
    if value is not None and value < 1:
        _bad(param, f"{param} must be at least 1, got {value}.")
    if value is not None and value >= limits.max_model_len:
        _bad(param, f"'{param}' is too large: {value}. This model's maximum context length is "
                    f"{limits.max_model_len} tokens, and the prompt needs at least one of them.")


def check_completion(req, limits: AdmissionLimits) -> None:
    """``/v1/completions`` (``server.protocol.CompletionRequest``)."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        _bad("prompt", "The prompt is empty.")
    for p in items:
        if isinstance(p, str):
            if not p:
                _bad("prompt", "The prompt is empty: give at least one character or token.")
            check_text(p, "prompt")
        elif len(p) > limits.max_model_len:
            _bad("prompt", f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                           f"your request has {len(p)} input tokens. Please reduce the length of the input.")
    check_sampling(req, limits, num_prompts=len(items))
    check_max_tokens(req.max_tokens, "max_tokens", limits)
    _int_in(req.logprobs, "logprobs", 0, limits.max_logprobs)
    _int_in(req.prompt_logprobs, "prompt_logprobs", 0, limits.max_logprobs)
    if req.suffix is not None:
        check_text(req.suffix, "suffix")


def check_messages(messages) -> None:
    """Chat messages (``/v1/chat/completions``, ``/tokenize``): count and text."""
    if len(messages) > MAX_CHAT_MESSAGES:
        _bad("messages", f"messages has {len(messages)} entries; at most {MAX_CHAT_MESSAGES} are allowed.")
    for m in messages:
        check_text(m.role, "messages")
        if m.name is not None:
            check_text(m.name, "messages")
        parts = m.content if isinstance(m.content, list) else [m]
        for part in parts:
            text = part.content if part is m else part.text
            if isinstance(text, str):
                check_text(text, "messages")


def check_chat(req, limits: AdmissionLimits) -> None:
    """``/v1/chat/completions`` (``server.protocol.ChatCompletionRequest``)."""
    check_messages(req.messages)
    check_sampling(req, limits)
    check_max_tokens(req.max_tokens, "max_tokens", limits)
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens", limits)
    if req.top_logprobs is not None:
        if not req.logprobs:
            _bad("top_logprobs", "top_logprobs requires logprobs to be true.")
        _int_in(req.top_logprobs, "top_logprobs", 0, limits.max_logprobs)


def check_token_ids(ids: list[int], param: str, limits: AdmissionLimits) -> None:
    for t in ids:
        if not 0 <= t < limits.vocab_size:
            _bad(param, f"Token id {t} in the {param} is out of vocabulary (vocabulary size {limits.vocab_size}).")


# ----------------------------------------------------------------------------- request body size


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered with 413 before any of
    it is parsed (by Content-Length when given, else while it streams in). The body read
    here is handed to the app unchanged; later ``receive`` calls (disconnects) pass through."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size_text: str):
        from fastapi.responses import JSONResponse

        from server.protocol import ErrorInfo, ErrorResponse

        message = (f"The request body is {size_text} bytes; this server accepts at most {self.max_bytes} "
                   "(--max-request-body-bytes).")
        body = ErrorResponse(error=ErrorInfo(message=message, type="RequestEntityTooLarge", param=None, code=413))
        return JSONResponse(body.model_dump(), status_code=413, headers={"connection": "close"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(length.decode())(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(f"more than {size}")(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list, receive):
    async def replayed():
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed
