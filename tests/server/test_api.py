"""The OpenAI-compatible HTTP API against a live uvicorn server and a deterministic fake engine.

The official ``openai`` client covers the happy paths; raw ``httpx`` covers every error case
of issue 4 (each followed by a check that the server still answers).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from model.tokenizer_builder import build_test_tokenizer
from server.api import build_app
from server.tokenizer import Tokenizer
from tests.server.fake_engine import FakeEngine

MAX_MODEL_LEN = 256


class LiveServer:
    """uvicorn in a background thread on a free loopback port (pre-bound: no port race)."""

    def __init__(self, app) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_test_tokenizer(320, str(path))
    return Tokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def live(tokenizer):
    engine = FakeEngine(tokenizer, max_model_len=MAX_MODEL_LEN)
    srv = LiveServer(build_app(engine))
    srv.engine = engine
    yield srv
    srv.close()


@pytest.fixture
def engine(live):
    e = live.engine
    yield e
    e.step_delay, e.reject_next, e.fail_after_steps, e.healthy = 0.0, None, None, True


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def expected_ids(engine: FakeEngine, prompt_len: int, n_tokens: int, seq: int = 0) -> list[int]:
    return [engine.expected_token(prompt_len, seq, j) for j in range(n_tokens)]


def expected_text(engine: FakeEngine, prompt_len: int, n_tokens: int, seq: int = 0) -> str:
    return engine.tokenizer.decode(expected_ids(engine, prompt_len, n_tokens, seq))


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_value(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


# ----------------------------------------------------------------------------- openai client


def test_completion(client, engine, tokenizer):
    r = client.completions.create(model="fake-model", prompt="hello world", max_tokens=7)
    n_prompt = len(tokenizer.encode("hello world"))
    assert r.id.startswith("cmpl-") and r.model == "fake-model" and r.object == "text_completion"
    assert r.choices[0].text == expected_text(engine, n_prompt, 7)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 7, n_prompt + 7)


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model="fake-model", prompt="hi")
    assert r.usage.completion_tokens == 16


def test_completion_stream_with_usage(client, engine, tokenizer):
    chunks = list(client.completions.create(model="fake-model", prompt="stream me", max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}))
    n_prompt = len(tokenizer.encode("stream me"))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(engine, n_prompt, 9)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert all(c.usage is None for c in chunks[:-1])


def test_chat(client, engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=6)
    n_prompt = len(chat_prompt_ids(tokenizer, messages))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(engine, n_prompt, 6)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 6)


def test_chat_stream(client, engine, tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages, max_completion_tokens=5,
                                                 stream=True, stream_options={"include_usage": True}))
    n_prompt = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": "parts"}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected_text(engine, n_prompt, 5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == n_prompt


def test_n_and_several_prompts(client, engine, tokenizer):
    r = client.completions.create(model="fake-model", prompt=["one two", "three"], n=2, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    lens = [len(tokenizer.encode(p)) for p in ("one two", "three")]
    for c in r.choices:
        assert c.text == expected_text(engine, lens[c.index // 2], 4, seq=c.index % 2)
    assert r.usage.prompt_tokens == sum(lens) and r.usage.completion_tokens == 16


def test_token_id_prompts(client, engine):
    r = client.completions.create(model="fake-model", prompt=[[0, 40, 41], [0, 42]], max_tokens=3)
    assert [c.text for c in r.choices] == [expected_text(engine, 3, 3), expected_text(engine, 2, 3)]
    assert r.usage.prompt_tokens == 5
    r = client.completions.create(model="fake-model", prompt=[0, 40, 41], max_tokens=2)
    assert r.choices[0].text == expected_text(engine, 3, 2)


def test_prompts_of_one_request_run_concurrently(client, engine):
    engine.step_delay = 0.005
    engine.max_concurrent = 0
    client.completions.create(model="fake-model", prompt=["a", "b", "c", "d"], max_tokens=5)
    assert engine.max_concurrent >= 4


def test_completion_logprobs(client, engine, tokenizer):
    r = client.completions.create(model="fake-model", prompt="log me", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    ids = expected_ids(engine, len(tokenizer.encode("log me")), 4)
    assert lp.tokens == [tokenizer.token_to_text(t) for t in ids]
    assert lp.token_logprobs == [-0.25, -0.5, -0.75, -0.25]
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert lp.text_offset == offsets
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == value and 1 <= len(top) <= 3 and max(top.values()) == value


def test_echo_logprobs_as_lm_eval_asks(live, http, engine, tokenizer):
    """lm-eval's loglikelihood payload: token-id prompts, echo, logprobs=1, max_tokens=1."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    ctx, cont = tokenizer.encode("the answer is"), tokenizer.encode(" four", add_special_tokens=False)
    body = {"model": "fake-model", "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n = len(ctx) + len(cont) + 1
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert r.json()["choices"][0]["text"].startswith(tokenizer.decode(ctx + cont, skip_special_tokens=False))
    ((logprob, greedy),) = LocalCompletionsAPI.parse_logprobs(r.json(), ctxlens=[len(ctx)])
    assert greedy and logprob == pytest.approx(sum(lp["token_logprobs"][len(ctx):-1]))


def test_echo_logprobs_stream(http, engine, tokenizer):
    body = {"model": "fake-model", "prompt": "abc", "max_tokens": 3, "logprobs": 0, "echo": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    n_prompt = len(tokenizer.encode("abc"))
    assert text == "abc" + expected_text(engine, n_prompt, 3)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert len(tokens) == n_prompt + 3 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_chat_logprobs(client, engine):
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.bytes == list(c.token.encode())


def test_stop_string_and_stop_token(client, engine, tokenizer):
    n_prompt = len(tokenizer.encode("go"))
    full = expected_text(engine, n_prompt, 30)
    stop = "fox"
    assert stop in full
    r = client.completions.create(model="fake-model", prompt="go", max_tokens=30, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="fake-model", prompt="go", max_tokens=30, stop=stop, stream=True))
    assert streamed == r.choices[0].text
    stop_id = expected_ids(engine, n_prompt, 3)[2]
    r = client.completions.create(model="fake-model", prompt="go", max_tokens=30,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop_id


def test_sampling_fields_reach_the_engine(client, engine):
    client.completions.create(model="fake-alias", prompt="p", max_tokens=2, temperature=0.5, top_p=0.9, seed=7,
                              presence_penalty=0.1, frequency_penalty=0.2,
                              extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                                          "min_tokens": 1})
    _, _, p = engine.requests[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 5, 0.05, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert p.ignore_eos and p.min_tokens == 1 and p.max_tokens == 2


# ----------------------------------------------------------------------------- errors (raw httpx)

LONG = [0] + [50] * MAX_MODEL_LEN
BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', None),
    ("body is a list", "/v1/completions", [1, 2], None),
    ("missing prompt", "/v1/completions", {"model": "fake-model"}, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 123}, "prompt"),
    ("prompt mixed list", "/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, "prompt"),
    ("empty token list", "/v1/completions", {"prompt": [[]]}, "prompt"),
    ("max_tokens not int", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, None),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, None),
    ("temperature negative", "/v1/completions", {"prompt": "x", "temperature": -1}, None),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, None),
    ("top_k negative", "/v1/completions", {"prompt": "x", "top_k": -5}, None),
    ("min_p above one", "/v1/completions", {"prompt": "x", "min_p": 1.5}, None),
    ("presence_penalty", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, None),
    ("logprobs 21", "/v1/completions", {"prompt": "x", "logprobs": 21}, None),
    ("stream flag not bool", "/v1/completions", {"prompt": "x", "stream": "maybe"}, "stream"),
    ("token id out of vocab", "/v1/completions", {"prompt": [0, 999999]}, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [[0, -1]]}, "prompt"),
    ("prompt too long", "/v1/completions", {"prompt": LONG}, "prompt"),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": LONG[:MAX_MODEL_LEN - 4], "max_tokens": 10},
     "max_tokens"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("stream_options stream false", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stream": False, "stream_options": {}}, "stream_options"),
    ("chat missing messages", "/v1/chat/completions", {"model": "fake-model"}, "messages"),
    ("chat messages not a list", "/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("chat role rejected by template", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     None),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("tokenize neither prompt nor messages", "/tokenize", {}, None),
    ("detokenize out of vocab", "/detokenize", {"tokens": [10**6]}, "tokens"),
]


def test_image_part_says_vision_is_not_supported(http):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, "BadRequestError", "messages")
    assert "vision input is not supported" in err["message"]


def assert_still_serving(http) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def assert_error(r, status: int, err_type: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == err_type and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("name,path,body,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_400(http, engine, name, path, body, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_error(r, 400, "BadRequestError", param)
    assert_still_serving(http)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(http, stream):
    r = http.post("/v1/completions", json={"model": "gpt-17", "prompt": "x", "stream": stream})
    assert "gpt-17" in assert_error(r, 404, "NotFoundError", "model")["message"]
    assert_error(http.get("/no/such/route"), 404, "NotFoundError")
    assert_still_serving(http)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_rejection_is_400(http, engine, stream):
    engine.reject_next = "bad params for the engine"
    r = http.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert assert_error(r, 400, "BadRequestError")["message"] == "bad params for the engine"
    assert_still_serving(http)


def test_engine_failure_is_500_and_mid_stream_an_error_event(http, engine):
    engine.fail_after_steps = 2
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    assert_error(r, 500, "InternalServerError")
    r = http.post("/v1/completions", json={"prompt": ["x", "y", "z"], "max_tokens": 8})
    assert_error(r, 500, "InternalServerError")
    wait_until(lambda: engine.stats()["num_running"] == 0)
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
    # everything generated before the failure reached the client first (deltas may coalesce)
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == expected_text(engine, len(engine.tokenizer.encode("x")), 2)
    engine.fail_after_steps = None
    assert_still_serving(http)


def test_health_503_when_engine_dead(http, engine):
    engine.healthy = False
    assert_error(http.get("/health"), 503, "ServiceUnavailable")
    engine.healthy = True
    assert http.get("/health").status_code == 200


def test_api_key(tokenizer):
    srv = LiveServer(build_app(FakeEngine(tokenizer, max_model_len=MAX_MODEL_LEN), api_key="sekrit"))
    try:
        with httpx.Client(base_url=srv.url) as http:
            assert_error(http.get("/v1/models"), 401, "AuthenticationError")
            assert_error(http.post("/v1/completions", json={"prompt": "x"},
                                   headers={"Authorization": "Bearer wrong"}), 401, "AuthenticationError")
            assert http.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
            assert http.get("/health").status_code == 200
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.completions.create(model="fake-model", prompt="x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        srv.close()


# ----------------------------------------------------------------------------- disconnects, load, metrics


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_disconnect_mid_stream_aborts_and_frees_blocks(http, engine):
    engine.step_delay = 0.02
    n_aborted = len(engine.aborted)
    with http.stream("POST", "/v1/completions", json={"prompt": "long", "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
        assert engine.stats()["num_running"] == 1
    wait_until(lambda: len(engine.aborted) > n_aborted)
    assert engine.aborted[-1].startswith("cmpl-")
    wait_until(lambda: engine.stats()["num_running"] == 0)
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    text = http.get("/metrics").text
    assert metric_value(text, "vllm:num_requests_running", model_name="fake-model") == 0
    assert metric_value(text, "mlaserve:kv_cache_free_blocks") == s["num_total_blocks"]
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") >= 1


@pytest.mark.parametrize("stream,step_delay", [(False, 0.02), (True, 30.0)], ids=["full-answer", "first-chunk"])
def test_disconnect_while_waiting_aborts(live, engine, stream, step_delay):
    """A client that gives up before any byte of the answer (non-streamed, or streamed but
    still waiting for the first output) aborts every engine request of its call."""
    engine.step_delay = step_delay
    n_aborted = len(engine.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json={"prompt": ["long", "longer"], "max_tokens": 200,
                                                       "stream": stream}, timeout=0.4)
    wait_until(lambda: len(engine.aborted) >= n_aborted + 2, timeout=5)  # long before a 30 s step ends
    assert {r.rsplit("-", 1)[1] for r in engine.aborted[-2:]} == {"0", "1"}
    wait_until(lambda: engine.stats()["num_running"] == 0)
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


def test_200_concurrent_streams(live, engine, tokenizer):
    async def one(client: openai.AsyncOpenAI, i: int):
        prompt = f"request number {i}"
        text, usage = "", None
        async for chunk in await client.completions.create(model="fake-model", prompt=prompt, max_tokens=8,
                                                           stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return prompt, text, usage

    async def run_all():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(limits=limits, timeout=60) as hc:
            client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", http_client=hc, max_retries=0)
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run_all())
    assert len(results) == 200
    for prompt, text, usage in results:
        n_prompt = len(tokenizer.encode(prompt))
        assert usage.prompt_tokens == n_prompt and usage.completion_tokens == 8
        assert usage.total_tokens == n_prompt + 8
        assert text == expected_text(engine, n_prompt, 8)
    assert engine.stats()["num_running"] == 0


def test_metrics(http, engine):
    http.post("/v1/completions", json={"prompt": "measure", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total"):
        assert metric_value(text, name, model_name="fake-model") >= 0
    s = engine.stats()
    assert metric_value(text, "vllm:generation_tokens_total") == s["generation_tokens_total"]
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert metric_value(text, name, model_name="fake-model") >= 1
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") >= 1


# ----------------------------------------------------------------------------- other endpoints


def test_models_version_health(http):
    data = http.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["fake-model", "fake-alias"]
    assert data["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert "version" in http.get("/version").json()
    assert http.get("/health").status_code == 200


def test_tokenize_detokenize_tokenizer_info(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and r["token_strs"] is None
    r = http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("hello", add_special_tokens=False) and len(r["token_strs"]) == r["count"]
    msgs = [{"role": "user", "content": "hi"}]
    assert http.post("/tokenize", json={"messages": msgs}).json()["tokens"] == chat_prompt_ids(tokenizer, msgs)
    ids = tokenizer.encode("round trip", add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "round trip"
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"]


def test_lm_eval_remote_tokenizer(live, tokenizer):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(live.url + "/v1/completions")
    remote = RemoteTokenizer(live.url + "/v1/completions")
    assert remote.encode("some text") == tokenizer.encode("some text", add_special_tokens=False)
    assert remote.decode(tokenizer.encode("some text", add_special_tokens=False)) == "some text"
    assert remote.eos_token_id == tokenizer.eos_token_id
    # lm-eval renders the template itself and passes no bos_token unless the caller does.
    msgs = [{"role": "user", "content": "q"}]
    assert remote.apply_chat_template(msgs, bos_token=remote.bos_token) == tokenizer.apply_chat_template(msgs)
