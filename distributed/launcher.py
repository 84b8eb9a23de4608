"""Start one worker process per rank of this node and watch them.

Workers are *spawned* (not forked: CUDA and threads do not survive fork), each with its
rendezvous environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) present from
interpreter start. On GPU every worker sees all local GPUs and pins ``cuda:LOCAL_RANK``
(NCCL/CUDA IPC between processes need the peers visible). A monitor thread waits on the
workers' sentinels so a crashed or killed worker is noticed at once: the failure callback
runs and the remaining workers are terminated (SIGTERM, then SIGKILL after a grace period),
instead of the survivors hanging in a collective. Workers also exit when the launcher dies.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from distributed.parallel_state import NVLS_OFF_ENV, ParallelConfig

DEFAULT_GRACE_S = 4.0
_env_lock = threading.Lock()


class WorkerFailedError(RuntimeError):
    """A worker exited with a non-zero code or was killed by a signal."""


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    exitcode: int

    def describe(self) -> str:
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"worker rank {self.rank} was killed by {name}"
        return f"worker rank {self.rank} exited with code {self.exitcode}"


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_env(rank: int, local_rank: int, parallel_config: ParallelConfig, on_cpu: bool) -> dict[str, str]:
    """The environment one worker starts with."""
    env = {
        "MASTER_ADDR": parallel_config.master_addr,
        "MASTER_PORT": str(parallel_config.master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(parallel_config.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(parallel_config.local_world_size),
        **NVLS_OFF_ENV,
    }
    if on_cpu:
        env["OMP_NUM_THREADS"] = "1"  # N ranks on one host must not oversubscribe the cores
    return env


def _worker_main(fn: Callable, rank: int, world_size: int, local_rank: int,
                 parallel_config: ParallelConfig, env: dict[str, str], args: tuple) -> None:
    # Also set here: a forkserver child inherits the server's env, not ours at start time,
    # and may have imported torch already (then OMP_NUM_THREADS alone would be too late).
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    _exit_with_parent()
    # Ctrl-C reaches the whole process group: the launcher handles it (and a worker whose
    # launcher is gone ends itself), so no worker prints a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fn(rank, world_size, local_rank, parallel_config, *args)


def _exit_with_parent() -> None:
    """Kill this worker if the launcher goes away (orphans would hold GPUs and ports)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class WorkerGroup:
    """Handle to this node's workers: join, failure detection, terminate.

    Liveness is read from the process sentinels (select, consumes nothing); reaping is
    serialised under one lock because two threads reaping the same child corrupt its exit
    code (forkserver reads it from a pipe once; waitpid succeeds once).
    """

    def __init__(self, processes: list, ranks: list[int], join_timeout_s: float | None,
                 on_failure: Callable[[WorkerFailure], None] | None, terminate_on_failure: bool,
                 grace_s: float) -> None:
        self.processes = processes
        self.ranks = ranks
        self.join_timeout_s = join_timeout_s
        self.grace_s = grace_s
        self._on_failure = on_failure
        self._terminate_on_failure = terminate_on_failure
        self._failure: WorkerFailure | None = None
        self._stopping = False
        self._lock = threading.Lock()  # failure / stopping state
        self._reap_lock = threading.RLock()  # process reaping and signalling
        self._failed = threading.Event()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="worker-monitor", daemon=True)
        self._monitor.start()

    @property
    def failure(self) -> WorkerFailure | None:
        """The first worker failure seen (None while all are healthy or exited cleanly)."""
        return self._failure

    @property
    def exitcodes(self) -> dict[int, int | None]:
        """{rank: exit code}, None for a worker still running."""
        done = self._exited()
        return {r: self._reap(p) if p.sentinel in done else None
                for r, p in zip(self.ranks, self.processes)}

    def is_alive(self) -> bool:
        """True while any worker is still running."""
        return len(self._exited()) < len(self.processes)

    def wait_for_failure(self, timeout: float | None = None) -> WorkerFailure | None:
        self._failed.wait(timeout)
        return self._failure

    def _exited(self, timeout: float = 0.0) -> set:
        return set(mp.connection.wait([p.sentinel for p in self.processes], timeout))

    def _reap(self, proc) -> int:
        """Exit code of a worker whose sentinel is ready."""
        with self._reap_lock:
            proc.join(5.0)
            return proc.exitcode

    def _watch(self) -> None:
        pending = {p.sentinel: (r, p) for r, p in zip(self.ranks, self.processes)}
        while pending:
            ready = mp.connection.wait(list(pending) + [self._wake_r])
            if self._wake_r in ready:
                return
            for s in ready:
                rank, proc = pending.pop(s)
                code = self._reap(proc)
                if code != 0 and not self._stopping:
                    self._report(WorkerFailure(rank, code))

    def _report(self, failure: WorkerFailure) -> None:
        with self._lock:
            if self._failure is not None or self._stopping:
                return
            self._failure = failure
        self._failed.set()
        if self._on_failure is not None:
            try:
                self._on_failure(failure)
            except Exception:  # a broken callback must not stop the cleanup below
                pass
        if self._terminate_on_failure:
            self.terminate()

    def join(self, timeout: float | None = None) -> dict[int, int]:
        """Wait for every worker to exit; returns {rank: exitcode}.

        Raises :class:`WorkerFailedError` as soon as one worker fails (the rest are
        terminated), or :class:`TimeoutError` (after terminating all) when ``timeout``
        (default: the spawn's ``join_timeout_s``) passes first.
        """
        timeout = self.join_timeout_s if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._failure is not None:
                self.terminate()
                raise WorkerFailedError(self._failure.describe())
            if not self.is_alive():
                codes = self.exitcodes
                for r, code in codes.items():  # the monitor may not have looked yet
                    if code != 0 and not self._stopping:
                        self._report(WorkerFailure(r, code))
                if self._failure is not None:
                    raise WorkerFailedError(self._failure.describe())
                return codes
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.terminate()
                raise TimeoutError(f"workers {self.ranks} did not finish within {timeout:g} s")
            self._failed.wait(0.05 if left is None else min(0.05, left))

    def terminate(self, grace_s: float | None = None) -> None:
        """SIGTERM every live worker, SIGKILL those still alive after ``grace_s``."""
        grace_s = self.grace_s if grace_s is None else grace_s
        with self._lock:
            self._stopping = True
        with self._reap_lock:
            for p in self.processes:
                if p.sentinel not in self._exited():
                    p.terminate()
        deadline = time.monotonic() + grace_s
        while self.is_alive() and time.monotonic() < deadline:
            self._exited(min(0.05, max(0.0, deadline - time.monotonic())))
        with self._reap_lock:
            for p in self.processes:
                if p.sentinel not in self._exited():
                    p.kill()
        while self.is_alive():
            self._exited(0.05)
        for p in self.processes:
            self._reap(p)
        if threading.current_thread() is not self._monitor:
            try:
                self._wake_w.send_bytes(b"x")
            except OSError:
                pass

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()


def spawn_workers(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    parallel_config: ParallelConfig | None = None,
    start_method: str = "spawn",
    join_timeout_s: float | None = None,
    device: str = "auto",
    on_failure: Callable[[WorkerFailure], None] | None = None,
    terminate_on_failure: bool = True,
    grace_s: float = DEFAULT_GRACE_S,
    local_ranks: list[int] | None = None,
) -> WorkerGroup:
    """Start this node's ranks; each runs ``fn(rank, world_size, local_rank, parallel_config, *args)``.

    ``fn`` and ``args`` must be picklable (a module-level function). On node ``i`` of
    ``nnodes`` the global ranks are ``i·L .. i·L+L-1`` with L = world_size / nnodes.
    ``device``: "cpu", "cuda" or "auto" (cuda when available). ``on_failure`` runs on the
    monitor thread when a worker dies with a non-zero code. ``local_ranks`` starts only those
    local ranks (the engine process itself is local rank 0 when it drives TP workers).
    """
    cfg = parallel_config or ParallelConfig(tp_size=world_size)
    if world_size != cfg.world_size:
        raise ValueError(f"world_size {world_size} != TP {cfg.tp_size} x DP {cfg.dp_size}")
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    local = cfg.local_world_size
    if device == "cuda":
        import torch
        if torch.cuda.device_count() < local:
            raise ValueError(f"{local} workers per node need {local} GPUs, "
                             f"{torch.cuda.device_count()} visible")
    ctx = mp.get_context(start_method)
    processes, ranks = [], []
    try:
        for local_rank in (range(local) if local_ranks is None else local_ranks):
            rank = cfg.global_rank(local_rank)
            env = worker_env(rank, local_rank, cfg, on_cpu=device == "cpu")
            proc = ctx.Process(target=_worker_main, name=f"mlaserve-worker-{rank}", daemon=True,
                               args=(fn, rank, world_size, local_rank, cfg, env, tuple(args)))
            with _env_lock:  # the child's interpreter starts with this environment
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    proc.start()
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
            processes.append(proc)
            ranks.append(rank)
    except BaseException:
        for p in processes:
            p.kill()
            p.join()
        raise
    return WorkerGroup(processes, ranks, join_timeout_s, on_failure, terminate_on_failure, grace_s)
