"""Grouped low-rank output projection (V4 ``o_a_proj`` → ``o_b_proj``).

The attention output o [T, H, d] is split into ``groups`` contiguous head groups (group j =
heads j·H/g … (j+1)·H/g − 1, each flattened to H·d/g). Group j is projected by its own block
``W_a[j]`` [rank, H·d/g] — ``o_a_proj.weight`` [g·rank, H·d/g] viewed [g, rank, H·d/g], rows
j·rank… belong to group j — then the g·rank vector is mixed to hidden by ``o_b_proj``.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedLinear(nn.Module):
    """Block-diagonal linear: x [T, g, in] → [T, g, rank], weight [g·rank, in]."""

    def __init__(self, in_per_group: int, rank: int, groups: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.groups, self.rank = groups, rank
        self.weight = nn.Parameter(torch.zeros(groups * rank, in_per_group, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, self.rank, -1).transpose(1, 2)  # [g, in, rank]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def grouped_output_projection(o: torch.Tensor, o_a: GroupedLinear, o_b: nn.Module) -> torch.Tensor:
    """[T, hidden] from the attention output o [T, H, d]."""
    t = o.shape[0]
    z = o_a(o.reshape(t, o_a.groups, -1))
    return o_b(z.reshape(t, -1))
