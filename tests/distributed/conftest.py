"""Helpers for the multi-process (gloo, CPU) distributed tests."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from distributed.launcher import find_free_port, spawn_workers
from distributed.parallel_state import ParallelConfig


# Workers fork from one server that imported torch once, instead of each spawned worker
# importing it again (seconds per process on a small CPU box).
START_METHOD = "forkserver"
mp.get_context(START_METHOD).set_forkserver_preload(
    ["torch", "torch.distributed", "msgpack", "distributed.comm", "distributed.launcher"])


def _run_spawned(fn, world_size: int, out_dir: Path, *args, tp_size: int | None = None,
                 dp_size: int = 1, enable_expert_parallel: bool = False,
                 timeout_s: float = 60.0) -> list:
    cfg = ParallelConfig(tp_size=tp_size or world_size // dp_size, dp_size=dp_size,
                         enable_expert_parallel=enable_expert_parallel,
                         master_port=find_free_port())
    group = spawn_workers(fn, world_size, (str(out_dir), *args), cfg, device="cpu",
                          start_method=START_METHOD, join_timeout_s=timeout_s)
    group.join()
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="session")
def start_method() -> str:
    return START_METHOD


@pytest.fixture(scope="session")
def run_spawned():
    """``run_spawned(fn, world_size, out_dir, *args, tp_size=, dp_size=, ...)`` runs
    ``fn(rank, world_size, local_rank, cfg, out_dir, *args)`` on every rank (spawned, CPU,
    gloo) and returns the JSON each rank wrote to ``out_dir/rank{r}.json``, in rank order."""
    return _run_spawned
