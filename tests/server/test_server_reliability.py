"""No single request can wedge the server (a live server of the bundled model, on CPU).

* a table of hostile requests: each a 4xx within 5 s, and a normal request succeeds after it;
* schemathesis over the server's own /openapi.json (examples, coverage and fuzzing phases,
  fixed seed, bounded): no 5xx, no time-out;
* 48 non-streaming clients that hang up: their requests are aborted and every KV block freed;
* 2,000 concurrent requests, streamed and not: all complete, none lost or duplicated, and
  their queue time shows in vllm:request_queue_time_seconds;
* every listening socket of the server's processes is bound to the HTTP --host (loopback).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from server.llm import bundled_model_dir
from server.tokenizer import Tokenizer
from tests.server.live_server import descendants, listening_sockets, live_server_process

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 32
OK = {"prompt": "1+2=", "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    with live_server_process("--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
                             str(MAX_NUM_SEQS), "--disable-log-stats", timeout_s=120) as (url, proc):
        yield url, proc


def metric(url: str, name: str, default: float | None = None, **labels) -> float:
    """The sum of a /metrics series' samples that carry ``labels`` (``default`` when none does)."""
    total, found = 0.0, False
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total, found = total + float(m.group(2)), True
    if not found and default is not None:
        return default
    assert found, f"{name} {labels} not in /metrics"
    return total


def assert_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json=OK, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


# ----------------------------------------------------------------------------- hostile requests

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "1+2="}]
HOSTILE = [  # (name, path, JSON body or raw bytes, expected status, expected param or None)
    ("n huge (the issue)", C, {"prompt": "1+2=", "n": 725098}, 400, "n"),
    ("n above --max-num-seqs", C, {"prompt": "1+2=", "n": MAX_NUM_SEQS + 1}, 400, "n"),
    ("n negative", C, {"prompt": "1+2=", "n": -3}, 400, "n"),
    ("n wrong type", C, {"prompt": "1+2=", "n": "two"}, 400, "n"),
    ("best_of below n", C, {"prompt": "1+2=", "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of huge", C, {"prompt": "1+2=", "best_of": 10**9}, 400, "best_of"),
    ("prompts x n fan-out", C, {"prompt": ["1+2="] * 40, "n": MAX_NUM_SEQS}, 400, "n"),
    ("logprobs above --max-logprobs", C, {"prompt": "1+2=", "logprobs": 21}, 400, "logprobs"),
    ("logprobs negative", C, {"prompt": "1+2=", "logprobs": -1}, 400, "logprobs"),
    ("prompt_logprobs huge", C, {"prompt": "1+2=", "prompt_logprobs": 10**6}, 400, "prompt_logprobs"),
    ("top_logprobs above limit", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("max_tokens huge", C, {"prompt": "1+2=", "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens negative", C, {"prompt": "1+2=", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens float", C, {"prompt": "1+2=", "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_completion_tokens huge", CHAT, {"messages": MSG, "max_completion_tokens": 10**9}, 400,
     "max_completion_tokens"),
    ("prompt + max_tokens > max-model-len", C, {"prompt": [1] * 100, "max_tokens": 60}, 400, "max_tokens"),
    ("prompt too long (ids)", C, {"prompt": [1] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ("prompt too long (text)", C, {"prompt": "1+" * 200}, 400, "prompt"),
    ("prompt empty string", C, {"prompt": ""}, 400, "prompt"),
    ("prompt empty list", C, {"prompt": []}, 400, "prompt"),
    ("prompt token out of vocab", C, {"prompt": [1, 2**40]}, 400, "prompt"),
    ("prompt lone surrogate", C, b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("body bad UTF-8", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("body truncated JSON", C, b'{"prompt": "1+', 400, None),
    ("temperature NaN", C, b'{"prompt": "1+2=", "temperature": NaN}', 400, "temperature"),
    ("temperature Infinity", C, b'{"prompt": "1+2=", "temperature": Infinity}', 400, "temperature"),
    ("top_p NaN", C, b'{"prompt": "1+2=", "top_p": NaN}', 400, "top_p"),
    ("top_k huge", C, {"prompt": "1+2=", "top_k": 10**30}, 400, "top_k"),
    ("min_p negative", C, {"prompt": "1+2=", "min_p": -0.5}, 400, "min_p"),
    ("repetition_penalty zero", C, {"prompt": "1+2=", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("frequency_penalty huge", C, {"prompt": "1+2=", "frequency_penalty": 1e308}, 400, "frequency_penalty"),
    ("min_tokens huge", CHAT, {"messages": MSG, "min_tokens": 10**20}, 400, "min_tokens"),
    ("seed above int64", C, {"prompt": "1+2=", "seed": 2**64}, 400, "seed"),
    ("seed wrong type", C, {"prompt": "1+2=", "seed": "abc"}, 400, "seed"),
    ("stop list too long", C, {"prompt": "1+2=", "stop": ["x"] * 1000}, 400, "stop"),
    ("stop string too long", C, {"prompt": "1+2=", "stop": "x" * 5000}, 400, "stop"),
    ("stop empty string", C, {"prompt": "1+2=", "stop": [""]}, 400, "stop"),
    ("stop_token_ids out of vocab", C, {"prompt": "1+2=", "stop_token_ids": [10**30]}, 400, "stop_token_ids"),
    ("logit_bias too many", C, {"prompt": "1+2=", "logit_bias": {str(i): 1 for i in range(5000)}}, 400,
     "logit_bias"),
    ("logit_bias key not a token", C, {"prompt": "1+2=", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias key out of vocab", C, {"prompt": "1+2=", "logit_bias": {str(10**25): 1}}, 400, "logit_bias"),
    ("logit_bias value NaN", C, b'{"prompt": "1+2=", "logit_bias": {"1": NaN}}', 400, "logit_bias"),
    ("chat messages lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages"),
    ("chat too many messages", CHAT, {"messages": MSG * 5000}, 400, "messages"),
    ("chat content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("tokenize lone surrogate", "/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("body of 12 MB", C, b'{"prompt": "' + b"1" * (12 * 1024 * 1024) + b'"}', 413, None),
]


@pytest.mark.parametrize("name,path,body,status,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_a_quick_4xx(server, name, path, body, status, param):
    url, _ = server
    t0 = time.monotonic()
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
        "json": body}
    r = httpx.post(url + path, timeout=5, **kw)
    assert time.monotonic() - t0 < 5
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert_serves(url)


# ----------------------------------------------------------------------------- schemathesis

SCHEMATHESIS = [sys.executable, "-c", ("import sys; from schemathesis.cli import schemathesis; "
                                        "sys.argv[0] = 'schemathesis'; schemathesis()")]


def test_schemathesis_finds_no_server_error(server, tmp_path):
    url, _ = server
    cmd = [*SCHEMATHESIS, "run", url + "/openapi.json", "--checks", "not_a_server_error",
           "--phases", "examples,coverage,fuzzing", "--seed", "18", "--max-examples", "20",
           "--request-timeout", "5", "--no-shrink", "--suppress-health-check", "all",
           "--generation-database", "none"]  # same seed, same cases: nothing replayed from earlier runs
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert re.search(r"\d+ generated, \d+ passed", r.stdout), r.stdout[-3000:]
    assert "Fuzzing" in r.stdout and "Coverage" in r.stdout
    assert_serves(url)


# ----------------------------------------------------------------------------- abandoned work


def test_hung_up_clients_are_aborted_and_free_their_blocks(server):
    url, _ = server
    aborted_before = metric(url, "vllm:request_success_total", 0.0, finished_reason="abort")
    tokens_before = metric(url, "vllm:generation_tokens_total")
    body = {"prompt": "1+2=", "max_tokens": 120, "n": 4, "ignore_eos": True}
    num_clients, per_request = 48, 4 * 120

    async def hang_up() -> None:
        async with httpx.AsyncClient(timeout=1.0) as c:
            with pytest.raises(httpx.TimeoutException):
                await c.post(url + "/v1/completions", json=body)

    async def main() -> None:
        await asyncio.gather(*(hang_up() for _ in range(num_clients)))

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while True:
        running, waiting = metric(url, "vllm:num_requests_running"), metric(url, "vllm:num_requests_waiting")
        free, total = metric(url, "mlaserve:kv_cache_free_blocks"), metric(url, "mlaserve:kv_cache_total_blocks")
        if running == waiting == 0 and free == total:
            break
        assert time.monotonic() < deadline, f"30 s after the hang-ups: {running} running, {waiting} waiting, " \
                                            f"{free}/{total} blocks free"
        time.sleep(0.2)
    # Aborted, not finished: each of the 4 sequences of every request counted as "abort", and
    # far fewer tokens generated than the requests asked for.
    assert metric(url, "vllm:request_success_total", 0.0, finished_reason="abort") - aborted_before == 4 * num_clients
    assert metric(url, "vllm:generation_tokens_total") - tokens_before < 0.8 * num_clients * per_request
    assert_serves(url)


# ----------------------------------------------------------------------------- overload


def test_2000_concurrent_requests_all_complete_once(server):
    url, _ = server
    num = 2000
    success_before = metric(url, "vllm:request_success_total")
    queued_before = metric(url, "vllm:request_queue_time_seconds_count")
    prompt_tokens_before = metric(url, "vllm:prompt_tokens_total")

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str, int]:
        body = {"prompt": f"{i}+{i % 7}=", "max_tokens": 1 + i % 2, "temperature": 0, "ignore_eos": True}
        if i % 2:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            return i, out["id"], out["usage"]["completion_tokens"]
        body["stream"] = True
        ids, done = set(), False
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    ids.add(chunk["id"])
        assert done and len(ids) == 1
        return i, ids.pop(), body["max_tokens"]

    async def main() -> list:
        limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(num)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert sorted(i for i, _, _ in results) == list(range(num))
    assert len({rid for _, rid, _ in results}) == num  # one response per request, none shared
    assert all(tokens == 1 + i % 2 for i, _, tokens in results if i % 2)
    # The engine saw each request exactly once.
    assert metric(url, "vllm:request_success_total") - success_before == num
    assert metric(url, "vllm:request_queue_time_seconds_count") - queued_before == num
    assert metric(url, "vllm:request_queue_time_seconds_sum") > 0
    tok = Tokenizer.from_pretrained(bundled_model_dir())
    expected_prompt_tokens = sum(len(tok.encode(f"{i}+{i % 7}=")) for i in range(num))
    assert metric(url, "vllm:prompt_tokens_total") - prompt_tokens_before == expected_prompt_tokens
    print(f"2,000 requests in {elapsed:.1f} s")
    assert_serves(url)


# ----------------------------------------------------------------------------- sockets


def test_only_the_http_port_listens_and_only_on_host(server):
    url, proc = server
    port = int(url.rsplit(":", 1)[1])
    found = listening_sockets([proc.pid] + descendants(proc.pid))
    assert found, "the server has no listening socket?"
    assert all(addr == "127.0.0.1" and p == port for _, addr, p in found), found
    assert {pid for pid, _, _ in found} == {proc.pid}, "a process other than the front end listens"
