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

:meth:`V4Attention.forward` runs one request's chunk; :meth:`V4Attention.decode` advances B
requests by one token each: window rows and (selected) entries gathered from the row pools
into padded [B, W + N, d] keys with a [B, W + N] bias (model/v4/cache_pool.py), or, with
packed records and a sparse-decode backend, attended in place (model/v4/sparse_attention.py);
a chunk, with a sparse-prefill backend, likewise reads the pool rows in place.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention import V4SparseDecodeBackend, V4SparsePrefillBackend
from kernels.v4_kv_write import RowNorm, norm_rope_rows
from kernels.v4_sparse_prefill import PrefillEntries, PrefillWindow
from model.layers.norm import RMSNorm
from model.v4.attention_core import (
    bias_from_visible,
    causal_entry_bias,
    selected_entry_bias,
    sink_attention,
    visible_prefix_bias,
    window_bias,
)
from model.v4.compressor import CSACompressor, LightningIndexer, WindowCompressor
from model.v4.config import V4Config
from model.v4.norm import unweighted_rms_norm
from model.v4.output_proj import GroupedLinear, grouped_output_projection
from model.v4.rope import RotaryTable, apply_trailing_rope
from model.v4.cache_pool import BatchIndex, CachePools, RowLease
from model.v4.sparse_attention import (entry_scope, sparse_attend, stored_rows, window_key_positions, window_scope,
                                       write_window_row)
from model.v4_parallel import local_heads_and_groups

QUERY_BLOCK = 256  # queries per attention block in a long chunk (bounds the transient logits)


class V4Attention(nn.Module):
    def __init__(self, config: V4Config, layer_idx: int, dtype: torch.dtype, tp_size: int = 1) -> None:
        """``tp_size`` > 1: this rank's heads and output groups (the output is a partial sum)."""
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.kind = c.layer_kinds[layer_idx]
        self.ratio = c.compress_ratios[layer_idx]
        self.head_dim, self.rope_dims = c.head_dim, c.qk_rope_head_dim
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, lease: RowLease, pools: CachePools,
                rope: RotaryTable, sparse: V4SparsePrefillBackend | None = None) -> torch.Tensor:
        """One request: x [T, D] (input_layernorm'ed) at absolute ``positions`` [T] → [T, D]; stores
        the chunk's rows in the request's pool units. ``sparse``: the backend that attends the
        pool rows in place (None: gathered, decoded rows and masks in torch)."""
        t, start, layer = x.shape[0], int(positions[0]), self.layer_idx
        cos, sin = rope.cos_sin(positions, x.dtype)
        q_residual, q, kv = self.project(x, cos, sin)

        window = pools["window"]
        first_key = max(0, start - (self.sliding_window - 1))
        stored = window.codec.encode(kv)
        keep = min(t, self.sliding_window)
        if sparse is not None:  # the new rows go to the ring after the attention read the old ones
            o = self._prefill_sparse(sparse, x, q_residual, q, stored, positions, lease, pools, rope)
            window.put(layer, lease.rows("window", start + t - keep, start + t), stored[t - keep:])
            return self.output(o, cos, sin)
        old = window.get(layer, lease.rows("window", first_key, start))
        window.put(layer, lease.rows("window", start + t - keep, start + t), stored[t - keep:])
        keys = torch.cat([old, window.codec.decode(stored)]).to(q.dtype)
        key_pos = torch.arange(first_key, start + t, device=x.device)
        entries = picks = None
        if self.compressor is not None:
            entries = self.compressor.compress(x, start, lease, pools, rope).to(keys.dtype)
            if isinstance(self.compressor, CSACompressor):
                picks = self.compressor.indexer.select(x, q_residual, positions, lease, pools, rope,
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
        return self.output(o, cos, sin)

    def _prefill_sparse(self, backend: V4SparsePrefillBackend, x: torch.Tensor, q_residual: torch.Tensor,
                        q: torch.Tensor, stored: torch.Tensor, positions: torch.Tensor, lease: RowLease,
                        pools: CachePools, rope: RotaryTable) -> torch.Tensor:
        """:meth:`forward`'s attention [T, H, d] by ``backend``: the window's ring rows before the
        chunk and the chunk's rows ``stored`` (encoded), then the picked (CSA) or all visible
        (HCA) entries, as stored."""
        window, layer, start = pools["window"], self.layer_idx, int(positions[0])
        first_key = max(0, start - (self.sliding_window - 1))
        win = PrefillWindow(window.codec.decode(stored).to(q.dtype), stored_rows(window, layer, "v4", self.rope_dims),
                            lease.rows("window", first_key, start), self.sliding_window)
        entries, comp = None, self.compressor
        if comp is not None:
            n = comp.compress_store(x, start, lease, pools, rope)
            picks = None
            if isinstance(comp, CSACompressor):
                picks = comp.indexer.select(x, q_residual, positions, lease, pools, rope, self.query_block)
            name = comp.pool_prefix + "entries"
            entries = PrefillEntries(stored_rows(pools[name], comp.pool_layer, "v4", self.rope_dims),
                                     lease.rows(name, 0, n), picks, self.ratio)
        return backend.prefill(q, start, win, entries, self.sinks, self.scale)

    def decode(self, x: torch.Tensor, batch: BatchIndex, pools: CachePools, rope: RotaryTable,
               sparse: V4SparseDecodeBackend | None = None, kv_write: str = "auto") -> torch.Tensor:
        """B requests, one token each: x [B, D] at ``batch.positions`` → [B, D]; ``sparse``: the
        backend that attends the packed pool rows in place (None: padded gathers); ``kv_write``:
        the implementation of the row writes (kernels/v4_kv_write.py)."""
        p, layer = batch.positions, self.layer_idx
        cos, sin = rope.cos_sin(p, x.dtype)
        q_residual, q = self.project_queries(x, cos, sin)
        write_window_row(pools["window"], layer, batch, pools, self.kv_proj(x), self.row_norm, cos, sin, kv_write)
        if sparse is not None:
            return self.output(self._decode_sparse(sparse, x, q_residual, q, batch, pools, rope, kv_write), cos, sin)
        keys, bias = gather_window(pools["window"], layer, batch, pools, self.sliding_window)
        keys = keys.to(q.dtype)
        if self.compressor is not None:
            if isinstance(self.compressor, CSACompressor):
                entries, _ = self.compressor.decode_step(x, batch, pools, rope, kv_write)
                picks = self.compressor.indexer.decode_select(x, q_residual, batch, pools, rope, kv_write)
                entry_bias = selected_entry_bias(picks, entries.shape[1])
            else:
                entries, counts = self.compressor.decode_step(x, batch, pools, rope, kv_write)
                entry_bias = visible_prefix_bias(counts, entries.shape[1])
            keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
            bias = torch.cat([bias, entry_bias], dim=1)
        o = sink_attention(q.unsqueeze(1), keys, bias.unsqueeze(1), self.sinks, self.scale).squeeze(1)
        return self.output(o, cos, sin)

    def _decode_sparse(self, backend: V4SparseDecodeBackend, x: torch.Tensor, q_residual: torch.Tensor,
                       q: torch.Tensor, batch: BatchIndex, pools: CachePools, rope: RotaryTable,
                       kv_write: str) -> torch.Tensor:
        """:meth:`decode`'s attention [B, H, d] by ``backend`` over the window ring rows (already
        stored) and the picked (CSA) or all visible (HCA) entries, as stored."""
        window, layer = pools["window"], self.layer_idx
        scopes = [window_scope(window, layer, batch, pools, self.sliding_window, "v4", self.rope_dims)]
        comp = self.compressor
        if comp is not None:
            counts = comp.decode_store(x, batch, pools, rope, kv_write)
            entries = pools[comp.pool_prefix + "entries"]
            if isinstance(comp, CSACompressor):
                picks = comp.indexer.decode_select(x, q_residual, batch, pools, rope, kv_write)
                scopes.append(entry_scope(entries, comp.pool_layer, batch, pools, "v4", picks=picks,
                                          rope_dims=self.rope_dims))
            else:
                scopes.append(entry_scope(entries, comp.pool_layer, batch, pools, "v4", counts=counts,
                                          rope_dims=self.rope_dims))
        return sparse_attend(backend, q, scopes, self.sinks, self.scale)

    @property
    def row_norm(self) -> RowNorm:
        return RowNorm(self.kv_norm.weight, self.kv_norm.eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_residual [N, q_lora_rank], q [N, H, d], the new K = V rows [N, d]) of x [N, D]."""
        q_residual, q = self.project_queries(x, cos, sin)
        return q_residual, q, norm_rope_rows(self.kv_proj(x), self.row_norm, cos, sin)

    def project_queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_residual [N, q_lora_rank], q [N, H, d]) of x [N, D]."""
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim)
        return q_residual, apply_trailing_rope(unweighted_rms_norm(q, self.eps), cos, sin)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        o = apply_trailing_rope(o, cos, sin, inverse=True)
        return grouped_output_projection(o, self.o_a_proj, self.o_b_proj)


def gather_window(pool, layer: int, batch: BatchIndex, pools: CachePools,
                  window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's window rows (this step's already stored) from ring pool ``pool`` in
    position order, [B, window, d] (zero before position 0), with its [B, window] float32 bias."""
    key_pos = window_key_positions(batch, window)
    keys = pool.get(layer, batch.ring_rows(pools, pool.name, key_pos))
    visible = key_pos >= 0
    keys = torch.where(visible.unsqueeze(-1), keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    return keys, bias_from_visible(visible)
