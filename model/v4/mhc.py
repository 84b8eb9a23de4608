"""Manifold-constrained hyper-connections (mHC): the residual is ``hc`` parallel streams.

A *site* (two per V4 layer: before attention, before the MoE) reads the streams X [T, hc, D]
and produces three float32 weight sets from one projection of the flattened, unweighted-
RMS-normed streams:

- ``pre``  [T, hc]:     ``sigmoid(mix·scale0 + base) + hc_eps``; collapses the streams into
  the sublayer input ``u = Σ_k pre_k X_k``;
- ``post`` [T, hc]:     ``2·sigmoid(mix·scale1 + base)``; spreads the sublayer output back;
- ``comb`` [T, hc, hc]: ``softmax(mix·scale2 + base) + hc_eps`` then Sinkhorn: one column
  pass, then ``iters − 1`` (row pass, column pass) rounds — it ends on a column pass, so
  rows sum to 1 only approximately. The order matters for exactness.

After the sublayer F: ``X'_k = post_k · F(u) + Σ_j comb[j, k] · X_j`` (comb transposed).
The projection row layout is [pre (hc) | post (hc) | comb (hc·hc, row-major)].

V4 computes and consumes ``pre`` at the same site; V4.1 feeds one site's ``pre`` to the next
site — :func:`mhc_site_weights`, :func:`collapse_streams` and :func:`expand_streams` are
separate so both schedules can be built from them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.v4.norm import unweighted_rms_norm


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Column-first Sinkhorn normalisation of [..., hc, hc], ending on a column pass."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_site_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [T, hc], post [T, hc], comb [T, hc, hc])`` in float32 for streams [T, hc, D].

    ``fn`` is [(2 + hc)·hc, hc·D], ``base`` [(2 + hc)·hc], ``scale`` [3] (pre, post, comb).
    """
    hc = streams.shape[-2]
    flat = unweighted_rms_norm(streams.flatten(-2).float(), norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    base = base.float()
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb_logits = comb_w.view(*comb_w.shape[:-1], hc, hc) * s_comb + comb_b.view(hc, hc)
    comb = torch.softmax(comb_logits, dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def collapse_streams(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``Σ_k pre_k X_k`` [T, D]: float32 weighting, result in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def expand_streams(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """New streams ``post_k · out + Σ_j comb[j, k] X_j`` [T, hc, D], in the streams' dtype.

    The arithmetic runs in ``compute_dtype`` (default: the streams' dtype, as V4 does; V4.1
    passes float32 and casts once at the end).
    """
    dtype = compute_dtype or streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams.to(dtype))
    return (post.to(dtype).unsqueeze(-1) * out.to(dtype).unsqueeze(-2) + mixed).to(streams.dtype)


class HyperConnection(nn.Module):
    """One mHC site's parameters (float32): ``fn``, ``base``, ``scale`` (HF ``attn_hc``/``ffn_hc``)."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(n, hc_mult * hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre, post, comb)`` for streams [T, hc, D]; see :func:`mhc_site_weights`."""
        return mhc_site_weights(
            streams, self.fn, self.base, self.scale,
            hc_eps=self.hc_eps, sinkhorn_iters=self.sinkhorn_iters, norm_eps=self.norm_eps,
        )


class HyperHead(nn.Module):
    """V4's final collapse: ``Σ_k (sigmoid(mix_k·hc_scale + hc_base_k) + hc_eps) X_k`` [T, D]."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(hc_mult), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mix = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return collapse_streams(streams, pre)
