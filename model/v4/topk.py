"""Top-k with a fixed order among ties, for the indexer's picks and V4.1's candidate blocks.

Tied scores are common there: an indexer score is a weighted sum of ReLUs, exactly 0 wherever
every head's dot product is negative, and padded or masked entries are all -inf. ``torch.topk``
leaves the order among ties to the backend (CUDA's radix select depends on the row length), so
one request could pick different entries alone and inside a padded batch. Here ties go to the
lower index, so the picks depend on the scores only.
"""

from __future__ import annotations

import torch


def ordered_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest ``scores`` along the last dim, largest first and,
    among equal values, lower index first."""
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]
