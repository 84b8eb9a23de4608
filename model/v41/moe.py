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

Routed experts can also run from stacked MXFP4 weights through ``kernels.mxfp4_experts``:
W4A8 on SM90, W4A16 on other GPUs, and on CPU the torch reference, which is this module's own
math on the dequantized weights (the same results as the per-expert modules). A MoE built with
``mxfp4_experts=True`` holds only those (``w13_mxfp4`` [E, 2I, D/2] int8 + ``w13_mxfp4_scale``
[E, 2I, D/32] E8M0, ``w2_mxfp4`` [E, D, I/2] + [E, D, I/32], this rank's experts or slice, in
its state dict) and empty placeholders for the per-expert modules; the checkpoint's per-expert
tensors (HF names ``experts.E.w1.weight`` …) go into the stacks through :meth:`MoE.load_expert`.
A MoE with per-expert modules switches to stacked MXFP4 with :meth:`MoE.use_mxfp4_experts` or
:meth:`MoE.pack_experts_mxfp4` (then the stacks are extra, outside the state dict).

The shared expert's FP8 weights can be held as stored and run as MXFP8 (``mxfp8_shared``,
model/v41/fp8_linear.py).

CUDA-graph capture: stacked MXFP4 experts run their kernel path, which has no host syncs;
per-expert modules run :meth:`MoE.routed_every_expert` (every local expert on every row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.mxfp4_experts import BACKENDS, moe_experts_mxfp4, mxfp4_backend
from kernels.mxfp8_gemm import mxfp8_linears
from kernels.weight_formats import E8M0_DTYPE, MXFP4, MXFP4_GROUP, QuantizedWeight, quantize
from model.v4.moe import clamped_swiglu, normalize_routing_weights, sqrt_softplus
from model.layers.linear import divide
from model.parallel import ParallelContext, StepRows
from model.v41.config import V41Config
from model.v41.fp8_linear import MXFP8Linear, fp8_linear
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
    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype, mxfp8: bool = False) -> None:
        """``mxfp8``: the weights as stored (FP8, the shared expert's), run as MXFP8 (model/v41/fp8_linear.py)."""
        super().__init__()
        self.limit = limit
        self.w1 = fp8_linear(hidden, inter, dtype, mxfp8)
        self.w2 = fp8_linear(inter, hidden, dtype, mxfp8)
        self.w3 = fp8_linear(hidden, inter, dtype, mxfp8)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.w1, MXFP8Linear):  # one MXFP8 quantization of x for both
            gate, up = (y.float() for y in mxfp8_linears(x, [self.w1.operands, self.w3.operands]))
        else:
            gate, up = self.w1(x).float(), self.w3(x).float()
        h = clamped_swiglu(gate, up, self.limit) if self.limit > 0 else F.silu(gate) * up
        if weight is not None:
            h = weight * h
        return self.w2(h.to(x.dtype))


def stream_capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s work is being captured into a CUDA graph (no host syncs allowed)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def stacked_mxfp4_unsupported(config: V41Config, par: ParallelContext | None = None) -> str | None:
    """Why this rank's routed experts cannot be held as stacked MXFP4 (one line), or None."""
    _, inter = local_experts(config.n_routed_experts, config.moe_intermediate_size, par or ParallelContext())
    for name, k in (("hidden_size", config.hidden_size), ("the per-rank expert intermediate size", inter)):
        if k % MXFP4_GROUP:
            return f"{name} {k} is not a multiple of the MXFP4 group {MXFP4_GROUP}"
    return None


class MoE(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype, par: ParallelContext | None = None,
                 mxfp4_experts: bool = False, mxfp8_shared: bool = False) -> None:
        """``mxfp4_experts``: hold the routed experts as stacked MXFP4 only (module doc);
        ``mxfp8_shared``: the shared expert's FP8 weights as stored, run as MXFP8."""
        super().__init__()
        c = config
        self.par = par = par or ParallelContext()
        self.num_experts = c.n_routed_experts
        self.gate = Router(c, dtype)
        local, inter = local_experts(c.n_routed_experts, c.moe_intermediate_size, par)
        self.local_experts = local
        self.hidden, self.inter = c.hidden_size, inter
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, inter, c.swiglu_limit, dtype) if e in local and not mxfp4_experts
            else nn.Identity()
            for e in range(c.n_routed_experts)
        )
        shared = divide(c.moe_intermediate_size * c.n_shared_experts, par.tp_size, "shared expert intermediate size")
        self.shared_experts = Expert(c.hidden_size, shared, c.swiglu_limit, dtype, mxfp8_shared)
        self.limit = c.swiglu_limit
        self.mxfp4_backend = "auto"
        self.mxfp4_path: str | None = None  # the MXFP4 path the last routed call took
        self.stacked_mxfp4 = mxfp4_experts
        # Stacked MXFP4 routed experts (w13 = w1 rows then w3 rows): in the state dict when they
        # are the only copy, else extra buffers (so .to() moves them) outside it.
        if mxfp4_experts:
            reason = stacked_mxfp4_unsupported(c, par)
            if reason:
                raise ValueError(f"stacked MXFP4 experts: {reason}")
            e, d = len(local), c.hidden_size
            self.register_buffer("w13_mxfp4", torch.empty(e, 2 * inter, d // 2, dtype=torch.int8))
            self.register_buffer("w13_mxfp4_scale", torch.empty(e, 2 * inter, d // MXFP4_GROUP, dtype=E8M0_DTYPE))
            self.register_buffer("w2_mxfp4", torch.empty(e, d, inter // 2, dtype=torch.int8))
            self.register_buffer("w2_mxfp4_scale", torch.empty(e, d, inter // MXFP4_GROUP, dtype=E8M0_DTYPE))
        else:
            for name in ("w13_mxfp4", "w13_mxfp4_scale", "w2_mxfp4", "w2_mxfp4_scale"):
                self.register_buffer(name, None, persistent=False)

    def expert_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Stacked MXFP4 only: the per-expert tensors the stacks take, by their name inside this
        module (``experts.E.w1.weight`` …), with their logical shapes on this rank."""
        d, inter = self.hidden, self.inter
        shapes = {"w1": (inter, d), "w3": (inter, d), "w2": (d, inter)}
        return {f"experts.{e}.{p}.weight": shape for e in self.local_experts for p, shape in shapes.items()}

    @torch.no_grad()
    def load_expert(self, name: str, w: QuantizedWeight | torch.Tensor) -> None:
        """Copy one per-expert tensor (``experts.E.w1.weight`` …, MXFP4 as stored, or plain
        values, quantized here) into the stacks."""
        parts = name.split(".")
        if not self.stacked_mxfp4 or len(parts) != 4 or parts[0] != "experts" or parts[2] not in ("w1", "w2", "w3"):
            raise ValueError(f"{name!r} is not a routed-expert tensor of this MXFP4 MoE")
        e, part = int(parts[1]), parts[2]
        if e not in self.local_experts:
            raise ValueError(f"expert {e} is not on this rank (experts {self.local_experts.start}.."
                             f"{self.local_experts.stop - 1})")
        shape = self.expert_tensor_shapes()[name]
        if not isinstance(w, QuantizedWeight):
            w = quantize(w, MXFP4, (1, MXFP4_GROUP))
        if w.format != MXFP4 or tuple(w.block) != (1, MXFP4_GROUP) or tuple(w.shape) != shape:
            raise ValueError(f"{name} must be MXFP4 {shape} with one scale per {MXFP4_GROUP}, got "
                             f"{w.format} {tuple(w.shape)} block {tuple(w.block)}")
        j, inter = e - self.local_experts.start, self.inter
        if part == "w2":
            data, scale = self.w2_mxfp4[j], self.w2_mxfp4_scale[j]
        else:
            rows = slice(0, inter) if part == "w1" else slice(inter, 2 * inter)
            data, scale = self.w13_mxfp4[j, rows], self.w13_mxfp4_scale[j, rows]
        data.copy_(w.data.view(torch.int8))
        scale.view(torch.uint8).copy_(w.scale.view(torch.uint8))

    def use_mxfp4_experts(self, w13: QuantizedWeight, w2: QuantizedWeight, backend: str = "auto") -> None:
        """Run the routed experts from MXFP4 ``w13`` [E, 2I, D] (gate rows, then up rows) and
        ``w2`` [E, D, I] of this rank's experts (E local, I this rank's slice); ``backend`` as
        :func:`kernels.mxfp4_experts.mxfp4_backend`."""
        e, inter, d = len(self.local_experts), self.inter, self.hidden
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
        values (its new scale may differ by a power of two, with the codes shifted to match).
        A MoE that holds stacked MXFP4 only just takes the ``backend``."""
        if self.stacked_mxfp4:
            self.mxfp4_backend = backend
            return
        experts = [self.experts[e] for e in self.local_experts]
        w13 = torch.stack([torch.cat([ex.w1.weight, ex.w3.weight]) for ex in experts])
        w2 = torch.stack([ex.w2.weight for ex in experts])
        self.use_mxfp4_experts(quantize(w13, MXFP4, (1, MXFP4_GROUP)), quantize(w2, MXFP4, (1, MXFP4_GROUP)),
                               backend)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ of this rank's chosen experts, fp32 [N, hidden]."""
        if self.w13_mxfp4 is not None:
            self.mxfp4_path = mxfp4_backend(x.device, self.inter, self.hidden, self.mxfp4_backend)
            return moe_experts_mxfp4(x, self.w13_mxfp4, self.w13_mxfp4_scale, self.w2_mxfp4, self.w2_mxfp4_scale,
                                     weights, ids, self.limit, self.local_experts.start, self.mxfp4_path,
                                     sync_free=stream_capturing(x)).float()
        if stream_capturing(x):
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
        if self.stacked_mxfp4:
            raise ValueError("training runs per-expert weights: load the model with mxfp4_experts=False")
        weights, ids = self.gate(x)
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, ids, weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            out = out + expert(x, dense[:, e : e + 1]).float()
        out = out + self.shared_experts(x).float()
        return out.to(x.dtype), ids
