"""A real ``python -m server serve`` subprocess on a free loopback port, for end-to-end tests.

    with live_server("--kv-cache-dtype", "fp8") as base_url:
        httpx.post(f"{base_url}/v1/completions", json={...})

Readiness needs two things: ``GET /health`` answers 200 *and* our own process logged that
uvicorn bound the port. The second guards against a port race on a shared machine: another
process could grab the free port we picked, answer ``/health`` itself, while our server fails to
bind and exits. A bind failure ("address already in use") is retried on a fresh port.

The server runs in its own session (process group) so that its engine processes are ended
with it. Its stdout and stderr go to a file, never a pipe (a full pipe would stall it); the
log's tail is put in the failure message when it dies or never becomes healthy, and printed to
stderr when the ``with`` body raises (pytest shows it with the failing test).

``OMP_NUM_THREADS=1`` unless ``env`` sets it: on a small shared CPU box, torch's default of
one intra-op thread per core makes every parallel region wait for a thread that another
process has descheduled. Measured on 2 busy cores with the bundled model: a round of 1,000
lm-eval-like requests took 96-137 s (single requests up to 24 s) with 2 threads, 5-7 s with 1.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = "127.0.0.1"
LOG_TAIL_LINES = 60
BIND_RETRIES = 3


class LiveServerError(RuntimeError):
    """The server died, never became healthy, or could not bind a port."""


def free_port(host: str = HOST) -> int:
    """A port the kernel reports free right now (it may be taken before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (progress-bar carriage returns made newlines)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        return f"(log unreadable: {e})"
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of every listening TCP socket on this host."""
    out = {}
    for path, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            addr_hex, port_hex = f[1].split(":")
            raw = bytes.fromhex(addr_hex)
            if family == 4:
                addr = ".".join(str(b) for b in raw[::-1])
            else:
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = str(ipaddress.IPv6Address(words))
            out[int(f[9])] = (addr, int(port_hex, 16))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _listening_unix_inodes() -> dict[int, tuple[str, int]]:
    """{socket inode: ("unix:" + path, 0)} of every listening Unix-domain socket on this host."""
    out = {}
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
                out[int(fields[6])] = ("unix:" + (fields[7] if len(fields) > 7 else ""), 0)
    return out


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP or Unix socket that one of ``pids`` holds
    (Unix sockets as ("unix:PATH", 0))."""
    listening = {**_listening_inodes(), **_listening_unix_inodes()}
    return [(pid, *listening[inode]) for pid in pids for inode in _socket_inodes(pid) if inode in listening]


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, SIGKILL it if it has not exited after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    # Engine processes outlive a parent that exited on its own; the group id is still ours.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)


def _bound_line(host: str, port: int) -> str:
    return f"Uvicorn running on http://{host}:{port}"


def _wait_ready(proc: subprocess.Popen, log_path: str, base_url: str, host: str, port: int,
                timeout_s: float) -> str | None:
    """None when ready; "bind" when the port was taken; raises LiveServerError otherwise."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                tail = log_tail(log_path)
                if "address already in use" in tail.lower():
                    return "bind"
                raise LiveServerError(f"server exited with code {proc.returncode} before becoming "
                                      f"healthy; log tail:\n{tail}")
            healthy = False
            with contextlib.suppress(httpx.HTTPError):
                healthy = client.get(f"{base_url}/health").status_code == 200
            if healthy and _bound_line(host, port) in log_tail(log_path, 10_000):
                return None
            if time.monotonic() > deadline:
                raise LiveServerError(f"server not healthy after {timeout_s:.0f} s at {base_url}; "
                                      f"log tail:\n{log_tail(log_path)}")
            time.sleep(0.2)


@contextlib.contextmanager
def live_server(*serve_args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None,
                log_path: str | None = None) -> Iterator[str]:
    """:func:`live_server_process`, yielding only the base URL."""
    with live_server_process(*serve_args, timeout_s=timeout_s, env=env, log_path=log_path) as (url, _):
        yield url


@contextlib.contextmanager
def live_server_process(*serve_args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None,
                        log_path: str | None = None, may_exit: bool = False,
                        ) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``python -m server serve *serve_args --host 127.0.0.1 --port P``; yield
    (``http://127.0.0.1:P``, the server process). ``may_exit``: the body may end the server
    (failure tests); otherwise a server that exited while in use is an error.

    ``serve_args`` must not contain ``--host``/``--port`` or a ``--uvicorn-log-level`` above
    info (readiness reads uvicorn's "running on" line). ``env`` entries are added to the
    current environment. The server is always stopped on exit.
    """
    for flag in ("--host", "--port"):
        if any(a == flag or a.startswith(flag + "=") for a in serve_args):
            raise ValueError(f"live_server picks {flag} itself; do not pass it")
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix="mlaserve-live-", suffix=".log")
        os.close(fd)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    keep_log = False  # kept only when the with-body failed (the message names it)
    try:
        for _attempt in range(BIND_RETRIES):
            port = free_port()
            base_url = f"http://{HOST}:{port}"
            cmd = [sys.executable, "-m", "server", "serve", *serve_args, "--host", HOST, "--port", str(port)]
            with open(log_path, "w", encoding="utf-8") as log:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                if _wait_ready(proc, log_path, base_url, HOST, port, timeout_s) == "bind":
                    continue
                try:
                    yield base_url, proc
                except BaseException:
                    keep_log = True
                    sys.stderr.write(f"---- server log tail ({' '.join(cmd)}; full log {log_path}) ----\n"
                                     f"{log_tail(log_path)}\n")
                    raise
                if proc.poll() is not None and not may_exit:
                    raise LiveServerError(f"server exited with code {proc.returncode} while in use; "
                                          f"log tail:\n{log_tail(log_path)}")
                return
            finally:
                _stop(proc)
        raise LiveServerError(f"could not bind a free port in {BIND_RETRIES} attempts; log tail:\n"
                              f"{log_tail(log_path)}")
    finally:
        if own_log and not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(log_path)


class LiveServers:
    """:func:`live_server_process` servers started ahead of the tests that use them, ``ahead``
    at a time in the order given: a server starts one process after another, on one core, so
    the next one starts on the other core while a test uses this one.

        servers = LiveServers({"a": (("--device", "cpu"), {}), "b": (("--device", "cpu"), {"env": ...})})
        with servers.use("a") as (url, proc):  # waits until a is ready; a stops at the block's end
            ...
        servers.close()  # at the fixture's end: stops the servers no test used
    """

    def __init__(self, servers: dict[Hashable, tuple[tuple[str, ...], dict]], ahead: int = 2) -> None:
        self.options = {key: kwargs for key, (_, kwargs) in servers.items()}
        self._closed = False
        self._ready: dict[Hashable, Future] = {key: Future() for key in servers}
        self._stop = {key: threading.Event() for key in servers}
        self._failed: dict[Hashable, BaseException | None] = dict.fromkeys(servers)
        self._pool = ThreadPoolExecutor(ahead)
        self._runs = {key: self._pool.submit(self._serve, key, args, kwargs) for key, (args, kwargs) in servers.items()}

    def _serve(self, key: Hashable, args: tuple[str, ...], kwargs: dict) -> None:
        ready = self._ready[key]
        if self._closed:
            ready.cancel()
            return
        try:
            with live_server_process(*args, **kwargs) as server:
                ready.set_result(server)
                self._stop[key].wait()
                if self._failed[key] is not None:  # raised inside the block: the log tail is printed, the log kept
                    raise LiveServerError(f"the test using this server failed: {self._failed[key]!r}"[:500])
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            raise

    @contextlib.contextmanager
    def use(self, key: Hashable) -> Iterator[tuple[str, subprocess.Popen]]:
        """(base URL, server process) of ``key``'s server once it is ready; the server stops
        when the block ends (an error in the block or the server's own, as with
        :func:`live_server_process`, raises here)."""
        server = self._ready[key].result()
        try:
            yield server
        except BaseException as e:
            self._failed[key] = e
            raise
        finally:
            self._stop[key].set()
            stopped = self._runs[key].exception()  # waits until the server has stopped
            if self._failed[key] is None and stopped is not None:
                raise stopped

    def close(self) -> None:
        """Stop the servers no test used (those not started never start)."""
        self._closed = True
        for stop in self._stop.values():
            stop.set()
        self._pool.shutdown(wait=True)


def selected_tests(request) -> list:
    """The selected test items of the requesting fixture's module that use that fixture, in
    the order they run (what a module fixture of :class:`LiveServers` should start)."""
    return [item for item in request.session.items
            if item.module is request.module and request.fixturename in item.fixturenames]
