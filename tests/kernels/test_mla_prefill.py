"""The split of a short chunk after a long cached prefix (``kernels.mla_prefill``): the piece
count, the LSE merge, and the whole split against the reference on CPU, with a torch stand-in
for the flash kernel (its GPU form is in test_prefill_gpu.py); the attention-with-LSE parts that
context windows are merged from."""

from __future__ import annotations

import pytest
import torch

from kernels import mla_prefill
from kernels.mla_prefill import (attention_with_lse_reference, flash_varlen_lse, merge_lse_,
                                 mla_prefill_after_context_split, mla_prefill_reference, merge_by_lse, tail_segments)


def fake_flash_forward(padded_lse: bool):
    """What torch's varlen flash kernel returns, computed in float32 on the CPU: the output and
    the LSE, per head and row ([H, total_q]) or padded per sequence ([num_seqs, H, max_q])."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        qs, ks = cu_q.tolist(), cu_k.tolist()
        outs, lses = [], []
        for j in range(len(qs) - 1):
            qj, kj, vj = q[qs[j]:qs[j + 1]].float(), k[ks[j]:ks[j + 1]].float(), v[ks[j]:ks[j + 1]].float()
            s = torch.einsum("thd,khd->htk", qj, kj) * scale
            if causal:
                s = s.masked_fill(~mla_prefill.causal_offset_mask(qj.shape[0], kj.shape[0], "cpu"), float("-inf"))
            lse = torch.logsumexp(s, -1)
            outs.append(torch.einsum("htk,khd->thd", torch.softmax(s, -1), vj))
            lses.append(torch.nn.functional.pad(lse, (0, max_q - lse.shape[1]), value=float("nan")) if padded_lse
                        else lse)
        lse = torch.stack(lses) if padded_lse else torch.cat(lses, dim=1)
        return torch.cat(outs).to(q.dtype), lse

    return run


def test_tail_segments_fill_two_waves_and_keep_pieces_long():
    assert tail_segments(301, 7891, 16, 132) == 6  # 48 CTAs: six pieces of ~1.3k keys
    assert tail_segments(700, 7110, 16, 132) == 3  # 96 CTAs
    assert tail_segments(1082, 7110, 16, 132) == 1  # 144 CTAs: more than one wave already
    assert tail_segments(4096, 4096, 16, 132) == 1  # 512 CTAs fill the GPU already
    assert tail_segments(7, 900, 16, 132) == 1  # a prefix too short to cut into 512-key pieces
    assert tail_segments(7, 100_000, 128, 132) == 3


def test_merge_by_lse_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 2, 8, generator=g), torch.randn(30, 2, 8, generator=g), torch.randn(30, 2, 8, generator=g)
    parts = [(0, 11), (11, 30)]
    outs, lses = [], []
    for a, b in parts:
        s = torch.einsum("thd,khd->htk", q, k[a:b])
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("htk,khd->thd", torch.softmax(s, -1), v[a:b]))
    full = torch.einsum("htk,khd->thd", torch.softmax(torch.einsum("thd,khd->htk", q, k), -1), v)
    torch.testing.assert_close(merge_by_lse(torch.stack(outs), torch.stack(lses)), full)
    # A part that saw no key (LSE -inf) adds nothing.
    got = merge_by_lse(torch.stack([outs[0], torch.zeros_like(outs[0])]),
                       torch.stack([lses[0], torch.full_like(lses[0], float("-inf"))]))
    torch.testing.assert_close(got, outs[0])


@pytest.mark.parametrize("padded_lse", [False, True])
@pytest.mark.parametrize("tq,context,segments", [(7, 600, 1), (13, 1200, 3), (64, 2048, 6)])
def test_split_after_context_matches_the_reference(monkeypatch, padded_lse, tq, context, segments):
    monkeypatch.setattr(mla_prefill, "_flash_forward", fake_flash_forward(padded_lse))
    g = torch.Generator().manual_seed(tq)
    heads, dim = 3, 16
    q = torch.randn(tq, heads, dim, generator=g)
    k, v = (torch.randn(context + tq, heads, dim, generator=g) for _ in range(2))
    got = mla_prefill_after_context_split(q, k, v, context, segments, 0.25)
    torch.testing.assert_close(got, mla_prefill_reference(q, k, v, 0.25), atol=2e-5, rtol=1e-4)


def _attention(q, k, v, causal, scale):
    s = torch.einsum("thd,khd->htk", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(~mla_prefill.causal_offset_mask(q.shape[0], k.shape[0], "cpu"), float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(s, -1), v.double()), torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_reference_matches_float64(causal):
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 5, generator=g)
    out, lse = attention_with_lse_reference(q, k, v, causal, 0.3)
    want_out, want_lse = _attention(q, k, v, causal, 0.3)
    assert out.shape == (6, 2, 5) and lse.shape == (2, 6) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padded_lse", [False, True])
def test_flash_varlen_lse_reads_both_lse_layouts_at_unequal_lengths(monkeypatch, padded_lse):
    monkeypatch.setattr(mla_prefill, "_flash_forward", fake_flash_forward(padded_lse))
    g = torch.Generator().manual_seed(5)
    q_lens, k_lens = [3, 7, 1], [5, 2, 9]
    q = torch.randn(sum(q_lens), 2, 8, generator=g)
    k, v = (torch.randn(sum(k_lens), 2, 8, generator=g) for _ in range(2))
    cu_q = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 16], dtype=torch.int32)
    out, lse = flash_varlen_lse(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), False, 0.5)
    assert lse.shape == (2, 11) and torch.isfinite(lse).all()
    for j in range(3):
        want_out, want_lse = _attention(q[cu_q[j]:cu_q[j + 1]], k[cu_k[j]:cu_k[j + 1]], v[cu_k[j]:cu_k[j + 1]],
                                        False, 0.5)
        torch.testing.assert_close(out[cu_q[j]:cu_q[j + 1]].double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, cu_q[j]:cu_q[j + 1]].double(), want_lse, atol=1e-5, rtol=1e-5)


def test_running_lse_merge_equals_attention_over_all_keys():
    """Own keys (causal) first, then three disjoint windows of earlier keys, folded in one by one."""
    g = torch.Generator().manual_seed(7)
    tq, context = 5, 23
    q = torch.randn(tq, 3, 8, generator=g)
    k, v = torch.randn(context + tq, 3, 8, generator=g), torch.randn(context + tq, 3, 6, generator=g)
    out, lse = attention_with_lse_reference(q, k[context:], v[context:], True, 0.4)
    acc = out.float()
    for a, b in [(0, 10), (10, 11), (11, 23)]:
        part, part_lse = attention_with_lse_reference(q, k[a:b], v[a:b], False, 0.4)
        merge_lse_(acc, lse, part, part_lse)
    want, want_lse = _attention(q, k, v, True, 0.4)
    torch.testing.assert_close(acc.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
