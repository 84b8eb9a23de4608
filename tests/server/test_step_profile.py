"""The opt-in per-step time breakdown (server.step_profile) on the bundled model, on CPU:
every scheduled step is recorded once with the right kind, batch and tokens; phases add up;
off means nothing is recorded; ``bench throughput --step-profile`` reports it."""

from __future__ import annotations

import json
import re
import types

import pytest
import torch

from server import LLM, SamplingParams
from server.cli import main
from server.cuda_graphs import DecodeGraphs
from server.step_profile import PHASES, StepProfiler, classify_step, format_summary

ENV_VAR = "MLASERVE_STEP_PROFILE"  # read through server.envs
VOCAB = 16  # the bundled adder's vocabulary


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(l),), generator=g).tolist()
            for l in torch.randint(4, 40, (n,), generator=g)]


def _count_scheduled(llm):
    """Wrap the scheduler: the number of non-empty steps and the tokens they schedule."""
    seen = {"steps": 0, "tokens": 0, "seqs": 0}
    schedule = llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        if not out.is_empty:
            seen["steps"] += 1
            seen["tokens"] += sum(e.num_new_tokens for e in out.scheduled)
            seen["seqs"] += len(out.scheduled)
        return out

    llm.engine.scheduler.schedule = counting
    return seen


def test_every_step_is_recorded_with_kind_batch_and_tokens(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    # Small token budget: prompts are chunked, so prefill, mixed and decode steps all occur.
    llm = LLM(device="cpu", max_num_batched_tokens=32, max_num_seqs=4, block_size=16)
    seen = _count_scheduled(llm)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    s = llm.engine.stats()["step_profile"]
    kinds = s["kinds"]
    assert {"prefill", "mixed", "decode-eager"} <= set(kinds) and "decode-graph" not in kinds
    assert sum(k["steps"] for k in kinds.values()) == seen["steps"] == len(llm.engine.step_profiler.records)
    # Every prompt token once, every generated token but each sequence's last fed back once.
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    expected_tokens = sum(map(len, prompts)) + generated - len(prompts)
    assert sum(k["tokens"] for k in kinds.values()) == seen["tokens"] == expected_tokens
    assert sum(k["mean_batch"] * k["steps"] for k in kinds.values()) == pytest.approx(seen["seqs"])
    assert kinds["decode-eager"]["eager_reasons"] == {"graphs off (cpu)": kinds["decode-eager"]["steps"]}
    for rec in llm.engine.step_profiler.records:
        assert set(rec.phases) == set(PHASES)
        assert all(v >= 0 for v in rec.phases.values())
        assert sum(rec.phases.values()) <= rec.wall_s * (1 + 1e-9) + 1e-9
        if rec.kind.startswith("decode"):
            assert rec.num_tokens == rec.num_seqs
    for k in kinds.values():
        assert sum(k["phases_s"].values()) <= k["total_s"] * (1 + 1e-9) + 1e-9
        assert k["mean_ms"] == pytest.approx(1e3 * k["total_s"] / k["steps"])
    # The engine steps (incl. empty ones) hold every runner step; scheduler = the rest.
    assert s["engine_steps"] >= seen["steps"]
    assert s["engine_s"] >= sum(k["total_s"] for k in kinds.values()) * (1 - 1e-9)
    assert s["scheduler_s"] == pytest.approx(s["engine_s"] - s["runner_s"])
    table = format_summary(s)
    assert re.search(r"^decode-eager +\d+ ", table, re.M) and "graphs off (cpu)" in table


def test_off_records_nothing_and_never_times(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = LLM(device="cpu", block_size=16)

    def boom(*a, **k):
        raise AssertionError("profiler used while off")

    for name in ("begin", "mark", "end_runner_step", "end_engine_step"):
        monkeypatch.setattr(StepProfiler, name, boom)
    llm.generate(prompt_token_ids=_prompts(3), sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    prof = llm.engine.step_profiler
    assert not prof.enabled and not prof.records and prof.engine_steps == 0
    assert "step_profile" not in llm.engine.stats()


def test_decode_classification_follows_graph_fits():
    graphs = types.SimpleNamespace(max_batch=8, graphs={1: None, 8: None})
    graphs.fits = types.MethodType(DecodeGraphs.fits, graphs)  # the runner's own replay rule
    assert classify_step(8, 8, graphs, "off") == ("decode-graph", None)
    assert classify_step(9, 9, graphs, "off") == ("decode-eager", "batch > captured max 8")
    assert classify_step(3, 3, None, "graphs off (enforce_eager)") == ("decode-eager", "graphs off (enforce_eager)")
    assert classify_step(2, 3, graphs, "off") == ("mixed", None)
    assert classify_step(0, 3, graphs, "off") == ("prefill", None)
    graphs.graphs = {}
    assert classify_step(1, 1, graphs, "off") == ("decode-eager", "no graph captured")
    # V4: a request past the graphs' context decodes eagerly, and the profile says why
    v4 = types.SimpleNamespace(max_batch=8, graphs={1: None}, max_tokens=64)
    assert classify_step(1, 1, v4, "off", fits=True) == ("decode-graph", None)
    assert classify_step(1, 1, v4, "off", fits=False) == ("decode-eager", "a request past the graphs' 64 tokens")


def test_cuda_synchronizes_at_each_boundary_only_when_profiling(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    dev = torch.device("cuda", 0)
    prof = StepProfiler(enabled=True, device=dev)
    rec = prof.begin()
    rec.kind = "prefill"
    prof.mark(rec, "plan")
    prof.mark(rec, "forward")
    prof.end_runner_step(rec, "sample")
    assert calls == [dev] * 4
    calls.clear()
    rec = StepProfiler(enabled=True, device=torch.device("cpu")).begin()
    assert calls == []


def test_bench_throughput_step_profile(tmp_path, capsys):
    out_json = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
               "--device", "cpu", "--block-size", "16", "--output-json", str(out_json), "--disable-tqdm",
               "--step-profile"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.index("Throughput:") < out.index("==== Step profile")
    assert re.search(r"^engine steps: \d+, [\d.]+ s = runner ", out, re.M)
    prof = json.loads(out_json.read_text())["step_profile"]
    kinds = prof["kinds"]
    assert sum(k["tokens"] for k in kinds.values()) == 4 * 8 + 4 * (3 - 1)
    assert kinds["decode-eager"]["steps"] == 2 and kinds["decode-eager"]["mean_batch"] == 4
