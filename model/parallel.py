"""How the model's layers talk to their peers: ranks, groups and the per-layer reductions.

Tensor parallel (TP > 1), two modes that must give the same results:

* ``reduce_scatter`` (default, "sequence parallel"): the residual stream is split over
  ranks by token rows (the step is padded to a multiple of TP). Each layer all-gathers the
  normed rows before its projections and **reduce-scatters** the row-parallel output back —
  one ReduceScatter when the shards are equal, which is why we pad.
* ``all_reduce``: every rank keeps all rows; each row-parallel output is all-reduced.

DEP (data-parallel attention + expert-parallel MoE, ``dispatch_moe``): every rank runs
attention on its own tokens; each MoE layer all-gathers hidden states and top-k choices over
the EP group, runs its local experts on all rows, and reduce-scatters the sums back to
their owners.

With no groups (world size 1) every hook is the identity and costs nothing.
"""

from __future__ import annotations

import torch

REDUCTION_MODES = ("reduce_scatter", "all_reduce")


class ParallelContext:
    def __init__(
        self,
        tp_rank: int = 0,
        tp_size: int = 1,
        ep_rank: int = 0,
        ep_size: int = 1,
        tp_group=None,
        ep_group=None,
        tp_reduction: str = "reduce_scatter",
        dispatch_moe: bool = False,
    ) -> None:
        if tp_reduction not in REDUCTION_MODES:
            raise ValueError(f"tp_reduction must be one of {REDUCTION_MODES}, got {tp_reduction!r}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.tp_group, self.ep_group = tp_group, ep_group
        self.tp_reduction = tp_reduction
        self.dispatch_moe = dispatch_moe and ep_size > 1
        # Per-step state, set by the model's forward: real rows (before TP padding) and, under
        # DEP, how many rows every EP rank holds this step.
        self.num_valid_rows: int | None = None
        self.ep_rows: list[int] | None = None

    @classmethod
    def from_groups(cls, tp_group, ep_group=None, tp_reduction: str = "reduce_scatter", dispatch_moe: bool = False):
        ep_rank = ep_group.rank_in_group if ep_group is not None else 0
        ep_size = ep_group.world_size if ep_group is not None else 1
        return cls(tp_group.rank_in_group, tp_group.world_size, ep_rank, ep_size, tp_group, ep_group,
                   tp_reduction, dispatch_moe)

    @property
    def sequence_parallel(self) -> bool:
        return self.tp_size > 1 and self.tp_reduction == "reduce_scatter"

    def _comm(self):
        if self.tp_group is None:
            raise RuntimeError("tensor-parallel collectives need process groups (distributed.init_distributed)")
        from distributed import comm

        return comm

    # ---- TP hooks ------------------------------------------------------------------------------
    def padded_rows(self, n: int) -> int:
        return -(-n // self.tp_size) * self.tp_size if self.sequence_parallel else n

    def scatter_partial_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A partial sum over ranks → this rank's reduced rows (SP) or all rows reduced (AR)."""
        if self.tp_size == 1:
            return x
        comm = self._comm()
        if self.sequence_parallel:
            return comm.reduce_scatter(x, self.tp_group, dim=0)
        return comm.all_reduce(x, self.tp_group)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows → all rows (SP); identity when rows are already replicated."""
        if not self.sequence_parallel:
            return x
        return self._comm().all_gather(x, self.tp_group, dim=0)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return logits
        return self._comm().all_gather(logits, self.tp_group, dim=-1)

    # ---- DEP hooks -----------------------------------------------------------------------------
    def exchange_rows(self, n: int, device) -> None:
        """Learn every EP rank's row count for this step (one tiny all-gather)."""
        if not self.dispatch_moe:
            return
        counts = self._ep_comm().all_gather(torch.tensor([n], dtype=torch.int64, device=device), self.ep_group)
        self.ep_rows = [int(c) for c in counts.tolist()]

    def _ep_comm(self):
        if self.ep_group is None:
            raise RuntimeError("expert-parallel dispatch needs process groups")
        from distributed import comm

        return comm

    def dispatch(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        comm = self._ep_comm()
        return [comm.all_gather(t, self.ep_group, dim=0, sizes=self.ep_rows) for t in tensors]

    def combine(self, x: torch.Tensor) -> torch.Tensor:
        return self._ep_comm().reduce_scatter(x, self.ep_group, dim=0, sizes=self.ep_rows)
