"""Vocabulary-parallel embedding and LM head.

Rank r holds rows [r·V/tp, (r+1)·V/tp) of the (padded) vocabulary. The embedding returns a
partial result (zeros for tokens owned elsewhere) that the caller reduces; the LM head
returns this rank's slice of the logits, which the caller all-gathers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp_rank: int = 0, tp_size: int = 1, dtype=torch.float32) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.per_rank = padded_vocab(vocab_size, tp_size) // tp_size
        self.start = tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "weight") -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"shape mismatch for {name}: expected ({self.vocab_size}, {param.shape[1]}), got {tuple(loaded.shape)}"
            )
        rows = max(0, min(self.per_rank, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.start : self.start + rows].to(param.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        owned = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        return out * owned.unsqueeze(-1).to(out.dtype)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """This rank's logits slice [T, V/tp] in float32."""
        return F.linear(hidden, self.weight).float()
