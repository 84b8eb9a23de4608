"""Manifold-constrained hyper-connections (mHC) with V4.1's single-pass schedule.

The residual is ``hc_mult`` parallel streams ``X [T, hc, D]``. Each site (attention, FFN)
projects the flattened, RMS-normalized streams once to ``(pre, post, comb)``:
``pre = sigmoid(.)+eps`` [hc], ``post = 2·sigmoid(.)`` [hc], and ``comb`` [hc, hc], a
softmax made (approximately) doubly stochastic by Sinkhorn iterations that start and end
on a column pass. V4.1 consumes each site's ``pre`` at the *next* site: layer 0's
attention collapses with a one-hot ``pre`` (stream 0), every FFN with its own layer's
attention-site ``pre``, the next attention with the previous FFN-site ``pre``, and the final
norm with the last FFN-site ``pre`` (there is no separate head mix). After the sublayer F:
``X'_k = post_k · F + Σ_j comb[j, k] · X_j``. All of it runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.v41.norm import unweighted_rms_norm


def hc_site_mixes(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
    norm_eps: float, hc_eps: float, sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (all fp32)."""
    hc = streams.shape[-2]
    flat = unweighted_rms_norm(streams.flatten(-2).float(), norm_eps)
    mix = F.linear(flat, fn.float())
    pre = torch.sigmoid(mix[..., :hc] * scale[0].float() + base[:hc].float()) + hc_eps
    post = 2 * torch.sigmoid(mix[..., hc : 2 * hc] * scale[1].float() + base[hc : 2 * hc].float())
    logits = (mix[..., 2 * hc :] * scale[2].float() + base[2 * hc :].float()).view(*mix.shape[:-1], hc, hc)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_k pre_k · X_k in fp32, cast to the streams' dtype: [T, hc, D] -> [T, D]."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def hc_expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """post_k · out + Σ_j comb[j, k] · residual_j: out [T, D], residual [T, hc, D]."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), residual.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(residual.dtype)


def one_hot_pre(num_tokens: int, hc: int, device) -> torch.Tensor:
    """The ``pre`` layer 0's attention site collapses with: stream 0 only."""
    pre = torch.zeros(num_tokens, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre
