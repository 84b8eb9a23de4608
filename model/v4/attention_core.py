"""V4's attention core: one shared K = V head, a per-head sink logit, additive masks.

Each query attends a key set laid out as [window rows ‖ compressed entries] with an
additive float32 bias (0 = visible, −inf = hidden). The logits are ``q·kᵀ · scale`` (V4:
``head_dim^-0.5`` on every layer, no YaRN mscale); the per-head sink ``s_h`` is one more
logit column that only enlarges the softmax denominator: ``p = softmax([logits, s_h])[:-1]``,
``o = p · kv``. The value is the same tensor as the key, rotated dims included; callers undo
the rotation on ``o`` (``rope.apply_trailing_rope(..., inverse=True)``).

The mask builders express V4's visibility rules:

- window: query at position t sees raw rows at positions (t − window, t];
- compressed, causal (HCA): entry w (pooled over positions w·m … w·m + m − 1) is visible to
  query t iff (w + 1)·m ≤ t + 1, i.e. w < (t + 1) // m — usable in the step that completes it;
- compressed, selected (CSA): only the indexer's picks (−1 = no pick) are visible.
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """o [..., T, H, d] for q [..., T, H, d], shared kv [..., S, d], bias [..., T, S] (float32),
    sinks [H] (float32); the leading dims (a training batch) are optional.

    Every row must have at least one visible key (the window always holds the query's own row).
    """
    t, h = q.shape[-3], q.shape[-2]
    logits = torch.matmul(q.transpose(-3, -2), kv.transpose(-1, -2).unsqueeze(-3)) * scale  # [..., H, T, S]
    logits = logits.float() + bias.unsqueeze(-3)
    sink_col = sinks.float().view(h, 1, 1).expand(*logits.shape[:-3], h, t, 1)
    combined = torch.cat([logits, sink_col], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, kv.unsqueeze(-3)).transpose(-3, -2)  # [..., T, H, d]


def window_bias(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[T, S] float32: 0 where q_pos − window < kv_pos ≤ q_pos, else −inf."""
    diff = q_pos[:, None] - kv_pos[None, :]
    visible = (diff >= 0) & (diff < window)
    return bias_from_visible(visible)


def causal_entry_bias(q_pos: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """[T, n] float32: entry w visible to query t iff w < (t + 1) // ratio."""
    w = torch.arange(num_entries, device=q_pos.device)
    visible = w[None, :] < ((q_pos[:, None] + 1) // ratio)
    return bias_from_visible(visible)


def selected_entry_bias(picks: torch.Tensor, num_entries: int) -> torch.Tensor:
    """[..., T, n] float32: 0 on the picked entries ``picks`` [..., T, k] (−1 = none), −inf elsewhere."""
    visible = torch.zeros(*picks.shape[:-1], num_entries + 1, dtype=torch.bool, device=picks.device)
    safe = torch.where(picks >= 0, picks, torch.full_like(picks, num_entries))
    visible.scatter_(-1, safe, True)
    return bias_from_visible(visible[..., :num_entries])


def visible_prefix_bias(counts: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float32: 0 on each row's first ``counts`` [B] columns (a padded gather's real
    rows), −inf after."""
    return bias_from_visible(torch.arange(width, device=counts.device) < counts.unsqueeze(-1))


def bias_from_visible(visible: torch.Tensor) -> torch.Tensor:
    """float32 0 where ``visible``, −inf elsewhere."""
    zero = torch.zeros((), dtype=torch.float32, device=visible.device)
    return torch.where(visible, zero, torch.full_like(zero, float("-inf")))
