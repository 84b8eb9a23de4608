"""One DeepSeek-V4 attention layer (sliding window, CSA or HCA), torch reference.

For a chunk of one request (normed input x [T, D] at ``positions``):

- q: ``q_a_proj → q_a_norm`` (= q_residual, also the indexer's input) ``→ q_b_proj`` [T, H, d]
  → per-head unweighted RMSNorm → RoPE on the trailing rope dims;
- kv: ``kv_proj → kv_norm → RoPE`` [T, d], one head used as both K and V;
- keys: the window rows (state + chunk), then for CSA/HCA the compressed entries; the bias
  lets query t see window positions (t − window, t] and, for HCA, every entry w with
  (w + 1)·m ≤ t + 1, for CSA only the indexer's picks among those;
- ``sink_attention`` at scale d^-0.5, inverse RoPE of the output at the query positions,
  grouped output projection.

Window-only layers use the main RoPE table, CSA/HCA layers the compress table for q, kv,
compressed entries and indexer.
"""

from __future__ import annotations

import torch
from torch import nn

from model.layers.norm import RMSNorm
from model.v4.attention_core import (
    causal_entry_bias,
    selected_entry_bias,
    sink_attention,
    window_bias,
)
from model.v4.compressor import CSACompressor, LightningIndexer, WindowCompressor
from model.v4.config import V4Config
from model.v4.norm import unweighted_rms_norm
from model.v4.output_proj import GroupedLinear, grouped_output_projection
from model.v4.rope import RotaryTable, apply_trailing_rope
from model.v4.state import V4LayerState, WindowState
from model.v4_parallel import local_heads_and_groups

QUERY_BLOCK = 256  # queries per attention block in a long chunk (bounds the transient logits)


class V4Attention(nn.Module):
    def __init__(self, config: V4Config, layer_idx: int, dtype: torch.dtype, tp_size: int = 1) -> None:
        """``tp_size`` > 1: this rank's heads and output groups (the output is a partial sum)."""
        super().__init__()
        c = config
        self.kind = c.layer_kinds[layer_idx]
        self.ratio = c.compress_ratios[layer_idx]
        self.head_dim = c.head_dim
        self.num_heads, o_groups = local_heads_and_groups(c.num_attention_heads, c.o_groups, tp_size)
        self.sliding_window, self.eps = c.sliding_window, c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        self.query_block = QUERY_BLOCK
        h, d = c.hidden_size, c.head_dim
        self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, torch.float32)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * d, bias=False, dtype=dtype)
        self.kv_proj = nn.Linear(h, d, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(d, c.rms_norm_eps, torch.float32)
        self.o_a_proj = GroupedLinear(c.num_attention_heads * d // c.o_groups, c.o_lora_rank, o_groups, dtype)
        self.o_b_proj = nn.Linear(o_groups * c.o_lora_rank, h, bias=False, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.compressor: WindowCompressor | None = None
        if self.kind == "csa":
            indexer = LightningIndexer(h, c.q_lora_rank, c.index_n_heads, c.index_head_dim, self.ratio,
                                       c.index_topk, c.rms_norm_eps, dtype)
            self.compressor = CSACompressor(h, d, self.ratio, indexer, c.rms_norm_eps, dtype)
        elif self.kind == "hca":
            self.compressor = WindowCompressor(h, d, self.ratio, False, c.rms_norm_eps, dtype)
        self.requires_grad_(False)

    def new_state(self) -> V4LayerState:
        st = V4LayerState(window=WindowState(self.sliding_window))
        if self.compressor is not None:
            st.compressor = self.compressor.new_state()
        if isinstance(self.compressor, CSACompressor):
            st.indexer = self.compressor.indexer.new_state()
        return st

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: V4LayerState, rope: RotaryTable) -> torch.Tensor:
        """x [T, D] (input_layernorm'ed) at absolute ``positions`` [T] → [T, D]; updates ``state``."""
        t = x.shape[0]
        cos, sin = rope.cos_sin(positions, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, self.num_heads, self.head_dim)
        q = apply_trailing_rope(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = apply_trailing_rope(self.kv_norm(self.kv_proj(x)), cos, sin)

        keys, key_pos = state.window.attend_and_append(kv)
        first_key, start = state.window.end - keys.shape[0], state.window.end - t
        entries = picks = None
        if self.compressor is not None:
            entries = self.compressor.compress(x, state.compressor, rope).to(keys.dtype)
            if isinstance(self.compressor, CSACompressor):
                picks = self.compressor.indexer.select(x, q_residual, positions, state.indexer, rope,
                                                       self.query_block)

        # Query blocks bound the logits to [H, block, window + block + entries] for long chunks.
        o = torch.empty_like(q)
        for a in range(0, t, self.query_block):
            b = min(a + self.query_block, t)
            lo = max(0, start + a - self.sliding_window + 1 - first_key)
            hi = start + b - first_key
            block_keys, bias = keys[lo:hi], window_bias(positions[a:b], key_pos[lo:hi], self.sliding_window)
            if entries is not None:
                n = entries.shape[0]
                if picks is not None:
                    entry_bias = selected_entry_bias(picks[a:b], n)
                else:
                    entry_bias = causal_entry_bias(positions[a:b], n, self.ratio)
                block_keys = torch.cat([block_keys, entries], dim=0)
                bias = torch.cat([bias, entry_bias], dim=1)
            o[a:b] = sink_attention(q[a:b], block_keys, bias, self.sinks, self.scale)
        o = apply_trailing_rope(o, cos, sin, inverse=True)
        return grouped_output_projection(o, self.o_a_proj, self.o_b_proj)
