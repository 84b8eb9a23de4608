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

Under a ParallelContext (model/v4_parallel.py) ``experts`` holds this rank's experts (another
rank's index is an empty placeholder, so tensor names keep their global expert id) or a slice
of every expert's intermediate dim, the shared expert its intermediate slice, and the block
returns this rank's partial sum.

Routed experts can also run from stacked MXFP4 weights (:meth:`MoE.use_mxfp4_experts`, or
:meth:`MoE.pack_experts_mxfp4` from the loaded ones) through ``kernels.mxfp4_experts``: W4A8 on
SM90, W4A16 on other GPUs, and on CPU the torch reference, which is this module's own math on
the dequantized weights (the same results as the per-expert modules); on one rank only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.mxfp4_experts import BACKENDS, moe_experts_mxfp4
from kernels.weight_formats import MXFP4, MXFP4_GROUP, QuantizedWeight, quantize
from model.v4.moe import clamped_swiglu, normalize_routing_weights, sqrt_softplus
from model.layers.linear import divide
from model.parallel import ParallelContext, StepRows
from model.v41.config import V41Config
from model.v4_parallel import local_experts, routed_experts


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
    def __init__(self, config: V41Config, dtype: torch.dtype, par: ParallelContext | None = None) -> None:
        super().__init__()
        c = config
        self.par = par = par or ParallelContext()
        self.num_experts = c.n_routed_experts
        self.gate = Router(c, dtype)
        local, inter = local_experts(c.n_routed_experts, c.moe_intermediate_size, par)
        self.local_experts = local
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, inter, c.swiglu_limit, dtype) if e in local else nn.Identity()
            for e in range(c.n_routed_experts)
        )
        shared = divide(c.moe_intermediate_size * c.n_shared_experts, par.tp_size, "shared expert intermediate size")
        self.shared_experts = Expert(c.hidden_size, shared, c.swiglu_limit, dtype)
        self.limit = c.swiglu_limit
        self.mxfp4_backend = "auto"
        # Stacked MXFP4 routed experts (w13 = w1 rows then w3 rows); buffers so .to() moves
        # them, not persistent so the state dict keeps HF-V4.1's names.
        for name in ("w13_mxfp4", "w13_mxfp4_scale", "w2_mxfp4", "w2_mxfp4_scale"):
            self.register_buffer(name, None, persistent=False)

    def use_mxfp4_experts(self, w13: QuantizedWeight, w2: QuantizedWeight, backend: str = "auto") -> None:
        """Run the routed experts from MXFP4 ``w13`` [E, 2I, D] (gate rows, then up rows) and
        ``w2`` [E, D, I]; ``backend`` as :func:`kernels.mxfp4_moe.mxfp4_backend`. One rank only
        (every expert whole and local)."""
        if len(self.local_experts) != self.num_experts or self.par.tp_size > 1:
            raise ValueError("stacked MXFP4 experts run on one rank only (no TP or EP split of the experts)")
        e, inter, d = self.num_experts, self.experts[0].w1.out_features, self.experts[0].w1.in_features
        for name, w, shape in (("w13", w13, (e, 2 * inter, d)), ("w2", w2, (e, d, inter))):
            if w.format != MXFP4 or tuple(w.block) != (1, MXFP4_GROUP) or tuple(w.shape) != shape:
                raise ValueError(f"{name} must be MXFP4 {shape} with one scale per {MXFP4_GROUP}, got "
                                 f"{w.format} {tuple(w.shape)} block {tuple(w.block)}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown MXFP4 MoE backend {backend!r}; one of {', '.join(BACKENDS)}")
        self.w13_mxfp4, self.w13_mxfp4_scale = w13.data.contiguous(), w13.scale.contiguous()
        self.w2_mxfp4, self.w2_mxfp4_scale = w2.data.contiguous(), w2.scale.contiguous()
        self.mxfp4_backend = backend

    @torch.no_grad()
    def pack_experts_mxfp4(self, backend: str = "auto") -> None:
        """Quantize the loaded per-expert weights to stacked MXFP4 and run from those. Exact for
        weights loaded from an MXFP4 checkpoint: a dequantized group requantizes to the same
        values (its new scale may differ by a power of two, with the codes shifted to match)."""
        w13 = torch.stack([torch.cat([ex.w1.weight, ex.w3.weight]) for ex in self.experts])
        w2 = torch.stack([ex.w2.weight for ex in self.experts])
        self.use_mxfp4_experts(quantize(w13, MXFP4, (1, MXFP4_GROUP)), quantize(w2, MXFP4, (1, MXFP4_GROUP)),
                               backend)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ of this rank's chosen experts, fp32 [N, hidden]."""
        if self.w13_mxfp4 is not None:
            return moe_experts_mxfp4(x, self.w13_mxfp4, self.w13_mxfp4_scale, self.w2_mxfp4, self.w2_mxfp4_scale,
                                     weights, ids, self.limit, backend=self.mxfp4_backend).float()
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.routed_every_expert(x, weights, ids)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            if e not in self.local_experts:
                continue  # another rank's expert
            rows, slot = torch.where(ids == e)
            out[rows] += self.experts[e](x[rows], weights[rows, slot, None]).float()
        return out

    def routed_every_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`routed` without host syncs or data-dependent shapes (what a captured decode
        graph runs): every local expert on every row, each row keeping its chosen experts'
        outputs only, added in the same (ascending expert) order; it reads every local
        expert's weights."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in self.local_experts:
            picked = ids == e
            w = torch.where(picked, weights, torch.zeros_like(weights)).sum(dim=-1, keepdim=True)
            y = self.experts[e](x, w).float()
            out += torch.where(picked.any(dim=-1, keepdim=True), y, torch.zeros((), device=x.device))
        return out

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None,
                rows: StepRows | None = None) -> torch.Tensor:
        """x [N, hidden] → [N, hidden] (this rank's partial sum under TP / EP; ``rows``: the
        step's layout under DP)."""
        def route(xr, start, stop):
            return self.gate(xr, None if image_mask is None else image_mask[start:stop])

        out = routed_experts(self.par, rows, x, route, self.routed)
        out += self.shared_experts(x).float()
        return out.to(x.dtype)

    def forward_dense(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: every expert runs on every token of x [N, hidden], weighted by its routing
        weight (0 where not chosen), so there is no data-dependent indexing or host sync.
        Returns (the same output as :meth:`forward`, the chosen expert ids [N, k])."""
        weights, ids = self.gate(x)
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, ids, weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            out = out + expert(x, dense[:, e : e + 1]).float()
        out = out + self.shared_experts(x).float()
        return out.to(x.dtype), ids
