"""RMSNorm with DeepSeek-V4.1's rounding: statistics in fp32, the normalized value cast back
to the input dtype *before* the weight multiplies it (``w * (x·rsqrt(mean x² + eps)).to(dtype)``).

V4.1 uses ``rms_norm_eps = 1e-20`` everywhere, so an all-zero row would divide by ~1e-10;
the trained model never produces one. The weight stays in the model dtype. (V4 keeps its
norms in fp32 and multiplies before casting; the unweighted norm is V4's
``model.v4.norm.unweighted_rms_norm``.)
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

