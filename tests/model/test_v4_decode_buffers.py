"""The captured decode's inputs on CPU (model/v4/decode_buffers.py): the persistent, padded
index tensors hold what the eager decode builds; ``decode_batch`` over them (fixed page-table
widths, padding rows) gives the eager decode's rows; padding rows write only the scratch
unit; pools sized from a plan are fixed and give every unit back; the experts' sync-free
path (what a graph runs) sums what the per-expert loop sums.

float64 makes the comparisons tight (to the fp32 noise of V4's float32 norms and mHC): V4.1's
FP8/FP4 roundings of the cache rows would let an fp32 rounding difference of the wider
gathers flip a grid step (tests/model/test_v4_batched_decode.py)."""

from __future__ import annotations

import os

import pytest
import torch

from model.v4.cache_pool import SCRATCH_UNIT, SPARE_UNITS, BatchIndex, PoolPlan
from model.v4_family import load_v4_family

torch.set_num_threads(1)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIXTURES = {name: os.path.join(ROOT, "tests", "fixtures", name) for name in ("dev-v4-s0", "dev-v41-s0")}
LENGTHS = [0, 1, 3, 7, 12, 15, 23, 40]  # windows that close next step or not, entries on several pages
MAX_TOKENS = 64


def _model(name: str, dtype=torch.float64):
    model = load_v4_family(FIXTURES[name], dtype, "cpu")
    model.configure_cache("auto", page_rows=4)
    return model


def _logits(model, out):
    return model.compute_logits(out) if hasattr(model, "compute_logits") else out


def _states(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    states = [model.new_state() for _ in LENGTHS]
    with torch.no_grad():
        for n, s in zip(LENGTHS, states):
            if n:
                model(torch.randint(2, model.config.vocab_size, (n,), generator=g), s)
    return states


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64) if t.dtype == torch.float64 else t.view(torch.uint8)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_padded_buffers_hold_the_eager_index(name):
    model = _model(name)
    pools = model.cache_pools()
    states = _states(model)
    ids = torch.arange(2, 2 + len(states))
    widths = pools.page_widths(MAX_TOKENS)
    inputs = model.prepare_decode(ids, states, widths)
    eager = BatchIndex.build(pools, [s.lease for s in states], [s.num_tokens for s in states], ids.device)
    buffers = model.decode_buffers(16, MAX_TOKENS)
    b, n = 12, len(states)
    buffers.fill(ids, inputs, b)
    got_ids, got = buffers.view(b)
    assert torch.equal(got_ids[:n], ids) and not got_ids[n:].any()
    assert torch.equal(got.index.positions[:n], eager.positions) and not got.index.positions[n:].any()
    for name_, base in eager.ring_base.items():
        assert torch.equal(got.index.ring_base[name_][:n], base)
        assert (got.index.ring_base[name_][n:] == SCRATCH_UNIT).all()  # padding reads the scratch unit
    for name_, table in eager.page_tables.items():
        fixed = got.index.page_tables[name_]
        assert fixed.shape == (b, widths[name_]) and table.shape[1] <= widths[name_]
        assert torch.equal(fixed[:n, : table.shape[1]], table)
        assert (fixed[:n, table.shape[1]:] == SCRATCH_UNIT).all() and (fixed[n:] == SCRATCH_UNIT).all()
    if inputs.hash_ids is not None:
        assert torch.equal(got.hash_ids[:n], inputs.hash_ids) and not got.hash_ids[n:].any()
    with pytest.raises(ValueError, match="do not fit a captured batch"):
        buffers.fill(ids, inputs, n - 1)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_padded_decode_batch_equals_eager_decode(name):
    """Three steps through the buffers (padded to 12, fixed widths) = eager ``decode``."""
    model = _model(name)
    states = _states(model)
    padded = [s.clone() for s in states]
    buffers = model.decode_buffers(16, MAX_TOKENS)
    widths = model.cache_pools().page_widths(MAX_TOKENS)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(2, model.config.vocab_size, (len(states),), generator=g)
            eager = _logits(model, model.decode(ids, states))
            inputs = model.prepare_decode(ids, padded, widths, check_ids=False)
            buffers.fill(ids, inputs, 12)
            out = model.decode_batch(*buffers.view(12))
            model.finish_decode(padded, inputs)
            got = _logits(model, out[: len(states)])
            assert (got - eager).abs().max().item() < 5e-5  # V4 keeps its norms and mHC in fp32
            assert torch.equal(got.argmax(-1), eager.argmax(-1))
    assert [s.num_tokens for s in padded] == [s.num_tokens for s in states]
    if name == "dev-v41-s0":
        assert [s.engram_history for s in padded] == [s.engram_history for s in states]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_padding_rows_write_only_the_scratch_unit(name):
    model = _model(name)
    states = _states(model)
    pools = model.cache_pools()
    before = {k: _bits(p.data[:, SCRATCH_UNIT + 1:]).clone() for k, p in pools.items()}
    buffers = model.decode_buffers(8, MAX_TOKENS)
    buffers.pad(0, 8)
    with torch.no_grad():
        out = model.decode_batch(*buffers.view(8))
    assert torch.isfinite(_logits(model, out)).all()
    for k, p in pools.items():
        assert torch.equal(_bits(p.data[:, SCRATCH_UNIT + 1:]), before[k]), k
    assert [s.num_tokens for s in states] == LENGTHS


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_pools_sized_from_a_plan_are_fixed_and_give_units_back(name):
    model = load_v4_family(FIXTURES[name], torch.float32, "cpu")
    ratios = sorted({r for _, r in _paged(model)})
    plan = PoolPlan(states=3, pages={(kind, r): (5, 2) for kind in ("entries", "keys") for r in ratios})
    model.configure_cache("auto", page_rows=64, plan=plan)
    pools = model.cache_pools()
    for p in pools.values():
        assert p.fixed and p.num_free == p.num_units - 1
        assert p.num_units == (3 if p.ring else 5) + SPARE_UNITS + 1 and (p.ring or p.rows_per_unit == 2)
    data = {k: p.data.data_ptr() for k, p in pools.items()}
    states = [model.new_state() for _ in range(3 + SPARE_UNITS)]
    with pytest.raises(RuntimeError, match="all .* units are in use"):
        model.new_state()
    assert all(p.num_free == 0 for p in pools.values() if p.ring)  # the failed lease gave its units back
    states.pop().release()
    assert all(p.num_free == 1 for p in pools.values() if p.ring)
    with torch.no_grad():
        model(torch.arange(2, 6), states[0])  # 4 tokens: ratio-1 entries on two 2-row pages
        clone = states[0].clone()
    held = {k: p.num_units - 1 - p.num_free for k, p in pools.items()}
    assert all(held[k] == 2 * -(-(4 // p.ratio) // 2) for k, p in pools.items() if not p.ring)  # both copies
    with pytest.raises(RuntimeError, match="units are in use"):
        with torch.no_grad():
            model(torch.arange(2, 60), states[1])  # more entries than the pages hold
    for s in states + [clone]:
        s.release()
        s.release()  # once only
    assert {k: p.num_free for k, p in pools.items()} == {k: p.num_units - 1 for k, p in pools.items()}
    assert {k: p.data.data_ptr() for k, p in pools.items()} == data  # never moved


def _paged(model):
    model.cache_pools()
    return model._paged


def test_sync_free_experts_equal_the_per_expert_loop():
    torch.manual_seed(0)
    v4 = load_v4_family(FIXTURES["dev-v4-s0"], torch.float64, "cpu")
    v41 = load_v4_family(FIXTURES["dev-v41-s0"], torch.float64, "cpu")
    x = torch.randn(9, v4.config.hidden_size, dtype=torch.float64)
    experts = v4.model.layers[2].mlp.experts
    ids = torch.randint(0, v4.config.n_routed_experts, (9, 2))
    ids[:, 1] = (ids[:, 0] + 1) % v4.config.n_routed_experts  # distinct picks per row, as top-k gives
    w = torch.rand(9, 2, dtype=torch.float32)
    assert (experts.forward_every_expert(x, ids, w) - experts(x, ids, w)).abs().max().item() < 1e-12
    moe = v41.model.layers[1].ffn
    x = torch.randn(9, v41.config.hidden_size, dtype=torch.float64)
    w, ids = moe.gate(x)
    assert (moe.routed_every_expert(x, w, ids) - moe.routed(x, w, ids)).abs().max().item() < 1e-12
