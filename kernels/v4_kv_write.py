"""DeepSeek-V4 / V4.1 decode KV writes: norm + RoPE + cache encoding + insert, torch reference and dispatch.

Per decode token a layer stores rows in its row pools (model/v4/cache_pool.py):

- window row (every layer): ``encode(RoPE(norm(kv_proj(x))))`` at ring row ``p % window``;
- compressed entry (compressor layers, when position p closes a window of m tokens): the
  raw ``kv`` / ``gate`` rows of the window (V4 CSA: window w − 1's first half and window w's
  second half, 2m slots) pooled by a float32 softmax over the slots per channel
  (:func:`pool_window_rows`), normed, rotated at the window's first position w·m, encoded and
  put at paged row w; the new raw rows go to their rings first. V4.1's indexer keys are a
  row write of ``wk(latent)`` (normed, rotated, encoded) at the same paged row.

``encode`` is the pool's row codec (plain model dtype, V4.1's fake-quantized values, or the
packed FP8/FP4 records of kernels/v4_cache_formats.py); its ``fmt`` name tells the fused
kernels (kernels/v4_kv_write_triton.py) which encoding to reproduce. The functions here are
the one definition of this math: the model's chunk path and decode path both call them.
:func:`kernels.attention.v4_kv_write.write_rows` / ``compress_step`` run the fused Triton
kernels on CUDA (``impl`` ``auto``) and these references otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.rmsnorm import rms_norm_after_cast_reference, rms_norm_reference
from kernels.rope import apply_trailing_rope

@dataclass(frozen=True)
class RowNorm:
    """A weighted RMSNorm: V4 multiplies the weight in float32 (``weight_after_cast`` False),
    V4.1 casts the normalized value to the input dtype first."""

    weight: torch.Tensor
    eps: float
    weight_after_cast: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        norm = rms_norm_after_cast_reference if self.weight_after_cast else rms_norm_reference
        return norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class RowStore:
    """A pool layer's rows ``flat`` [rows, width], its codec's ``encode`` [N, dim] → [N, width]
    and that encoding's name ``fmt`` (model/v4/cache_pool.py ``RowCodec.format``)."""

    flat: torch.Tensor
    encode: Callable[[torch.Tensor], torch.Tensor]
    fmt: str


@dataclass(frozen=True)
class RowTarget:
    """Where B requests' new rows go, for tokens at ``positions`` [B]: a ring (row ``p % rows``
    of the unit at ``ring_base`` [B]) or a paged pool (row ``(p + 1) // ratio − 1`` through
    ``page_table`` [B, pages] of ``rows``-row pages, written only where p closes a window of
    ``ratio``; the others go to row 0, the scratch unit's)."""

    positions: torch.Tensor
    rows: int
    ring_base: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    ratio: int = 1

    def flat_rows(self) -> torch.Tensor:
        p = self.positions
        if self.ring_base is not None:
            return self.ring_base + p.remainder(self.rows)
        index = ((p + 1) // self.ratio - 1).clamp_min(0).unsqueeze(-1)
        rows = (self.page_table.gather(1, index // self.rows) * self.rows + index % self.rows).squeeze(-1)
        return torch.where((p + 1) % self.ratio == 0, rows, torch.zeros_like(rows))


def norm_rope_rows(x: torch.Tensor, norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``RoPE(norm(x))`` on the trailing ``2·cos.shape[-1]`` dims: the K = V rows of x [N, d]."""
    return apply_trailing_rope(norm(x), cos, sin)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """[n, c]: per-channel softmax over the slot axis (float32) of ``gate``, weighting ``kv``."""
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def pool_window_rows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor | None = None,
                     prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None,
                     has_prev: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled rows [N, c] of N windows' raw rows kv, gate [N, m, width] (gate plus the float32
    ``position_bias`` [m, width]). With ``prev_*`` (V4's overlapping CSA, width = 2c): the
    previous windows' first halves (where ``has_prev`` [N]; else zero kv, −inf gate) then
    these windows' second halves, 2m slots."""
    if position_bias is not None:
        gate = gate + position_bias
    if prev_kv is not None:
        d = kv.shape[-1] // 2
        prev = has_prev.view(-1, 1, 1)
        prev_gate = prev_gate + position_bias if position_bias is not None else prev_gate
        ca_kv = torch.where(prev, prev_kv[..., :d], torch.zeros((), dtype=kv.dtype, device=kv.device))
        ca_gate = torch.where(prev, prev_gate[..., :d], torch.full((), float("-inf"), dtype=gate.dtype,
                                                                     device=kv.device))
        kv = torch.cat([ca_kv, kv[..., d:]], dim=1)
        gate = torch.cat([ca_gate, gate[..., d:]], dim=1)
    return pool_windows(kv, gate)


def write_rows_reference(x: torch.Tensor, norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor, store: RowStore,
                         target: RowTarget) -> torch.Tensor:
    """Store ``encode(RoPE(norm(x)))`` of rows x [B, d] at ``target``; returns ``norm(x)``."""
    latent = norm(x)
    store.flat[target.flat_rows()] = store.encode(apply_trailing_rope(latent, cos, sin))
    return latent


def compress_step_reference(kv: torch.Tensor, gate: torch.Tensor, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
                            ring: RowTarget, gate_base: torch.Tensor, ratio: int, overlap: bool,
                            position_bias: torch.Tensor | None, norm: RowNorm, cos: torch.Tensor, sin: torch.Tensor,
                            store: RowStore, target: RowTarget) -> torch.Tensor:
    """One decode token per request: put the new raw rows kv, gate [B, width] in their rings
    (flat [rows, width]; ``ring`` for kv, the same with unit bases ``gate_base`` for gate),
    pool the window ending at each token (every request computes one; ``target`` writes only
    those that close), norm it in the model dtype (``cos``'s), rotate it at the window's first
    position (cos/sin there) and store it. Returns the normed, unrotated latents [B, c]
    (V4.1's indexer keys are made from them)."""
    p, m, r = ring.positions, ratio, ring.rows
    kv_base, gate_base = ring.ring_base.unsqueeze(-1), gate_base.unsqueeze(-1)
    kv_ring[ring.flat_rows()] = kv
    gate_ring[gate_base.squeeze(-1) + p.remainder(r)] = gate
    this = (p + 1 - m).unsqueeze(-1) + torch.arange(m, device=p.device)  # the window ending at p
    prev = {}
    if overlap:
        before = (this - m).remainder(r)
        prev = {"prev_kv": kv_ring[kv_base + before], "prev_gate": gate_ring[gate_base + before],
                "has_prev": (p + 1) // m - 1 > 0}
    pooled = pool_window_rows(kv_ring[kv_base + this.remainder(r)], gate_ring[gate_base + this.remainder(r)],
                              position_bias, **prev)
    latent = norm(pooled.to(cos.dtype))
    store.flat[target.flat_rows()] = store.encode(apply_trailing_rope(latent, cos, sin))
    return latent
