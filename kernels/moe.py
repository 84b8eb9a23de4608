"""MoE routing (DeepSeek V3 ``noaux_tc`` and V2 ``greedy`` / ``group_limited_greedy``) and
expert compute: torch references plus the dispatch functions the model calls.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from kernels.activation import silu_and_mul, silu_and_mul_reference

_HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    scoring_func: str = "sigmoid"  # sigmoid (V3) | softmax (V2)
    topk_method: str = "noaux_tc"  # noaux_tc | greedy | group_limited_greedy
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


def route_reference(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (combine weights [T, k] float32, expert ids [T, k] int64).

    V3: sigmoid scores; experts are *chosen* on scores + correction bias within the
    ``topk_group`` best groups (group score = sum of its top-2 biased scores; experts of
    dropped groups get -inf, as DeepSeek's reference); combine weights are the *unbiased*
    scores, renormalized if ``norm_topk_prob``, times ``routed_scaling_factor``.
    V2: softmax scores, greedy top-k (or group-limited by the group max).
    """
    logits = router_logits.float()
    t, e = logits.shape
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.topk_method in ("noaux_tc", "group_limited_greedy") and cfg.n_group > 1:
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, e // cfg.n_group), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(cfg.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, e // cfg.n_group).reshape(t, e)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob and cfg.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def route(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return route_reference(router_logits, cfg, correction_bias)


def moe_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Sum over chosen experts of weight · down(silu(gate(x)) · up(x)).

    ``w13`` [E_local, 2I, H] (gate rows then up rows), ``w2`` [E_local, H, I]; the local
    experts are global ids ``expert_offset .. expert_offset + E_local - 1``; choices of
    other experts contribute nothing here (another rank owns them).
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    local_ids = topk_ids - expert_offset
    n_local = w13.shape[0]
    for e in torch.unique(local_ids).tolist():
        if e < 0 or e >= n_local:
            continue
        token_idx, slot = torch.nonzero(local_ids == e, as_tuple=True)
        h = silu_and_mul_reference(x[token_idx] @ w13[e].t())
        y = h @ w2[e].t()
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


def moe_experts_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """The same sum with two grouped GEMMs (``torch._grouped_mm``) over expert-sorted rows.

    No host synchronization and fixed shapes (T·k rows), so it can be captured in a CUDA
    graph; each used expert's weights are read once. Choices of experts another rank owns
    are sorted last, fall outside the offsets (rows the GEMMs leave unwritten) and contribute
    exactly zero. The routing weight scales each sorted row of the down GEMM's input (the
    narrower side), the output rows go back to slot order in one copy and the k slots of a
    token are summed in float32: deterministic (no atomic adds), like the Triton kernels.
    """
    t, k = topk_ids.shape
    n_local = w13.shape[0]
    local = topk_ids.flatten() - expert_offset
    owned = (local >= 0) & (local < n_local)
    group = torch.where(owned, local, n_local)  # foreign choices go to a virtual last group
    order = torch.argsort(group, stable=True)
    counts = torch.zeros(n_local + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, group, torch.ones_like(group, dtype=torch.int32))
    offs = torch.cumsum(counts[:n_local], 0, dtype=torch.int32)
    xs = x.index_select(0, order // k)
    h = silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
    h = h * topk_weights.flatten()[order].unsqueeze(-1).to(h.dtype)  # down is linear: weight its input rows
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    y = torch.where(owned[order].unsqueeze(-1), y, 0.0)
    y_slots = torch.empty_like(y).index_copy_(0, order, y)
    return y_slots.view(t, k, -1).sum(1, dtype=torch.float32).to(x.dtype)


def bf16_experts_backend(x: torch.Tensor, backend: str = "auto") -> str:
    """``auto`` on CUDA: the fused Triton kernels when installed (bf16/fp16), else grouped GEMMs;
    the per-expert reference off CUDA. At V2-Lite prefill sizes (768 rows per expert) the Triton
    kernels with 128-row tiles took 1.9 ms and ``torch._grouped_mm`` 2.8 ms on the H200."""
    if backend != "auto":
        return backend
    if not x.is_cuda:
        return "reference"
    return "triton" if _HAS_TRITON and x.dtype in (torch.bfloat16, torch.float16) else "grouped"


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """``auto`` (``bf16_experts_backend``): the fused Triton kernels (measured faster than grouped
    GEMMs at decode and prefill sizes on the H200, benchmarks/RESULTS.md), the per-expert
    reference on CPU. ``triton`` / ``grouped`` force one.
    The choice depends on shapes only, so a captured decode graph keeps its path."""
    backend = bf16_experts_backend(x, backend)
    if backend == "triton":
        from kernels.moe_triton import moe_experts_triton

        return moe_experts_triton(x, w13, w2, topk_weights, topk_ids, expert_offset)
    if backend == "grouped":
        return moe_experts_grouped(x, w13, w2, topk_weights, topk_ids, expert_offset)
    return moe_experts_reference(x, w13, w2, topk_weights, topk_ids, expert_offset)


def fp8_experts_backend(on_cuda: bool, block: tuple[int, int], inter: int, backend: str = "auto") -> str:
    """``triton`` (FP8 weights read directly) on CUDA for 128x128 blocks and an intermediate
    size that is a multiple of 128 when Triton is installed; else ``dequant`` (bf16 copies of
    the weights, then ``moe_experts``)."""
    if backend not in ("auto", "triton", "dequant"):
        raise ValueError(f"unknown FP8 MoE backend {backend!r}; one of auto, triton, dequant")
    if backend != "auto":
        return backend
    ok = on_cuda and tuple(block) == (128, 128) and inter % 128 == 0 and _HAS_TRITON
    return "triton" if ok else "dequant"


def moe_experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_offset: int = 0,
    block: tuple[int, int] = (128, 128),
    backend: str = "auto",
) -> torch.Tensor:
    """Block-FP8 experts (e4m3 weights + fp32 ``scale_inv`` per block), same contract as
    ``moe_experts``. ``triton`` reads the FP8 weights directly (w8a8, activations quantized
    per token per 128 columns); ``dequant`` builds x-dtype weights and calls ``moe_experts``."""
    path = fp8_experts_backend(x.is_cuda, block, w13.shape[1] // 2, backend)
    if path == "triton":
        from kernels.moe_triton import moe_experts_fp8_triton

        return moe_experts_fp8_triton(x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids,
                                      expert_offset)
    from kernels.fp8 import dequantize_weight_blocks

    w13d = dequantize_weight_blocks(w13, w13_scale_inv, block, x.dtype)
    w2d = dequantize_weight_blocks(w2, w2_scale_inv, block, x.dtype)
    return moe_experts(x, w13d, w2d, topk_weights, topk_ids, expert_offset)
