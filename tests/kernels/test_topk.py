"""kernels/topk.py: the indexer's top-k gives ties to the lower index, so a request's picks do
not depend on the padded batch it decodes in."""

from __future__ import annotations

import torch

from kernels.topk import ordered_topk


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


def test_the_key_select_of_32_bit_scores_equals_the_stable_sort():
    """float32 / bf16 scores (the path without a sort): ReLU zeros of both signs, −inf padding,
    ties among the largest, negative scores."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 300, generator=g)
    scores = torch.where(scores < 0.3, scores.clamp_min(0) * torch.sign(torch.randn(4, 300, generator=g)), scores)
    scores[:, 250:] = float("-inf")
    scores[1, 10] = scores[1, 20] = scores[1].max()
    scores[2] = -scores[2].abs() - 1
    for dtype in (torch.float32, torch.bfloat16):
        s = scores.to(dtype)
        want = (s.float() + 0.0).sort(dim=-1, descending=True, stable=True)
        for k in (1, 64, 300):
            values, indices = ordered_topk(s, k)
            assert torch.equal(indices, want.indices[:, :k]), (dtype, k)
            assert torch.equal(values, s.gather(-1, want.indices[:, :k]))
