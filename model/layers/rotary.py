"""Rotary embedding module: builds the (YaRN) cos/sin cache once from the model config."""

from __future__ import annotations

import torch
import torch.nn as nn

from kernels.rope import apply_rope, apply_rope_inplace, build_cos_sin_cache, yarn_attention_factor, yarn_inv_freq
from model.config import ModelConfig


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rs = config.rope_scaling
        self.rot_dim = config.qk_rope_head_dim
        inv_freq = yarn_inv_freq(
            self.rot_dim, config.rope_theta, rs.factor, rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow
        )
        attn_factor = yarn_attention_factor(rs.factor, rs.mscale, rs.mscale_all_dim)
        self.max_positions = max(config.max_position_embeddings, 1)
        cache = build_cos_sin_cache(inv_freq, self.max_positions, attn_factor)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, positions, self.cos_sin_cache)

    def rotate_trailing_(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate the last ``rot_dim`` dims of x [T, H, D] in place (MLA's q_pe inside q); returns x."""
        return apply_rope_inplace(x, positions, self.cos_sin_cache)
