"""V4.1 lightning indexer with KV sharing and the two-level (candidate-block) top-k.

Roles, per layer with a compressed branch:

* a KV source that is also an index source *owns the keys*: from each new compressor latent
  ``k = FP4_32(RoPE_c(k_norm(wk·latent)))`` at the group's first position, appended to the
  source's ``index_keys``;
* every index source (owner or "reindex") scores its queries against its KV source's keys
  with its own ``wq_b``/``weights_proj``:
  ``score[t, s] = Σ_h w[t, h]·ReLU(q[t, h]·k[s])·d^-½``, ``w = weights_proj(x)·H^-½``,
  ``q = FP4_32(RoPE_c(wq_b·q_res))``; entries ``s ≥ (t + 1) // ratio`` are not yet visible;
* the candidate source additionally publishes a block mask
  (:func:`kernels.v4_indexer.select_candidate_blocks`)
  that later index sources apply before their own top-k (its own top-k is unrestricted);
* reuse layers (no indexer) attend with the top-k of the nearest index source before them.

The top-k picks (-1 where fewer entries than ``index_topk`` are visible) become the attention's
additive bias over the compressed entries: 0 on picks, -inf elsewhere.

With packed key records (``--kv-cache-dtype fp8``) an :class:`~kernels.attention.v4_indexer.IndexerBackend`
runs the step on the records in place (:meth:`Indexer.packed_picks`): the same scores from the
same e2m1 values and the same selection — on CUDA the Triton kernels, scores and selection
fused (no [Q, keys] sort or torch glue), elsewhere the torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.microscaling import fake_quant_fp4
from kernels.attention.v4_indexer import IndexerBackend
from kernels.v4_indexer import blocks_to_entries, score_values, select_candidate_blocks, topk_picks
from model.layers.norm import RMSNorm
from model.v4.rope import apply_trailing_rope
from model.v41.config import V41Config
from model.v41.fp8_linear import fp8_linear

# Queries scored per block: bounds the transient [block, heads, entries] score tensor.
QUERY_BLOCK = 256


class Indexer(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype, mxfp8: bool = False) -> None:
        """``mxfp8``: ``wq_b`` (FP8 in the checkpoint) as stored, run as MXFP8 (model/v41/fp8_linear.py)."""
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
        self.backend: IndexerBackend | None = None  # scores packed key records (set by configure_cache)
        self.wq_b = fp8_linear(config.q_lora_rank, self.num_heads * self.head_dim, dtype, mxfp8)
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

    def prefill_packed_picks(self, x: torch.Tensor, q_res: torch.Tensor, records: torch.Tensor,
                             pages: list[int], page_rows: int, num_keys: int, positions: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, step: dict) -> torch.Tensor:
        """:meth:`topk_picks` scored by :attr:`backend` on one request's packed key records
        [rows, bytes] (its pages ``pages``, the first ``num_keys`` keys), ``QUERY_BLOCK``
        queries at a time."""
        t = x.shape[0]
        page_table = torch.tensor(pages, dtype=torch.long, device=x.device).unsqueeze(0)
        visible = (positions.long() + 1) // self.ratio
        earlier = step.get("candidates")
        picks, candidates = [], []
        for s in range(0, t, QUERY_BLOCK):
            e = min(t, s + QUERY_BLOCK)
            block_picks, own = self.packed_picks(
                self.backend, x[s:e], q_res[s:e], records, page_table, page_rows, visible[s:e], num_keys, cos[s:e],
                sin[s:e], None if earlier is None else earlier[s:e], queries_per_request=e - s)
            picks.append(block_picks)
            candidates.append(own)
        if self.is_candidate_source:
            step["candidates"] = torch.cat(candidates)
        return torch.cat(picks)

    def decode_packed_picks(self, x: torch.Tensor, q_res: torch.Tensor, records: torch.Tensor,
                            page_table: torch.Tensor, page_rows: int, counts: torch.Tensor, num_keys: int,
                            cos: torch.Tensor, sin: torch.Tensor, step: dict) -> torch.Tensor:
        """:meth:`decode_picks` scored by :attr:`backend` on the packed key records [rows, bytes]
        of B requests (``page_table`` [B, pages], ``num_keys``: the padded width)."""
        earlier = step.get("candidates")
        picks, own = self.packed_picks(self.backend, x, q_res, records, page_table, page_rows, counts, num_keys,
                                       cos, sin, None if earlier is None else earlier[:, 0])
        if self.is_candidate_source:
            step["candidates"] = own.unsqueeze(1)
        return picks

    def packed_picks(self, backend: IndexerBackend, x: torch.Tensor, q_res: torch.Tensor, records: torch.Tensor,
                     page_table: torch.Tensor, page_rows: int, visible: torch.Tensor, num_keys: int,
                     cos: torch.Tensor, sin: torch.Tensor, candidates: torch.Tensor | None,
                     queries_per_request: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(picks [Q, k], this layer's candidate block mask [Q, blocks] or None) for Q queries
        scored by ``backend`` on the packed key records [rows, bytes] of their requests
        (``page_table`` [Q / queries_per_request, pages]); ``visible`` [Q]; ``candidates``: the
        candidate source's mask [Q, blocks], when published."""
        allowed = candidates if self.uses_candidates else None
        return backend.picks(self.raw_queries(q_res, cos, sin), self.head_weights(x), records, page_table, page_rows,
                             visible, num_keys, self.head_dim**-0.5, self.index_topk, queries_per_request, allowed,
                             self.block_size, self.topk_blocks if self.is_candidate_source else None,
                             allowed_blocks=self.topk_blocks)

    def raw_queries(self, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`queries` before the FP4 rounding."""
        q = self.wq_b(q_res).view(q_res.shape[0], self.num_heads, self.head_dim)
        return apply_trailing_rope(q, cos, sin)

    def queries(self, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[N, heads, index_head_dim] rotated, FP4-fake-quantized queries of q_res [N, q_lora_rank]."""
        return fake_quant_fp4(self.raw_queries(q_res, cos, sin), 32, "ue8m0")

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(x).float() * self.num_heads**-0.5

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """Index scores [B, T, n] (float32, -inf on entries not yet visible) of queries q
        [B, T, heads, d], head weights [B, T, heads] and keys [B, n, d]; visible [T, 1]."""
        index_scores = score_values(q, weights, keys, self.head_dim**-0.5)
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
        return topk_picks(index_scores, self.index_topk), own
