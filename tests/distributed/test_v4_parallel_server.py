"""DeepSeek-V4 and V4.1 served on CPU (gloo, fp32) with ``-tp 2`` and ``-dp 2
--enable-expert-parallel`` answer like ``-tp 1`` through the HTTP server: greedy texts,
sampled-token logprobs and prompt logprobs, under chunked prefill (11-token steps), preemption
(3 KV blocks), n = 2 siblings sharing a prompt chunk, and an unbalanced DEP step (one request
alone: the other DP rank runs dummy forwards); and with prefix caching (state snapshots: the
TP workers restore and take the same snapshots as the engine; V4.1: DEP, each DP engine
keeping its own). A TP size that does not split the heads / output groups is one error line.

V4: the bundled tiny fixture tests/fixtures/dev-v4-s0 (4 heads, 2 output groups, 4 experts).
V4.1: tiny-v41 (the same split, 8 layers, engram) written in the released format, FP8 linears
and MXFP4 routed experts: under ``-tp 2`` the experts' 16-wide slices are dequantized to
per-expert modules, under DEP each rank keeps its two whole experts stacked MXFP4. The HF-named
fixture dev-v41-s0 under TP / DP is tests/distributed/test_v4_model_parallel.py (model level).

Tolerance on logprobs: V4 5e-5 on every one (fp32, only the order of the partial sums differs,
see that module). V4.1 keeps its FP8 / FP4 activation roundings on, and a 1e-7 difference in
a value on a rounding boundary moves it by a whole quantization step (one flipped
sliding-window row moves the 8 logprobs that attend to it; measured here up to 5e-4, the
model test saw 9e-3), so V4.1 needs the *median* within 5e-5 and every one within 2e-2. A
wrong shard misses both by far: deliberately broken shards (rank 1's two heads swapped in
wq_b, or its two attention sinks, or DEP rank 1's two experts) gave medians of 0.09-0.37 and
maxima of 0.9-2.5, and changed the greedy texts.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server import test_v4_serving as serving
from tests.server.live_server import live_server
from tests.server.test_v41_mxfp4_serving import mxfp4_checkpoint

pytestmark = pytest.mark.slow

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
V4 = os.path.join(FIXTURES, "dev-v4-s0")
FLAGS = ("--device", "cpu", "--served-model-name", "m", "--block-size", "16", "--max-num-batched-tokens", "11",
         "--max-num-seqs", "8", "--num-gpu-blocks-override", "3", "--disable-log-stats")
TOL = 5e-5
V41_MAX_TOL = 2e-2  # V4.1: the bound on one logprob moved by a rounding flip (see the module doc)


tokenizer_dir = serving.tokenizer_dir  # the fixtures' servable 320-token tokenizer (a pytest fixture)


def _prompts() -> list[list[int]]:
    with open(os.path.join(V4, "golden.json"), encoding="utf-8") as f:
        base = json.load(f)["prompt_ids"]
    rng = random.Random(3)
    return [base[:n] if i % 2 else [0] + [rng.randrange(2, 320) for _ in range(n - 1)]
            for i, n in enumerate((27, 9, 19, 14, 23, 5))]


def _query(url: str) -> dict:
    prompts = _prompts()
    greedy = {"model": "m", "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with httpx.Client(base_url=url, timeout=120) as c:
        batch = c.post("/v1/completions", json={**greedy, "prompt": prompts, "max_tokens": 6}).json()
        echo = c.post("/v1/completions", json={**greedy, "prompt": prompts[0], "max_tokens": 1, "echo": True}).json()
        pair = c.post("/v1/completions", json={**greedy, "prompt": prompts[2], "max_tokens": 4, "n": 2}).json()
        alone = c.post("/v1/completions", json={**greedy, "prompt": prompts[4], "max_tokens": 5}).json()
        metrics = c.get("/metrics").text
    choices = [ch for r in (batch, echo, pair, alone) for ch in sorted(r["choices"], key=lambda ch: ch["index"])]
    return {
        "texts": [ch["text"] for ch in choices],
        "logprobs": [ch["logprobs"]["token_logprobs"] for ch in choices],
        "preemptions": _counter(metrics, "vllm:num_preemptions_total"),
        "prefix_cache_hits": _counter(metrics, "vllm:prefix_cache_hits_total"),
    }


def _counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"{name}\{{[^}}]*\}} ([\d.e+]+)", metrics))


# Every server the tests compare: (checkpoint, flags). Without prefix caching the n = 2
# siblings run together (sharing a chunk) and preempt.
SERVERS = {
    "v4_tp1": ("v4", ("--no-enable-prefix-caching",)),
    "v4_tp2": ("v4", ("-tp", "2", "--no-enable-prefix-caching")),
    "v4_dep2": ("v4", ("-dp", "2", "--enable-expert-parallel", "--no-enable-prefix-caching")),
    "v4_tp1_cached": ("v4", ()),
    "v4_tp2_cached": ("v4", ("-tp", "2")),
    "v41_tp1": ("v41", ("--no-enable-prefix-caching",)),
    "v41_tp2": ("v41", ("-tp", "2", "--no-enable-prefix-caching")),
    "v41_dep2_cached": ("v41", ("-dp", "2", "--enable-expert-parallel")),
}


def _serve_and_query(model: str, tokenizer_dir: str, *flags: str) -> dict:
    with live_server(model, *FLAGS, "--tokenizer", tokenizer_dir, *flags, timeout_s=180) as url:
        return _query(url)


@pytest.fixture(scope="module")
def served(tokenizer_dir, tmp_path_factory):
    """{server: future of ``_query``'s answers}, two servers at a time (a server starts one
    process after another, on one core; the V4.1 checkpoint is written while the first V4
    servers start); a test waits for the servers it compares, and a server's failure fails
    only those tests."""
    pool = ThreadPoolExecutor(2)
    try:
        futures = {name: pool.submit(_serve_and_query, V4, tokenizer_dir, *flags)
                   for name, (model, flags) in SERVERS.items() if model == "v4"}
        v41 = mxfp4_checkpoint(str(tmp_path_factory.mktemp("v41-released")))
        futures.update({name: pool.submit(_serve_and_query, v41, tokenizer_dir, *flags)
                        for name, (model, flags) in SERVERS.items() if model == "v41"})
        yield futures
    finally:
        pool.shutdown(cancel_futures=True)  # the servers no selected test waited for never start


def _assert_same(got: dict, ref: dict, max_tol: float = TOL) -> None:
    """Equal texts; logprobs: the median difference within TOL, every one within ``max_tol``."""
    assert got["texts"] == ref["texts"]
    assert [len(a) for a in got["logprobs"]] == [len(b) for b in ref["logprobs"]]
    diffs = [abs(x - y) for a, b in zip(got["logprobs"], ref["logprobs"]) for x, y in zip(a, b)
             if x is not None or y is not None]
    assert statistics.median(diffs) < TOL, statistics.median(diffs)
    assert max(diffs) < max_tol, max(diffs)


def test_tp2_matches_tp1(served):
    reference = served["v4_tp1"].result()
    assert reference["preemptions"] > 0  # the 3-block cache preempts and recomputes
    got = served["v4_tp2"].result()
    _assert_same(got, reference)
    assert got["preemptions"] == reference["preemptions"]  # the same schedule, states dropped alike


def test_dep2_matches_tp1(served):
    _assert_same(served["v4_dep2"].result(), served["v4_tp1"].result())


def test_tp2_with_prefix_caching_matches_tp1(served):
    """The n = 2 siblings start from the first one's snapshot at token 16 (TP workers too)."""
    reference = served["v4_tp1"].result()
    cached = served["v4_tp1_cached"].result()
    assert cached["prefix_cache_hits"] > 0
    _assert_same(cached, reference)
    got = served["v4_tp2_cached"].result()
    _assert_same(got, reference)
    assert got["prefix_cache_hits"] == cached["prefix_cache_hits"]


def test_v41_tp2_matches_tp1(served):
    reference_v41 = served["v41_tp1"].result()
    assert reference_v41["preemptions"] > 0
    got = served["v41_tp2"].result()
    _assert_same(got, reference_v41, V41_MAX_TOL)
    assert got["preemptions"] == reference_v41["preemptions"]


def test_v41_dep2_with_prefix_caching_matches_tp1(served):
    """Each DP engine snapshots and restores its own requests' states (the n = 2 siblings from
    the first one's) while the MoE layers dispatch over both ranks."""
    got = served["v41_dep2_cached"].result()
    assert got["prefix_cache_hits"] > 0
    _assert_same(got, served["v41_tp1"].result(), V41_MAX_TOL)


def test_tp_size_that_does_not_split_the_heads_is_one_line(tokenizer_dir):
    r = subprocess.run([sys.executable, "-m", "server", "serve", V4, "--device", "cpu", "--tokenizer", tokenizer_dir,
                        "-tp", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "--tensor-parallel-size 4" in ln]
    assert len(lines) == 1 and "4 attention heads and 2 output groups" in lines[0], r.stderr
