"""Dense MLP and the DeepSeek MoE block (router, routed experts, shared experts).

Tensor parallel: the dense MLP and the experts are split on their intermediate dim (gate/up
column-parallel, down row-parallel); every rank routes all tokens. Expert parallel: rank r
holds experts [r·E/ep, (r+1)·E/ep) whole. When tokens are dispatched over the MoE group
(DP > 1), each TP rank routes only its slice of the rows (``StepRows.routed``), and the group
holds whole experts (expert parallel) or a slice of every expert (``moe_tensor_parallel``).
Either way the block returns this rank's partial sum — routed and shared experts already
added — so the caller reduces exactly once.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.fp8 import FP8_DTYPE, dequantize_weight_blocks
from kernels.activation import silu_and_mul
from kernels.moe import RoutingConfig, fp8_experts_backend, moe_experts, moe_experts_fp8, route
from model.config import ModelConfig
from model.layers.linear import MergedColumnParallelLinear, RowParallelLinear, divide
from model.parallel import ParallelContext, StepRows


class DenseMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, fp8_block=fp8_block)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class RoutedExperts(nn.Module):
    """Stacked expert weights: w13 [E_local, 2·I_local, H] (gate ‖ up), w2 [E_local, H, I_local]."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        ep_rank: int = 0,
        ep_size: int = 1,
        dtype: torch.dtype = torch.float32,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.num_local = divide(num_experts, ep_size, "n_routed_experts")
        self.expert_offset = ep_rank * self.num_local
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.inter = intermediate_size
        self.inter_local = divide(intermediate_size, tp_size, "moe_intermediate_size")
        self.fp8_block = fp8_block
        wdtype = FP8_DTYPE if fp8_block else dtype
        e, i, h = self.num_local, self.inter_local, hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=wdtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=wdtype), requires_grad=False)
        if fp8_block:
            bn, bk = fp8_block
            if i % bn:
                raise ValueError(f"FP8 experts need moe_intermediate_size per rank ({i}) divisible by {bn}")
            self.w13_scale_inv = nn.Parameter(torch.empty(e, 2 * i // bn, -(-h // bk)), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(e, -(-h // bn), i // bk), requires_grad=False)
        else:
            self.w13_scale_inv = self.w2_scale_inv = None

    def local_index(self, expert_id: int) -> int | None:
        j = expert_id - self.expert_offset
        return j if 0 <= j < self.num_local else None

    def load_expert(self, expert_id: int, proj: str, loaded: torch.Tensor, is_scale: bool, name: str) -> None:
        """Place one checkpoint tensor (gate_proj / up_proj / down_proj, weight or scale)."""
        j = self.local_index(expert_id)
        if j is None:
            return
        if is_scale:
            bn, bk = self.fp8_block
            rows, cols = self.inter_local // bn, self.inter_local // bk
        else:
            rows = cols = self.inter_local
        if proj in ("gate_proj", "up_proj"):
            param = self.w13_scale_inv if is_scale else self.w13
            piece = loaded.narrow(0, self.tp_rank * rows, rows) if self.tp_size > 1 else loaded
            target = param.data[j].narrow(0, 0 if proj == "gate_proj" else rows, rows)
        else:
            param = self.w2_scale_inv if is_scale else self.w2
            piece = loaded.narrow(1, self.tp_rank * cols, cols) if self.tp_size > 1 else loaded
            target = param.data[j]
        if tuple(target.shape) != tuple(piece.shape):
            raise ValueError(f"shape mismatch for {name}: expected {tuple(target.shape)}, got {tuple(piece.shape)}")
        target.copy_(piece.to(param.dtype))

    def dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert weights in ``dtype``. FP8 experts are dequantized here, on every call, in
        one batched pass: correct and graph-safe, but it re-reads and re-writes all local
        experts per forward — only used where the Triton FP8 MoE does not apply (CPU, blocks
        other than 128x128)."""
        if self.w13.dtype != FP8_DTYPE:
            return self.w13.to(dtype), self.w2.to(dtype)
        blk = self.fp8_block
        return (dequantize_weight_blocks(self.w13, self.w13_scale_inv, blk, dtype),
                dequantize_weight_blocks(self.w2, self.w2_scale_inv, blk, dtype))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if (self.w13.dtype == FP8_DTYPE
                and fp8_experts_backend(x.is_cuda, self.fp8_block, self.inter_local) == "triton"):
            # FP8 weights read directly by the Triton MoE (no per-forward dequantization)
            return moe_experts_fp8(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv,
                                   topk_weights, topk_ids, self.expert_offset, self.fp8_block)
        w13, w2 = self.dense_weights(x.dtype)
        return moe_experts(x, w13, w2, topk_weights, topk_ids, self.expert_offset)


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        par: ParallelContext | None = None,
        dtype: torch.dtype = torch.float32,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.par = par = par or ParallelContext()
        tp_rank, tp_size = par.tp_rank, par.tp_size
        self.routing = RoutingConfig(
            top_k=c.num_experts_per_tok,
            scoring_func=c.scoring_func,
            topk_method=c.topk_method,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
        )
        # The router stays in float32 (as HF and DeepSeek's reference compute it).
        self.gate_weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size), requires_grad=False)
        if c.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(c.n_routed_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None
        # Under expert parallelism the experts are whole (no TP split inside the MoE); under
        # DP without it every expert is split over all DP × TP ranks.
        moe_tp_rank, moe_tp_size, moe_ep_rank, moe_ep_size = par.expert_shard()
        self.experts = RoutedExperts(
            c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, moe_tp_rank, moe_tp_size,
            moe_ep_rank, moe_ep_size, dtype, fp8_block,
        )
        self.shared_experts = None
        if c.n_shared_experts:
            # Shared experts are TP-split like a dense MLP.
            self.shared_experts = DenseMLP(
                c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, tp_rank, tp_size, dtype, fp8_block
            )

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate_weight.float())
        return route(logits, self.routing, self.e_score_correction_bias)

    def forward(self, x: torch.Tensor, rows: StepRows | None = None) -> torch.Tensor:
        """This rank's partial MoE output; rows past ``rows.num_valid`` (TP padding) stay 0.

        ``rows`` (None: every row is valid and routed here) says which rows this rank routes;
        the others' routed part comes from their TP peers through the caller's reduction.
        """
        n = x.shape[0] if rows is None else min(rows.num_valid, x.shape[0])
        start, stop = (0, n) if rows is None else rows.routed
        if self.shared_experts is not None and n == x.shape[0]:
            out = self.shared_experts(x)  # a fresh buffer: the routed sum is added into it
        else:  # rows past n (TP padding) stay 0
            out = torch.zeros_like(x)
            if self.shared_experts is not None:
                out[:n] = self.shared_experts(x[:n])
        xr = x[start:stop]
        weights, ids = self.select_experts(xr)
        if self.par.dispatch_moe:
            if rows is None:
                raise ValueError("a MoE that dispatches tokens across DP ranks needs the step's rows (StepRows)")
            x_all, w_all, ids_all = self.par.dispatch(rows, xr, weights, ids)
            routed = self.par.combine(rows, self.experts(x_all, w_all, ids_all))
        else:
            routed = self.experts(xr, weights, ids)
        out[start:stop] += routed
        return out
