"""How an engine process (and each of its TP workers) joins a parallel job and stays in step.

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

The TP worker processes themselves are in ``server/tp_worker.py``; the process groups and
collectives underneath are ``distributed/``.
"""

from __future__ import annotations

import torch

from distributed import comm
from distributed.parallel_state import (
    ParallelConfig, get_dp_group, get_ep_group, get_tp_group, get_world_group, init_distributed,
)
from model.parallel import ParallelContext
from server import envs
from server.runner_setup import resolve_device


def check_supported(config) -> None:
    """Layouts this build can run; anything else is a clear error naming the flag."""
    if config.data_parallel_size > 1 and config.nnodes > 1:
        raise ValueError(
            "--data-parallel-size > 1 with --nnodes > 1 is not supported yet (every DP engine "
            "runs on node 0); use one node, or --tensor-parallel-size across nodes"
        )


def engine_device(config, local_rank: int) -> torch.device:
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
    return int(comm.all_reduce(t, tp.cpu_view(), op="min")[0])


def init_engine_rank(config, rank: int, local_rank: int) -> ParallelConfig:
    pcfg = ParallelConfig.from_engine_config(config)
    backend = "nccl" if engine_device(config, local_rank).type == "cuda" else "gloo"
    init_distributed(rank, pcfg.world_size, local_rank, pcfg, backend=backend,
                     timeout_s=envs.MLASERVE_DIST_INIT_TIMEOUT)
    return pcfg


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


def receive_plans(runner) -> None:
    """A TP worker's side: run every plan (or dummy step) rank 0 broadcasts, until "stop"."""
    group = get_tp_group()
    while True:
        msg = comm.broadcast_object(None, group, src=0)
        if msg[0] == "stop":
            return
        if msg[0] == "dummy":
            runner.dummy_step()
        else:
            runner.run_plan(runner.plan_class.from_wire(msg[1]))


class DPSync:
    """Per-iteration agreement of the DP engines: (anyone busy?, anyone stopping?)."""

    def __init__(self) -> None:
        self.group = get_dp_group().cpu_view()

    def __call__(self, busy: bool, stop: bool) -> tuple[bool, bool]:
        flags = torch.tensor([int(busy), int(stop)], dtype=torch.int64)
        out = comm.all_reduce(flags, self.group, op="max")
        return bool(out[0]), bool(out[1])
