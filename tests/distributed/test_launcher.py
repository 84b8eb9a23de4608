"""distributed/launcher.py: worker env, join, failure detection and termination (CPU)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed.comm import all_reduce
from distributed.launcher import WorkerFailedError, find_free_port, spawn_workers
from distributed.parallel_state import ParallelConfig, destroy_distributed, get_world_group, init_distributed

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS",
            "NCCL_NVLS_ENABLE")


def _spawn(start_method, fn, world_size, args, cfg=None, **kw):
    cfg = cfg or ParallelConfig(tp_size=world_size, master_port=find_free_port())
    return spawn_workers(fn, world_size, args, cfg, device="cpu", start_method=start_method, **kw)


def _env_worker(rank, world_size, local_rank, cfg, out_dir):
    info = {k: os.environ.get(k) for k in ENV_KEYS}
    info.update(args=[rank, world_size, local_rank], threads=torch.get_num_threads())
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(info))


@pytest.mark.parametrize("method, world", [("conftest", 2), ("spawn", 1)])
def test_env_and_clean_join(tmp_path, start_method, method, world):
    """The worker environment is in place from interpreter start ("spawn", the production
    default; one worker to keep it quick) and under the tests' forkserver."""
    port = find_free_port()
    group = _spawn(start_method if method == "conftest" else method, _env_worker, world,
                   (str(tmp_path),), ParallelConfig(tp_size=world, master_port=port), join_timeout_s=60)
    assert group.join() == dict.fromkeys(range(world), 0)
    assert group.failure is None
    for r in range(world):
        info = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert info == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                        "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "OMP_NUM_THREADS": "1",
                        "NCCL_NVLS_ENABLE": "0", "args": [r, world, r], "threads": 1}
    assert os.environ.get("WORLD_SIZE") != str(world)  # the launcher's own env is restored


def _killed_worker(rank, world_size, local_rank, cfg, out_dir):
    init_distributed(rank, world_size, local_rank, cfg, backend="gloo", timeout_s=20,
                     collective_timeout_s=60)
    if rank == 1:
        (Path(out_dir) / "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(torch.ones(1), get_world_group())  # blocks: rank 1 never arrives


def test_sigkilled_worker_is_detected_and_peers_terminated(tmp_path, start_method):
    seen = []
    group = _spawn(start_method, _killed_worker, 3, (str(tmp_path),),
                   on_failure=lambda f: seen.append((f, time.time())),
                   join_timeout_s=30, grace_s=1.0)
    with pytest.raises(WorkerFailedError, match="rank 1 was killed by SIGKILL"):
        group.join()
    failure, noticed_at = seen[0]
    assert (failure.rank, failure.exitcode) == (1, -signal.SIGKILL)
    assert noticed_at - float((tmp_path / "killed_at").read_text()) < 2.0
    assert not group.is_alive()
    assert all(code is not None and code != 0 for code in group.exitcodes.values())


def _raising_worker(rank, world_size, local_rank, cfg, out_dir):
    if rank == 0:
        raise RuntimeError("boom")


def test_worker_exception_fails_join(tmp_path, start_method):
    group = _spawn(start_method, _raising_worker, 2, (str(tmp_path),), join_timeout_s=30)
    with pytest.raises(WorkerFailedError, match="rank 0 exited with code 1"):
        group.join()


def _stubborn_worker(rank, world_size, local_rank, cfg, out_dir):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (Path(out_dir) / f"ready{rank}").write_text("")
    time.sleep(60)


def test_join_timeout_terminates_and_kills_after_grace(tmp_path, start_method):
    group = _spawn(start_method, _stubborn_worker, 2, (str(tmp_path),), grace_s=0.5)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        group.join(timeout=0.5)
    assert time.monotonic() - start < 5
    assert group.exitcodes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}  # SIGTERM was ignored
    assert group.failure is None  # deaths we caused are not failures


def _node_worker(rank, world_size, local_rank, cfg, out_dir):
    init_distributed(rank, world_size, local_rank, cfg, backend="gloo", timeout_s=20,
                     collective_timeout_s=20)
    total = all_reduce(torch.tensor([rank + 1]), get_world_group()).item()
    destroy_distributed()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps([local_rank, total]))


def test_two_nodes_on_one_host(tmp_path, start_method):
    """--nnodes 2: each node launches its own ranks and they meet at the same rendezvous."""
    port = find_free_port()
    nodes = [_spawn(start_method, _node_worker, 2, (str(tmp_path),),
                    ParallelConfig(tp_size=2, nnodes=2, node_rank=n, master_port=port), join_timeout_s=30)
             for n in range(2)]
    assert [n.ranks for n in nodes] == [[0], [1]]
    for n in nodes:
        n.join()
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == [0, 3]


def test_find_free_port_binds_loopback():
    port = find_free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # still free
    assert 1 <= port <= 65535


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        spawn_workers(_env_worker, 3, (), ParallelConfig(tp_size=2), device="cpu")
    with pytest.raises(ValueError, match="device"):
        spawn_workers(_env_worker, 2, (), ParallelConfig(tp_size=2), device="tpu")


def _orphan_worker(rank, world_size, local_rank, cfg, out_dir):
    (Path(out_dir) / "pid").write_text(str(os.getpid()))
    time.sleep(60)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie nobody reaped is dead too


@pytest.mark.slow
def test_workers_exit_when_launcher_dies(tmp_path):
    here = Path(__file__).resolve()
    script = f"""
import os, sys, time
sys.path[:0] = [{str(here.parents[2])!r}, {str(here.parent)!r}]
from distributed.launcher import find_free_port, spawn_workers
from distributed.parallel_state import ParallelConfig
import test_launcher
spawn_workers(test_launcher._orphan_worker, 1, ({str(tmp_path)!r},),
              ParallelConfig(master_port=find_free_port()), device="cpu")
deadline = time.monotonic() + 30
while not os.path.exists({str(tmp_path / "pid")!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
os._exit(0)  # die without cleaning up: the worker must notice on its own
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 5
    while not _gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the orphaned worker was still running 5 s after its launcher died")
        time.sleep(0.05)
