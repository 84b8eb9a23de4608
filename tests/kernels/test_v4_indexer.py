"""The V4.1 lightning indexer on packed key records (kernels/v4_indexer.py, kernels/v4_indexer_triton.py).

CPU: the torch reference on the records equals the model's own indexer on decoded keys (the
scores, then the same picks and candidate masks up to ties), for decode and prefill, and the
model run through the reference backend gives the logits of its own path. GPU: the model's
decode step on the Triton backend captured in a CUDA graph, and a random V4.1 model on it
against the reference backend. The kernels themselves: tests/kernels/test_v4_indexer_triton.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kernels.v4_cache_formats import pack_v41_index_keys, unpack_v41_index_keys
from kernels.attention.v4_indexer import IndexerBackend, choose_indexer
from kernels.topk import key_scores, order_keys
from kernels.v4_indexer import index_scores_reference, quantize_index_queries, topk_picks, topk_picks_from_keys
from model.v41.config import parse_v41_config
from model.v41.indexer import Indexer

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "dev-v41-s0"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(**edits):
    with open(FIXTURE / "config.json") as f:
        cfg = parse_v41_config(json.load(f))
    return dataclasses.replace(cfg, **edits)


def _indexer(cfg, layer: int, seed: int) -> Indexer:
    idx = Indexer(cfg, layer, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for p in idx.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    return idx


def _paged_keys(counts: list[int], dim: int, page_rows: int, seed: int, device="cpu"):
    """(record pool uint8 [rows, bytes] with 0xFF (NaN) in every unwritten row, page tables
    [B, pages] of shuffled pages, the decoded keys [B, N, d] zero past each count, N)."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(counts) // page_rows))
    num_pages = len(counts) * width + 1  # + a scratch page 0
    pool = torch.full((num_pages * page_rows, dim // 2 + dim // 32), 0xFF, dtype=torch.uint8)
    tables = (torch.randperm(num_pages - 1, generator=g) + 1)[: len(counts) * width].view(len(counts), width)
    n = width * page_rows
    decoded = torch.zeros(len(counts), n, dim)
    for b, c in enumerate(counts):
        rows = tables[b, torch.arange(c) // page_rows] * page_rows + torch.arange(c) % page_rows
        pool[rows] = pack_v41_index_keys(torch.randn(c, dim, generator=g) * 2)
        decoded[b, :c] = unpack_v41_index_keys(pool[rows])
    return pool.to(device), tables.to(device), decoded.to(device), n


def _rope(cfg, t: int, seed: int):
    angle = torch.rand(t, cfg.qk_rope_head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6
    return angle.cos(), angle.sin()


def assert_same_picks(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> None:
    """Picks [Q, k] that select the same entries up to ties: the same number of picks per
    query, the same multiset of scores, and every entry scoring above the k-th score in both."""
    for g, w, s in zip(got.tolist(), want.tolist(), scores):
        g, w = [p for p in g if p >= 0], [p for p in w if p >= 0]
        assert len(g) == len(w) == len(set(g))
        if not w:
            continue
        assert torch.equal(s[g].sort().values, s[w].sort().values)
        kth = s[w].min()
        assert {p for p in g if s[p] > kth} == {p for p in w if s[p] > kth}


def test_decoded_queries_are_the_models_fake_quant():
    from kernels.microscaling import fake_quant_fp4
    from kernels.v4_indexer import dequantize_index_queries

    q = torch.randn(5, 8, 64) * torch.logspace(-3, 3, 64)
    assert torch.equal(dequantize_index_queries(*quantize_index_queries(q)), fake_quant_fp4(q, 32, "ue8m0"))


@pytest.mark.parametrize("dim", [32, 128])
def test_reference_equals_the_models_decode_indexer(dim):
    """Decode at mixed counts (0, a partial page, full pages): the candidate source's scores,
    picks and block mask, then a later index source restricted by that mask."""
    cfg = _config(index_head_dim=dim)
    src, later = cfg.candidate_source_layer_id, max(cfg.index_source_layer_ids)
    counts = [0, 1, 5, 13, 16, 30]
    b, page_rows = len(counts), 4
    pool, tables, keys, n = _paged_keys(counts, dim, page_rows, seed=dim)
    g = torch.Generator().manual_seed(1)
    x, q_res = torch.randn(b, cfg.hidden_size, generator=g), torch.randn(b, cfg.q_lora_rank, generator=g)
    cos, sin = _rope(cfg, b, 2)
    counts_t = torch.tensor(counts)
    ref = IndexerBackend()
    step_model, step_packed = {}, {}
    for layer, seed in ((src, 3), (later, 4)):
        idx = _indexer(cfg, layer, seed)
        idx.backend = ref
        want = idx.decode_picks(x, q_res, keys, counts_t, cos, sin, step_model)
        got = idx.decode_packed_picks(x, q_res, pool, tables, page_rows, counts_t, n, cos, sin, step_packed)
        model_scores = idx.scores(idx.queries(q_res, cos, sin).unsqueeze(1), idx.head_weights(x).unsqueeze(1), keys,
                                  counts_t.view(-1, 1, 1))[:, 0]
        if idx.uses_candidates:
            from kernels.v4_indexer import blocks_to_entries

            allowed = blocks_to_entries(step_model["candidates"][:, 0], idx.block_size, n)
            model_scores = model_scores.masked_fill(~allowed, float("-inf"))
        q8, qs = quantize_index_queries(idx.raw_queries(q_res, cos, sin))
        scores, _ = ref.scores(q8, qs, idx.head_weights(x), pool, tables, page_rows, counts_t, n, dim**-0.5, 1,
                               step_packed["candidates"][:, 0] if idx.uses_candidates else None, idx.block_size)
        torch.testing.assert_close(scores, model_scores, rtol=1e-6, atol=1e-6)
        assert_same_picks(got, want, model_scores)
        if idx.is_candidate_source:
            assert torch.equal(step_packed["candidates"], step_model["candidates"])
    assert step_packed["candidates"].shape == (b, 1, -(-n // cfg.candidate_block_size))


def test_reference_equals_the_models_prefill_indexer(monkeypatch):
    """One request's chunk at positions 5 … 40 over its paged keys, in query blocks of 7."""
    from model.v41 import indexer as indexer_module

    monkeypatch.setattr(indexer_module, "QUERY_BLOCK", 7)
    cfg = _config(index_head_dim=64)
    src, later = cfg.candidate_source_layer_id, max(cfg.index_source_layer_ids)
    positions = torch.arange(5, 41)
    t, ratio = positions.shape[0], cfg.compress_ratios[src]
    n_keys = (int(positions[-1]) + 1) // ratio
    pool, tables, keys, _ = _paged_keys([n_keys], 64, 8, seed=5)
    g = torch.Generator().manual_seed(6)
    x, q_res = torch.randn(t, cfg.hidden_size, generator=g), torch.randn(t, cfg.q_lora_rank, generator=g)
    cos, sin = _rope(cfg, t, 7)
    step_model, step_packed = {}, {}
    for layer, seed in ((src, 8), (later, 9)):
        idx = _indexer(cfg, layer, seed)
        idx.backend = IndexerBackend()
        want = idx.topk_picks(x, q_res, keys[0, :n_keys], positions, cos, sin, step_model)
        got = idx.prefill_packed_picks(x, q_res, pool, tables[0].tolist(), 8, n_keys, positions, cos, sin,
                                       step_packed)
        visible = ((positions + 1) // idx.ratio).view(-1, 1)
        scores = idx.scores(idx.queries(q_res, cos, sin)[None], idx.head_weights(x)[None], keys[:, :n_keys],
                            visible)[0]
        assert got.shape == want.shape
        assert_same_picks(got, want, scores if not idx.uses_candidates else scores.masked_fill(
            ~indexer_module.blocks_to_entries(step_model["candidates"], idx.block_size, n_keys), float("-inf")))
    assert torch.equal(step_packed["candidates"], step_model["candidates"])


def test_model_through_the_reference_backend_gives_its_own_logits(monkeypatch):
    """The fixture model (float64, fp8 records): chunked prefill and batched decode with the
    records scored by the reference backend give the logits of the model's own path."""
    from model.v4_family import load_v4_family

    calls = []
    real = IndexerBackend.picks
    monkeypatch.setattr(IndexerBackend, "picks", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    logits = {}
    for backend in ("auto", "torch"):
        model = load_v4_family(str(FIXTURE), torch.float64, "cpu")
        model.configure_cache("fp8", page_rows=4, indexer_backend=backend)
        assert (model.model.layers[1].attn.indexer.backend is None) == (backend == "auto")
        g = torch.Generator().manual_seed(0)
        states = [model.new_state() for _ in range(3)]
        out = []
        with torch.no_grad():
            for n, s in zip((5, 17, 26), states):
                ids = torch.randint(2, model.config.vocab_size, (n,), generator=g)
                out.append(model(ids[: n // 2], s))
                out.append(model(ids[n // 2:], s))
            for _ in range(4):
                out.append(model.decode(torch.randint(2, model.config.vocab_size, (3,), generator=g), states))
        logits[backend] = torch.cat(out)
    assert calls
    assert (logits["torch"] - logits["auto"]).abs().max().item() < 1e-9


def test_backend_choice_and_errors():
    assert choose_indexer("auto", "fp8", "cpu", 128) is None  # the model's own path off CUDA
    assert choose_indexer("auto", "auto", "cpu", 128) is None
    assert type(choose_indexer("torch", "fp8", "cpu", 32)) is IndexerBackend
    with pytest.raises(ValueError, match="indexer backend triton: needs a CUDA device"):
        choose_indexer("triton", "fp8", "cpu", 128)
    with pytest.raises(ValueError, match="reads packed key records"):
        choose_indexer("torch", "auto", "cpu", 128)
    with pytest.raises(ValueError, match="one of auto, triton, torch"):
        choose_indexer("cuda", "fp8", "cpu", 128)


def test_topk_picks_mark_invisible_picks():
    s = torch.tensor([[3.0, float("-inf"), 1.0, float("-inf")], [0.0, -0.0, -2.0, 0.0]])
    assert topk_picks(s, 3).tolist() == [[0, 2, -1], [0, 1, 3]]
    assert topk_picks(s, 9).shape == (2, 4)
    keys = order_keys(s)
    assert torch.equal(topk_picks_from_keys(keys, 3), topk_picks(s, 3))
    assert torch.equal(key_scores(keys), torch.where(s == 0, 0.0, s))


def test_reference_rejects_bad_inputs():
    q8, qs = quantize_index_queries(torch.randn(2, 4, 32))
    pool = torch.zeros(8, 17, dtype=torch.uint8)
    table = torch.zeros(2, 2, dtype=torch.long)
    vis = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="weights must be float32"):
        index_scores_reference(q8, qs, torch.zeros(2, 4, dtype=torch.float64), pool, table, 4, vis, 8, 1.0)
    with pytest.raises(ValueError, match="keys must be uint8"):
        index_scores_reference(q8, qs, torch.zeros(2, 4), pool[:, :16], table, 4, vis, 8, 1.0)
    with pytest.raises(ValueError, match="must address the 9 keys"):
        index_scores_reference(q8, qs, torch.zeros(2, 4), pool, table, 4, vis, 9, 1.0)


# ---- GPU: the model's step on the Triton backend ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_picks_replay_in_a_cuda_graph():
    """The decode step's scoring, candidate blocks and top-k captured once and replayed on
    new queries and counts written in place: each replay equals an eager reference run."""
    cfg = _config(index_head_dim=128, index_n_heads=32, candidate_topk_blocks=16, index_topk=64)
    idx = _indexer(cfg, cfg.candidate_source_layer_id, 11).cuda()
    idx.backend = choose_indexer("triton", "fp8", "cuda", 128)
    counts = [0, 37, 300, 999]
    pool, tables, _, n = _paged_keys(counts, 128, 64, seed=12, device="cuda")
    b = len(counts)
    x = torch.zeros(b, cfg.hidden_size, device="cuda")
    q_res = torch.zeros(b, cfg.q_lora_rank, device="cuda")
    cos, sin = (t.cuda() for t in _rope(cfg, b, 13))
    cnt = torch.zeros(b, dtype=torch.long, device="cuda")

    def step():
        out = {}
        picks = idx.decode_packed_picks(x, q_res, pool, tables, 64, cnt, n, cos, sin, out)
        return picks, out["candidates"]

    g = torch.Generator().manual_seed(14)
    x.copy_(torch.randn(b, cfg.hidden_size, generator=g))
    q_res.copy_(torch.randn(b, cfg.q_lora_rank, generator=g))
    cnt.copy_(torch.tensor(counts))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        picks, cands = step()
    ref = IndexerBackend()
    for rep in range(3):
        x.copy_(torch.randn(b, cfg.hidden_size, generator=g))
        q_res.copy_(torch.randn(b, cfg.q_lora_rank, generator=g))
        cnt.copy_(torch.tensor([c - 7 * rep if c > 7 * rep else c for c in counts]))
        graph.replay()
        torch.cuda.synchronize()
        idx.backend, fast = ref, idx.backend
        want_picks, want_cands = step()
        idx.backend = fast
        q8, qs = quantize_index_queries(idx.raw_queries(q_res, cos, sin))
        scores, _ = ref.scores(q8, qs, idx.head_weights(x), pool, tables, 64, cnt, n, 128**-0.5)
        assert_same_picks(picks.cpu(), want_picks.cpu(), scores.cpu())
        assert torch.equal(cands, want_cands), rep


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_with_the_triton_indexer_tracks_the_reference_backend(tmp_path):
    """A float32 random V4.1 model at the indexer's real width (32 heads × 128) with fp8
    records: chunked prefill and batched decode with the Triton indexer against the same model
    scoring through the torch reference. The scores differ in fp32 rounding only, so a pick
    can flip only at a near-tie: nearly every request's logits agree closely."""
    from model.v4_family import random_v4_family

    with open(FIXTURE / "config.json") as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text.update(index_head_dim=128, index_n_heads=32, candidate_block_size=4, candidate_topk_blocks=6)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    logits = {}
    for backend in ("triton", "torch"):
        model = random_v4_family(str(tmp_path), torch.float32, "cuda", seed=0)
        model.configure_cache("fp8", page_rows=16, indexer_backend=backend)
        g = torch.Generator().manual_seed(0)
        states = [model.new_state() for _ in range(6)]
        out = []
        with torch.no_grad():
            for n, s in zip((1, 9, 40, 77, 130, 300), states):
                ids = torch.randint(2, model.config.vocab_size, (n,), generator=g).cuda()
                out.append(model(ids[: n // 3 + 1], s)[-1:])
                out.append(model(ids[n // 3 + 1:], s)[-1:] if n > n // 3 + 1 else out[-1])
            for _ in range(5):
                ids = torch.randint(2, model.config.vocab_size, (len(states),), generator=g).cuda()
                out.append(model.decode(ids, states))
        logits[backend] = torch.cat(out).float()
    got, want = logits["triton"], logits["torch"]
    assert not got.isnan().any()
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert (rel < 1e-3).float().mean().item() >= 0.9, rel
