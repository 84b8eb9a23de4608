"""The HTTP API against the real engine (a live `mlaserve serve` of a tiny random checkpoint):
the official openai client, error bodies, disconnects, and 200 concurrent streams."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from model.checkpoint import write_random_checkpoint
from tests.server.live_server import LiveServers, selected_tests

pytestmark = pytest.mark.slow


CHAT_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    """The module's servers, started at once (LiveServers): the one most tests share, and those
    of the selected tests with a server of their own (--chat-template; --async-scheduling on
    the shared one's checkpoint)."""
    tests = {item.originalname for item in selected_tests(request)}
    d = tmp_path_factory.mktemp("api-real")
    ckpt = write_random_checkpoint("tiny-v3", str(d / "tiny"), seed=8)
    tiny = (ckpt, "--device", "cpu", "--served-model-name", "tiny", "--max-model-len", "256",
            "--num-gpu-blocks-override", "512", "--block-size", "16")
    wanted = {"shared": ((*tiny, "--max-num-seqs", "256", "--disable-log-stats"), {})}
    if "test_chat_template_flag" in tests:
        (d / "t.jinja").write_text(CHAT_TEMPLATE)
        wanted["chat_template"] = ((write_random_checkpoint("tiny-v2", str(d / "m"), seed=1), "--device", "cpu",
                                    "--served-model-name", "t", "--chat-template", str(d / "t.jinja"),
                                    "--num-gpu-blocks-override", "64", "--block-size", "16"), {})
    if "test_async_scheduling_server_matches_the_synchronous_one" in tests:
        wanted["async"] = ((*tiny, "--async-scheduling", "--disable-log-stats"), {})
    pool = LiveServers(wanted, ahead=3)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def server(servers):
    with servers.use("shared") as (url, _):
        yield url


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_openai_client_completions_stream_chat_n_logprobs(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="EMPTY")
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    again = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic

    chunks = list(client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens

    n = client.completions.create(model="tiny", prompt="abc", max_tokens=5, n=3, temperature=1.0, seed=3,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in n.choices) == [0, 1, 2] and n.usage.completion_tokens == 15
    for c in n.choices:
        assert len(c.logprobs.tokens) == 5 and all(len(t) >= 2 for t in c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)

    echo = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=1, echo=True, logprobs=0,
                                     temperature=0)
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert echo.choices[0].text.startswith("the cat sat")

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x " * 400, "max_tokens": 4}, "maximum context length"),
    ({"prompt": [5, 99999], "max_tokens": 4}, "out of vocabulary"),
    ({"prompt": "x", "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
])
def test_bad_requests_are_400_and_server_keeps_serving(server, body, fragment):
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and fragment in err["message"]
    ok = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


def test_disconnect_frees_blocks(server):
    total = _metric(server, "mlaserve:kv_cache_total_blocks")
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server + "/v1/completions",
                      json={"model": "tiny", "prompt": "stream me", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 3:
                    break  # leave mid-stream: closing the response drops the connection
    for _ in range(100):
        if _metric(server, "vllm:num_requests_running") == 0 and \
                _metric(server, "mlaserve:kv_cache_free_blocks") == total:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "mlaserve:kv_cache_free_blocks") == total


def test_200_concurrent_streams_complete_with_usage(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, dict]:
        text, usage = "", None
        async with client.stream("POST", server + "/v1/completions", json={
                "model": "tiny", "prompt": f"request {i}", "max_tokens": 4, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices", []):
                    text += ch.get("text", "")
        return i, usage

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200
    for _i, usage in results:
        assert usage is not None and usage["completion_tokens"] == 4
        assert usage["total_tokens"] == usage["prompt_tokens"] + 4


def test_logit_bias(server):
    forced = httpx.post(server + "/v1/completions", json={
        "model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "logit_bias": {"300": 100}, "return_tokens_as_token_ids": False, "logprobs": 0}).json()
    assert forced["usage"]["completion_tokens"] == 4
    toks = httpx.post(server + "/tokenize", json={"model": "tiny", "prompt": forced["choices"][0]["text"],
                                                  "add_special_tokens": False}).json()["tokens"]
    assert set(toks) == {300}
    bad = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                       "logit_bias": {"999999": 5}})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]


def test_chat_template_flag(servers):
    """--chat-template replaces the checkpoint's template (file path or inline text)."""
    with servers.use("chat_template") as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "t", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).json()
        # chat prompts are tokenized without adding BOS (the template owns special tokens), as vLLM
        ids = httpx.post(url + "/tokenize", json={"model": "t", "prompt": "<<hi>>",
                                                  "add_special_tokens": False}).json()["count"]
        assert r["usage"]["prompt_tokens"] == ids


def test_prefix_cache_metrics(server):
    prompt = [int(x) for x in range(3, 3 + 40)]  # 40 tokens: two full 16-token blocks to share
    before = _metric(server, "vllm:prefix_cache_hits_total")
    for _ in range(2):
        r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200
    assert _metric(server, "vllm:prefix_cache_hits_total") - before >= 32
    assert _metric(server, "vllm:prefix_cache_queries_total") > 0


def test_async_scheduling_server_matches_the_synchronous_one(servers, server):
    """`--async-scheduling` (steps launched before the previous tokens are read back) serves
    the same seeded completions, streamed or not, with logprobs, and frees every block."""
    bodies = [
        {"model": "tiny", "prompt": "alpha beta", "max_tokens": 12, "seed": 3, "temperature": 0.9, "n": 2},
        {"model": "tiny", "prompt": "gamma", "max_tokens": 7, "temperature": 0, "logprobs": 2},
        {"model": "tiny", "prompt": "delta epsilon zeta", "max_tokens": 9, "seed": 11, "presence_penalty": 0.5},
    ]

    def texts(url: str) -> list:
        with httpx.Client(timeout=60) as c:
            out = [[(ch["index"], ch["text"]) for ch in c.post(url + "/v1/completions", json=b).json()["choices"]]
                   for b in bodies]
            with c.stream("POST", url + "/v1/completions", json={**bodies[0], "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            streamed = {}
            for chunk in chunks:
                for ch in chunk["choices"]:
                    streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
            out.append(sorted(streamed.items()))
        return out

    want = texts(server)
    with servers.use("async") as (url, _):
        assert texts(url) == want
        total = _metric(url, "mlaserve:kv_cache_total_blocks")
        assert _metric(url, "mlaserve:kv_cache_free_blocks") == total
