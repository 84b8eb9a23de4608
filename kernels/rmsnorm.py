"""RMSNorm: torch reference (fp32 math, result cast back to the input dtype) and dispatch."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_after_cast_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4.1's rounding: ``x / rms(x)`` (float32 statistic) cast to x's dtype first, then
    times ``weight`` in the weight's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in float32 like HF's DeepseekV3RMSNorm."""
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + norm: returns (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x
