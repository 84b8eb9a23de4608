"""Top-k with a fixed order among ties, for the indexer's picks and V4.1's candidate blocks.

Tied scores are common there: an indexer score is a weighted sum of ReLUs, exactly 0 wherever
every head's dot product is negative, and padded or masked entries are all -inf. ``torch.topk``
leaves the order among ties to the backend (CUDA's radix select depends on the row length), so
one request could pick different entries alone and inside a padded batch. Here ties go to the
lower index, so the picks depend on the scores only.

Scores of 32 bits or fewer take one ``torch.topk`` over int64 keys ``(ordered score bits << 32)
| (2^32 − 1 − index)``: unique per entry, so the radix select has no ties to break, and the
order is score first, lower index second — the stable sort's order without sorting every row
(at 64k entries a row, the decode's width, a full sort costs several times the select).
Wider scores (float64 checks) take the stable sort. A kernel can write the keys itself
(:func:`order_keys`' layout; the indexer's does), leaving one select.
"""

from __future__ import annotations

import torch


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys of 32-bit-or-narrower float scores [..., n] (n < 2^32): ``(ordered bits << 32) |
    (2^32 − 1 − index)``, whose descending order is :func:`ordered_topk`'s (−0.0 taken as 0.0)."""
    x = scores.float()
    bits = torch.where(x == 0, 0.0, x).view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order = float order
    return (ordered << 32) | (0xFFFFFFFF - torch.arange(scores.shape[-1], device=scores.device))


def key_scores(keys: torch.Tensor) -> torch.Tensor:
    """The float32 scores of :func:`order_keys` keys (their high 32 bits; −0.0 comes back as 0.0)."""
    ordered = keys >> 32
    return torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(torch.int32).view(torch.float32)


# Every key of a −inf score is at most this; every finite score's key is above it.
NEG_INF_KEY_MAX = (((0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF) << 32) | 0xFFFFFFFF


def ordered_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest ``scores`` along the last dim, largest first and,
    among equal values, lower index first (NaN-free scores; −0.0 and 0.0 are equal)."""
    if scores.dtype == torch.float64 or scores.shape[-1] >= 2**32:
        values, indices = scores.sort(dim=-1, descending=True, stable=True)
        return values[..., :k], indices[..., :k]
    _, indices = order_keys(scores).topk(k, dim=-1)
    return scores.gather(-1, indices), indices
