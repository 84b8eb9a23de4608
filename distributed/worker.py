"""Engine ranks and TP workers: how a parallel engine is set up and kept in lockstep.

Layout (world = DP × TP, rank = dp·TP + tp):

* each DP rank has one *engine process* (TP rank 0 of its group): it owns the scheduler and
  KV-block manager, and per step sends its TP workers a compact plan (``StepPlan``: token
  ids, positions, block tables — plain lists as msgpack over the gloo CPU group, no
  pickle). Every TP rank runs the same forward on its shard; only the engine samples.
* DP ranks run attention on their own requests (heads sharded over their TP group);
  the engines agree every loop iteration (one all-reduce on the DP CPU group) whether anyone
  has work or wants to stop, and a DP rank with nothing to do runs a dummy step (its TP
  workers too, told by a "dummy" message) so the MoE collectives over all DP × TP ranks
  always match. The MoE holds whole experts per rank with --enable-expert-parallel, else a
  slice of every expert (vLLM's default for DP).
"""

from __future__ import annotations

import logging
import os

import torch

from distributed import comm
from distributed.parallel_state import (
    ParallelConfig, get_dp_group, get_ep_group, get_tp_group, get_world_group, init_distributed,
)
from model.parallel import ParallelContext

logger = logging.getLogger(__name__)


def check_supported(config) -> None:
    """Layouts this build can run; anything else is a clear error naming the flag."""
    if config.data_parallel_size > 1 and config.nnodes > 1:
        raise ValueError(
            "--data-parallel-size > 1 with --nnodes > 1 is not supported yet (every DP engine "
            "runs on node 0); use one node, or --tensor-parallel-size across nodes"
        )


def engine_device(config, local_rank: int) -> torch.device:
    from server.engine_core import resolve_device

    device = resolve_device(config)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def parallel_context(config) -> ParallelContext:
    """The model's view of the groups this rank belongs to.

    DP > 1: every MoE layer spans all DP × TP ranks, holding whole experts per rank with
    --enable-expert-parallel, else a slice of every expert (vLLM's default), and tokens are
    dispatched across the DP ranks. DP = 1 with --enable-expert-parallel: the EP group is the
    TP group, every TP rank already holds all rows and the TP reduction sums the experts'
    partial outputs (no dispatch).
    """
    tp, ep = get_tp_group(), get_ep_group()
    if config.data_parallel_size > 1:
        return ParallelContext.from_groups(
            tp, ep if config.enable_expert_parallel else get_world_group(), tp_reduction=config.tp_reduction,
            dispatch_moe=True, moe_tensor_parallel=not config.enable_expert_parallel,
        )
    use_ep = config.enable_expert_parallel and ep.world_size > 1
    return ParallelContext.from_groups(tp, ep if use_ep else None, tp_reduction=config.tp_reduction)


def agree_num_blocks(num_blocks: int) -> int:
    """Every TP rank holds the same (replicated) latent cache: take the smallest capacity."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return num_blocks
    t = torch.tensor([num_blocks], dtype=torch.int64)
    return int(comm.all_reduce(t, _cpu_view(tp), op="min")[0])


def _cpu_view(group):
    """The same ranks, seen through the gloo CPU group (for small control tensors)."""
    import copy

    view = copy.copy(group)
    view.device_group = group.cpu_group
    view.backend = "gloo"
    return view


def init_engine_rank(config, rank: int, local_rank: int) -> ParallelConfig:
    pcfg = ParallelConfig.from_engine_config(config)
    backend = "nccl" if engine_device(config, local_rank).type == "cuda" else "gloo"
    init_distributed(rank, pcfg.world_size, local_rank, pcfg, backend=backend,
                     timeout_s=float(os.environ.get("MLASERVE_DIST_INIT_TIMEOUT", "120")))
    return pcfg


def start_tp_workers(config, model_dir: str, dp_rank: int, on_failure):
    """Spawn TP ranks 1..TP-1 of this DP group (on this node) before joining the rendezvous."""
    from distributed.launcher import spawn_workers

    tp = config.tensor_parallel_size
    if tp == 1:
        return None
    pcfg = ParallelConfig.from_engine_config(config)
    local = [dp_rank * tp + t for t in range(1, tp) if (dp_rank * tp + t) // pcfg.local_world_size == pcfg.node_rank]
    local = [r % pcfg.local_world_size for r in local]
    device = "cuda" if engine_device(config, 0).type == "cuda" else "cpu"
    return spawn_workers(tp_worker_main, pcfg.world_size, (config, model_dir), pcfg, device=device,
                         local_ranks=local, on_failure=on_failure)


class PlanBroadcaster:
    """Rank 0's side of the control plane: one msgpack message per step to the TP group."""

    def __init__(self) -> None:
        self.group = get_tp_group()

    def __call__(self, plan) -> None:
        comm.broadcast_object(["plan", plan.to_wire()], self.group, src=0)

    def dummy(self) -> None:
        """An idle DP rank's step: its TP workers join the dummy forward's collectives."""
        comm.broadcast_object(["dummy"], self.group, src=0)

    def stop(self) -> None:
        comm.broadcast_object(["stop"], self.group, src=0)


def tp_worker_main(rank: int, world_size: int, local_rank: int, pcfg: ParallelConfig, config, model_dir: str) -> None:
    """A TP rank > 0: load this rank's shard, then run every plan rank 0 sends until "stop"."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{rank} %(levelname)s %(message)s")
    from model.loader import load_model
    from server.runner import ModelRunner, StepPlan, determine_num_blocks

    init_engine_rank(config, rank, local_rank)
    device = engine_device(config, local_rank)
    model = load_model(model_dir, dtype=config.dtype, device=device, par=parallel_context(config), progress=False,
                       load_format=config.load_format, seed=config.seed)
    from server.cuda_graphs import maybe_capture
    from server.engine_core import resolve_max_model_len

    max_len = resolve_max_model_len(config, model.config)
    num_blocks = agree_num_blocks(determine_num_blocks(config, model.config, model.dtype, device,
                                                       model=model, max_model_len=max_len))
    runner = ModelRunner(model, config, num_blocks, device)
    capacity = num_blocks * config.block_size
    runner.decode_graphs = maybe_capture(runner, config, min(max_len, capacity))
    group = get_tp_group()
    while True:
        msg = comm.broadcast_object(None, group, src=0)
        if msg[0] == "stop":
            break
        if msg[0] == "dummy":
            runner.dummy_step()
        else:
            runner.run_plan(StepPlan.from_wire(msg[1]))
    from distributed.parallel_state import destroy_distributed

    destroy_distributed()  # a clean exit (a process group left to the interpreter can abort)


class DPSync:
    """Per-iteration agreement of the DP engines: (anyone busy?, anyone stopping?)."""

    def __init__(self) -> None:
        self.group = _cpu_view(get_dp_group())

    def __call__(self, busy: bool, stop: bool) -> tuple[bool, bool]:
        flags = torch.tensor([int(busy), int(stop)], dtype=torch.int64)
        out = comm.all_reduce(flags, self.group, op="max")
        return bool(out[0]), bool(out[1])


def run_headless_node(config, model_dir: str) -> int:
    """``--node-rank`` > 0: run this node's TP workers (no API, no scheduler) until rank 0 stops."""
    from distributed.launcher import WorkerFailedError, spawn_workers

    try:
        check_supported(config)
    except ValueError as exc:
        logger.error("%s", exc)
        return 1
    pcfg = ParallelConfig.from_engine_config(config)
    device = "cuda" if engine_device(config, 0).type == "cuda" else "cpu"
    group = spawn_workers(tp_worker_main, pcfg.world_size, (config, model_dir), pcfg, device=device)
    try:
        group.join()
    except WorkerFailedError as exc:
        logger.error("%s", exc)
        return 1
    return 0
