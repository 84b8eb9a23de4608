"""DeepSeek-V4.1 MoE: sqrt-softplus router with selection-only bias, clamped SwiGLU experts.

Router (fp32): ``s = sqrt(softplus(x·Wgᵀ / gate_temp))``; experts = top-k of ``s + bias``
(``bias_vl`` replaces ``bias`` for image tokens; text requests never have any); weights =
the chosen ``s``, renormalized over the k (``+1e-20``, only when k > 1), times
``routed_scaling_factor``. Expert: GEMMs in the model dtype, then in fp32
``h = silu(min(g, L)) · clamp(u, -L, L) · weight``, cast back before ``w2``. One shared
expert (same clamp, weight 1) runs on every token; outputs accumulate in fp32.

V4's router and packed experts (``model.v4.moe``) are not reused as modules: V4.1 adds the
gate temperature and ``bias_vl``, keeps HF-V4.1's per-expert ``w1``/``w2``/``w3`` tensors,
weights an expert before ``w2`` rather than after, and runs the SwiGLU in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.v4.moe import clamped_swiglu, normalize_routing_weights, sqrt_softplus
from model.v41.config import V41Config


class Router(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate_temp = config.gate_temp
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(e, dtype=torch.float32))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None):
        """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])."""
        scores = sqrt_softplus(F.linear(x.float(), self.weight.float()) / self.gate_temp)
        bias = self.bias
        if image_mask is not None and bool(image_mask.any()):
            bias = torch.where(image_mask.reshape(-1, 1), self.bias_vl, self.bias)
        ids = (scores + bias).topk(self.top_k, dim=-1).indices
        renormalize = self.norm_topk_prob and self.top_k > 1
        return normalize_routing_weights(scores, ids, self.scaling, renormalize), ids


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.w3 = nn.Linear(hidden, inter, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        h = clamped_swiglu(gate, up, self.limit) if self.limit > 0 else F.silu(gate) * up
        if weight is not None:
            h = weight * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.num_experts = c.n_routed_experts
        self.gate = Router(c, dtype)
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype) for _ in range(c.n_routed_experts)
        )
        self.shared_experts = Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate(x, image_mask)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            out[rows] += self.experts[e](x[rows], weights[rows, slot, None]).float()
        out += self.shared_experts(x).float()
        return out.to(x.dtype)
