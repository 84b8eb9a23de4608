"""V4 rotary embedding: interleaved pairs on the *trailing* ``rot_dim`` dims of each head.

V4 uses two tables: window-only layers rotate with ``rope_theta`` and no YaRN; every layer
with a compressor rotates q, window kv, compressed entries and indexer q/k with
``compress_rope_theta`` and the YaRN frequency ramp, with cos/sin left unscaled (no mscale;
``attention_factor`` is 1.0 in every released config). Angles are ``position * inv_freq`` in
float32, computed per call from the positions (no table over max_position_embeddings, which
is 1M for V4). The attention output is rotated back with :func:`apply_trailing_rope`'s
``inverse=True`` at the query positions, because V = K carried the keys' rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.rope import apply_trailing_rope, yarn_inv_freq

__all__ = ["RopeSpec", "RotaryTable", "YarnParams", "apply_trailing_rope"]


@dataclass(frozen=True)
class YarnParams:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: base, optional YaRN ramp, and the factor applied to cos/sin."""

    theta: float
    yarn: YarnParams | None = None
    attention_factor: float = 1.0


class RotaryTable:
    """cos/sin for ``rot_dim`` trailing dims at arbitrary positions (one entry per pair)."""

    def __init__(self, rot_dim: int, spec: RopeSpec) -> None:
        if rot_dim % 2:
            raise ValueError(f"rope dim must be even, got {rot_dim}")
        self.rot_dim = rot_dim
        self.spec = spec
        y = spec.yarn
        with torch.device("cpu"):  # real values even when the model is built on the meta device
            if y is None or y.factor <= 1.0:
                self.inv_freq = 1.0 / (spec.theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
            else:
                self.inv_freq = yarn_inv_freq(
                    rot_dim, spec.theta, y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow
                )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each [N, rot_dim/2], rounded to ``dtype`` (the activations' dtype)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        f = self.spec.attention_factor
        return (freqs.cos() * f).to(dtype), (freqs.sin() * f).to(dtype)
