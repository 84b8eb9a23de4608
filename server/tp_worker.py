"""TP worker processes: ranks 1..TP-1 of a DP group, each holding one shard of the model.

A worker builds its shard exactly as the engine process does (``build_runner``), then runs
every step plan the engine broadcasts until it is told to stop; it never schedules or
samples. ``--node-rank`` > 0 runs only workers (a headless node).
"""

from __future__ import annotations

import logging

from distributed.launcher import WorkerFailedError, spawn_workers
from distributed.parallel_state import ParallelConfig, destroy_distributed
from server.engine_parallel import (
    agree_num_blocks, check_supported, engine_device, init_engine_rank, parallel_context, receive_plans,
)
from server.runner_setup import build_runner

logger = logging.getLogger(__name__)


def _spawn_device(config) -> str:
    return "cuda" if engine_device(config, 0).type == "cuda" else "cpu"


def start_tp_workers(config, model_dir: str, dp_rank: int, on_failure):
    """Spawn TP ranks 1..TP-1 of this DP group (on this node) before joining the rendezvous."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return None
    pcfg = ParallelConfig.from_engine_config(config)
    local = [dp_rank * tp + t for t in range(1, tp) if (dp_rank * tp + t) // pcfg.local_world_size == pcfg.node_rank]
    local = [r % pcfg.local_world_size for r in local]
    return spawn_workers(tp_worker_main, pcfg.world_size, (config, model_dir), pcfg, device=_spawn_device(config),
                         local_ranks=local, on_failure=on_failure)


def tp_worker_main(rank: int, world_size: int, local_rank: int, pcfg: ParallelConfig, config, model_dir: str) -> None:
    """A TP rank > 0: load this rank's shard, then run every plan rank 0 sends until "stop"."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{rank} %(levelname)s %(message)s")
    try:
        init_engine_rank(config, rank, local_rank)
        setup = build_runner(config, model_dir, engine_device(config, local_rank), par=parallel_context(config),
                             agree_num_blocks=agree_num_blocks, progress=False)
    except Exception as exc:  # a bad checkpoint, too little memory...: the engine reports the same
        logger.error("start-up failed: %s: %s", type(exc).__name__, exc)  # one line, no traceback
        raise SystemExit(1) from None
    receive_plans(setup.runner)
    destroy_distributed()  # a clean exit (a process group left to the interpreter can abort)


def run_headless_node(config, model_dir: str) -> int:
    """``--node-rank`` > 0: run this node's TP workers (no API, no scheduler) until rank 0 stops."""
    try:
        check_supported(config)
    except ValueError as exc:
        logger.error("%s", exc)
        return 1
    pcfg = ParallelConfig.from_engine_config(config)
    group = spawn_workers(tp_worker_main, pcfg.world_size, (config, model_dir), pcfg, device=_spawn_device(config))
    try:
        group.join()
    except WorkerFailedError as exc:
        logger.error("%s", exc)
        return 1
    return 0
