"""RMSNorm without a weight, as V4 uses it in the mHC flatten-norm, the per-head q norm and
the HyperHead. (The weighted RMSNorm is ``model.layers.norm.RMSNorm``, kept in float32.)"""

from __future__ import annotations

import torch


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim; the statistic is float32, the product in x's dtype."""
    rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x * rstd.to(x.dtype)
