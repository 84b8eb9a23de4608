"""Tensor / data / expert parallelism of the DeepSeek-V4 family (V4, V4.1), on ParallelContext.

The split follows R1's (model/parallel.py) and the weight table of model/v4_sharding.py:

* attention heads (``q_b_proj``/``wq_b`` rows, the sinks) and the grouped output projection's
  groups (``o_a_proj``/``wo_a``) are cut over the TP group; ``o_b_proj``/``wo_b`` is
  row-parallel on its input columns and returns a partial sum;
* the single K = V latent head, compressors, indexers, norms, mHC and routers are replicated:
  every rank computes (and keeps in its per-request state) the same window rows and
  compressed entries;
* routed experts are split on their intermediate dim over the TP group, or whole experts per
  rank under ``--enable-expert-parallel``; under DP they span every DP × TP rank and tokens
  are dispatched (``ParallelContext.dispatch``); shared experts are TP-split;
* embedding, LM head and V4.1's engram tables are vocab-parallel (rows, padded).

The residual streams of mHC are row-wise, so they follow the reduction mode like R1's
residual: under ``reduce_scatter`` each rank holds its token rows of the streams, the normed
sublayer input is all-gathered before attention / MoE and the partial output is
reduce-scattered back; under ``all_reduce`` every rank holds all rows. Attention and the MoE
always see the step's valid rows only (TP padding never enters a request's state).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from model.layers.embedding import VocabParallelEmbedding
from model.layers.linear import divide
from model.parallel import ParallelContext, StepRows
from model.v4_loader import ShardSpec


def local_heads_and_groups(num_heads: int, o_groups: int, tp_size: int) -> tuple[int, int]:
    """This rank's (attention heads, output groups); a split that is not even is one line."""
    return divide(num_heads, tp_size, "num_attention_heads"), divide(o_groups, tp_size, "o_groups")


def expert_split(par: ParallelContext) -> tuple[int, int, bool]:
    """(rank, world, whole experts?) of this rank's share of the routed experts."""
    tp_rank, tp_size, ep_rank, ep_size = par.expert_shard()
    if ep_size > 1:
        return ep_rank, ep_size, True
    return tp_rank, tp_size, False


def local_experts(num_experts: int, inter: int, par: ParallelContext) -> tuple[range, int]:
    """(the global ids of this rank's routed experts, their intermediate size per rank)."""
    rank, world, whole = expert_split(par)
    if whole:
        n = divide(num_experts, world, "n_routed_experts")
        return range(rank * n, (rank + 1) * n), inter
    return range(num_experts), divide(inter, world, "moe_intermediate_size")


def shard_spec(par: ParallelContext) -> ShardSpec:
    """How the loader cuts this rank's tensors: TP for attention/vocab/shared experts, the
    routed experts over their own group."""
    rank, world, _ = expert_split(par)
    return ShardSpec(par.tp_rank, par.tp_size, rank, world)


def vocab_embedding(vocab_size: int, dim: int, par: ParallelContext, dtype: torch.dtype) -> nn.Module:
    """The token embedding: a plain (trainable) ``nn.Embedding`` on one rank, vocab-parallel
    rows (zeros for tokens owned elsewhere, summed by the caller's reduction) under TP."""
    if par.tp_size == 1:
        return nn.Embedding(vocab_size, dim, dtype=dtype)
    return VocabParallelEmbedding(vocab_size, dim, par.tp_rank, par.tp_size, dtype)


def vocab_rows(rows: int, par: ParallelContext) -> tuple[int, int]:
    """(first row, rows per rank) of a vocab-parallel table on this rank (padded to equal)."""
    per_rank = -(-rows // par.tp_size)
    return par.tp_rank * per_rank, per_rank


def owned_lookup(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids local to a table holding rows [start, start + rows), clamped; mask of the owned ones)."""
    local = ids - start
    owned = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), owned


def pad_rows_to(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (TP padding of a sequence-parallel step)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def first_rows(par: ParallelContext, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The embedding's reduction: partial rows of ``n`` tokens → this rank's residual rows."""
    padded = par.padded_rows(n)
    return lambda x: par.scatter_partial_rows(pad_rows_to(x, padded))


def row_parallel_site(par: ParallelContext, n: int, sublayer: Callable[[torch.Tensor], torch.Tensor]
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Wrap a sublayer whose output is a partial sum over the TP group: this rank's rows of
    its normed input → all ``n`` valid rows → sublayer → reduced back to this rank's rows."""
    if par.tp_size == 1:
        return sublayer
    padded = par.padded_rows(n)
    return lambda x: par.scatter_partial_rows(pad_rows_to(sublayer(par.gather_rows(x)[:n]), padded))


def final_rows(par: ParallelContext, x: torch.Tensor, n: int) -> torch.Tensor:
    """This rank's rows of the final hidden states → all ``n`` rows."""
    return par.gather_rows(x)[:n]


RouteFn = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def routed_experts(par: ParallelContext, rows: StepRows | None, x: torch.Tensor, route: RouteFn,
                   experts: ExpertsFn) -> torch.Tensor:
    """This rank's partial routed-expert output [n, ...] for x [n, D] (every valid row).

    ``route(x_rows, start, stop)`` gives (weights, expert ids) of rows [start, stop) (the hash
    routers need the token ids of those rows); ``experts(x, weights, ids)`` sums this rank's
    experts. Under DP the rows this rank routes (``rows.routed``) are dispatched over the MoE
    group and the sums combined back; rows routed by a TP peer stay 0 here (its reduction
    adds them)."""
    n = x.shape[0]
    start, stop = (0, n) if rows is None else rows.routed
    xr = x[start:stop]
    weights, ids = route(xr, start, stop)
    if par.dispatch_moe:
        if rows is None:
            raise ValueError("a MoE that dispatches tokens across DP ranks needs the step's rows (StepRows)")
        x_all, w_all, ids_all = par.dispatch(rows, xr, weights, ids)
        routed = par.combine(rows, experts(x_all, w_all, ids_all))
    else:
        routed = experts(xr, weights, ids)
    if (start, stop) == (0, n):
        return routed
    out = routed.new_zeros((n, *routed.shape[1:]))
    out[start:stop] = routed
    return out
