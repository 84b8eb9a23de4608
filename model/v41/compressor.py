"""V4.1 compressor (v2) of a KV-source layer: ``ratio`` consecutive tokens -> one latent.

Ratio > 1: ``latent = norm(Σ_slot softmax_slot(wgate·x) · wkv·x)``, the projections, the
softmax over the group's slots (per channel) and the pooling in fp32, cast to the model
dtype before the norm. There is no position bias and no overlap between groups; groups are
aligned to absolute positions (group g = tokens g·ratio … g·ratio + ratio - 1) and a group
exists only once complete. Ratio 1: ``latent = norm(wkv·x)``, one per token, no gate.

The latent is returned *before* RoPE: the indexer derives its keys from it, and the
attention rotates it (at the group's first position) into the shared compressed cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.norm import RMSNorm
from model.v4.compressor import pool_windows
from model.v4.state import split_complete_windows
from model.v41.config import V41Config
from model.v41.state import SourceState


class Compressor(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = config.compress_ratios[layer_idx]
        d, h = config.head_dim, config.hidden_size
        self.wkv = nn.Linear(h, d, bias=False, dtype=dtype)
        self.wgate = nn.Linear(h, d, bias=False, dtype=dtype) if self.ratio > 1 else None
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype, weight_after_cast=True)

    def forward(self, x: torch.Tensor, source: SourceState) -> tuple[torch.Tensor | None, int]:
        """x [T, hidden] (the layer's normed input) -> (latents of the groups completed by
        these tokens [G, head_dim] or None, absolute position of the first one's first token).

        Open-group rows are carried in ``source.pending_*``; the caller appends the entries.
        """
        first_position = source.num_entries * self.ratio
        if self.wgate is None:
            return self.norm(self.wkv(x)), first_position
        kv = F.linear(x.float(), self.wkv.weight.float())
        gate = F.linear(x.float(), self.wgate.weight.float())
        kv, gate, source.pending_kv, source.pending_gate = split_complete_windows(
            source.pending_kv, source.pending_gate, kv, gate, self.ratio)
        if kv.shape[0] == 0:
            return None, first_position
        pooled = pool_windows(kv, gate)  # kv is float32 here, so the whole pooling is
        return self.norm(pooled.to(x.dtype)), first_position  # float32, unlike V4's
