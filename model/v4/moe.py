"""V4 MoE: sqrt-softplus routing (learned top-k or hash by token id), clamped SwiGLU experts.

Routing: ``s = sqrt(softplus(x·Wgᵀ))``. Top-k layers choose ``topk(s + e_score_correction_bias)``
— the bias steers *selection only*; hash layers choose ``tid2eid[token_id]`` (so the MoE needs
the token ids). Either way the weights are ``s`` at the chosen experts, renormalised
(``/ (Σ + 1e-20)``) and multiplied by ``routed_scaling_factor``.

Experts (routed and shared alike) are SwiGLU with a clamp: ``silu(min(g, L)) · clamp(u, −L, L)``
with ``L = swiglu_limit``. Routed experts are packed as HF stores them: ``gate_up_proj``
[E, 2I, D] (gate rows, then up rows) and ``down_proj`` [E, D, I]; the routing weight
multiplies the expert's output (after ``down_proj``). ``moe(x) = Σ routed + shared(x)``.

Under a ParallelContext (model/v4_parallel.py) the packed experts hold this rank's experts
(ids from ``expert_offset``) or slice of every expert's intermediate dim, the shared expert its
intermediate slice, and the block returns this rank's partial sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.linear import divide
from model.parallel import ParallelContext, StepRows
from model.v4_parallel import local_experts, routed_experts


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits).sqrt()


def normalize_routing_weights(scores: torch.Tensor, indices: torch.Tensor, scaling: float,
                              renormalize: bool = True) -> torch.Tensor:
    """``scores`` at ``indices`` [T, k], renormalised to sum 1 (+1e-20), times ``scaling``."""
    w = scores.gather(1, indices)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class TopKRouter(nn.Module):
    """Learned router; state: ``weight`` [E, D], ``e_score_correction_bias`` [E] (float32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, scaling: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.scaling = top_k, scaling
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], expert indices [T, k])`` for x [T, D]."""
        scores = sqrt_softplus(F.linear(x, self.weight))
        idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        return normalize_routing_weights(scores, idx, self.scaling), idx


class HashRouter(nn.Module):
    """Hash router: experts ``tid2eid[token_id]`` [vocab, k]; ``weight`` still gives the scores."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, scaling: float, vocab: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.scaling = top_k, scaling
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.register_buffer("tid2eid", torch.zeros(vocab, top_k, dtype=torch.long))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids is None:
            raise ValueError("a hash-routed MoE layer needs the token ids of its rows")
        scores = sqrt_softplus(F.linear(x, self.weight))
        idx = self.tid2eid[input_ids.reshape(-1)].long()
        return normalize_routing_weights(scores, idx, self.scaling), idx


class PackedExperts(nn.Module):
    """Routed experts, torch reference: one gather/GEMM pair per expert that has tokens.
    Holds experts ``expert_offset …`` (all of them unless expert parallel)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float, dtype: torch.dtype,
                 expert_offset: int = 0) -> None:
        super().__init__()
        self.num_experts, self.limit, self.expert_offset = num_experts, limit, expert_offset
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, inter, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_every_expert(x, indices, weights)
        out = torch.zeros_like(x)
        for e in torch.unique(indices).tolist():
            j = e - self.expert_offset
            if not 0 <= j < self.num_experts:
                continue  # another rank's expert
            token, slot = torch.where(indices == e)
            gate, up = F.linear(x[token], self.gate_up_proj[j]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[j]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def forward_every_expert(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without host syncs or data-dependent shapes (what a captured decode
        graph runs): every local expert on every row, each row keeping its chosen experts'
        outputs only, added in the same (ascending expert) order. It reads every local
        expert's weights, so it pays off only where launches cost more than that."""
        out = torch.zeros_like(x)
        local = indices - self.expert_offset
        for j in range(self.num_experts):
            picked = local == j
            chosen = picked.any(dim=-1, keepdim=True)
            w = torch.where(picked, weights, torch.zeros_like(weights)).sum(dim=-1, keepdim=True)
            gate, up = F.linear(x, self.gate_up_proj[j]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[j]) * w
            out += torch.where(chosen, y.to(out.dtype), torch.zeros((), dtype=out.dtype, device=out.device))
        return out


class ClampedSwiGLU(nn.Module):
    """The shared expert: ``down(clamped_swiglu(gate(x), up(x)))`` with plain linears."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class V4MoE(nn.Module):
    """``gate`` (TopKRouter or HashRouter), ``experts`` (PackedExperts), ``shared_experts``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int, limit: float,
                 scaling: float, hash_routed: bool, vocab: int, dtype: torch.dtype,
                 par: ParallelContext | None = None) -> None:
        super().__init__()
        self.hash_routed = hash_routed
        self.par = par = par or ParallelContext()
        if hash_routed:
            self.gate = HashRouter(hidden, num_experts, top_k, scaling, vocab, dtype)
        else:
            self.gate = TopKRouter(hidden, num_experts, top_k, scaling, dtype)
        ids, inter_local = local_experts(num_experts, inter, par)
        self.experts = PackedExperts(len(ids), hidden, inter_local, limit, dtype, ids.start)
        shared_local = divide(shared_inter, par.tp_size, "shared expert intermediate size")
        self.shared_experts = ClampedSwiGLU(hidden, shared_local, limit, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None,
                rows: StepRows | None = None) -> torch.Tensor:
        """x [T, D] (post-attention-normed), input_ids [T] (needed by hash layers) → [T, D]
        (this rank's partial sum under TP / EP; ``rows``: the step's layout under DP)."""
        def route(xr, start, stop):
            return self.gate(xr, None if input_ids is None else input_ids[start:stop])

        def experts(xr, weights, indices):
            return self.experts(xr, indices, weights)

        return routed_experts(self.par, rows, x, route, experts) + self.shared_experts(x)
