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

from kernels.v4_kv_write import pool_windows
from model.layers.norm import RMSNorm
from model.v4.state import split_complete_windows
from model.v41.config import V41Config


class Compressor(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = config.compress_ratios[layer_idx]
        d, h = config.head_dim, config.hidden_size
        self.wkv = nn.Linear(h, d, bias=False, dtype=dtype)
        self.wgate = nn.Linear(h, d, bias=False, dtype=dtype) if self.ratio > 1 else None
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype, weight_after_cast=True)

    def forward(self, x: torch.Tensor, start: int, pending_kv: torch.Tensor | None = None,
                pending_gate: torch.Tensor | None = None) -> tuple[torch.Tensor | None, int, torch.Tensor | None,
                                                                   torch.Tensor | None]:
        """x [T, hidden] (the layer's normed input at positions ``start …``) -> (latents of the
        groups completed by these tokens [G, head_dim] or None, absolute position of the first
        one's first token, the open group's fp32 kv and gate rows afterwards).

        ``pending_*`` are the open group's rows before x (positions (start // ratio)·ratio …
        start − 1); the caller stores the entries and the new open rows.
        """
        first_position = (start // self.ratio) * self.ratio
        if self.wgate is None:
            return self.norm(self.wkv(x)), first_position, None, None
        kv, gate = self.project(x)
        kv, gate, pending_kv, pending_gate = split_complete_windows(pending_kv, pending_gate, kv, gate, self.ratio)
        if kv.shape[0] == 0:
            return None, first_position, pending_kv, pending_gate
        return self.pool(kv, gate, x.dtype), first_position, pending_kv, pending_gate

    def sequence_latents(self, x: torch.Tensor) -> torch.Tensor | None:
        """Whole sequences from position 0: x [B, T, hidden] -> the latents of their complete
        groups [B, T // ratio, head_dim] (None when there is none); the training forward's path."""
        if self.wgate is None:
            return self.norm(self.wkv(x))
        b, t, _ = x.shape
        groups = t // self.ratio
        if groups == 0:
            return None
        kv, gate = self.project(x[:, : groups * self.ratio])
        shape = (b * groups, self.ratio, kv.shape[-1])
        return self.pool(kv.reshape(shape), gate.reshape(shape), x.dtype).view(b, groups, -1)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio > 1: the float32 (kv, gate) rows of x [..., hidden]."""
        return F.linear(x.float(), self.wkv.weight.float()), F.linear(x.float(), self.wgate.weight.float())

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Complete groups kv, gate [G, ratio, head_dim] (float32) -> latents [G, head_dim]."""
        pooled = pool_windows(kv, gate)  # kv is float32 here, so the whole pooling is
        return self.norm(pooled.to(dtype))  # float32, unlike V4's
