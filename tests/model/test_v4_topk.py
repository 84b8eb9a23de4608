"""model/v4/topk.py: the indexer's top-k gives ties to the lower index, so a request's picks do
not depend on the padded batch it decodes in."""

from __future__ import annotations

import torch

from model.v4.topk import ordered_topk


def test_ties_go_to_the_lower_index_and_padding_changes_nothing():
    g = torch.Generator().manual_seed(0)
    scores = torch.relu(torch.randn(3, 40, generator=g, dtype=torch.float64))  # ~half exact zeros
    scores[:, 5] = scores[:, 7] = 0.5  # a tie among the largest too
    values, indices = ordered_topk(scores, 30)
    assert torch.equal(values, scores.gather(-1, indices))
    assert torch.equal(values, scores.topk(30, dim=-1).values)  # the same values as torch.topk
    for row in range(3):
        for a, b in zip(indices[row, :-1].tolist(), indices[row, 1:].tolist()):
            assert scores[row, a] > scores[row, b] or a < b
    padded = torch.cat([scores, torch.full((3, 25), float("-inf"), dtype=torch.float64)], dim=-1)
    batch = torch.cat([padded, torch.zeros(2, 65, dtype=torch.float64)])
    assert torch.equal(ordered_topk(batch, 30)[1][:3], indices)
