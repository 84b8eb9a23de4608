"""The start-up warm-up: which step shapes it runs, that it leaves nothing behind (requests,
blocks, prefix-cache entries, counters), and that serving after it is unchanged."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import write_random_checkpoint
from server import LLM, SamplingParams
from server import warmup
from server.config import EngineConfig

VOCAB = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny-v3", str(tmp_path_factory.mktemp("warmup") / "m"), seed=3)


def _prompts(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(length),), generator=g).tolist()
            for length in torch.randint(5, 90, (n,), generator=g)]


def test_prompt_lengths_fill_a_step_and_respect_the_limits():
    # The V2-Lite benchmark's shape: three prompts of the budget (warmup_prompt_lengths says
    # which steps they make).
    assert warmup.warmup_prompt_lengths(8192, 9280, 256, 10**6) == [8192] * 3
    # vLLM's R1 launch line with short contexts: prompts as long as a sequence may be, enough
    # of them to fill the 16k budget and two more.
    lengths = warmup.warmup_prompt_lengths(16384, 2048, 512, 10**6)
    assert lengths == [2045] * 11 and sum(lengths[:-2]) >= 16384
    assert warmup.warmup_prompt_lengths(16384, 2048, 4, 10**6) == [2045] * 4  # --max-num-seqs
    assert warmup.warmup_prompt_lengths(8192, 9280, 256, 9000) == [8192]  # KV capacity: one fits
    assert warmup.warmup_prompt_lengths(8192, 9280, 256, 20000) == [8192] * 2
    assert warmup.warmup_prompt_lengths(64, 3, 8, 100) == [1] * 8  # tiny max_model_len
    assert warmup.warmup_output_tokens(1, 3) == 2 and warmup.warmup_output_tokens(8192, 9280) == 3


def test_prefill_attention_warm_up_covers_the_step_budget(monkeypatch):
    class Backend:
        name = "stub"
        asked = []

        def warm_up(self, max_chunk_tokens):
            self.asked.append(max_chunk_tokens)
            return 0

    class Runner:
        device = torch.device("cuda")
        prefill_backend = Backend()

    warmup.warm_up_prefill_attention(Runner, EngineConfig(max_num_batched_tokens=8192), 9280)
    warmup.warm_up_prefill_attention(Runner, EngineConfig(max_num_batched_tokens=16384), 2048)  # a chunk < a sequence
    assert Backend.asked == [8192, 2048]
    monkeypatch.setenv("MLASERVE_SKIP_WARMUP", "1")
    warmup.warm_up_prefill_attention(Runner, EngineConfig(), 9280)
    monkeypatch.delenv("MLASERVE_SKIP_WARMUP")
    Runner.device = torch.device("cpu")
    warmup.warm_up_prefill_attention(Runner, EngineConfig(), 9280)
    assert Backend.asked == [8192, 2048]


def test_skip_reasons(monkeypatch):
    class Core:
        device = torch.device("cuda")
        config = EngineConfig(data_parallel_size=1)
        max_model_len = 4096

    assert warmup.warmup_skip_reason(Core) is None
    monkeypatch.setenv("MLASERVE_SKIP_WARMUP", "1")
    assert "MLASERVE_SKIP_WARMUP" in warmup.warmup_skip_reason(Core)
    monkeypatch.delenv("MLASERVE_SKIP_WARMUP")
    Core.config = EngineConfig(data_parallel_size=2)
    assert "data parallel" in warmup.warmup_skip_reason(Core)
    Core.max_model_len = 1
    assert "--max-model-len" in warmup.warmup_skip_reason(Core)
    Core.device = torch.device("cpu")
    assert "CPU" in warmup.warmup_skip_reason(Core)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_warmup_runs_the_serving_shapes_and_forgets_them(ckpt, monkeypatch, async_scheduling):
    args = dict(block_size=16, num_gpu_blocks_override=64, max_num_batched_tokens=48, max_num_seqs=8,
                max_model_len=256, async_scheduling=async_scheduling)
    reference = LLM(ckpt, **args).generate(prompt_token_ids=_prompts(), sampling_params=GREEDY)
    llm = LLM(ckpt, **args)  # on the CPU the engine skips its warm-up; run it here by hand
    core = llm.engine
    steps = []
    inner = core.runner.execute if not async_scheduling else core.runner.launch

    def spy(out, *rest):
        if not out.is_empty:
            steps.append((out.num_decodes, [(e.start_pos, e.num_new_tokens) for e in out.prefills]))
        return inner(out, *rest)

    monkeypatch.setattr(core.runner, "launch" if async_scheduling else "execute", spy)
    monkeypatch.setattr(warmup, "warmup_skip_reason", lambda c: None)
    assert warmup.warm_up(core) is not None
    monkeypatch.undo()
    assert (0, [(0, 48)]) in steps  # a budget-wide chunk from position 0
    assert any(d >= 1 and any(start == 0 and n == 47 for start, n in ch) for d, ch in steps)  # the other divisibility
    assert any(d >= 1 and any(start > 0 and n >= 2 for start, n in ch) for d, ch in steps)  # a tail after context
    assert any(d >= 2 and not ch for d, ch in steps)  # pure decode steps
    # Nothing of it is left: requests, blocks, prefix-cache entries, counters.
    stats = core.stats()
    assert not core.has_unfinished() and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["prompt_tokens_total"] == stats["generation_tokens_total"] == 0
    assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0
    assert core.runner.num_overlapped_steps == 0
    first_warmup_prompt = torch.randint(0, core.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    again = llm.generate(prompt_token_ids=[first_warmup_prompt], sampling_params=GREEDY)[0]
    assert again.num_cached_tokens == 0  # the warm-up's prompts were not kept as prefixes
    # Serving afterwards gives what an engine that never warmed up gives.
    outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]


@pytest.mark.gpu
def test_gpu_engine_warms_up_at_start(ckpt, caplog):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with caplog.at_level("INFO", logger="server.warmup"):
        llm = LLM(ckpt, device="cuda", block_size=16, max_num_batched_tokens=48, max_num_seqs=8, max_model_len=256,
                  gpu_memory_utilization=0.3)
    assert any("start-up warm-up:" in r.getMessage() for r in caplog.records)
    stats = llm.engine.stats()
    assert stats["prompt_tokens_total"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    out = llm.generate(prompt_token_ids=_prompts(2), sampling_params=GREEDY)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
