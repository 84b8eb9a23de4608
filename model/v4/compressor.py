"""V4's KV compressors (CSA with overlapping windows, HCA) and the lightning indexer.

A compressor turns every completed window of m tokens into one entry: per channel c, a
float32 softmax over the window's slots of ``gate + position_bias[slot]`` weights the slots'
``kv`` rows; the pooled row goes through ``kv_norm`` and RoPE (compress table) at the
window's first position w·m. HCA pools its m slots. CSA (``overlap``) projects to two halves
[Ca | Cb] and pools 2m slots: window w − 1's Ca (zero kv, −inf gate for w = 0) followed by
window w's Cb. The raw rows of the open window (and, for CSA, of the previous one) live in
the request's ring pools, the entries in a paged pool (model/v4/state.py).

The lightning indexer (CSA layers) owns the same overlapping compressor at
``index_head_dim``; its entries are the index keys. A query t scores entry s as
``Σ_h w[t,h] · ReLU(q_I[t,h]·k_s) · index_head_dim^-0.5`` with ``w = weights_proj(x) ·
index_n_heads^-0.5``; entries not yet visible ((s + 1)·m > t + 1) score −inf, and the top
``index_topk`` picks that land on them become −1.

Two paths share the pooling: :meth:`WindowCompressor.compress` feeds one request's chunk
(any length; any number of windows close), :meth:`WindowCompressor.decode_step` advances B
requests by one token each in one batch (every request computes a candidate entry; those
whose window did not close write it to the pool's scratch unit), then gathers every
request's entries into a padded [B, N, d] tensor with its counts (:meth:`decode_store` only
stores, for attention that reads the pool in place: model/v4/sparse_attention.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention.v4_kv_write import compress_step
from kernels.v4_kv_write import RowNorm, RowStore, RowTarget, norm_rope_rows, pool_window_rows
from model.layers.norm import RMSNorm
from model.v4.rope import RotaryTable, apply_trailing_rope
from model.v4.cache_pool import BatchIndex, CachePools, RowLease
from kernels.topk import ordered_topk


class WindowCompressor(nn.Module):
    """``kv_proj``, ``gate_proj``, ``position_bias`` [m, width] (float32), ``kv_norm`` [head_dim]."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32), requires_grad=False)
        self.kv_norm = RMSNorm(head_dim, eps, torch.float32)
        self.kv_proj.requires_grad_(False)
        self.gate_proj.requires_grad_(False)

    @property
    def ring_rows(self) -> int:
        """Raw rows a request's ring keeps: the open window, and the previous one for CSA."""
        return 2 * self.ratio if self.overlap else self.ratio

    def bind_pools(self, prefix: str, layer: int) -> None:
        """Use pools ``<prefix>kv``, ``<prefix>gate`` (rings) and ``<prefix>entries`` (paged), layer ``layer``."""
        self.pool_prefix, self.pool_layer = prefix, layer

    def pool_rows(self, kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None,
                  prev_gate: torch.Tensor | None, has_prev: torch.Tensor | None, window_ids: torch.Tensor,
                  rope: RotaryTable) -> torch.Tensor:
        """Entries [N, head_dim] of N closed windows from their raw rows kv, gate [N, m, width]
        (gate without the position bias) and, for CSA, the previous windows' raw rows (used
        where ``has_prev`` [N]; window 0 has none: zero kv, −inf gate)."""
        prev = {"prev_kv": prev_kv, "prev_gate": prev_gate, "has_prev": has_prev} if self.overlap else {}
        pooled = pool_window_rows(kv, gate, self.position_bias, **prev)
        cos, sin = rope.cos_sin(window_ids * self.ratio, pooled.dtype)
        return norm_rope_rows(pooled, self.row_norm, cos, sin)

    @property
    def row_norm(self) -> RowNorm:
        return RowNorm(self.kv_norm.weight, self.kv_norm.eps)

    def compress(self, x: torch.Tensor, start: int, lease: RowLease, pools: CachePools,
                 rope: RotaryTable) -> torch.Tensor:
        """Feed one request's chunk x [T, D] at positions ``start …``; returns all its entries so
        far [n, head_dim] as stored (decoded)."""
        n = self.compress_store(x, start, lease, pools, rope)
        name = self.pool_prefix + "entries"
        return pools[name].get(self.pool_layer, lease.rows(name, 0, n))

    def compress_store(self, x: torch.Tensor, start: int, lease: RowLease, pools: CachePools,
                       rope: RotaryTable) -> int:
        """:meth:`compress` without reading the entries back: returns their count n."""
        m, t, layer = self.ratio, x.shape[0], self.pool_layer
        kv_pool, gate_pool = pools[self.pool_prefix + "kv"], pools[self.pool_prefix + "gate"]
        name = self.pool_prefix + "entries"
        entries, end = pools[name], start + x.shape[0]
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        n_old, n_new = start // m, end // m
        if n_new > n_old:
            lag = 1 if self.overlap else 0  # CSA also reads the window before the first one it closes
            first = (n_old - lag) * m
            have = max(first, 0)
            pad = have - first  # window −1 (before position 0): rows that pool_rows masks
            rows = lease.rows(kv_pool.name, have, start)
            buf_kv = torch.cat([kv.new_zeros(pad, kv.shape[-1]), kv_pool.get(layer, rows), kv])
            buf_gate = torch.cat([gate.new_zeros(pad, gate.shape[-1]), gate_pool.get(layer, rows), gate])
            n_w = n_new - n_old
            wins_kv = buf_kv[: (n_w + lag) * m].reshape(n_w + lag, m, -1)
            wins_gate = buf_gate[: (n_w + lag) * m].reshape(n_w + lag, m, -1)
            ids = torch.arange(n_old, n_new, device=x.device)
            new = self.pool_rows(wins_kv[lag:], wins_gate[lag:], wins_kv[:-1] if lag else None,
                                 wins_gate[:-1] if lag else None, ids > 0, ids, rope)
            lease.reserve(name, n_new)
            entries.put(layer, lease.rows(name, n_old, n_new), entries.codec.encode(new))
        keep = min(t, self.ring_rows)
        kv_pool.put(layer, lease.rows(kv_pool.name, end - keep, end), kv[t - keep:])
        gate_pool.put(layer, lease.rows(gate_pool.name, end - keep, end), gate[t - keep:])
        return n_new

    def decode_step(self, x: torch.Tensor, batch: BatchIndex, pools: CachePools, rope: RotaryTable,
                    kv_write: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode_store`, then every request's entries gathered [B, N, head_dim] (zero
        past its count) with the counts [B]."""
        counts = self.decode_store(x, batch, pools, rope, kv_write)
        return batch.gather_prefix(pools, self.pool_prefix + "entries", self.pool_layer, counts), counts

    def decode_store(self, x: torch.Tensor, batch: BatchIndex, pools: CachePools, rope: RotaryTable,
                     kv_write: str = "auto") -> torch.Tensor:
        """B requests, one token each (x [B, D] at ``batch.positions``): store the raw rows, emit
        the entries of the windows that close (kernels/v4_kv_write.py, ``kv_write`` its
        implementation); returns each request's entry count [B]."""
        m, layer, p = self.ratio, self.pool_layer, batch.positions
        kv_name, gate_name, name = (self.pool_prefix + k for k in ("kv", "gate", "entries"))
        kv_pool, gate_pool, entries = pools[kv_name], pools[gate_name], pools[name]
        cos, sin = rope.cos_sin(((p + 1) // m - 1).clamp_min(0) * m, x.dtype)
        ring = RowTarget(p, kv_pool.rows_per_unit, ring_base=batch.ring_base[kv_name])
        target = RowTarget(p, entries.rows_per_unit, page_table=batch.page_tables[name], ratio=m)
        store = RowStore(entries.flat(layer), entries.codec.encode, entries.codec.format)
        compress_step(self.kv_proj(x), self.gate_proj(x), kv_pool.flat(layer), gate_pool.flat(layer), ring,
                      batch.ring_base[gate_name], m,
                      self.overlap, self.position_bias, self.row_norm, cos, sin, store, target, kv_write)
        return (p + 1) // m


class IndexerScorer(nn.Module):
    """``weights_proj`` [index_n_heads, D] and the score formula (see the module doc)."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.softmax_scale = head_dim**-0.5
        self.weights_scaling = n_heads**-0.5
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False, dtype=dtype)
        self.weights_proj.requires_grad_(False)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Scores [T, n] for index queries q [T, H_I, c], keys [n, c] (or [T, n, c]: each query
        its own request's keys), layer input x [T, D]."""
        scores = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2))) * self.softmax_scale
        weights = self.weights_proj(x).float() * self.weights_scaling
        return (scores * weights.unsqueeze(-1)).sum(dim=1)


class LightningIndexer(WindowCompressor):
    """The CSA indexer: its own overlapping compressor, ``q_b_proj`` and ``scorer``."""

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int, topk: int,
                 eps: float, dtype: torch.dtype) -> None:
        super().__init__(hidden, head_dim, ratio, True, eps, dtype)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, dtype=dtype)
        self.q_b_proj.requires_grad_(False)
        self.scorer = IndexerScorer(hidden, n_heads, head_dim, dtype)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, lease: RowLease,
               pools: CachePools, rope: RotaryTable, query_block: int = 256) -> torch.Tensor:
        """Update one request's index keys with its chunk and return each query's picks [T, k]
        (−1 = none). Queries are scored ``query_block`` at a time, so the scores stay [block, n]."""
        keys = self.compress(x, int(positions[0]), lease, pools, rope)
        t, n = x.shape[0], keys.shape[0]
        if n == 0:
            return torch.empty(t, 0, dtype=torch.long, device=x.device)
        q = self.queries(q_residual, positions, rope)
        entry = torch.arange(n, device=x.device).unsqueeze(0)
        picks = []
        for a in range(0, t, query_block):
            b = min(a + query_block, t)
            scores = self.scorer(q[a:b], keys, x[a:b])
            picks.append(self.top_picks(scores, entry, ((positions[a:b] + 1) // self.ratio).unsqueeze(-1)))
        return torch.cat(picks)

    def decode_select(self, x: torch.Tensor, q_residual: torch.Tensor, batch: BatchIndex, pools: CachePools,
                      rope: RotaryTable, kv_write: str = "auto") -> torch.Tensor:
        """B requests, one token each: update their index keys, return their picks [B, k]."""
        keys, counts = self.decode_step(x, batch, pools, rope, kv_write)
        q = self.queries(q_residual, batch.positions, rope)
        scores = self.scorer(q, keys, x)  # [B, N]
        entry = torch.arange(keys.shape[1], device=x.device).unsqueeze(0)
        return self.top_picks(scores, entry, counts.unsqueeze(-1))

    def queries(self, q_residual: torch.Tensor, positions: torch.Tensor, rope: RotaryTable) -> torch.Tensor:
        q = self.q_b_proj(q_residual).view(q_residual.shape[0], self.n_heads, self.head_dim)
        cos, sin = rope.cos_sin(positions, q_residual.dtype)
        return apply_trailing_rope(q, cos, sin)

    def top_picks(self, scores: torch.Tensor, entry: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Top ``topk`` of scores [T, n] among the ``visible`` [T, 1] first entries; −1 past them."""
        _, indices = ordered_topk(scores.masked_fill(entry >= visible, float("-inf")), min(self.topk, scores.shape[-1]))
        return torch.where(indices >= visible, torch.full_like(indices, -1), indices)


class CSACompressor(WindowCompressor):
    """Overlapping compressor at head_dim plus the lightning ``indexer``."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, indexer: LightningIndexer, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__(hidden, head_dim, ratio, True, eps, dtype)
        self.indexer = indexer
