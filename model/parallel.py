"""How the model's layers talk to their peers: ranks, groups and the per-layer reductions.

Tensor parallel (TP > 1), two modes that must give the same results:

* ``reduce_scatter`` (default, "sequence parallel"): the residual stream is split over
  ranks by token rows (the step is padded to a multiple of TP). Each layer all-gathers the
  normed rows before its projections and **reduce-scatters** the row-parallel output back —
  one ReduceScatter when the shards are equal, which is why we pad.
* ``all_reduce``: every rank keeps all rows; each row-parallel output is all-reduced.

Data parallel (DP > 1, ``dispatch_moe``): every DP rank runs attention on its own tokens
(heads sharded over its TP group); each MoE layer all-gathers hidden states and top-k
choices over the MoE group (``ep_*``: every DP × TP rank), runs its share of the experts on
all rows, and reduce-scatters the sums back to their owners. The share is whole experts
(DEP, ``--enable-expert-parallel``) or, by default, a 1/(DP × TP) slice of every expert's
intermediate dim (``moe_tensor_parallel``, vLLM's default for DP without expert
parallelism). Within a TP group each rank sends a different contiguous slice of the rows
(its sequence-parallel shard), so no token reaches the experts twice; the TP reduction that
follows fills in the other slices.

:class:`ParallelContext` is fixed configuration, shared by every layer. What changes per
step (valid rows, every EP rank's row count) is a :class:`StepRows`, built once per forward
by :meth:`ParallelContext.step_rows` and passed down explicitly.

With no groups (world size 1) every hook is the identity and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REDUCTION_MODES = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class StepRows:
    """One step's row layout on this rank.

    ``num_valid``: the step's real rows (before TP padding; pad rows never reach routing).
    ``routed``: [start, stop) of the valid rows this rank routes to the experts (all of them
    unless the MoE dispatches across a TP group). ``ep_rows``: how many rows every EP rank
    dispatches this step (None when the MoE does not dispatch).
    """

    num_valid: int
    routed: tuple[int, int]
    ep_rows: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ParallelContext:
    """The parallel layout every layer shares; fixed at start-up (per-step values live in
    :class:`StepRows`). ``ep_*`` is the MoE group: the ranks one MoE layer's experts are
    spread over (the TP group under TP + --enable-expert-parallel, every DP × TP rank under
    DP > 1)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: object | None = None
    ep_group: object | None = None
    tp_reduction: str = "reduce_scatter"
    dispatch_moe: bool = False  # MoE tokens are all-gathered over the MoE group (DP > 1)
    moe_tensor_parallel: bool = False  # the MoE group splits every expert, not the expert set

    def __post_init__(self) -> None:
        if self.tp_reduction not in REDUCTION_MODES:
            raise ValueError(f"tp_reduction must be one of {REDUCTION_MODES}, got {self.tp_reduction!r}")
        if self.dispatch_moe and self.ep_size == 1:
            raise ValueError("dispatch_moe needs a MoE group of more than one rank")
        if self.moe_tensor_parallel and not self.dispatch_moe:
            raise ValueError("moe_tensor_parallel splits experts over the dispatch group; set dispatch_moe")

    @classmethod
    def from_groups(cls, tp_group, ep_group=None, tp_reduction: str = "reduce_scatter",
                    dispatch_moe: bool = False, moe_tensor_parallel: bool = False):
        ep_rank = ep_group.rank_in_group if ep_group is not None else 0
        ep_size = ep_group.world_size if ep_group is not None else 1
        dispatch = dispatch_moe and ep_size > 1
        return cls(tp_group.rank_in_group, tp_group.world_size, ep_rank, ep_size, tp_group, ep_group,
                   tp_reduction, dispatch, moe_tensor_parallel and dispatch)

    @property
    def sequence_parallel(self) -> bool:
        return self.tp_size > 1 and self.tp_reduction == "reduce_scatter"

    def expert_shard(self) -> tuple[int, int, int, int]:
        """(tp_rank, tp_size, ep_rank, ep_size) of this rank's routed experts: the intermediate
        split and the expert-set split."""
        if self.ep_size == 1:
            return self.tp_rank, self.tp_size, 0, 1
        if self.moe_tensor_parallel:
            return self.ep_rank, self.ep_size, 0, 1
        return 0, 1, self.ep_rank, self.ep_size

    def _comm(self, group, what: str):
        if group is None:
            raise RuntimeError(f"{what} collectives need process groups (distributed.init_distributed)")
        from distributed import comm

        return comm

    # ---- per-step layout -----------------------------------------------------------------------
    def step_rows(self, n: int, device) -> StepRows:
        """The layout of an ``n``-row step. Under dispatch this runs one tiny all-gather over
        the EP group (every rank must call it, idle ones with their dummy row)."""
        if not self.dispatch_moe:
            return StepRows(n, (0, n))
        chunk = -(-n // self.tp_size)  # = padded_rows(n) / TP: this rank's sequence-parallel shard
        start = min(self.tp_rank * chunk, n)
        stop = min(start + chunk, n)
        counts = self._comm(self.ep_group, "MoE dispatch").all_gather(
            torch.tensor([stop - start], dtype=torch.int64, device=device), self.ep_group)
        return StepRows(n, (start, stop), tuple(int(c) for c in counts.tolist()))

    # ---- TP hooks ------------------------------------------------------------------------------
    def padded_rows(self, n: int) -> int:
        return -(-n // self.tp_size) * self.tp_size if self.sequence_parallel else n

    def scatter_partial_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A partial sum over ranks → this rank's reduced rows (SP) or all rows reduced (AR)."""
        if self.tp_size == 1:
            return x
        comm = self._comm(self.tp_group, "tensor-parallel")
        if self.sequence_parallel:
            return comm.reduce_scatter(x, self.tp_group, dim=0)
        return comm.all_reduce(x, self.tp_group)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows → all rows (SP); identity when rows are already replicated."""
        if not self.sequence_parallel:
            return x
        return self._comm(self.tp_group, "tensor-parallel").all_gather(x, self.tp_group, dim=0)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return logits
        return self._comm(self.tp_group, "tensor-parallel").all_gather(logits, self.tp_group, dim=-1)

    # ---- DEP hooks -----------------------------------------------------------------------------
    def dispatch(self, rows: StepRows, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Every EP rank's routed rows, concatenated in EP rank order (the same on all ranks)."""
        comm = self._comm(self.ep_group, "MoE dispatch")
        return [comm.all_gather(t, self.ep_group, dim=0, sizes=rows.ep_rows) for t in tensors]

    def combine(self, rows: StepRows, x: torch.Tensor) -> torch.Tensor:
        """Sum the experts' partial outputs over EP ranks; keep this rank's routed rows."""
        return self._comm(self.ep_group, "MoE dispatch").reduce_scatter(
            x, self.ep_group, dim=0, sizes=rows.ep_rows)
