"""The MLA layer's step-wide prefill (one batched prefix gather, one kv_b_proj, one varlen
backend call for every chunk; or, past the context workspace, the prefixes in windows merged
by LSE) equals attention computed one sequence at a time, on mixed steps: decodes plus several
chunks with and without cached prefixes, float / bf16 / fp8 caches, unused pages poisoned with
NaN."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionSpec, FlashInferPrefill, TorchPrefill
from kernels.fp8 import FP8_DTYPE
from kernels.mla_prefill import mla_prefill_reference
from model.checkpoint import write_random_checkpoint
from model.forward_context import (ForwardContext, build_attention_metadata, build_prefill_metadata, forward_context,
                                   plan_context_windows)
from model.loader import load_model
from tests.kernels.fake_flashinfer import FakeRaggedPrefillWrapper, install_fake_flashinfer

BLOCK = 4
NUM_PAGES = 40
# (cached prefix, new tokens) per sequence: 2 decodes first, then prefill chunks.
DECODES = [(6, 1), (3, 1)]
CHUNKS = [(0, 5), (7, 3), (0, 1), (9, 6), (4, 4)]


@pytest.fixture(scope="module")
def attn(tmp_path_factory):
    path = write_random_checkpoint("tiny-v3", str(tmp_path_factory.mktemp("varlen") / "m"), seed=4, num_layers=2)
    return load_model(path, dtype="float32", progress=False).layers[0].self_attn


def _tables(gen) -> list[list[int]]:
    """Scattered, disjoint pages per sequence; every other page stays poisoned."""
    perm = torch.randperm(NUM_PAGES, generator=gen).tolist()
    tables = []
    for ctx, new in DECODES + CHUNKS:
        n = -(-(ctx + new) // BLOCK)
        tables.append(perm[:n])
        perm = perm[n:]
    return tables


def _cache(cache_dtype, tables, gen) -> torch.Tensor:
    """NaN everywhere but the cached prefixes, which hold random latents; one extra page at the
    end takes the pad rows' writes (slot -1), as the runner's caches have."""
    cache = torch.full((NUM_PAGES + 1, BLOCK, 32 + 16), float("nan")).to(cache_dtype)
    for table, (ctx, _) in zip(tables, DECODES + CHUNKS):
        for pos in range(ctx):
            cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(48, generator=gen).to(cache_dtype)
    return cache


def _per_sequence(attn, x, positions, cache, table, ctx_len, k_scale) -> torch.Tensor:
    """One chunk on its own: its prefix read slot by slot, its own latents from x."""
    t, h = x.shape[0], attn.num_local_heads
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(t, h, attn.qk_dim)
    q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
    q = torch.cat([q_nope, attn.rotary(positions, q_pe)], dim=-1)
    kv = attn.kv_a_proj_with_mqa(x)
    kv_c = attn.kv_a_layernorm(kv[:, : attn.kv_lora_rank])
    k_pe = attn.rotary(positions, kv[:, attn.kv_lora_rank :].unsqueeze(1)).squeeze(1)
    rows = torch.stack([cache[table[p // BLOCK], p % BLOCK] for p in range(ctx_len)]) if ctx_len else None
    if rows is not None:
        rows = rows.float() * (k_scale if cache.dtype == FP8_DTYPE else 1.0)
        kv_c = torch.cat([rows[:, : attn.kv_lora_rank], kv_c])
        k_pe = torch.cat([rows[:, attn.kv_lora_rank :], k_pe])
    k, v = attn._up_project(kv_c, k_pe)
    out = mla_prefill_reference(q, k, v, attn.softmax_scale)
    return attn.o_proj(out.reshape(t, -1))


def _step(attn, cache_dtype, backend, seed=0, workspace=None):
    gen = torch.Generator().manual_seed(seed)
    tables = _tables(gen)
    cache = _cache(cache_dtype, tables, gen)
    k_scale = 0.5 if cache_dtype == FP8_DTYPE else 1.0
    seqs = DECODES + CHUNKS
    md = build_attention_metadata(tables, [c for c, _ in seqs], [n for _, n in seqs], BLOCK,
                                  num_decode_seqs=len(DECODES), num_pad_tokens=2)
    positions = torch.cat([torch.arange(c, c + n) for c, n in seqs] + [torch.zeros(2, dtype=torch.long)])
    x = torch.randn(positions.shape[0], 64, generator=gen)
    expect = []
    for (ctx, new), table, start in zip(CHUNKS, tables[len(DECODES):], md.query_start_loc[len(DECODES):].tolist()):
        expect.append(_per_sequence(attn, x[start : start + new], positions[start : start + new], cache, table, ctx,
                                    k_scale))
    ctx = ForwardContext(md, [cache], [k_scale], prefill_backend=backend, context_workspace_tokens=workspace)
    with torch.no_grad(), forward_context(ctx):
        got = attn(positions, x)
    rows = slice(sum(n for _, n in DECODES), sum(n for _, n in seqs))
    return got, got[rows], torch.cat(expect), ctx


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_varlen_prefill_equals_per_sequence_prefill(attn, cache_dtype):
    got, prefill_rows, expect, _ = _step(attn, cache_dtype, TorchPrefill())
    assert torch.isfinite(got).all()  # NaN pages never read, decode and pad rows included
    torch.testing.assert_close(prefill_rows, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_DTYPE])
@pytest.mark.parametrize("workspace", [20, 19, 8, 3, 1])
def test_context_windows_equal_per_sequence_prefill(attn, cache_dtype, workspace):
    """The chunks' prefixes hold 7 + 9 + 4 = 20 rows: a workspace of 20 takes the one-gather
    path, smaller ones cut them into windows (8: the first window holds chunk 1's prefix and a
    row of chunk 3's, with chunk 2, which has none, between them; 1: a window per row)."""
    got, prefill_rows, expect, ctx = _step(attn, cache_dtype, TorchPrefill(), seed=2, workspace=workspace)
    pm = ctx.prefill_metadata
    assert (pm.context_windows is None) == (workspace >= 20)
    if pm.context_windows is not None:
        assert len(pm.context_windows) == -(-20 // workspace) and pm.kv_order is None
    assert torch.isfinite(got).all()
    torch.testing.assert_close(prefill_rows, expect, rtol=2e-5, atol=2e-5)


def test_context_window_plan_covers_every_prefix_row_once_in_order():
    contexts, queries = [0, 10, 3, 0, 7, 0], [4, 5, 6, 7, 8, 2]
    for workspace in (1, 4, 6, 13, 19, 20, 100):
        windows = plan_context_windows(contexts, queries, workspace)
        assert [w[0] for w in windows] == [0] + [w[1] for w in windows[:-1]] and windows[-1][1] == 20
        per_chunk = [0] * len(contexts)
        for start, end, chunks, k_lens in windows:
            assert 0 < end - start == sum(k_lens) <= workspace and chunks == sorted(set(chunks))
            assert all(contexts[c] for c in chunks)
            for c, n in zip(chunks, k_lens):
                per_chunk[c] += n
        assert per_chunk == contexts
    md = build_attention_metadata([[1, 2, 3, 4, 5]] * 6, contexts, queries, 4)
    pm = build_prefill_metadata(md, page_size=4, context_workspace=6)
    second = pm.context_windows[1]  # chunk 1's last 4 rows and chunk 2's first 2
    assert (second.prefix_start, second.prefix_end, second.row_start, second.row_end) == (6, 12, 4, 15)
    assert second.rows is None and second.segments.cu_q.tolist() == [0, 5, 11]
    assert second.segments.cu_k.tolist() == [0, 4, 6]
    third = pm.context_windows[2]  # chunk 2's last row and chunk 4's first 5: chunk 3 between
    assert third.rows.tolist() == list(range(9, 15)) + list(range(22, 30))
    assert third.segments.q_lens == [6, 8] and third.segments.k_lens == [1, 5]


def test_prefill_metadata_indices():
    """The gather indices and the ragged key layout, checked against slot arithmetic."""
    tables = [[5, 1], [2, 8, 3], [7], [0, 4, 6]]
    lens = [(2, 1), (5, 3), (0, 2), (6, 1)]  # 1 decode, then 3 chunks
    md = build_attention_metadata(tables, [c for c, _ in lens], [n for _, n in lens], 3, num_decode_seqs=1)
    pm = build_prefill_metadata(md, page_size=3)
    assert (pm.row_start, pm.row_end, pm.query_lens, pm.context_lens) == (1, 7, [3, 2, 1], [5, 0, 6])
    assert pm.qo_indptr.tolist() == pm.qo_indptr_cpu == [0, 3, 5, 6]
    assert pm.kv_indptr.tolist() == pm.kv_indptr_cpu == [0, 8, 10, 17]
    slots = [t[p // 3] * 3 + p % 3 for t, (c, _) in zip(tables[1:], lens[1:]) for p in range(c)]
    assert pm.prefix_slots.tolist() == slots
    # [prefixes (11 rows) ‖ chunk rows (6 rows)] → chunk after chunk, prefix first
    assert pm.kv_order.tolist() == [0, 1, 2, 3, 4, 11, 12, 13] + [14, 15] + [5, 6, 7, 8, 9, 10, 16]


def test_no_prefix_no_gather():
    md = build_attention_metadata([[1], [2, 3]], [0, 0], [3, 5], 4)
    pm = build_prefill_metadata(md, page_size=4)
    assert pm.prefix_slots is None and pm.kv_order is None and pm.kv_indptr_cpu == pm.qo_indptr_cpu == [0, 3, 8]
    assert build_prefill_metadata(build_attention_metadata([[1, 2]], [4], [1], 4, num_decode_seqs=1), 4) is None


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_flashinfer_prefill_plans_once_and_runs_the_ragged_step(attn, cache_dtype, monkeypatch):
    install_fake_flashinfer(monkeypatch)
    spec = AttentionSpec(torch.device("cpu"), cache_dtype, attn.num_local_heads, attn.kv_lora_rank, attn.rope_dim,
                         BLOCK, attn.softmax_scale, torch.float32, qk_head_dim=attn.qk_dim, v_head_dim=attn.v_dim)
    backend = FlashInferPrefill(spec)
    got, prefill_rows, expect, ctx = _step(attn, cache_dtype, backend, seed=1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(prefill_rows, expect, rtol=1e-5, atol=1e-5)
    (wrapper,) = FakeRaggedPrefillWrapper.created
    assert wrapper.runs_per_plan == [1]
    plan = wrapper.plans[0]
    assert plan["qo_indptr"] == [0, 5, 8, 9, 15, 19]
    assert plan["kv_indptr"] == [0, 5, 15, 16, 31, 39]
    assert plan == dict(plan, num_qo_heads=attn.num_local_heads, num_kv_heads=attn.num_local_heads,
                        head_dim_qk=attn.qk_dim, head_dim_vo=attn.v_dim, causal=True, sm_scale=attn.softmax_scale,
                        q_data_type=torch.float32, kv_data_type=torch.float32, o_data_type=torch.float32)
    with pytest.raises(RuntimeError, match="earlier step"):
        backend.forward_varlen(torch.zeros(1), torch.zeros(1), torch.zeros(1), build_prefill_metadata(
            ctx.attn, BLOCK), attn.softmax_scale)
