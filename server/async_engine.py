"""AsyncEngine: the HTTP layer's handle on an engine loop running in its own process.

The engine process owns the model, scheduler and KV cache and runs ``EngineCore.step()`` in a
loop; the API process tokenizes, validates and streams. They talk over a local pipe with
msgpack messages (no pickle on the per-request path, so nothing received is ever executed):

  API → engine: ["add", request_id, prompt_token_ids, sampling_params_dict] | ["abort", id] | ["shutdown"]
  engine → API: ["ready", info] | ["deltas", [delta, ...], stats] | ["fatal", message]

If the engine process dies, every in-flight request fails with EngineDeadError and
``is_healthy`` turns False (the HTTP layer answers /health with 503 and exits).

Liveness, both ways:

* the engine loop stamps a shared-memory heartbeat every iteration; while there is work and
  the stamp is older than ``MLASERVE_ENGINE_ITERATION_TIMEOUT_S`` (default 60 s, vLLM's
  VLLM_ENGINE_ITERATION_TIMEOUT_S), ``health_problem()`` names the stall (/health: 503);
* the engine process kills itself within ~1 s once the API process is gone (a watchdog
  thread on its parent pid; its TP workers watch it the same way), so nothing outlives a
  front end that was SIGKILLed; a clean shutdown that takes longer than
  ``SHUTDOWN_GRACE_S`` ends it with SIGKILL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import AsyncIterator

import msgpack

from model.config import ModelConfig, load_model_config
from server import envs
from server.config import EngineConfig
from server.engine_core import RequestDelta, SeqDelta, validate_request
from server.errors import EngineDeadError, EngineStartupError, InvalidRequestError, ServerStoppingError
from server.outputs import OutputAccumulator, RequestOutput, TokenLogprob
from server.sampling_params import SamplingParams
from server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 3.0
PARENT_WATCH_INTERVAL_S = 0.5


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
    return [d.request_id, seqs, d.finished, plp, d.num_cached_tokens, d.error, d.queue_time]


def delta_from_wire(w) -> RequestDelta:
    rid, seqs, finished, plp, cached, error, queue_time = w
    return RequestDelta(
        rid,
        [SeqDelta(i, t, list(ids), None if lps is None else [_lp_from_wire(x) for x in lps], fr, sr)
         for i, t, ids, lps, fr, sr in seqs],
        finished,
        None if plp is None else [_lp_from_wire(x) for x in plp],
        cached,
        error,
        queue_time,
    )


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---- the engine process -----------------------------------------------------------------------
def _exit_with_parent(parent_pid: int) -> None:
    """Kill this process (and so, through their own watchdogs, its TP workers) as soon as the
    API process that started it is gone, whatever the main thread is doing."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_WATCH_INTERVAL_S)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _engine_main(config: EngineConfig, model_dir: str, conn, dp_rank: int = 0, heartbeat=None,
                 parent_pid: int | None = None) -> None:
    """Entry point of an engine process: build the core, then serve the pipe until shutdown."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine{dp_rank} %(levelname)s %(message)s")
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group: the API process handles it and stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _limit_cpu_threads(config)
    try:
        from server.engine_core import EngineCore

        core = EngineCore(config, model_dir, dp_rank)
    except Exception as exc:  # report any startup failure to the parent as one line
        conn.send_bytes(_pack(["fatal", f"{type(exc).__name__}: {exc}"]))
        return
    conn.send_bytes(_pack(["ready", {"max_model_len": core.max_model_len, **core.stats()}]))
    last_stats = 0.0
    stop = False
    stall_s = envs.MLASERVE_TEST_ENGINE_STALL_S
    while True:
        if heartbeat is not None:
            heartbeat.value = time.monotonic()
        busy = core.has_unfinished()
        if busy and stall_s > 0:
            logger.warning("test hook: stalling the engine loop for %.1f s", stall_s)
            time.sleep(stall_s)
            stall_s = 0.0
        if conn.poll(0 if busy else (0.005 if core.dp_sync else 1.0)):
            stop = _drain_messages(core, conn) or stop
        if core.dp_sync is not None:
            # DEP: every DP engine takes the same decision each iteration.
            any_busy, any_stop = core.dp_sync(core.has_unfinished(), stop)
            if any_stop:
                core.shutdown()
                return
            deltas = []
            if any_busy:
                core.ran_model = False
                if core.has_unfinished():
                    deltas = core.step()
                if not core.ran_model:
                    core.runner.dummy_step()
        else:
            if stop:
                core.shutdown()
                return
            deltas = core.step() if core.has_unfinished() else []
        now = time.monotonic()
        if deltas or now - last_stats > 0.5:
            conn.send_bytes(_pack(["deltas", [delta_to_wire(d) for d in deltas], core.stats()]))
            last_stats = now


def _limit_cpu_threads(config: EngineConfig) -> None:
    """On CPU, leave one core to the API process (tokenizing, streaming): torch's default of a
    thread per core makes both stall each other (measured: a 20x slower lm-eval round on 2
    cores). OMP_NUM_THREADS, when set, wins."""
    import torch

    from server.runner_setup import resolve_device

    if os.environ.get("OMP_NUM_THREADS") or resolve_device(config).type != "cpu":
        return
    threads = max(1, (os.cpu_count() or 1) - 1)
    torch.set_num_threads(threads)
    logger.info("CPU engine: %d torch thread(s) (set OMP_NUM_THREADS to change)", threads)


def _drain_messages(core, conn) -> bool:
    """Apply every queued message; returns True when asked to shut down."""
    while conn.poll(0):
        try:
            msg = _unpack(conn.recv_bytes())
        except (EOFError, OSError):
            return True  # the API process is gone: shut down
        kind = msg[0]
        if kind == "shutdown":
            return True
        if kind == "add":
            _, rid, ids, params = msg
            try:
                core.add_request(rid, ids, SamplingParams(**params))
            except InvalidRequestError as exc:
                err = RequestDelta(rid, [], finished=True, error=str(exc))
                conn.send_bytes(_pack(["deltas", [delta_to_wire(err)], core.stats()]))
        elif kind == "abort":
            core.abort(msg[1])
    return False


def load_chat_template(value: str) -> str:
    """``--chat-template``: a path to a Jinja file, else the template text itself (as vLLM)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise EngineStartupError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def served_name_for(model_arg: str | None, model_dir: str) -> str:
    """vLLM's default: the model argument exactly as given; the bundled model is ``arith``."""
    from server.llm import bundled_model_dir

    if not model_arg or os.path.abspath(model_arg) == os.path.abspath(bundled_model_dir()):
        return os.path.basename(model_dir.rstrip("/"))
    return model_arg


# ---- the API-side handle ----------------------------------------------------------------------
class _EngineProcess:
    """One engine process (one per DP rank) and the pipe to it."""

    def __init__(self, dp_rank: int, proc, conn, heartbeat) -> None:
        self.dp_rank, self.proc, self.conn = dp_rank, proc, conn
        self.heartbeat = heartbeat  # time.monotonic() of the loop's latest iteration (shared memory)
        self.stats: dict = {}
        self.inflight: set[str] = set()
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send_bytes(_pack(msg))


class AsyncEngine:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.engine_config = config
        self.model_dir = model_dir
        self.model_config: ModelConfig = load_model_config(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir)
        if config.chat_template:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        self.served_model_name = config.served_model_name or served_name_for(config.model, model_dir)
        self.max_model_len = 0
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._owner: dict[str, _EngineProcess] = {}
        self._engines: list[_EngineProcess] = []
        self._dead: str | None = None
        self._stopping: str | None = None
        self._closing = False

    @classmethod
    async def start(cls, config: EngineConfig, model_dir: str | None = None) -> "AsyncEngine":
        from server.llm import bundled_model_dir

        model_dir = model_dir or config.model or bundled_model_dir()
        engine = cls(config, model_dir)
        await asyncio.get_running_loop().run_in_executor(None, engine._spawn)
        return engine

    def _spawn(self) -> None:
        config = self.engine_config
        if config.world_size > 1:
            from server.engine_parallel import check_supported

            try:
                check_supported(config)
            except ValueError as exc:
                raise EngineStartupError(str(exc)) from None
            if config.nnodes == 1:  # one host: any free loopback port will do
                from distributed.launcher import find_free_port

                config = dataclasses.replace(config, master_port=find_free_port(config.master_addr))
        from server.runner_setup import check_v4_family_parallel, resolve_max_model_len

        try:  # here, before any process starts: a TP worker would print a traceback of its own
            resolve_max_model_len(config, self.model_config)
            check_v4_family_parallel(config, self.model_dir)
        except ValueError as exc:
            raise EngineStartupError(str(exc)) from None
        ctx = mp.get_context("spawn")
        for dp_rank in range(config.data_parallel_size):
            parent, child = ctx.Pipe()
            heartbeat = ctx.RawValue("d", time.monotonic())
            proc = ctx.Process(target=_engine_main,
                               args=(config, self.model_dir, child, dp_rank, heartbeat, os.getpid()),
                               name=f"mlaserve-engine-{dp_rank}", daemon=False)  # it spawns TP workers
            proc.start()
            child.close()
            self._engines.append(_EngineProcess(dp_rank, proc, parent, heartbeat))
        try:
            infos = [self._await_ready(e) for e in self._engines]
        except BaseException:
            for e in self._engines:
                e.proc.kill()
            raise
        self.max_model_len = min(info.pop("max_model_len") for info in infos)
        for e, info in zip(self._engines, infos):
            e.stats = info
            threading.Thread(target=self._read_loop, args=(e,), name=f"mlaserve-engine-reader-{e.dp_rank}",
                             daemon=True).start()

    @staticmethod
    def _await_ready(e: _EngineProcess) -> dict:
        timeout_s = envs.MLASERVE_ENGINE_STARTUP_TIMEOUT
        if not e.conn.poll(timeout_s):
            raise EngineStartupError(f"engine process {e.dp_rank} did not start within {timeout_s:.0f} s "
                                     "(MLASERVE_ENGINE_STARTUP_TIMEOUT)")
        try:
            msg = _unpack(e.conn.recv_bytes())
        except EOFError:
            e.proc.join(5)
            raise EngineStartupError(f"engine process exited during startup (exit code {e.proc.exitcode})") from None
        if msg[0] == "fatal":
            e.proc.join(5)
            raise EngineStartupError(f"engine failed to start: {msg[1]}")
        return msg[1]

    # ---- reading outputs ---------------------------------------------------------------------
    def _read_loop(self, e: _EngineProcess) -> None:
        while True:
            try:
                msg = _unpack(e.conn.recv_bytes())
            except (EOFError, OSError):
                if self._closing:
                    self._dead = self._dead or "engine shut down"
                    return
                e.proc.join(2)
                self._mark_dead(f"engine process {e.dp_rank} exited (exit code {e.proc.exitcode})")
                return
            if msg[0] == "deltas":
                e.stats = msg[2]
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

    def stop_accepting(self, reason: str) -> None:
        """Refuse new requests and fail those in flight with ServerStoppingError(reason)."""
        self._stopping = reason
        for queue, loop in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ServerStoppingError(reason))
            except RuntimeError:
                pass

    def _send(self, e: _EngineProcess, msg) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            e.send(msg)
        except (OSError, ValueError) as exc:
            raise EngineDeadError(f"engine process is gone: {exc}") from None

    def _pick_engine(self) -> _EngineProcess:
        """DEP: the DP rank with the fewest requests in flight (ties: lowest rank)."""
        return min(self._engines, key=lambda e: (len(e.inflight), e.dp_rank))

    # ---- public API --------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._dead is None and bool(self._engines) and all(e.proc.is_alive() for e in self._engines)

    def health_problem(self) -> str | None:
        """None while the engine serves; else why not: it died, or it has work and its loop has
        not completed an iteration within MLASERVE_ENGINE_ITERATION_TIMEOUT_S."""
        if not self.is_healthy:
            return self._dead or "the engine process is not running"
        now = time.monotonic()
        for e in self._engines:
            busy = bool(e.inflight) or e.stats.get("num_running", 0) or e.stats.get("num_waiting", 0)
            age = now - e.heartbeat.value
            limit = envs.MLASERVE_ENGINE_ITERATION_TIMEOUT_S
            if busy and age > limit:
                return (f"engine {e.dp_rank} has work but its loop has not completed an iteration for {age:.0f} s "
                        f"(limit {limit:g} s, MLASERVE_ENGINE_ITERATION_TIMEOUT_S)")
        return None

    def stats(self) -> dict:
        keys = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "prompt_tokens_total",
                "generation_tokens_total", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
        total = {k: sum(e.stats.get(k, 0) for e in self._engines) for k in keys}
        total["collectives"] = {}
        for e in self._engines:
            for k, v in e.stats.get("collectives", {}).items():
                total["collectives"][k] = total["collectives"].get(k, 0) + v
        blocks = total["num_total_blocks"]
        total["kv_cache_usage"] = (1.0 - total["num_free_blocks"] / blocks) if blocks else 0.0
        # The other numbers are the engine's latest report: this says how old it may be.
        total["engine_heartbeat_age_s"] = max((time.monotonic() - e.heartbeat.value for e in self._engines),
                                              default=0.0)
        return total

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len,
                         self.engine_config.max_logprobs)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the cumulative output after every step that changed it; the last is finished."""
        self.validate(prompt_token_ids, params)
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._stopping is not None:
            raise ServerStoppingError(self._stopping)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (queue, asyncio.get_running_loop())
        engine = self._pick_engine()
        engine.inflight.add(request_id)
        self._owner[request_id] = engine
        acc = OutputAccumulator(request_id, prompt, prompt_token_ids, params.n, params.logprobs is not None,
                                time.monotonic())
        finished = False
        try:
            self._send(engine, ["add", request_id, list(prompt_token_ids), dataclasses.asdict(params)])
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    finished = True
                    raise InvalidRequestError(item.error)
                out = acc.apply(item, time.monotonic())
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._owner.pop(request_id, None)
            engine.inflight.discard(request_id)
            if not finished and self._dead is None:
                try:
                    self._send(engine, ["abort", request_id])
                except EngineDeadError:
                    pass

    async def abort(self, request_id: str) -> None:
        engine = self._owner.get(request_id)
        if engine is not None and self._dead is None:
            self._send(engine, ["abort", request_id])

    async def shutdown(self) -> None:
        if not self._engines:
            return
        self._closing = True
        for e in self._engines:
            try:
                e.send(["shutdown"])
            except (OSError, ValueError):
                pass
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for e in self._engines:
            await loop.run_in_executor(None, e.proc.join, max(0.0, deadline - time.monotonic()))
            if e.proc.is_alive():
                logger.warning("engine process %d did not stop within %.0f s; killing it", e.dp_rank,
                               SHUTDOWN_GRACE_S)
                e.proc.kill()  # its TP workers follow it (they watch their parent)
                await loop.run_in_executor(None, e.proc.join, 2.0)
