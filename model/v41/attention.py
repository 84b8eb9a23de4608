"""DeepSeek-V4.1 attention: one shared K=V latent head over [sliding window ‖ shared compressed entries].

Per layer: ``q_res = q_norm(wq_a·x)``, ``q = RoPE(wq_b·q_res)`` (no per-head q norm),
``kv = FP8_32(RoPE(kv_norm(wkv·x)))`` — the window rows, cached as they are used. Layers with
a compressed branch add the compressed cache of their KV source (a source first runs its
:class:`~model.v41.compressor.Compressor`, stores indexer keys, rotates each new latent at its
group's first position and FP4-fake-quantizes it with e4m3 scales in 16-blocks), masked by
the top-k bias of their index source. Scores are ``q·kᵀ/√head_dim`` plus a per-head sink
logit that only enlarges the softmax denominator; the output's RoPE tail is rotated back by
the query position and projected by the grouped low-rank ``wo_a`` (heads in ``o_groups``
contiguous groups) and ``wo_b``. The core, masks, grouped projection and RoPE are V4's
(``model.v4``); what differs is the QAT rounding and the KV sharing.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0
from model.layers.norm import RMSNorm
from model.v4.attention_core import selected_entry_bias, sink_attention, window_bias
from model.v4.output_proj import GroupedLinear
from model.v4.rope import RotaryTable, apply_trailing_rope
from model.v41.compressor import Compressor
from model.v41.config import V41Config
from model.v41.indexer import QUERY_BLOCK, Indexer
from model.v41.state import RequestState, SourceState
from model.v4_parallel import local_heads_and_groups


class Attention(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype, tp_size: int = 1) -> None:
        """``tp_size`` > 1: this rank's heads and output groups (the output is a partial sum)."""
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.ratio = c.compress_ratios[layer_idx]
        self.head_dim = c.head_dim
        self.num_heads, self.o_groups = local_heads_and_groups(c.num_attention_heads, c.o_groups, tp_size)
        self.window = c.sliding_window
        self.scale = c.head_dim**-0.5
        self.kv_source = c.kv_source_of(layer_idx)
        self.index_source = c.index_source_of(layer_idx)
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.wq_b = nn.Linear(c.q_lora_rank, self.num_heads * self.head_dim, bias=False, dtype=dtype)
        self.wkv = nn.Linear(c.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.wo_a = GroupedLinear(c.num_attention_heads * self.head_dim // c.o_groups, c.o_lora_rank, self.o_groups,
                                  dtype)
        self.wo_b = nn.Linear(self.o_groups * c.o_lora_rank, c.hidden_size, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor = Compressor(c, layer_idx, dtype) if self.kv_source == layer_idx else None
        self.indexer = Indexer(c, layer_idx, dtype) if self.index_source == layer_idx else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_res [N, q_lora_rank], q [N, heads, head_dim], window K=V rows [N, head_dim]) of
        normed x [N, hidden]; cos/sin at the tokens' positions."""
        q_res = self.q_norm(self.wq_a(x))
        q = apply_trailing_rope(self.wq_b(q_res).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)
        kv = fake_quant_fp8_ue8m0(apply_trailing_rope(self.kv_norm(self.wkv(x)), cos, sin), 32)
        return q_res, q, kv

    def shared_entries(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """KV source: the rotated, FP4-fake-quantized entries of compressor latents [G, head_dim];
        cos/sin at the groups' first positions (the indexer keys come from the same latents)."""
        return fake_quant_fp4(apply_trailing_rope(latent, cos, sin), 16, "e4m3")

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[N, hidden] from the attention output [N, heads, head_dim]: undo the RoPE, then the
        grouped low-rank projection."""
        out = apply_trailing_rope(out, cos, sin, inverse=True)
        return self.wo_b(self.wo_a(out.reshape(out.shape[0], self.o_groups, -1)).flatten(1))

    def _compress(self, x: torch.Tensor, source: SourceState, rope: RotaryTable) -> None:
        """KV source: pool the groups these tokens complete, store their indexer keys and
        their rotated, FP4-fake-quantized entries in the shared cache."""
        latent, first = self.compressor(x, source)
        if latent is None:
            return
        group_pos = first + self.ratio * torch.arange(latent.shape[0], device=x.device)
        cos, sin = rope.cos_sin(group_pos, latent.dtype)
        if self.indexer is not None:
            source.append_index_keys(self.indexer.keys_from_latents(latent, cos, sin))
        source.append_entries(self.shared_entries(latent, cos, sin))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, state: RequestState,
                step: dict) -> torch.Tensor:
        """x [T, hidden] normed; ``rope`` is this layer's flavour (compress iff ratio > 0).

        ``step`` is shared by the layers of one forward: index sources leave their top-k
        picks there (``step["topk_picks"][layer]``) for the reuse layers after them, and the
        candidate source its block mask. Queries attend ``QUERY_BLOCK`` at a time.
        """
        t = x.shape[0]
        cos, sin = rope.cos_sin(positions, x.dtype)
        q_res, q, kv = self.project(x, cos, sin)

        cached = state.windows[self.layer_idx]
        n_cached = 0 if cached is None else cached.shape[0]
        window_rows = kv if cached is None else torch.cat([cached, kv], dim=0)
        # A copy, so the state does not pin the whole chunk's rows.
        state.windows[self.layer_idx] = window_rows[max(0, window_rows.shape[0] - (self.window - 1)):].clone()
        row_pos = torch.arange(int(positions[0]) - n_cached, int(positions[-1]) + 1, device=x.device)

        entries, picks = None, None
        if self.ratio:
            source = state.sources[self.kv_source]
            if self.compressor is not None:
                self._compress(x, source, rope)
            all_picks = step.setdefault("topk_picks", {})
            if self.indexer is not None and source.index_keys is not None:
                all_picks[self.layer_idx] = self.indexer.topk_picks(
                    x, q_res, source.index_keys, positions, cos, sin, step)
            entries, picks = source.entries, all_picks.get(self.index_source)

        out = torch.empty_like(q)
        for s in range(0, t, QUERY_BLOCK):
            e = min(t, s + QUERY_BLOCK)
            lo = max(0, n_cached + s - (self.window - 1))  # first window row a query of the block sees
            keys = window_rows[lo : n_cached + e]
            bias = window_bias(positions[s:e], row_pos[lo : n_cached + e], self.window)
            if entries is not None:
                keys = torch.cat([keys, entries], dim=0)
                bias = torch.cat([bias, entry_bias(None if picks is None else picks[s:e], entries.shape[0],
                                                   bias)], dim=-1)
            out[s:e] = sink_attention(q[s:e], keys, bias, self.attn_sink, self.scale)
        return self.output(out, cos, sin)


def entry_bias(picks: torch.Tensor | None, num_entries: int, window: torch.Tensor) -> torch.Tensor:
    """[..., T, n] float32 bias over the shared entries: 0 on the picks (``picks`` [..., T, k]);
    all -inf when the KV source has no index source (``picks`` None, shaped like ``window``'s rows)."""
    if picks is None:  # no index source for this KV source: entries stay masked
        return window.new_full((*window.shape[:-1], num_entries), float("-inf"))
    return selected_entry_bias(picks, num_entries)
