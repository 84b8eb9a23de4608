"""A randomized mix through the engine under pressure (tiny cache, chunked prefill, async
scheduling, prefix sharing, n > 1, seeds, stop tokens, aborts): every finished request equals
the same request run alone, and no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from model.checkpoint import write_random_checkpoint
from server import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny-v2", str(tmp_path_factory.mktemp("stress") / "m"), seed=21)


def _workload(seed: int, n_requests: int = 24):
    rng = random.Random(seed)
    shared = [rng.randrange(2, 512) for _ in range(40)]  # a common prefix for prefix-cache hits
    reqs = []
    for i in range(n_requests):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(2, 512) for _ in range(rng.randrange(1, 70))]
        greedy = rng.random() < 0.5
        params = SamplingParams(
            n=rng.choice([1, 1, 2, 3]) if not greedy else 1,
            temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
            top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
            seed=None if greedy else rng.randrange(1 << 20),
            max_tokens=rng.randrange(1, 20), ignore_eos=True,
            stop_token_ids=[rng.randrange(2, 512)] if rng.random() < 0.3 else [],
            presence_penalty=rng.choice([0.0, 0.5]), repetition_penalty=rng.choice([1.0, 1.2]),
            logprobs=rng.choice([None, 0, 2]),
        )
        reqs.append((prompt, params))
    return reqs


def _tokens(out):
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("engine_args", [
    dict(num_gpu_blocks_override=24, max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=True),
    dict(num_gpu_blocks_override=40, max_num_batched_tokens=48, max_num_seqs=16),
], ids=["async-tiny-cache", "sync-chunked"])
def test_mixed_workload_matches_requests_run_alone(ckpt, engine_args):
    reqs = _workload(seed=len(engine_args))
    solo = LLM(ckpt, block_size=8, num_gpu_blocks_override=256)
    alone = [_tokens(solo.generate(prompt_token_ids=[p], sampling_params=s)[0]) for p, s in reqs]
    llm = LLM(ckpt, block_size=8, **engine_args)
    batched = llm.generate(prompt_token_ids=[p for p, _ in reqs], sampling_params=[s for _, s in reqs])
    for (prompt, params), out, ref in zip(reqs, batched, alone):
        assert _tokens(out) == ref, (len(prompt), params)
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            if params.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if engine_args["num_gpu_blocks_override"] == 24:
        assert stats["num_preemptions"] > 0  # the tiny cache really forced recompute


def test_random_aborts_never_leak(ckpt):
    llm = LLM(ckpt, block_size=8, num_gpu_blocks_override=32, max_num_batched_tokens=24, max_num_seqs=8,
              async_scheduling=True)
    eng = llm.engine
    rng = random.Random(5)
    live = []
    for i, (prompt, params) in enumerate(_workload(seed=9, n_requests=30)):
        eng.add_request(f"r{i}", prompt, params)
        live.append(f"r{i}")
        for _ in range(rng.randrange(0, 3)):
            eng.step()
        if live and rng.random() < 0.4:
            eng.abort(live.pop(rng.randrange(len(live))))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]
    assert torch.isfinite(eng.runner.kv_caches[0][:-1].float()).all()  # nothing wrote garbage
