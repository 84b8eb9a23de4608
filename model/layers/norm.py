"""RMSNorm module over the kernels' dispatch function."""

from __future__ import annotations

import torch
from torch import nn

from kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_after_cast_reference


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` with float32 statistics.

    ``weight_after_cast=False`` (DeepSeek V2/V3/R1 and V4): the weight multiplies in float32,
    then the result is cast to x's dtype. ``True`` (DeepSeek-V4.1's rounding): the normalized
    value is cast to x's dtype first and the weight, kept in the model dtype, multiplies it.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 weight_after_cast: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight_after_cast = weight_after_cast
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_after_cast:
            return rms_norm_after_cast_reference(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one fused pass where the kernels allow; with no
        residual, (norm(x), x)."""
        if self.weight_after_cast:
            s = x if residual is None else x + residual
            return rms_norm_after_cast_reference(s, self.weight, self.eps), s
        return add_rms_norm(x, residual, self.weight, self.eps)
