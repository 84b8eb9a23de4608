"""Real multi-process servers on CPU (gloo, fp32): TP2, DP2 (with and without expert
parallelism) and DP2 × TP2 answer like TP1; the reduce-scatter and all-reduce modes agree
and the counters show which ran; a killed worker turns /health to 503 and ends the server
with a non-zero exit within 10 s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from model.checkpoint import write_random_checkpoint
from tests.server.live_server import descendants, listening_sockets, live_server_process

pytestmark = pytest.mark.slow


TEST_FLAGS = ("--dtype", "float32", "--num-gpu-blocks-override", "64", "--block-size", "16", "--disable-log-stats")
# The user's launch line, verbatim (issue: the vLLM seed run of DeepSeek-R1 on 8 GPUs).
SEED_LAUNCH_LINE = (
    "--dtype auto --kv-cache-dtype fp8 --tensor-parallel-size 8 --swap-space 16 --max-num-seqs 1024 "
    "--trust-remote-code --max-model-len 10240 --gpu-memory-utilization 0.95 --max-num-batched-tokens 16384 "
    "--async-scheduling --max-cudagraph-capture-size 1024 --compilation_config.cudagraph_mode FULL_DECODE_ONLY"
).split()


@contextmanager
def serve(model_dir: str, *flags: str, timeout_s: float = 120.0, test_flags=TEST_FLAGS, may_exit: bool = False):
    """A live CPU server of ``model_dir``; yields (base URL, server process)."""
    with live_server_process(model_dir, "--device", "cpu", *test_flags, *flags, timeout_s=timeout_s,
                             may_exit=may_exit) as (url, proc):
        yield url, proc


PROMPTS = ["the quick brown fox", "DeepSeek MLA keeps a latent cache", "1+2=3, 4+5="]


def _query(url: str) -> dict:
    """Greedy completions and prompt logprobs (echo) for every prompt, sent concurrently."""
    with httpx.Client(base_url=url, timeout=60) as c:
        gen = c.post("/v1/completions", json={"model": c.get("/v1/models").json()["data"][0]["id"],
                                               "prompt": PROMPTS, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True}).json()
        echo = c.post("/v1/completions", json={"model": gen["model"], "prompt": PROMPTS, "max_tokens": 1,
                                                "temperature": 0, "echo": True, "logprobs": 0}).json()
        # An unbalanced DEP step: a single request keeps one rank idle.
        alone = c.post("/v1/completions", json={"model": gen["model"], "prompt": PROMPTS[0], "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True}).json()
        metrics = c.get("/metrics").text
    return {
        "texts": [ch["text"] for ch in sorted(gen["choices"], key=lambda ch: ch["index"])],
        "logprobs": [ch["logprobs"]["token_logprobs"] for ch in sorted(echo["choices"], key=lambda ch: ch["index"])],
        "alone": alone["choices"][0]["text"],
        "collectives": {m.group(1): float(m.group(2)) for m in
                        re.finditer(r'mlaserve:collectives_total\{kind="(\w+)",model_name="[^"]*"\} ([\d.e+]+)',
                                    metrics)},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["texts"] == b["texts"]
    assert a["alone"] == b["alone"]
    for la, lb in zip(a["logprobs"], b["logprobs"]):
        assert la[0] is None and lb[0] is None
        assert max(abs(x - y) for x, y in zip(la[1:], lb[1:])) < 1e-5


# Every layout served from one checkpoint per model, and the flags that ask for it.
LAYOUTS = {
    "tp1": (),
    "tp2": ("--tensor-parallel-size", "2"),
    "tp2_all_reduce": ("-tp", "2", "--tp-reduction", "all_reduce"),
    "dp2_dep": ("--data-parallel-size", "2", "--enable-expert-parallel"),
    "dp2_moe_tp": ("--data-parallel-size", "2"),
    "dp2_tp2": ("-dp", "2", "-tp", "2", "--enable-expert-parallel"),  # two engines, each with one TP worker
}
MODELS = ("tiny-v3", "tiny-v2")


def _assert_internal_sockets_on_loopback(url: str, server_pid: int) -> None:
    """The HTTP port is the only socket bound to --host (here loopback too); every other
    listener (the TCP store, gloo's pairs) is on --master-addr (127.0.0.1), never a wildcard."""
    pids = [server_pid] + descendants(server_pid)
    found = listening_sockets(pids)
    http_port = int(url.rsplit(":", 1)[1])
    assert [(pid, port) for pid, _, port in found if port == http_port] == [(server_pid, http_port)]
    assert len(found) > 1, "a TP2 server with no internal listener?"
    assert all(addr == "127.0.0.1" for _, addr, _ in found), found


def _serve_layout(path: str, layout: str) -> dict:
    with serve(path, *LAYOUTS[layout], timeout_s=180) as (url, proc):
        answers = _query(url)
        if layout == "tp2":
            _assert_internal_sockets_on_loopback(url, proc.pid)
    return answers


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{(model, layout): future of ``_query``'s answers}: every layout of every model, two
    servers at a time (a server starts one process after another, on one core); a test
    waits for the layouts it compares, and a layout's failure fails only those tests."""
    paths = {m: write_random_checkpoint(m, str(tmp_path_factory.mktemp(m) / "m"), seed=17) for m in MODELS}
    pool = ThreadPoolExecutor(2)
    try:
        yield {(m, layout): pool.submit(_serve_layout, paths[m], layout) for m in MODELS for layout in LAYOUTS}
    finally:
        pool.shutdown(cancel_futures=True)  # the layouts no selected test waited for never start


@pytest.mark.parametrize("model", MODELS)
def test_tp2_reduce_scatter_and_all_reduce_match_tp1(served, model):
    ref = served[model, "tp1"].result()
    rs = served[model, "tp2"].result()
    ar = served[model, "tp2_all_reduce"].result()
    _assert_same(rs, ref)
    _assert_same(ar, ref)
    # (one all-reduce at start-up agrees on the KV capacity; the layers never all-reduce)
    assert rs["collectives"].get("reduce_scatter_tensor", 0) > 0 and rs["collectives"].get("all_reduce", 0) <= 1
    assert rs["collectives"].get("reduce_scatter_v", 0) == 0  # steps are padded to equal shards
    assert ar["collectives"].get("all_reduce", 0) > 0 and "reduce_scatter_tensor" not in ar["collectives"]


@pytest.mark.parametrize("layout", ["dp2_dep", "dp2_moe_tp"], ids=["dep", "moe_tp"])
@pytest.mark.parametrize("model", MODELS)
def test_dp2_matches_tp1(served, model, layout):
    """DP2 with whole experts per rank (DEP), or every expert split over both ranks (the default)."""
    dep = served[model, layout].result()
    _assert_same(dep, served[model, "tp1"].result())
    assert dep["collectives"].get("reduce_scatter_v", 0) + dep["collectives"].get("reduce_scatter_tensor", 0) > 0


@pytest.mark.parametrize("model", MODELS)
def test_dp2_tp2_matches_tp1(served, model):
    """DP2 × TP2 with experts over all four ranks: two engines, each with one TP worker."""
    dptp = served[model, "dp2_tp2"].result()
    _assert_same(dptp, served[model, "tp1"].result())
    assert dptp["collectives"].get("reduce_scatter_tensor", 0) > 0  # the TP layers
    assert dptp["collectives"].get("reduce_scatter_v", 0) > 0  # the MoE combine of unequal DP steps


def test_unsupported_layouts_are_one_line_errors():
    from server.llm import LLM, bundled_model_dir

    for extra in ((), ("--node-rank", "1")):
        r = subprocess.run([sys.executable, "-m", "server", "serve", bundled_model_dir(), "--device", "cpu",
                            "-dp", "2", "--nnodes", "2", *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1
        assert "--data-parallel-size > 1 with --nnodes > 1 is not supported" in r.stderr
        assert "Traceback" not in r.stderr
    with pytest.raises(ValueError, match="one engine process per DP rank"):
        LLM(data_parallel_size=2, device="cpu")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_killed_worker_gives_503_and_nonzero_exit(tmp_path):
    path = write_random_checkpoint("tiny-v2", str(tmp_path / "m"), seed=3)
    with serve(path, "-tp", "2", may_exit=True) as (url, proc):
        engines = _children(proc.pid)
        # The engine's children: its TP worker (a multiprocessing spawn child), not the
        # multiprocessing resource tracker.
        workers = [w for e in engines for w in _children(e)
                   if "resource_tracker" not in open(f"/proc/{w}/cmdline").read()]
        assert workers, "no TP worker process found"
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        saw_503 = False
        while time.monotonic() - t0 < 10:
            if proc.poll() is not None:
                break
            try:
                saw_503 = saw_503 or httpx.get(url + "/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert proc.poll() is not None and proc.returncode != 0, "server did not exit within 10 s"
        assert time.monotonic() - t0 < 10
        assert saw_503 or proc.returncode != 0


def test_seed_launch_line_starts_on_cpu(tmp_path):
    """The user's TP8 launch line, verbatim, serves a tiny 8-head checkpoint on CPU (8 ranks)."""
    from model.checkpoint import load_config_dict

    cfg = dict(load_config_dict("tiny-v3"), num_attention_heads=8, num_key_value_heads=8,
               max_position_embeddings=16384, num_hidden_layers=2)
    path = write_random_checkpoint(cfg, str(tmp_path / "m"), seed=4)
    with serve(path, *SEED_LAUNCH_LINE, timeout_s=240, test_flags=()) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as c:
            name = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post("/v1/completions", json={"model": name, "prompt": PROMPTS, "max_tokens": 4,
                                                 "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert all(ch["finish_reason"] == "length" for ch in r.json()["choices"])
            coll = _query(url)["collectives"]
    assert coll.get("reduce_scatter_tensor", 0) > 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL-front-end"])
def test_no_tp_process_outlives_the_server(tmp_path, sig):
    """SIGTERM to a TP2 server, or SIGKILL to its front end alone: within 10 s neither its
    engine nor its TP worker runs (the engine watches its parent, the worker its engine)."""
    from tests.server.test_server_lifecycle import wait_gone

    path = write_random_checkpoint("tiny-v2", str(tmp_path / "m"), seed=5)
    with serve(path, "-tp", "2", may_exit=True) as (url, proc):
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        pids = [proc.pid] + descendants(proc.pid)
        assert len(pids) >= 4, pids  # front end, resource tracker, engine, TP worker (+ its tracker)
        os.kill(proc.pid, sig)
        left = wait_gone(pids, 10.0)
        assert not left, f"still running 10 s after {sig.name}: {left}"
