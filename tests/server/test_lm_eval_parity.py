"""lm-eval accuracy parity: the real ``lm_eval --model local-completions`` CLI against a live server.

The project judges MLA changes the way the seeds do: lm-eval accuracy with a full-precision KV
cache, then with ``--kv-cache-dtype fp8``. The bundled adder (``configs/arith``) is scored on the
local tasks in ``configs/lm_eval_tasks`` (``arith_gen``: greedy generation, exact match;
``arith_mc``: the true sum among near misses by log-likelihood, which exercises ``echo`` +
``logprobs``), through ``tokenizer_backend=remote`` (``/tokenizer_info``, ``/tokenize``,
``/detokenize``) with both ``tokenized_requests=False`` (text prompts) and ``True`` (token ids).

Bars: >= 0.9 on both tasks with ``auto``; fp8 loses at most 3 points per task and mode. Note
that a fresh prompt's log-likelihood comes from prefill, which attends to the just-computed
latents, so the fp8 cache shows up in ``arith_gen`` (decode reads it) — as in vLLM.

Run with ``-s`` to see lm-eval's tables; set ``MLASERVE_LM_EVAL_TABLES=path.md`` to also write
them (with timings and a summary) to a markdown file.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from tests.server.live_server import ROOT, live_server

TASKS_DIR = os.path.join("configs", "lm_eval_tasks")
TASK_METRICS = {"arith_gen": "exact_match,none", "arith_mc": "acc,none"}
KV_CACHE_DTYPES = ("auto", "fp8")
TOKENIZED_REQUESTS = (False, True)
LIMIT = 200  # docs per task: the whole held-out file; ~10 s of requests per lm_eval run on 2 cores
NUM_CONCURRENT = 8
MIN_ACCURACY_AUTO = 0.9
MAX_FP8_LOSS = 0.03  # 3 points
LM_EVAL_TIMEOUT_S = 420
# Decode-heavy probes: fp8 must change their logprobs, or the fp8 server did not use an fp8 cache.
FP8_PROBE_PROMPTS = ("978+51=", "977+81=", "12+30=", "505+496=")
# lm-eval must not reach the network (the tasks read a local jsonl) nor oversubscribe the cores.
LM_EVAL_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


@dataclass
class LmEvalRun:
    kv_cache_dtype: str
    tokenized_requests: bool
    command: list[str]
    scores: dict[str, float]  # task -> metric value
    n_samples: dict[str, int]  # task -> docs scored
    table: str  # what lm_eval printed on stdout: the model line and the results table
    wall_s: float


# The ``lm_eval`` console script's own entry point (the real CLI, not the API) with its task
# index built from ``--include_path`` alone: by default every run first parses lm-eval's ~14,000
# built-in task YAMLs, ~7 s of CPU that none of these tasks reads.
LM_EVAL_CLI = """
import functools, sys
from lm_eval.tasks import TaskManager
TaskManager.__init__ = functools.partialmethod(TaskManager.__init__, include_defaults=False)
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
sys.exit(cli_evaluate())
"""


def lm_eval_cli() -> list[str]:
    """The command that runs :data:`LM_EVAL_CLI` on the running interpreter."""
    if importlib.util.find_spec("lm_eval") is None:
        pytest.fail("the `lm_eval` CLI is not installed (pip install 'lm-eval[api]')")
    return [sys.executable, "-c", LM_EVAL_CLI]


def model_args(served_name: str, base_url: str, tokenized_requests: bool) -> str:
    return ",".join([
        f"model={served_name}",
        f"base_url={base_url}/v1/completions",
        "tokenizer_backend=remote",
        f"tokenized_requests={tokenized_requests}",
        f"num_concurrent={NUM_CONCURRENT}",
        "max_retries=1",
    ])


def lm_eval_command(served_name: str, base_url: str, tokenized_requests: bool, output_path: str,
                    tasks=TASK_METRICS, limit: int = LIMIT) -> list[str]:
    return [
        *lm_eval_cli(), "--model", "local-completions",
        "--tasks", ",".join(tasks),
        "--include_path", TASKS_DIR,
        "--model_args", model_args(served_name, base_url, tokenized_requests),
        "--limit", str(limit),
        "--output_path", output_path,
    ]


def engine_gauges(base_url: str) -> str:
    """The server's queue gauges (engine-side running/waiting counts), for a stall's message."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError as e:
        return f"(/metrics unreachable: {e})"
    return "\n".join(line for line in text.splitlines()
                     if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def run_lm_eval(kv_cache_dtype: str, tokenized_requests: bool, served_name: str, base_url: str,
                output_path: str, tasks=TASK_METRICS, limit: int = LIMIT) -> LmEvalRun:
    """One ``lm_eval`` CLI run against the live server; ``tasks`` maps task name -> metric key."""
    cmd = lm_eval_command(served_name, base_url, tokenized_requests, output_path, tasks, limit)
    env = {**os.environ, **LM_EVAL_ENV}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        tail = "\n".join(err.replace("\r", "\n").splitlines()[-15:])
        pytest.fail(f"lm_eval ran past {LM_EVAL_TIMEOUT_S} s (kv {kv_cache_dtype}, tokenized_requests="
                    f"{tokenized_requests}); server queues now:\n{engine_gauges(base_url)}\n"
                    f"lm_eval stderr tail:\n{tail}")
    wall_s = time.monotonic() - t0
    stderr_tail = "\n".join(proc.stderr.replace("\r", "\n").splitlines()[-40:])
    assert proc.returncode == 0, f"lm_eval failed ({proc.returncode}): {' '.join(cmd)}\n{stderr_tail}"
    found = glob.glob(os.path.join(output_path, "**", "results_*.json"), recursive=True)
    assert len(found) == 1, f"expected one results JSON under {output_path}, found {found}\n{stderr_tail}"
    with open(found[0], encoding="utf-8") as f:
        results = json.load(f)
    scores = {task: float(results["results"][task][metric]) for task, metric in tasks.items()}
    n_samples = {task: int(results["n-samples"][task]["effective"]) for task in tasks}
    return LmEvalRun(kv_cache_dtype, tokenized_requests, cmd, scores, n_samples, proc.stdout.strip(), wall_s)


def run_lm_eval_both_modes(kv_cache_dtype: str, served_name: str, base_url: str, out_dir_of,
                           tasks=TASK_METRICS, limit: int = LIMIT) -> dict[bool, LmEvalRun]:
    """Both ``tokenized_requests`` modes against one server at once ({mode: run});
    ``out_dir_of(mode)`` names each run's output directory. Concurrent because each CLI run
    spends seconds starting up while the server idles, and its requests leave the second core
    mostly free; the scores cannot depend on it (greedy, and the engine is batch invariant)."""
    with ThreadPoolExecutor(len(TOKENIZED_REQUESTS)) as pool:
        futures = {tok: pool.submit(run_lm_eval, kv_cache_dtype, tok, served_name, base_url, out_dir_of(tok),
                                    tasks, limit) for tok in TOKENIZED_REQUESTS}
        return {tok: f.result() for tok, f in futures.items()}


def decode_logprobs(base_url: str, served_name: str) -> list[list[float]]:
    out = []
    with httpx.Client(timeout=60) as client:
        for prompt in FP8_PROBE_PROMPTS:
            r = client.post(f"{base_url}/v1/completions", json={
                "model": served_name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["logprobs"]["token_logprobs"])
    return out


def served_model_name(base_url: str) -> str:
    r = httpx.get(f"{base_url}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


@dataclass
class KvResult:
    """One server with one ``--kv-cache-dtype``: both lm_eval runs and the decode probes."""
    kv_cache_dtype: str
    server_start_s: float
    runs: dict[bool, LmEvalRun]  # tokenized_requests -> run
    probes: list[list[float]]  # decode logprobs of FP8_PROBE_PROMPTS

    def section(self) -> str:
        """lm-eval's own tables for this KV cache dtype, as it printed them, with timings."""
        lines = [f"### `--kv-cache-dtype {self.kv_cache_dtype}` (server ready in {self.server_start_s:.1f} s)", ""]
        for tok, run in self.runs.items():
            lines += [f"tokenized_requests={tok}: lm_eval took {run.wall_s:.1f} s", ""]
            lines += ["```", run.table, "```", ""]
        return "\n".join(lines)


def summary_table(auto: KvResult, fp8: KvResult) -> str:
    lines = ["### auto vs fp8", "",
             "| task | metric | tokenized_requests | auto | fp8 | fp8 − auto (points) |",
             "|---|---|---|---:|---:|---:|"]
    for task, metric in TASK_METRICS.items():
        for tok in TOKENIZED_REQUESTS:
            a, f = auto.runs[tok].scores[task], fp8.runs[tok].scores[task]
            lines.append(f"| {task} | {metric.split(',')[0]} | {tok} | {a:.4f} | {f:.4f} | {100 * (f - a):+.1f} |")
    return "\n".join(lines) + "\n"


class ParityRunner:
    """Runs every KV cache dtype's server at once, on first use: one server's work leaves the
    second core mostly idle (its engine is one thread, lm_eval mostly waits on it)."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._done: dict[str, KvResult] = {}
        self._failed: dict[str, str] = {}

    def __getitem__(self, kv: str) -> KvResult:
        if not self._done and not self._failed:
            self._run_all()
        if kv in self._failed:
            pytest.fail(f"the --kv-cache-dtype {kv} runs failed: {self._failed[kv]}")
        return self._done[kv]

    def _run_all(self) -> None:
        with ThreadPoolExecutor(len(KV_CACHE_DTYPES)) as pool:
            futures = {kv: pool.submit(self._run, kv) for kv in KV_CACHE_DTYPES}
        for kv, future in futures.items():
            try:
                self._done[kv] = future.result()
            except BaseException as e:  # pytest.fail's Failed included
                self._failed[kv] = "".join(traceback.format_exception(e))[-4000:]
                continue
            print("\n" + self._done[kv].section(), flush=True)

    def _run(self, kv: str) -> KvResult:
        t0 = time.monotonic()
        with live_server("--device", "cpu", "--kv-cache-dtype", kv, "--disable-log-stats") as base_url:
            start_s = time.monotonic() - t0
            name = served_model_name(base_url)
            probes = decode_logprobs(base_url, name)
            runs = run_lm_eval_both_modes(kv, name, base_url,
                                          lambda tok: str(self._tmp.mktemp(f"lm_eval_{kv}_tok{int(tok)}")))
        return KvResult(kv, start_s, runs, probes)

    def finish(self) -> None:
        """Print the auto-vs-fp8 summary; write every table to $MLASERVE_LM_EVAL_TABLES if set."""
        if set(self._done) != set(KV_CACHE_DTYPES):
            return
        summary = summary_table(self._done["auto"], self._done["fp8"])
        print("\n" + summary, flush=True)
        if path := os.environ.get("MLASERVE_LM_EVAL_TABLES"):
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(self._done[kv].section() for kv in KV_CACHE_DTYPES) + "\n" + summary)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    runner = ParityRunner(tmp_path_factory)
    yield runner
    runner.finish()


@pytest.mark.parametrize("tokenized_requests", TOKENIZED_REQUESTS)
def test_auto_kv_cache_accuracy_at_least_0_9(parity, tokenized_requests):
    run = parity["auto"].runs[tokenized_requests]
    for task, score in run.scores.items():
        assert score >= MIN_ACCURACY_AUTO, f"{task} with auto KV, tokenized_requests={tokenized_requests}: {score}"


@pytest.mark.parametrize("tokenized_requests", TOKENIZED_REQUESTS)
def test_fp8_kv_cache_loses_at_most_3_points(parity, tokenized_requests):
    auto, fp8 = parity["auto"].runs[tokenized_requests], parity["fp8"].runs[tokenized_requests]
    for task in TASK_METRICS:
        loss = auto.scores[task] - fp8.scores[task]
        assert loss <= MAX_FP8_LOSS + 1e-9, (
            f"{task}, tokenized_requests={tokenized_requests}: auto {auto.scores[task]:.4f} "
            f"vs fp8 {fp8.scores[task]:.4f} loses {100 * loss:.1f} points")


@pytest.mark.parametrize("kv", KV_CACHE_DTYPES)
def test_every_doc_was_scored(parity, kv):
    for tok, run in parity[kv].runs.items():
        assert run.n_samples == {task: LIMIT for task in TASK_METRICS}, (tok, run)
        for task in TASK_METRICS:
            assert f"|{task}|" in run.table.replace(" ", ""), run.table  # lm-eval's table has a row per task


def test_fp8_server_really_decodes_from_an_fp8_cache(parity):
    """Parity is only meaningful if the fp8 server's decode read quantized latents: its
    logprobs must differ from auto's somewhere (while staying close: same greedy answers)."""
    auto, fp8 = parity["auto"].probes, parity["fp8"].probes
    assert len(auto) == len(fp8) == len(FP8_PROBE_PROMPTS)
    assert auto != fp8, "fp8 KV cache gave bit-identical decode logprobs to auto: was it applied?"
    for a, f in zip(auto, fp8):
        assert len(a) == len(f) and max(abs(x - y) for x, y in zip(a, f)) < 0.5, (a, f)
