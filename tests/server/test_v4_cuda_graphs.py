"""Decode CUDA graphs of the DeepSeek-V4 family (server/v4_cuda_graphs.py).

CPU: the runner's graph path (inputs copied into the persistent buffers, padded to the next
captured size, ``decode_batch`` over them, the states advanced after) with the replay
replaced by running the same ``decode_batch`` eagerly: the engine gives the same greedy
tokens as without it, pure-decode steps take it, and every pool unit comes back.
GPU: the fixtures served with graphs on and off (same greedy tokens, logprobs within fp32
rounding), and one graph replay = the eager decode at B = 1, 3, 8.
"""

from __future__ import annotations

import gc

import pytest
import torch

from server.sampling_params import SamplingParams
from server.v4_cuda_graphs import V4DecodeGraphs
from tests.server import test_v4_serving as serving
from tests.server.test_v4_serving import V4, V41, make_core, prompts_for, run, run_logprobs

tokenizer_dir = serving.tokenizer_dir  # the fixtures' servable tokenizer (a pytest fixture)

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class EagerReplay(V4DecodeGraphs):
    """The graph path with ``decode_batch`` run eagerly instead of replayed (no GPU here)."""

    def capture(self) -> None:
        self.buffers.pad(0, self.max_batch)
        self.graphs = {b: None for b in self.sizes}

    def launch(self, b: int) -> torch.Tensor:
        self.num_replays += 1
        self.launched = getattr(self, "launched", []) + [b]
        return self._forward(b)


one_torch_thread = serving.one_torch_thread  # autouse: one intra-op thread, as the live servers run


@pytest.mark.parametrize("fixture", [V4, V41], ids=["v4", "v41"])
def test_graph_path_on_cpu_gives_the_eager_tokens(fixture, tokenizer_dir):
    prompts = prompts_for(fixture, 5, seed=2)
    ref = run(make_core(fixture, tokenizer_dir, max_num_seqs=8), prompts, GREEDY)
    core = make_core(fixture, tokenizer_dir, max_num_seqs=8, max_num_batched_tokens=32)
    graphs = EagerReplay(core.runner.model, [1, 2, 4, 8], 1024)
    graphs.capture()
    core.runner.decode_graphs = graphs
    got = run(core, prompts, GREEDY)  # checks that every block and pool unit comes back
    assert got == ref
    assert graphs.num_replays > 0 and set(graphs.launched) <= {1, 2, 4, 8}
    assert 8 in graphs.launched  # the steps of all 5 requests decoding pad to 8


def test_requests_past_the_graph_context_run_eagerly(tokenizer_dir):
    """Graphs cover contexts up to ``max_tokens``: a decode step with a longer request runs
    eagerly, with the same tokens."""
    prompts = prompts_for(V41, 3, seed=4)
    ref = run(make_core(V41, tokenizer_dir, max_num_seqs=4), prompts, GREEDY)
    core = make_core(V41, tokenizer_dir, max_num_seqs=4)
    longest = max(len(p) for p in prompts)
    graphs = EagerReplay(core.runner.model, [1, 2, 4], longest + 2)
    graphs.capture()
    core.runner.decode_graphs = graphs
    assert run(core, prompts, GREEDY) == ref
    assert 0 < graphs.num_replays < GREEDY.max_tokens - 1  # replays stop once a request passes max_tokens


# ---- GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fixture", [V4, V41], ids=["v4", "v41"])
def test_served_with_graphs_matches_enforce_eager(fixture, tokenizer_dir):
    """fp32 weights: the graphs' padded batches and fixed-width gathers round like a different
    batch size does (~1e-6); V4.1's FP8/FP4 cache roundings can turn that into a grid step
    (tests/model/test_v4_batched_decode.py), hence the logprob tolerance."""
    prompts = prompts_for(fixture, 6, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    got = {}
    for eager in (True, False):
        core = make_core(fixture, tokenizer_dir, device="cuda", dtype="float32", max_model_len=256,
                         max_num_seqs=8, enforce_eager=eager, kv_cache_memory_bytes=1 << 30)
        assert (core.runner.decode_graphs is None) == eager
        got[eager] = run_logprobs(core, prompts, params)
        if not eager:
            assert core.runner.decode_graphs.num_replays > 0
            assert core.runner.decode_graphs.sizes == [1, 2, 4, 8]
        del core
        gc.collect()
    for rid in got[True]:
        eager_ids, graph_ids = got[True][rid][1], got[False][rid][1]
        assert graph_ids == eager_ids, rid
        diff = max(abs(a[1] - b[1]) for a, b in zip(got[True][rid][2], got[False][rid][2]))
        assert diff < (1e-4 if fixture == V4 else 2e-2), (rid, diff)


def capture_over_fixed_pools(model, sizes=(1, 2, 4, 8), max_tokens: int = 256) -> V4DecodeGraphs:
    """The model's row pools at a fixed plan (as the engine sizes them), then its decode graphs."""
    from model.v4.cache_pool import PoolPlan

    model.cache_pools()
    ratios = {r for _, r in model._paged}
    model.configure_cache("auto", plan=PoolPlan(32, {(k, r): (256, 4) for k in ("entries", "keys") for r in ratios}))
    graphs = V4DecodeGraphs(model, list(sizes), max_tokens)
    graphs.capture()
    return graphs


def replay_errors(model, graphs: V4DecodeGraphs, batches, steps: int = 4) -> dict[int, float]:
    """{B: max |replayed − eager logits|} over ``steps`` decode steps of B requests (all but
    the first with a prompt already), each run through the graphs and, on cloned states,
    through ``model.decode``; every state released after."""
    g = torch.Generator().manual_seed(0)
    vocab, device, errors = model.config.vocab_size, model.lm_head.weight.device, {}
    with torch.no_grad():
        for b in batches:
            states = [model.new_state() for _ in range(b)]
            for i, s in enumerate(states):
                if i:
                    model(torch.randint(2, vocab, (5 * i + 2,), generator=g).to(device), s)
            copies = [s.clone() for s in states]
            errors[b] = 0.0
            for _ in range(steps):  # windows close in some of these steps
                ids = torch.randint(2, vocab, (b,), generator=g).to(device)
                eager = model.decode(ids, copies)
                replay = graphs.run(ids, states).clone()
                if hasattr(model, "compute_logits"):
                    eager, replay = model.compute_logits(eager), model.compute_logits(replay)
                errors[b] = max(errors[b], (replay - eager).abs().max().item())
            for s in states + copies:
                s.release()
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", [V4, V41], ids=["v4", "v41"])
def test_replay_equals_eager_decode(fixture):
    """float64: the graph (padded, fixed widths, sync-free experts) = ``model.decode`` to the
    fp32 noise of V4's float32 norms and mHC."""
    from model.v4_family import load_v4_family

    model = load_v4_family(fixture, torch.float64, "cuda")
    graphs = capture_over_fixed_pools(model)
    errors = replay_errors(model, graphs, (1, 3, 8))
    assert all(e < 5e-5 for e in errors.values()), errors
    assert graphs.num_replays == 12
    assert model.cache_pools().num_free() == {k: p.num_units - 1 for k, p in model.cache_pools().items()}
