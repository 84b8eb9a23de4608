"""V4's KV compressors (CSA with overlapping windows, HCA) and the lightning indexer.

A compressor turns every completed window of m tokens into one entry: per channel c, a
float32 softmax over the window's slots of ``gate + position_bias[slot]`` weights the slots'
``kv`` rows; the pooled row goes through ``kv_norm`` and RoPE (compress table) at the
window's first position w·m. HCA pools its m slots. CSA (``overlap``) projects to two halves
[Ca | Cb] and pools 2m slots: window w − 1's Ca (zero kv, −inf gate for w = 0) followed by
window w's Cb. The open window and the overlap half live in :class:`CompressorState`.

The lightning indexer (CSA layers) owns the same overlapping compressor at
``index_head_dim``; its entries are the index keys. A query t scores entry s as
``Σ_h w[t,h] · ReLU(q_I[t,h]·k_s) · index_head_dim^-0.5`` with ``w = weights_proj(x) ·
index_n_heads^-0.5``; entries not yet visible ((s + 1)·m > t + 1) score −inf, and the top
``index_topk`` picks that land on them become −1.
"""

from __future__ import annotations

import torch
from torch import nn

from model.layers.norm import RMSNorm
from model.v4.rope import RotaryTable, apply_trailing_rope
from model.v4.state import CompressorState


def pool_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """[n, c]: per-channel softmax over the slot axis (float32) of ``gate``, weighting ``kv``."""
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def overlap_windows(
    kv: torch.Tensor, gate: torch.Tensor, state: CompressorState, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSA slot layout [n_w, 2m, head_dim]: previous window's Ca, then this window's Cb.

    Reads the overlap half saved by the previous call and saves this call's last Ca.
    """
    n_w, m, _ = kv.shape
    slots_kv = kv.new_zeros(n_w, 2 * m, head_dim)
    slots_gate = gate.new_full((n_w, 2 * m, head_dim), float("-inf"))
    slots_kv[:, m:] = kv[..., head_dim:]
    slots_gate[:, m:] = gate[..., head_dim:]
    slots_kv[1:, :m] = kv[:-1, :, :head_dim]
    slots_gate[1:, :m] = gate[:-1, :, :head_dim]
    if state.prev_kv is not None:
        slots_kv[0, :m] = state.prev_kv.to(slots_kv.dtype)
        slots_gate[0, :m] = state.prev_gate.to(slots_gate.dtype)
    state.prev_kv = kv[-1, :, :head_dim].clone()
    state.prev_gate = gate[-1, :, :head_dim].clone()
    return slots_kv, slots_gate


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

    def new_state(self) -> CompressorState:
        return CompressorState(ratio=self.ratio, overlap=self.overlap)

    def compress(self, x: torch.Tensor, state: CompressorState, rope: RotaryTable) -> torch.Tensor:
        """Feed a chunk's normed inputs x [T, D]; returns all entries so far [n, head_dim]."""
        kv_w, gate_w, first = state.take_complete_windows(self.kv_proj(x), self.gate_proj(x))
        n_w = kv_w.shape[0]
        if n_w == 0:
            if state.entries is None:
                state.entries = x.new_zeros(0, self.head_dim)
            return state.entries
        gate_w = gate_w + self.position_bias
        if self.overlap:
            kv_w, gate_w = overlap_windows(kv_w, gate_w, state, self.head_dim)
        pooled = self.kv_norm(pool_windows(kv_w, gate_w))
        positions = (torch.arange(n_w, device=x.device) + first) * self.ratio
        cos, sin = rope.cos_sin(positions, pooled.dtype)
        return state.append_entries(apply_trailing_rope(pooled, cos, sin))


class IndexerScorer(nn.Module):
    """``weights_proj`` [index_n_heads, D] and the score formula (see the module doc)."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.softmax_scale = head_dim**-0.5
        self.weights_scaling = n_heads**-0.5
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False, dtype=dtype)
        self.weights_proj.requires_grad_(False)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Scores [T, n] for index queries q [T, H_I, c], keys [n, c], layer input x [T, D]."""
        scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * self.softmax_scale  # [T, H_I, n]
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

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, state: CompressorState,
               rope: RotaryTable, query_block: int = 256) -> torch.Tensor:
        """Update the index keys with the chunk and return each query's picks [T, k] (−1 = none).

        Queries are scored ``query_block`` at a time, so the scores stay [block, n] for long chunks.
        """
        keys = self.compress(x, state, rope)
        t, n = x.shape[0], keys.shape[0]
        if n == 0:
            return torch.empty(t, 0, dtype=torch.long, device=x.device)
        q = self.q_b_proj(q_residual).view(t, self.n_heads, self.head_dim)
        cos, sin = rope.cos_sin(positions, x.dtype)
        q = apply_trailing_rope(q, cos, sin)
        entry = torch.arange(n, device=x.device).unsqueeze(0)
        picks = []
        for a in range(0, t, query_block):
            b = min(a + query_block, t)
            scores = self.scorer(q[a:b], keys, x[a:b])
            threshold = ((positions[a:b] + 1) // self.ratio).unsqueeze(-1)  # entries visible to each query
            top = scores.masked_fill(entry >= threshold, float("-inf")).topk(min(self.topk, n), dim=-1).indices
            picks.append(torch.where(top >= threshold, torch.full_like(top, -1), top))
        return torch.cat(picks)


class CSACompressor(WindowCompressor):
    """Overlapping compressor at head_dim plus the lightning ``indexer``."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, indexer: LightningIndexer, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__(hidden, head_dim, ratio, True, eps, dtype)
        self.indexer = indexer
