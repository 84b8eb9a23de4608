"""The batched decode of the DeepSeek-V4 family (``model.decode(ids [B], states)``) gives what B
per-request one-token forwards give, for requests at different lengths and compressor phases
(windows that close in the step, requests without entries yet, a request at position 0), on
the bundled V4 / V4.1 fixtures and the trained arith-v41 (CPU); and the states' pools grow in
place and keep ``clone()`` an independent snapshot.

fp32 GEMMs over B rows round differently from one row (~1e-6). V4.1 rounds its cache rows and
index queries to FP8/FP4 grids, so now and then such a difference flips one rounded value by a
grid step and that request's logits move by more (seen: 4e-4 on dev-v41-s0, 0.2 on a trained
arith-v41 request, argmax unchanged). In float64 the flips vanish and the paths agree to fp32
noise, which is the tight check; the fp32 runs check that nearly every row agrees as closely."""

from __future__ import annotations

import os

import pytest
import torch

from model.v4_family import load_v4_family

torch.set_num_threads(1)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIXTURES = {
    "dev-v4-s0": os.path.join(ROOT, "tests", "fixtures", "dev-v4-s0"),
    "dev-v41-s0": os.path.join(ROOT, "tests", "fixtures", "dev-v41-s0"),
    "arith-v41": os.path.join(ROOT, "configs", "arith-v41"),
}
# Prompt lengths: 0 (first token by decode), short ones without entries, ones whose next token
# closes a window of every ratio in the fixtures (2, 4, 8) or not, and past the windows (8, 16).
LENGTHS = [0, 1, 3, 6, 7, 12, 15, 16, 23, 31, 40]
_MODELS: dict = {}


def _model(name: str, page_rows: int = 4, dtype: torch.dtype = torch.float32):
    key = (name, page_rows, dtype)
    if key not in _MODELS:
        model = load_v4_family(FIXTURES[name], dtype, "cpu")
        model.configure_cache("auto", page_rows=page_rows)  # small pages: entries span several
        _MODELS[key] = model
    return _MODELS[key]


def _logits(model, out: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(out) if hasattr(model, "compute_logits") else out


def _prompts(model, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return [torch.randint(2, vocab, (n,), generator=g) for n in LENGTHS]


@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in sorted(FIXTURES)]
                         + [("dev-v41-s0", torch.float64), ("arith-v41", torch.float64)])
def test_batched_decode_equals_per_request_decode(name, dtype):
    model = _model(name, dtype=dtype)
    prompts = _prompts(model, 0)
    states = [model.new_state() for _ in prompts]
    with torch.no_grad():
        for p, s in zip(prompts, states):
            if len(p):
                model(p, s)
        refs = [s.clone() for s in states]
        g = torch.Generator().manual_seed(1)
        for _ in range(9):  # every request crosses a window boundary of each ratio at least once
            ids = torch.randint(2, model.config.vocab_size, (len(states),), generator=g)
            batched = _logits(model, model.decode(ids, states))
            single = torch.cat([_logits(model, model(ids[b:b + 1], refs[b])) for b in range(len(refs))])
            diff = (batched - single).abs().amax(-1)
            if dtype == torch.float64 or name == "dev-v4-s0":  # no FP8/FP4 roundings to flip
                assert diff.max().item() < 5e-5
                assert torch.equal(batched.argmax(-1), single.argmax(-1))
            else:  # see the module doc: a rare rounding flip moves one request
                assert (diff < 5e-5).float().mean().item() >= 0.8
                assert (batched.argmax(-1) == single.argmax(-1)).float().mean().item() >= 0.8
    assert [s.num_tokens for s in states] == [n + 9 for n in LENGTHS]


@pytest.mark.parametrize("name", ["dev-v4-s0", "dev-v41-s0"])
def test_decode_matches_a_one_shot_prompt(name):
    """Token-by-token batched decode of whole prompts (from position 0) = one-shot prefill."""
    model = _model(name)
    prompts = [p for p in _prompts(model, 2) if len(p) >= 12][:3]
    n = min(len(p) for p in prompts)
    with torch.no_grad():
        one_shot = [_logits(model, model(p[:n], model.new_state())) for p in prompts]
        states = [model.new_state() for _ in prompts]
        rows = [_logits(model, model.decode(torch.stack([p[i] for p in prompts]), states)) for i in range(n)]
    for b in range(len(prompts)):
        got = torch.stack([r[b] for r in rows])
        assert (got - one_shot[b]).abs().max().item() < 1e-4


def test_pools_grow_in_place_and_clones_are_independent():
    model = _model("dev-v41-s0", page_rows=2)
    pools = model.cache_pools()
    before = {name: pool.num_units for name, pool in pools.items()}
    with torch.no_grad():
        states = [model.new_state() for _ in range(20)]  # more than the pools' first units
        ids = torch.randint(2, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
        model(ids[:30], states[0])
        snap = states[0].clone()
        a = model(ids[30:31], states[0])
        model(ids[31:35], states[0])  # the original moves on; the snapshot must not see it
        b = model(ids[30:31], snap)
    assert torch.equal(a, b)
    assert all(pools[name].num_units >= before[name] for name in pools)
    assert any(pools[name].num_units > before[name] for name in pools)
    free = {name: pool.num_free for name, pool in pools.items()}
    del states, snap
    assert all(pools[name].num_free > free[name] for name in pools)  # dropped states give units back


def test_decode_refuses_mismatched_states():
    model = _model("dev-v4-s0")
    s = model.new_state()
    with pytest.raises(ValueError, match="one distinct state per token"):
        model.decode(torch.tensor([3, 4]), [s, s])
    other = load_v4_family(FIXTURES["dev-v4-s0"], torch.float32, "cpu")
    with pytest.raises(ValueError, match="new_state"):
        model.decode(torch.tensor([3]), [other.new_state()])


@pytest.mark.gpu
@pytest.mark.parametrize("name,cache", [("dev-v4-s0", "auto"), ("dev-v41-s0", "auto"), ("dev-v41-s0", "fp8")])
def test_batched_decode_on_cuda(name, cache):
    """The same equality on a GPU (float64: the check is exact up to fp32 noise), with the
    packed records for fp8. With fp8 on CUDA the batched path attends through the sparse-decode
    backend (float32 inside, by its contract) while the per-request path stays float64, and
    V4.1's FP8/FP4 roundings of later rows can turn that into a grid step (1.8e-3 seen on the
    H200): there, most rows must agree tightly and all closely."""
    model = load_v4_family(FIXTURES[name], torch.float64, "cuda")
    model.configure_cache(cache, page_rows=4)
    prompts = [p.cuda() for p in _prompts(model, 0)]
    states = [model.new_state() for _ in prompts]
    with torch.no_grad():
        for p, s in zip(prompts, states):
            if len(p):
                model(p, s)
        refs = [s.clone() for s in states]
        for step in range(5):
            ids = torch.randint(2, model.config.vocab_size, (len(states),), device="cuda")
            batched = _logits(model, model.decode(ids, states))
            single = torch.cat([_logits(model, model(ids[b:b + 1], refs[b])) for b in range(len(refs))])
            diff = (batched - single).abs().amax(-1)
            if cache == "fp8" and model.sparse_decode is not None:
                assert (diff < 5e-5).float().mean().item() >= 0.8 and diff.max().item() < 5e-2, (step, diff)
            else:
                assert diff.max().item() < 5e-5, (step, diff)
