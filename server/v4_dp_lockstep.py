"""DP lockstep of the DeepSeek-V4 family's per-request forwards.

Under DP every MoE layer dispatches tokens over all DP × TP ranks, so every rank must run the
same number of model forwards per engine step. R1 runs one forward per step; the V4 runner
runs one per scheduled chunk (its per-request states), so DP ranks with different numbers
of requests would call the MoE collectives a different number of times. Before each forward
a rank tells the group it has one more (a one-int max all-reduce on the CPU group); when it
has none left it keeps answering 0 and runs a throwaway one-token forward each time a peer
still says 1, until everyone says 0. An idle DP rank (the engine's dummy step) only drains.
The TP workers of a DP rank follow their engine's plan, so they agree the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distributed import comm
from model.parallel import ParallelContext


class ForwardLockstep:
    def __init__(self, par: ParallelContext, dummy_forward: Callable[[], None]) -> None:
        self.group = par.ep_group.cpu_view() if par.dispatch_moe else None
        self.dummy_forward = dummy_forward
        self.num_dummy_forwards = 0

    def before_forward(self) -> None:
        """Call before every real forward of a step (a no-op without DP dispatch)."""
        if self.group is not None:
            self._anyone(1)

    def finish(self) -> None:
        """Call once at the end of every step (and for an idle rank's dummy step): throwaway
        forwards until no rank of the group has a forward left."""
        if self.group is None:
            return
        while self._anyone(0):
            self.dummy_forward()
            self.num_dummy_forwards += 1

    def _anyone(self, more: int) -> bool:
        flag = torch.tensor([more], dtype=torch.int64)
        return bool(comm.all_reduce(flag, self.group, op="max")[0])
