"""``mlaserve bench throughput|serve``: vLLM's dataset semantics, metrics, output and JSON keys.

The serve benchmark runs against the real HTTP layer twice: over a deterministic fake engine
(fast; checks what the server received and that --max-concurrency holds) and, marked slow,
against a real ``python -m server serve`` subprocess on a tiny random checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn

from server.bench.datasets import DatasetError, sample_random_requests
from server.bench.plot import PlotUnavailable, plot_latency_percentiles
from server.bench.serve_client import (RequestResult, arrival_offsets, compute_metrics, format_report,
                                     latency_series)
from server.bench.throughput import ModelSpecError, materialize_model
from server.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Field names, in order, of vLLM's "Serving Benchmark Result" block (benchmarks/serve.py).
VLLM_SERVE_FIELDS = [
    "Successful requests:", "Failed requests:", "Maximum request concurrency:", "Benchmark duration (s):",
    "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
    "Output token throughput (tok/s):", "Peak output token throughput (tok/s):", "Peak concurrent requests:",
    "Total token throughput (tok/s):",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):",
    "Mean E2EL (ms):", "Median E2EL (ms):", "P99 E2EL (ms):",
]
VLLM_SERVE_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}
VLLM_THROUGHPUT_KEYS = {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
                        "tokens_per_second"}
THROUGHPUT_LINE = re.compile(r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s$",
                             re.M)


def _positions(text: str, fields: list[str]) -> list[int]:
    """Offsets of each field's line inside the result block (the run's preamble is skipped)."""
    text = text[text.index("============ Serving Benchmark Result"):]
    found = []
    for f in fields:
        m = re.search(rf"^{re.escape(f)} +\S", text, re.M)
        assert m, f"missing line {f!r} in:\n{text}"
        found.append(m.start())
    return found


# ----------------------------------------------------------------------------- dataset


def test_random_dataset_has_vllm_semantics():
    special = {0, 1, 5}
    reqs = sample_random_requests(20, 16, 4, 64, special_token_ids=special, seed=3)
    allowed = [t for t in range(64) if t not in special]
    assert [r.prompt_len for r in reqs] == [16] * 20 and [r.expected_output_len for r in reqs] == [4] * 20
    for r in reqs:  # a run through the allowed ids: allowed[(offset + i + k) % n]
        start = allowed.index(r.prompt_token_ids[0])
        assert r.prompt_token_ids == [allowed[(start + k) % len(allowed)] for k in range(16)]
    assert len({tuple(r.prompt_token_ids) for r in reqs}) > 1
    again = sample_random_requests(20, 16, 4, 64, special_token_ids=special, seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = sample_random_requests(20, 16, 4, 64, special_token_ids=special, seed=4)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]


def test_random_dataset_range_ratio_and_prefix():
    reqs = sample_random_requests(200, 100, 10, 1000, range_ratio=0.5, prefix_len=7, seed=0)
    body_lens = [r.prompt_len - 7 for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert min(body_lens) >= 50 and max(body_lens) <= 150 and len(set(body_lens)) > 20
    assert min(out_lens) >= 5 and max(out_lens) <= 15
    assert len({tuple(r.prompt_token_ids[:7]) for r in reqs}) == 1


@pytest.mark.parametrize("kwargs, flag", [
    (dict(num_requests=0), "--num-prompts"),
    (dict(output_len=0), "--output-len"),
    (dict(input_len=0), "--input-len"),
    (dict(range_ratio=1.0), "--random-range-ratio"),
    (dict(vocab_size=2, special_token_ids={0, 1}), "vocabulary"),
])
def test_random_dataset_rejects_bad_settings(kwargs, flag):
    args = dict(num_requests=4, input_len=8, output_len=2, vocab_size=32) | kwargs
    with pytest.raises(DatasetError, match=flag):
        sample_random_requests(**args)


# ----------------------------------------------------------------------------- arrivals and metrics


def test_arrival_offsets():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    times = arrival_offsets(400, 20.0, seed=1)
    assert times == sorted(times) and times[-1] == pytest.approx(400 / 20.0)
    gaps = np.diff([0.0, *times])
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.2)  # exponential gaps: cv = 1
    uniform = np.diff(arrival_offsets(400, 20.0, burstiness=100.0, seed=1))
    assert uniform.std() / uniform.mean() < 0.2
    assert arrival_offsets(10, 5.0, seed=2) == arrival_offsets(10, 5.0, seed=2)
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_offsets(3, 0.0)


def test_metrics_and_report_match_vllm_definitions():
    a = RequestResult(prompt_len=10, success=True, output_tokens=3, ttft=0.1, itl=[0.02, 0.04], latency=0.16,
                      start_time=100.0)
    b = RequestResult(prompt_len=20, success=True, output_tokens=5, ttft=0.3, itl=[0.05] * 4, latency=0.5,
                      start_time=100.05)
    c = RequestResult(prompt_len=30, error="HTTP 400: too long")
    m = compute_metrics([a, b, c], duration=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 8)
    assert m["request_throughput"] == pytest.approx(1.0) and m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100.0, 300.0], 99))
    assert m["mean_tpot_ms"] == pytest.approx((30.0 + 50.0) / 2)  # (E2EL - TTFT) / (tokens - 1)
    assert m["mean_itl_ms"] == pytest.approx(np.mean([20, 40, 50, 50, 50, 50]))
    assert m["mean_e2el_ms"] == pytest.approx(330.0)
    assert m["max_concurrent_requests"] == 2 and m["max_output_tokens_per_s"] == 8.0
    assert m["output_lens"] == [3, 5, 0] and m["errors"][2] == "HTTP 400: too long"
    report = format_report(m, max_concurrency=4, request_rate=math.inf)
    assert report.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert report.splitlines()[-1] == "=" * 50
    pos = _positions(report, VLLM_SERVE_FIELDS)
    assert pos == sorted(pos)
    for header in ("Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                   "End-to-end Latency"):
        assert re.search(rf"^-+{re.escape(header)}-+$", report, re.M)
    assert "Request rate configured (RPS):" not in report
    assert "Request rate configured (RPS):   " in format_report(m, max_concurrency=None, request_rate=5.0)
    assert latency_series([a, b, c])["tpot"] == pytest.approx([0.03, 0.05])


def test_plot_needs_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PlotUnavailable, match="pip install matplotlib"):
        plot_latency_percentiles({"ttft": [0.1, 0.2]}, str(tmp_path / "p.png"), "t")


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_latency_percentiles({"ttft": [0.1, 0.2, 0.3], "itl": [], "e2el": [1.0, 2.0]},
                                    str(tmp_path / "p.png"), "t")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no latency samples"):
        plot_latency_percentiles({"ttft": []}, str(tmp_path / "q.png"), "t")


# ----------------------------------------------------------------------------- throughput


def test_model_spec(tmp_path):
    with materialize_model(str(tmp_path)) as d:
        assert d == str(tmp_path)
    with pytest.raises(ModelSpecError, match="preset only"):
        with materialize_model(str(tmp_path), num_layers=2):
            pass
    with pytest.raises(ModelSpecError, match="presets: .*tiny-v3"):
        with materialize_model("no-such-model"):
            pass
    with materialize_model("tiny-v3", num_layers=1) as d:
        with open(os.path.join(d, "config.json")) as f:
            assert json.load(f)["num_hidden_layers"] == 1
        kept = d
    assert not os.path.exists(kept)  # the temporary checkpoint is removed afterwards


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "presets:"),
    (["--model", "tiny-v3", "--block-size", "3"], "--block-size: must be a power of two"),
    (["--model", "tiny-v3", "--num-layers", "0"], "--num-layers: must be at least 1"),
])
def test_bench_throughput_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--device", "cpu", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_throughput_tiny_preset(tmp_path, capsys):
    out_json = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", "tiny-v3", "--num-layers", "1", "--num-prompts", "8",
               "--input-len", "16", "--output-len", "4", "--device", "cpu", "--num-gpu-blocks-override", "64",
               "--block-size", "16",
               "--output-json", str(out_json), "--disable-tqdm"])
    assert rc == 0
    out = capsys.readouterr().out
    assert THROUGHPUT_LINE.search(out), out
    assert re.search(r"^Total num prompt tokens:  128$", out, re.M)
    assert re.search(r"^Total num output tokens:  32$", out, re.M)  # ignore_eos: exactly 8 x 4
    result = json.loads(out_json.read_text())
    assert VLLM_THROUGHPUT_KEYS <= set(result)
    assert (result["num_requests"], result["total_num_tokens"]) == (8, 160)
    assert result["requests_per_second"] == pytest.approx(8 / result["elapsed_time"])
    assert result["output_tokens_per_second"] == pytest.approx(32 / result["elapsed_time"])


# ----------------------------------------------------------------------------- serve over a fake engine


class _ThreadedServer:
    """uvicorn in a background thread on a pre-bound loopback port."""

    def __init__(self, app) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    from model.tokenizer_builder import build_test_tokenizer
    from server.api import build_app
    from server.tokenizer import Tokenizer
    from tests.server.fake_engine import FakeEngine

    path = tmp_path_factory.mktemp("tok")
    build_test_tokenizer(320, str(path))
    engine = FakeEngine(Tokenizer.from_pretrained(str(path)), max_model_len=64, step_delay=0.005)
    srv = _ThreadedServer(build_app(engine))
    srv.engine = engine
    yield srv
    srv.close()


def test_bench_serve_against_fake_engine(fake_server, tmp_path, capsys):
    engine = fake_server.engine
    engine.requests.clear()
    engine.max_concurrent = 0
    result_file = tmp_path / "res" / "serve.json"
    rc = main(["bench", "serve", "--base-url", fake_server.url, "--num-prompts", "12", "--random-input-len", "8",
               "--random-output-len", "5", "--max-concurrency", "3", "--request-rate", "200", "--save-result",
               "--result-dir", str(tmp_path / "res"), "--result-filename", "serve.json", "--save-detailed",
               "--metadata", "run=ci", "--disable-tqdm"])
    assert rc == 0
    out = capsys.readouterr().out
    pos = _positions(out, ["Request rate configured (RPS):", *VLLM_SERVE_FIELDS])
    assert pos[1:] == sorted(pos[1:])
    assert re.search(r"^Successful requests: +12 *$", out, re.M)
    assert re.search(r"^Total generated tokens: +60 *$", out, re.M)
    # What the server received: token-id prompts of exactly 8 tokens, 5 tokens each, ignore_eos.
    assert len(engine.requests) == 12
    for _rid, ids, params in engine.requests:
        assert len(ids) == 8 and params.max_tokens == 5 and params.ignore_eos
    assert 1 <= engine.max_concurrent <= 3
    result = json.loads(result_file.read_text())
    assert VLLM_SERVE_KEYS <= set(result)
    assert (result["completed"], result["failed"], result["total_input_tokens"],
            result["total_output_tokens"]) == (12, 0, 96, 60)
    assert result["model_id"] == "fake-model" and result["run"] == "ci" and result["max_concurrency"] == 3
    assert result["output_lens"] == [5] * 12 and all(len(itl) == 4 for itl in result["itls"])
    # Every request has 5 tokens, so E2EL = TTFT + 4 TPOT on average, and ITL averages to TPOT.
    assert result["mean_e2el_ms"] == pytest.approx(result["mean_ttft_ms"] + 4 * result["mean_tpot_ms"])
    assert result["mean_itl_ms"] == pytest.approx(result["mean_tpot_ms"])
    assert result["mean_e2el_ms"] >= 5 * 5.0  # five engine steps of 5 ms each at least
    assert result["max_concurrent_requests"] <= 3


def test_bench_serve_errors(fake_server, capsys):
    with pytest.raises(SystemExit) as e:  # 60 + 10 tokens > the server's max_model_len of 64
        main(["bench", "serve", "--base-url", fake_server.url, "--num-prompts", "2", "--random-input-len", "60",
              "--random-output-len", "10", "--disable-tqdm"])
    assert e.value.code == 2 and "max_model_len is 64" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["bench", "serve", "--base-url", dead, "--num-prompts", "2", "--disable-tqdm"]) == 1
    assert "is the server running?" in capsys.readouterr().err
    fake_server.engine.reject_next = "rejected for the test"  # the next request gets a 400
    assert main(["bench", "serve", "--base-url", fake_server.url, "--num-prompts", "3", "--random-input-len", "4",
                 "--random-output-len", "2", "--max-concurrency", "1", "--disable-tqdm"]) == 0
    out = capsys.readouterr().out
    assert "Error 0: HTTP 400: rejected for the test" in out
    assert re.search(r"^Successful requests: +2 *$", out, re.M) and re.search(r"^Failed requests: +1 *$", out, re.M)


# ----------------------------------------------------------------------------- serve, real server


@pytest.mark.slow
def test_bench_serve_against_real_server(tmp_path, capsys):
    from model.checkpoint import write_random_checkpoint

    ckpt = write_random_checkpoint("tiny-v3", str(tmp_path / "ckpt"), with_mtp=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", ckpt, "--host", "127.0.0.1", "--port", str(port),
         "--device", "cpu", "--num-gpu-blocks-override", "256", "--block-size", "16", "--disable-log-stats"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.5)
        rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "8", "--random-input-len", "16",
                   "--random-output-len", "4", "--max-concurrency", "4", "--result-filename",
                   str(tmp_path / "r.json"), "--disable-tqdm"])
        assert rc == 0
        out = capsys.readouterr().out
        _positions(out, VLLM_SERVE_FIELDS)
        assert re.search(r"^Total generated tokens: +32 *$", out, re.M)  # ignore_eos honoured by the engine
        result = json.loads((tmp_path / "r.json").read_text())
        assert VLLM_SERVE_KEYS <= set(result) and result["completed"] == 8 and result["total_input_tokens"] == 128
        assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
