"""The OpenAI-compatible HTTP app (FastAPI) in front of an ``AsyncEngine``, and its server.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (handlers in
``server/openai_serving.py``), ``GET /v1/models``, ``GET /health``, ``GET /version``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Error contract (vLLM's): every invalid request is a 400 with
``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`` — malformed JSON
and wrong types included, which FastAPI alone would answer with 422; an unknown model name
is a 404, a missing or wrong API key a 401 (``/v1/*`` only, as vLLM), an unknown route 404,
and only real internal failures a 500. Every error body has the same shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.admission import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimit, check_text
from server.errors import EngineDeadError, InvalidRequestError, ServerStoppingError
from server.openai_serving import APIError, OpenAIServer, error_body, error_response
from server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse, TokenizerInfoResponse, VersionResponse,
)

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0
ENGINE_WATCH_INTERVAL_S = 0.2
GRACEFUL_SHUTDOWN_S = 3


def _version() -> str:
    try:
        return importlib.metadata.version("mlaserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


# ----------------------------------------------------------------------------- errors


# pydantic names a union member in an error's loc by its type: "str", "list[int]", "ContentPart".
_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|[A-Z]\w*)$|\[")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's errors; the per-member errors of a union field
    (e.g. ``prompt``) collapse into one that lists the accepted types."""
    parts: list[str] = []
    union_tags: dict[str, list[str]] = {}
    param = None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"Invalid JSON in request body: {detail}".rstrip(": "), None
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        tag_at = next((j for j in range(1, len(loc)) if _UNION_TAG.search(loc[j])), None)
        if tag_at is not None:
            union_tags.setdefault(".".join(loc[:tag_at]), []).append(loc[tag_at])
            continue
        line = f"{'.'.join(loc) if loc else 'body'}: {err.get('msg', 'invalid value')}"
        if line not in parts:
            parts.append(line)
    for field, tags in union_tags.items():
        parts.append(f"{field}: must be one of {', '.join(dict.fromkeys(tags))}")
    if len(parts) > 4:
        parts = parts[:4] + [f"... ({len(parts) - 4} more)"]
    return "Invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api(_req: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_req: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def _dead(_req: Request, exc: EngineDeadError):
        if isinstance(exc, ServerStoppingError):
            return error_response(503, str(exc))
        return error_response(500, f"The engine is not running: {exc}")



class _InternalErrorMiddleware:
    """Unexpected exceptions become a JSON 500 here, instead of Starlette's plain-text 500
    (whose re-raise also makes uvicorn drop the keep-alive connection)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # headers are out; the ASGI server can only cut the connection
                raise
            logger.error("internal error while serving %s", scope.get("path"), exc_info=exc)
            resp = error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")
            await resp(scope, receive, send)


class _APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would get between streams and disconnects)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                resp = JSONResponse(error_body(401, "Unauthorized: missing or invalid API key."), status_code=401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------- app


async def _log_stats_forever(engine, interval: float) -> None:
    """A periodic one-line summary while there is traffic (``--disable-log-stats`` turns it off)."""
    prev, prev_t = None, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        try:
            s = engine.stats()
        except EngineDeadError as e:
            logger.error("engine stats unavailable, stopping the stats logger: %s", e)
            return
        t = time.monotonic()
        if prev is not None:
            dp = s["prompt_tokens_total"] - prev["prompt_tokens_total"]
            dg = s["generation_tokens_total"] - prev["generation_tokens_total"]
            if dp or dg or s["num_running"] or s["num_waiting"]:
                dt = max(t - prev_t, 1e-9)
                logger.info("Engine: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, "
                            "running %d reqs, waiting %d reqs, KV cache usage %.1f%%, preemptions %d",
                            dp / dt, dg / dt, s["num_running"], s["num_waiting"], 100 * s["kv_cache_usage"],
                            s["num_preemptions"])
        prev, prev_t = s, t


def build_app(engine, *, api_key: str | None = None, log_requests: bool = False,
              log_stats: bool = False, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """The FastAPI app for ``engine`` (anything with the AsyncEngine interface)."""
    srv = OpenAIServer(engine, log_requests=log_requests)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.create_task(_log_stats_forever(engine, STATS_LOG_INTERVAL_S)) if log_stats else None
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(title="mlaserve", version=_version(), lifespan=lifespan)
    app.state.server = srv
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if api_key:  # outside the body limit: an unauthenticated client's body is never read
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    app.add_middleware(_InternalErrorMiddleware)  # added last: outermost

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await srv.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await srv.chat(body, request)

    @app.get("/v1/models")
    async def models():
        root = getattr(engine.engine_config, "model", None)
        cards = [ModelCard(id=name, root=root, max_model_len=srv.max_model_len) for name in srv.model_names]
        return ModelList(data=cards).model_dump()

    @app.get("/health")
    async def health():
        problem = engine.health_problem()
        if problem is not None:
            return error_response(503, problem)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return VersionResponse(version=_version()).model_dump()

    @app.get("/metrics")
    async def metrics():
        content, content_type = srv.metrics.render()
        return Response(content=content, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        srv.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of `prompt` or `messages`.", "prompt")
        if body.prompt is not None:
            check_text(body.prompt, "prompt")
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = srv.tokenizer.encode(body.prompt, add_special_tokens=add_special)
        else:
            _, ids = srv.chat_prompt(body.messages, body.add_generation_prompt, bool(body.add_special_tokens))
        strs = srv.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=srv.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        srv.check_model(body.model)
        if body.tokens:
            srv.check_token_ids(body.tokens, "tokens")
        text = srv.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text).model_dump()

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = srv.tokenizer
        # mlaserve loads tokenizer.json, i.e. what transformers' PreTrainedTokenizerFast wraps.
        info = TokenizerInfoResponse(
            tokenizer_class="PreTrainedTokenizerFast", bos_token=tok.bos_token, eos_token=tok.eos_token,
            pad_token=getattr(tok, "pad_token", None), chat_template=tok.chat_template,
            model_max_length=getattr(tok, "model_max_length", None) or srv.max_model_len,
            vocab_size=tok.vocab_size)
        return info.model_dump()

    return app


# ----------------------------------------------------------------------------- server


async def _watch_engine(engine, server) -> None:
    """Shut the HTTP server down when the engine dies; when the server is asked to stop
    (SIGTERM / SIGINT), fail the requests in flight at once (503), so that the shutdown
    never waits on an engine that may be stuck."""
    while engine.is_healthy:
        if server.should_exit:
            engine.stop_accepting("The server is shutting down.")
            return
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    logger.error("the engine died; shutting the HTTP server down")
    server.should_exit = True


def _uvicorn_server(config):
    """A uvicorn server that, after a SIGTERM / SIGINT shutdown, leaves the process running so
    that the engine is stopped cleanly: uvicorn itself re-raises the captured signal as soon
    as serve() returns, which would end this process with its engine still running."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # (uvicorn's own list of signals to re-raise)

    return Server(config)


async def run_server(config, host: str, port: int, api_key: str | None = None, *,
                     uvicorn_log_level: str = "info", log_requests: bool = False, log_stats: bool = True,
                     max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> int:
    """Start the engine, serve HTTP until interrupted or the engine dies; the exit code."""
    import uvicorn

    from server.async_engine import AsyncEngine

    engine = await AsyncEngine.start(config)
    try:
        app = build_app(engine, api_key=api_key, log_requests=log_requests, log_stats=log_stats,
                        max_request_body_bytes=max_request_body_bytes)
        # A bounded graceful shutdown: SIGTERM / SIGINT end the whole server within seconds, busy or not.
        server = _uvicorn_server(uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        watchdog = asyncio.create_task(_watch_engine(engine, server))
        logger.info("serving %s on http://%s:%d", engine.served_model_name, host, port)
        await server.serve()
        watchdog.cancel()
        return 0 if engine.is_healthy else 1
    finally:
        await engine.shutdown()
