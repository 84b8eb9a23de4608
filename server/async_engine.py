"""AsyncEngine: the HTTP layer's handle on an engine loop running in its own process.

The engine process owns the model, scheduler and KV cache and runs ``EngineCore.step()`` in a
loop; the API process tokenizes, validates and streams. They talk over a local pipe with
msgpack messages (no pickle on the per-request path, so nothing received is ever executed):

  API → engine: ["add", request_id, prompt_token_ids, sampling_params_dict] | ["abort", id] | ["shutdown"]
  engine → API: ["ready", info] | ["deltas", [delta, ...], stats] | ["fatal", message]

If the engine process dies, every in-flight request fails with EngineDeadError and
``is_healthy`` turns False (the HTTP layer answers /health with 503 and exits).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import AsyncIterator

import msgpack

from model.config import ModelConfig, load_model_config
from server.config import EngineConfig
from server.engine_core import RequestDelta, SeqDelta
from server.errors import EngineDeadError, InvalidRequestError
from server.outputs import OutputAccumulator, RequestOutput, TokenLogprob
from server.sampling_params import SamplingParams
from server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("MLASERVE_ENGINE_STARTUP_TIMEOUT", "600"))


# ---- message encoding (plain lists/dicts only) ------------------------------------------------
def _lp_to_wire(lp: TokenLogprob | None):
    if lp is None:
        return None
    return [lp.token_id, lp.logprob, lp.rank, [[k, v] for k, v in lp.top.items()]]


def _lp_from_wire(w) -> TokenLogprob | None:
    if w is None:
        return None
    return TokenLogprob(w[0], w[1], w[2], {int(k): v for k, v in w[3]})


def delta_to_wire(d: RequestDelta) -> list:
    seqs = [[s.index, s.text, s.token_ids, None if s.logprobs is None else [_lp_to_wire(x) for x in s.logprobs],
             s.finish_reason, s.stop_reason] for s in d.seqs]
    plp = None if d.prompt_logprobs is None else [_lp_to_wire(x) for x in d.prompt_logprobs]
    return [d.request_id, seqs, d.finished, plp, d.num_cached_tokens, d.error]


def delta_from_wire(w) -> RequestDelta:
    rid, seqs, finished, plp, cached, error = w
    return RequestDelta(
        rid,
        [SeqDelta(i, t, list(ids), None if lps is None else [_lp_from_wire(x) for x in lps], fr, sr)
         for i, t, ids, lps, fr, sr in seqs],
        finished,
        None if plp is None else [_lp_from_wire(x) for x in plp],
        cached,
        error,
    )


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---- the engine process -----------------------------------------------------------------------
def _engine_main(config: EngineConfig, model_dir: str, conn) -> None:
    """Entry point of the engine process: build the core, then serve the pipe until shutdown."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    try:
        from server.engine_core import EngineCore

        core = EngineCore(config, model_dir)
    except Exception as exc:  # report any startup failure to the parent as one line
        conn.send_bytes(_pack(["fatal", f"{type(exc).__name__}: {exc}"]))
        return
    conn.send_bytes(_pack(["ready", {"max_model_len": core.max_model_len, **core.stats()}]))
    last_stats = 0.0
    while True:
        busy = core.has_unfinished()
        if conn.poll(0 if busy else 1.0):
            while True:
                msg = _unpack(conn.recv_bytes())
                kind = msg[0]
                if kind == "shutdown":
                    return
                if kind == "add":
                    _, rid, ids, params = msg
                    try:
                        core.add_request(rid, ids, SamplingParams(**params))
                    except InvalidRequestError as exc:
                        err = RequestDelta(rid, [], finished=True, error=str(exc))
                        conn.send_bytes(_pack(["deltas", [delta_to_wire(err)], core.stats()]))
                elif kind == "abort":
                    core.abort(msg[1])
                if not conn.poll(0):
                    break
        if core.has_unfinished():
            deltas = core.step()
            now = time.monotonic()
            if deltas or now - last_stats > 0.5:
                conn.send_bytes(_pack(["deltas", [delta_to_wire(d) for d in deltas], core.stats()]))
                last_stats = now
        elif time.monotonic() - last_stats > 0.5:
            conn.send_bytes(_pack(["deltas", [], core.stats()]))
            last_stats = time.monotonic()


# ---- the API-side handle ----------------------------------------------------------------------
class AsyncEngine:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.engine_config = config
        self.model_dir = model_dir
        self.model_config: ModelConfig = load_model_config(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir)
        self.served_model_name = config.served_model_name or model_dir.rstrip("/").split("/")[-1]
        self.max_model_len = 0
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stats: dict = {}
        self._dead: str | None = None
        self._send_lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._closing = False

    @classmethod
    async def start(cls, config: EngineConfig, model_dir: str | None = None) -> "AsyncEngine":
        from server.llm import bundled_model_dir

        model_dir = model_dir or config.model or bundled_model_dir()
        engine = cls(config, model_dir)
        await asyncio.get_running_loop().run_in_executor(None, engine._spawn)
        return engine

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(self.engine_config, self.model_dir, child),
                                 name="mlaserve-engine", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(STARTUP_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"engine process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            msg = _unpack(parent.recv_bytes())
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"engine process exited during startup (exit code {self._proc.exitcode})") from None
        if msg[0] == "fatal":
            self._proc.join(5)
            raise RuntimeError(f"engine failed to start: {msg[1]}")
        info = msg[1]
        self.max_model_len = info.pop("max_model_len")
        self._stats = info
        self._reader = threading.Thread(target=self._read_loop, name="mlaserve-engine-reader", daemon=True)
        self._reader.start()

    # ---- reading outputs ---------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                msg = _unpack(self._conn.recv_bytes())
            except (EOFError, OSError):
                if self._closing:
                    self._dead = "engine shut down"
                    return
                self._mark_dead(f"engine process exited (exit code {self._proc.exitcode})")
                return
            if msg[0] == "deltas":
                self._stats = msg[2]
                for w in msg[1]:
                    d = delta_from_wire(w)
                    entry = self._streams.get(d.request_id)
                    if entry is not None:
                        queue, loop = entry
                        loop.call_soon_threadsafe(queue.put_nowait, d)

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            logger.error("%s", reason)
        for queue, loop in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(reason))
            except RuntimeError:
                pass

    def _send(self, msg) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        with self._send_lock:
            try:
                self._conn.send_bytes(_pack(msg))
            except (OSError, ValueError) as exc:
                raise EngineDeadError(f"engine process is gone: {exc}") from None

    # ---- public API --------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.is_alive()

    def stats(self) -> dict:
        return dict(self._stats)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not prompt_token_ids:
            raise InvalidRequestError("The prompt must contain at least one token.")
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab:
                raise InvalidRequestError(f"Token id {t} is out of vocabulary (vocab size {vocab}).")
        params.validate()
        n, m = len(prompt_token_ids), params.max_tokens
        if (m is None and n >= self.max_model_len) or (m is not None and n + m > self.max_model_len):
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + (m or 0)} tokens ({n} in the messages, {m or 0} in the completion). "
                "Please reduce the length of the messages or completion."
            )

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the cumulative output after every step that changed it; the last is finished."""
        self.validate(prompt_token_ids, params)
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (queue, asyncio.get_running_loop())
        acc = OutputAccumulator(request_id, prompt, prompt_token_ids, params.n, params.logprobs is not None,
                                time.monotonic())
        finished = False
        try:
            self._send(["add", request_id, list(prompt_token_ids), dataclasses.asdict(params)])
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise InvalidRequestError(item.error)
                out = acc.apply(item, time.monotonic())
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                try:
                    self._send(["abort", request_id])
                except EngineDeadError:
                    pass

    async def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(["abort", request_id])

    async def shutdown(self) -> None:
        if self._proc is None:
            return
        self._closing = True
        try:
            self._send(["shutdown"])
        except EngineDeadError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
        if self._proc.is_alive():
            self._proc.kill()
