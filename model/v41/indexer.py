"""V4.1 lightning indexer with KV sharing and the two-level (candidate-block) top-k.

Roles, per layer with a compressed branch:

* a KV source that is also an index source *owns the keys*: from each new compressor latent
  ``k = FP4_32(RoPE_c(k_norm(wk·latent)))`` at the group's first position, appended to the
  source's ``index_keys``;
* every index source (owner or "reindex") scores its queries against its KV source's keys
  with its own ``wq_b``/``weights_proj``:
  ``score[t, s] = Σ_h w[t, h]·ReLU(q[t, h]·k[s])·d^-½``, ``w = weights_proj(x)·H^-½``,
  ``q = FP4_32(RoPE_c(wq_b·q_res))``; entries ``s ≥ (t + 1) // ratio`` are not yet visible;
* the candidate source additionally publishes a block mask (:func:`select_candidate_blocks`)
  that later index sources apply before their own top-k (its own top-k is unrestricted);
* reuse layers (no indexer) attend with the top-k of the nearest index source before them.

The top-k picks (-1 where fewer entries than ``index_topk`` are visible) become the attention's
additive bias over the compressed entries: 0 on picks, -inf elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.microscaling import fake_quant_fp4
from model.layers.norm import RMSNorm
from model.v4.rope import apply_trailing_rope
from model.v4.topk import ordered_topk
from model.v41.config import V41Config

# Queries scored per block: bounds the transient [block, heads, entries] score tensor.
QUERY_BLOCK = 256


def select_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Boolean mask over candidate blocks [T, ceil(n / block_size)]: the ``topk_blocks`` blocks of
    ``block_size`` consecutive entries with the highest max score, always including the block
    that holds a query's newest visible entry. ``scores`` [T, n] has invisible entries at -inf;
    ``visible`` [T, 1] is the number of visible entries per query."""
    n = scores.shape[-1]
    padded = F.pad(scores, (0, (-n) % block_size), value=float("-inf"))
    block_max = padded.view(*scores.shape[:-1], -1, block_size).amax(dim=-1)
    num_blocks = block_max.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")
    block_ids = torch.arange(num_blocks, device=scores.device)
    block_max = block_max.masked_fill(block_ids == newest, float("inf"))
    values, indices = ordered_topk(block_max, min(topk_blocks, num_blocks))
    return torch.zeros_like(block_max, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))


def blocks_to_entries(blocks: torch.Tensor, block_size: int, num_entries: int) -> torch.Tensor:
    """[T, blocks] block mask -> [T, num_entries] entry mask."""
    return blocks.repeat_interleave(block_size, dim=-1)[..., :num_entries]


class Indexer(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = config.compress_ratios[layer_idx]
        self.owns_keys = layer_idx in config.kv_source_layer_ids
        self.is_candidate_source = layer_idx == config.candidate_source_layer_id
        cand = config.candidate_source_layer_id
        # The mask is over the candidate source's entries: only layers reading the same KV source use it.
        self.uses_candidates = 0 <= cand < layer_idx and config.kv_source_of(cand) == config.kv_source_of(layer_idx)
        self.topk_blocks = config.candidate_topk_blocks
        self.block_size = config.candidate_block_size
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.index_topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False, dtype=dtype)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False, dtype=dtype)
        if self.owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, weight_after_cast=True)

    def keys_from_latents(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index keys [G, index_head_dim] of new latents; cos/sin at the groups' positions."""
        return fake_quant_fp4(self.raw_keys(latent, cos, sin), 32, "ue8m0")

    def raw_keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`keys_from_latents` before the FP4 rounding (the key pool's codec does it)."""
        return apply_trailing_rope(self.k_norm(self.wk(latent)), cos, sin)

    def topk_picks(
        self, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, step: dict,
    ) -> torch.Tensor:
        """The entries each query attends [T, min(index_topk, n)] (-1 = no pick) among the n
        shared entries, scored ``QUERY_BLOCK`` queries at a time so the transient scores stay
        [block, heads, n]. The candidate source leaves its block mask in ``step["candidates"]``.
        """
        t = x.shape[0]
        q = self.queries(q_res, cos, sin)
        weights = self.head_weights(x)
        visible = (positions.long().unsqueeze(-1) + 1) // self.ratio  # [T, 1]
        picks, candidates = [], []
        for s in range(0, t, QUERY_BLOCK):
            e = min(t, s + QUERY_BLOCK)
            index_scores = self.scores(q[None, s:e], weights[None, s:e], keys[None], visible[s:e])[0]
            earlier = step.get("candidates")
            block_picks, block_candidates = self.select(
                index_scores, visible[s:e], None if earlier is None else earlier[s:e])
            picks.append(block_picks)
            candidates.append(block_candidates)
        if self.is_candidate_source:
            step["candidates"] = torch.cat(candidates)
        return torch.cat(picks)

    def decode_picks(self, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, step: dict) -> torch.Tensor:
        """:meth:`topk_picks` for B requests with one query each: keys [B, N, d] padded past each
        request's ``counts`` [B] → picks [B, k]; the candidate mask goes to ``step`` as [B, 1, blocks]."""
        visible = counts.view(-1, 1, 1)
        scores = self.scores(self.queries(q_res, cos, sin).unsqueeze(1), self.head_weights(x).unsqueeze(1), keys,
                             visible)
        picks, own = self.select(scores, visible, step.get("candidates"))
        if self.is_candidate_source:
            step["candidates"] = own
        return picks.squeeze(1)

    def queries(self, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[N, heads, index_head_dim] rotated, FP4-fake-quantized queries of q_res [N, q_lora_rank]."""
        q = self.wq_b(q_res).view(q_res.shape[0], self.num_heads, self.head_dim)
        return fake_quant_fp4(apply_trailing_rope(q, cos, sin), 32, "ue8m0")

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(x).float() * self.num_heads**-0.5

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """Index scores [B, T, n] (float32, -inf on entries not yet visible) of queries q
        [B, T, heads, d], head weights [B, T, heads] and keys [B, n, d]; visible [T, 1]."""
        scores = torch.einsum("bshd,btd->bsht", q.float(), keys.float())
        scores = scores.relu() * self.head_dim**-0.5
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        entry_ids = torch.arange(keys.shape[-2], device=keys.device)
        return index_scores.masked_fill(entry_ids >= visible, float("-inf"))

    def select(self, index_scores: torch.Tensor, visible: torch.Tensor,
               candidates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(picks [..., T, k] with -1 = no pick, this layer's candidate block mask or None) from
        index scores [..., T, n]; ``candidates`` is the candidate source's mask, when published."""
        n = index_scores.shape[-1]
        own = None
        if self.is_candidate_source:
            own = select_candidate_blocks(index_scores, visible, self.topk_blocks, self.block_size)
        elif self.uses_candidates and candidates is not None:
            allowed = blocks_to_entries(candidates, self.block_size, n)
            index_scores = index_scores.masked_fill(~allowed, float("-inf"))
        values, indices = ordered_topk(index_scores, min(self.index_topk, n))
        picks = torch.where(values > float("-inf"), indices, torch.full_like(indices, -1))
        return picks, own
