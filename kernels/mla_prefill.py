"""MLA prefill attention (non-absorbed form) for one sequence: torch reference + dispatch.

Keys/values are the up-projected latents: k = [k_nope ‖ k_pe] (k_pe shared by all heads),
v per head. The query block holds the *last* ``Tq`` positions of a ``Tk``-long context
(chunked prefill: earlier tokens come from the cache), so query i sees keys 0..Tk-Tq+i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_offset_mask(tq: int, tk: int, device) -> torch.Tensor:
    """Boolean [tq, tk]: True where query i (at position tk - tq + i) may attend key j."""
    q_pos = torch.arange(tk - tq, tk, device=device)
    return torch.arange(tk, device=device)[None, :] <= q_pos[:, None]


def mla_prefill_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] → [Tq, H, Dv] (math in float32)."""
    tq, tk = q.shape[0], k.shape[0]
    mask = causal_offset_mask(tq, tk, q.device)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask,
        scale=softmax_scale,
    )
    return out.transpose(0, 1).to(q.dtype)


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    return mla_prefill_reference(q, k, v, softmax_scale)
