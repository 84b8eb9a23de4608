"""Admission limits (server/admission.py), the request body limit, --api-key on every /v1 route,
and fan-out scheduling: a request's n children queue like any other sequences."""

from __future__ import annotations

import httpx
import pytest

from server.admission import AdmissionLimits, check_chat, check_completion
from server.api import build_app
from server.errors import InvalidRequestError
from server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.fake_engine import FakeEngine
from tests.server.test_api import MAX_MODEL_LEN, LiveServer, tokenizer  # noqa: F401  (fixture)
from tests.server.test_scheduler import make_scheduler, make_seq, step

LIMITS = AdmissionLimits(max_model_len=128, vocab_size=100, max_num_seqs=8, max_logprobs=5)


def rejected(fn, body_cls, body: dict, limits: AdmissionLimits = LIMITS) -> str:
    with pytest.raises(InvalidRequestError) as e:
        fn(body_cls(**body), limits)
    return e.value.param


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": 9}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "n": 2, "best_of": 4}, "best_of"),  # best_of > n: not supported
    ({"prompt": ["x"] * 200, "n": 8}, "n"),  # prompts x n above max(1024, --max-num-seqs)
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 6}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 128}, "max_tokens"),
    ({"prompt": [1] * 129}, "prompt"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 1.01}, "top_p"),
    ({"prompt": "x", "logit_bias": {"100": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [100]}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": 129}, "min_tokens"),
    ({"prompt": "x", "suffix": "\ud800"}, "suffix"),
])
def test_completion_limits(body, param):
    assert rejected(check_completion, CompletionRequest, body) == param


def test_limits_follow_the_engine_flags():
    wide = AdmissionLimits(max_model_len=128, vocab_size=100, max_num_seqs=64, max_logprobs=30)
    check_completion(CompletionRequest(prompt="x", n=64, best_of=64, logprobs=30, prompt_logprobs=30), wide)
    check_completion(CompletionRequest(prompt=["x"] * 16, n=64), wide)  # 1024 sequences
    check_chat(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=30,
                                     max_completion_tokens=127, seed=2**63 - 1, top_k=-1), wide)
    assert rejected(check_chat, ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                          "logprobs": True, "top_logprobs": 31}, wide) == "top_logprobs"


def test_engine_enforces_max_logprobs_too():
    from server.engine_core import validate_request
    from server.sampling_params import SamplingParams

    validate_request([1, 2], SamplingParams(logprobs=30), 100, 128, max_logprobs=30)
    with pytest.raises(InvalidRequestError, match="between 0 and 20"):
        validate_request([1, 2], SamplingParams(logprobs=21), 100, 128)


# ----------------------------------------------------------------------------- HTTP: body size, API key


@pytest.fixture(scope="module")
def small_body_server(tokenizer):  # noqa: F811
    srv = LiveServer(build_app(FakeEngine(tokenizer, max_model_len=MAX_MODEL_LEN), api_key="k",
                               max_request_body_bytes=4096))
    yield srv.url
    srv.close()


AUTH = {"Authorization": "Bearer k"}


def test_body_limit_with_and_without_content_length(small_body_server):
    url = small_body_server
    big = b'{"prompt": "' + b"a" * 5000 + b'"}'
    r = httpx.post(url + "/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413
    small = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2


def test_api_key_guards_every_v1_route_and_only_those(small_body_server):
    url = small_body_server
    routes = httpx.get(url + "/openapi.json").json()["paths"]
    v1 = [(path, method) for path, ops in routes.items() for method in ops if path.startswith("/v1")]
    assert len(v1) >= 3
    for path, method in v1:
        assert httpx.request(method, url + path, json={}).status_code == 401, path
        assert httpx.request(method, url + path, json={}, headers={"Authorization": "Bearer x"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


# ----------------------------------------------------------------------------- fan-out scheduling


def test_fan_out_children_queue_fcfs_within_max_num_seqs():
    """A request with n = 12 children and --max-num-seqs 4: never more than 4 run, the token
    budget holds every step, and a later request is admitted in arrival order, not after
    every child (no all-at-once admission, no starvation)."""
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=False)
    fan = [make_seq([1, 2, 3, 4, 5], max_tokens=3, request_id="fan", index=i, n=12) for i in range(12)]
    for s in fan:
        sched.add_seq(s)
    other = make_seq([9, 8, 7], max_tokens=3, request_id="other")
    sched.add_seq(other)
    admitted_at: dict[int, int] = {}
    for t in range(100):
        out = step(sched)
        assert len(sched.running) <= 4 and out.num_batched_tokens <= 64
        for e in out.scheduled:
            admitted_at.setdefault(e.seq.seq_id, t)
        for seq in list(sched.running.values()):
            if seq.num_output_tokens >= 3:
                sched.finish_seq(seq, "length")
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    order = sorted(admitted_at, key=lambda sid: (admitted_at[sid], sid))
    assert order == [s.seq_id for s in fan] + [other.seq_id]  # first come, first served
    # 4 children at a time, 3 steps each: the later request runs in the first free slot
    # after the last child, i.e. in the 4th wave.
    assert [admitted_at[s.seq_id] for s in fan] == [0] * 4 + [3] * 4 + [6] * 4
    assert admitted_at[other.seq_id] == 9


def test_new_flags_parse():
    from server.cli import parse_serve_args

    args = parse_serve_args(["--max-logprobs", "30", "--max-request-body-bytes", "2M"])
    assert args.engine_config.max_logprobs == 30 and args.max_request_body_bytes == 2 * 1024 * 1024
    default = parse_serve_args([])
    assert default.engine_config.max_logprobs == 20 and default.max_request_body_bytes == 8 * 1024 * 1024
