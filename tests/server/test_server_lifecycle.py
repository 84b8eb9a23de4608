"""The server's processes live and die together, and /health tells the truth (bundled model, CPU).

* a stalled engine loop (test hook ``MLASERVE_TEST_ENGINE_STALL_S``) turns /health into 503;
* SIGTERM / SIGINT to a busy server, or SIGKILL to its front end alone: within 10 s no
  process of it is left (checked by PID);
* a killed engine process makes the server exit non-zero within 10 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.server.live_server import LiveServers, descendants, selected_tests

pytestmark = pytest.mark.slow

SERVE = ("--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "8", "--disable-log-stats")
EXIT_BOUND_S = 10.0


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read()


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if running(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if running(p)]


def keep_busy(url: str, stop: threading.Event) -> list[threading.Thread]:
    """Long generations (streamed and not) that keep every engine slot busy until ``stop``."""

    def client(stream: bool) -> None:
        body = {"prompt": "1+2=", "max_tokens": 100, "n": 2, "ignore_eos": True, "stream": stream}
        while not stop.is_set():
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                    for _ in r.iter_bytes():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                return

    threads = [threading.Thread(target=client, args=(i % 2 == 0,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    return threads


def wait_busy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=5).text
        if any(line.startswith("vllm:num_requests_running") and not line.endswith(" 0.0")
               for line in text.splitlines()):
            return
        time.sleep(0.1)
    raise AssertionError("the engine never became busy")


# "stalled": the engine loop is stuck (test hook) and reads no message, so only the
# engine's parent watchdog or the front end's kill after its grace period can end it.
STALLED_ENV = {"MLASERVE_TEST_ENGINE_STALL_S": "120"}
CASES = [(signal.SIGTERM, "busy"), (signal.SIGINT, "busy"), (signal.SIGTERM, "stalled"),
         (signal.SIGKILL, "busy"), (signal.SIGKILL, "stalled")]
# a 4 s stall of the first iteration with work, reported after 1 s
STALL_503_ENV = {"MLASERVE_TEST_ENGINE_STALL_S": "4", "MLASERVE_ENGINE_ITERATION_TIMEOUT_S": "1"}


def _server_options(item, logs) -> dict:
    """The ``live_server_process`` options of a test's server (every one serves ``SERVE``)."""
    if item.originalname == "test_no_process_outlives_the_server":
        stalled = item.callspec.params["engine_state"] == "stalled"
        return dict(env=STALLED_ENV if stalled else None, may_exit=True, log_path=str(logs / f"{item.name}.log"))
    if item.originalname == "test_killed_engine_makes_the_server_exit_nonzero":
        return dict(may_exit=True)
    return dict(env=STALL_503_ENV)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    """The selected tests' servers by test name, each started while the test before it runs."""
    logs = tmp_path_factory.mktemp("server-logs")
    pool = LiveServers({item.name: (SERVE, _server_options(item, logs)) for item in selected_tests(request)})
    yield pool
    pool.close()


@pytest.mark.parametrize("sig,engine_state", CASES, ids=[f"{s.name}-{e}" for s, e in CASES])
def test_no_process_outlives_the_server(servers, request, sig, engine_state):
    """SIGTERM / SIGINT to the server, or SIGKILL to its front end alone (its engine is never
    told): within 10 s no process of it runs."""
    log_path = servers.options[request.node.name]["log_path"]
    with servers.use(request.node.name) as (url, proc):
        stop = threading.Event()
        threads = keep_busy(url, stop)
        try:
            if engine_state == "busy":
                wait_busy(url)
            else:
                time.sleep(1.0)  # the requests reach the engine, which stalls on them
            pids = [proc.pid] + descendants(proc.pid)
            assert len(pids) >= 2, "no engine process found"
            t0 = time.monotonic()
            os.kill(proc.pid, sig)
            left = wait_gone(pids, EXIT_BOUND_S)
            assert not left, f"still running {time.monotonic() - t0:.1f} s after {sig.name}: {left}"
            print(f"{sig.name} ({engine_state}): every process gone after {time.monotonic() - t0:.1f} s")
            proc.wait(5)
            if sig != signal.SIGKILL:  # a clean stop: exit code 0, no traceback
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    log = f.read()
                assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
        finally:
            stop.set()
            for t in threads:
                t.join(10)


def test_killed_engine_makes_the_server_exit_nonzero(servers, request):
    with servers.use(request.node.name) as (_, proc):
        engine = next(p for p in descendants(proc.pid) if "resource_tracker" not in cmdline(p))
        os.kill(engine, signal.SIGKILL)
        try:
            proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 10 s of its engine's death")
        assert proc.returncode != 0


def test_stalled_engine_loop_turns_health_503(servers, request):
    with servers.use(request.node.name) as (url, _):
        assert httpx.get(url + "/health").status_code == 200
        result: dict = {}

        def send() -> None:
            result["r"] = httpx.post(url + "/v1/completions", json={"prompt": "1+2=", "max_tokens": 2}, timeout=60)

        t = threading.Thread(target=send)
        t.start()
        deadline = time.monotonic() + 3.5
        health = None
        while time.monotonic() < deadline:
            health = httpx.get(url + "/health", timeout=5)
            if health.status_code == 503:
                break
            time.sleep(0.1)
        assert health is not None and health.status_code == 503, "a stalled engine still reported healthy"
        err = health.json()["error"]
        assert err["code"] == 503 and "has not completed an iteration" in err["message"]
        age = [line for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith("mlaserve:engine_heartbeat_age_seconds{")]
        assert age and float(age[0].rsplit(" ", 1)[1]) > 1.0, age
        t.join(30)
        assert result["r"].status_code == 200  # the stall ends; the request completes
        assert httpx.get(url + "/health").status_code == 200
