"""Online serving benchmark, as ``vllm bench serve`` measures it, against any OpenAI server.

Each request is one streaming ``/v1/completions`` call (token-id prompt, ``ignore_eos``,
``stream_options.include_usage``). Per request, timed on the client with ``perf_counter``:

- TTFT: from sending the request to the first SSE chunk that carries a choice;
- ITL: the gaps between consecutive such chunks (a chunk may carry several tokens);
- E2EL: from sending to the last such chunk;
- TPOT: (E2EL − TTFT) / (output tokens − 1), output tokens from the final usage chunk.

Arrivals follow vLLM: ``--request-rate inf`` sends everything at t=0, a finite rate draws
gamma-distributed gaps (shape = burstiness, so 1.0 is a Poisson process) rescaled so the last
arrival lands at num_prompts / rate; ``--max-concurrency`` caps requests in flight.
Metric names, the printed block and the result keys are vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from server.bench.datasets import SampleRequest

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {  # attribute -> (short name, section header), vLLM's wording
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# Per-request lists that vLLM keeps in the result only with --save-detailed.
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")


class ServerError(RuntimeError):
    """The server cannot be benchmarked (unreachable, no model, no vocabulary information)."""


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, ``start_time`` from perf_counter)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


# ----------------------------------------------------------------------------- server facts


def _detail(resp) -> str:
    """The error message of an OpenAI/vLLM error body (nested or flat), else the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    if not isinstance(body, dict):
        return resp.text
    err = body.get("error")
    message = err.get("message") if isinstance(err, dict) else body.get("message")
    return message or resp.text


async def fetch_model(client, base_url: str, model: str | None) -> tuple[str, int | None]:
    """(model id to send, the server's max_model_len if it says) from ``/v1/models``."""
    import httpx

    try:
        resp = await client.get(f"{base_url}/v1/models")
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {base_url}/v1/models: {e!r} (is the server running?)") from None
    if resp.status_code != 200:
        raise ServerError(f"{base_url}/v1/models answered {resp.status_code}: {_detail(resp)}")
    cards = resp.json().get("data") or []
    if not cards:
        raise ServerError(f"{base_url}/v1/models lists no model")
    if model is None:
        return cards[0]["id"], cards[0].get("max_model_len")
    card = next((c for c in cards if c.get("id") == model), None)  # an alias may be unlisted
    return model, (card.get("max_model_len") if card else None)


async def fetch_vocabulary(client, base_url: str, model: str) -> tuple[int, set[int]]:
    """(vocab size, special token ids) from ``/tokenizer_info`` and ``/tokenize``, for servers
    that have them (mlaserve; vLLM with --enable-tokenizer-info-endpoint)."""
    import httpx

    try:
        resp = await client.get(f"{base_url}/tokenizer_info")
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {base_url}/tokenizer_info: {e!r}") from None
    if resp.status_code != 200 or "vocab_size" not in resp.json():
        raise ServerError(f"{base_url}/tokenizer_info is unavailable ({resp.status_code}); pass --tokenizer DIR "
                          "so prompts can be drawn from the tokenizer's vocabulary")
    info = resp.json()
    special: set[int] = set()
    for token in {info.get("bos_token"), info.get("eos_token"), info.get("pad_token")} - {None}:
        r = await client.post(f"{base_url}/tokenize",
                              json={"model": model, "prompt": token, "add_special_tokens": False})
        ids = r.json().get("tokens", []) if r.status_code == 200 else []
        if len(ids) == 1:
            special.add(ids[0])
    return int(info["vocab_size"]), special


async def wait_until_healthy(client, base_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await client.get(f"{base_url}/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{base_url}/health did not answer 200 within {timeout_s:g} s")
        await asyncio.sleep(0.5)


# ----------------------------------------------------------------------------- one request


async def stream_completion(client, api_url: str, model: str, request: SampleRequest, *,
                            ignore_eos: bool = True, extra_body: dict | None = None,
                            headers: dict | None = None) -> RequestResult:
    """Send one streaming completion and time its chunks; never raises for a failed request."""
    import httpx

    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
        **(extra_body or {}),
    }
    result = RequestResult(prompt_len=request.prompt_len)
    chunks = 0
    start = last = time.perf_counter()
    result.start_time = start
    try:
        async with client.stream("POST", api_url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.error = f"HTTP {resp.status_code}: {_detail(resp)}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    result.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    return result
                if event.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    result.generated_text += event["choices"][0].get("text") or ""
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if chunks == 0:
        result.error = "the stream ended without any completion chunk"
        return result
    if not result.output_tokens:  # server without usage: one token per chunk is the best guess
        result.output_tokens = chunks
    result.latency = last - start
    result.success = True
    return result


# ----------------------------------------------------------------------------- load generation


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send time of each request in seconds from the start (vLLM's schedule, see module doc)."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate: must be positive, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness: must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    times *= (num_requests / request_rate) / times[-1]
    return times.tolist()


async def run_requests(client, api_url: str, model: str, requests: list[SampleRequest], *,
                       request_rate: float = math.inf, burstiness: float = 1.0,
                       max_concurrency: int | None = None, seed: int = 0, ignore_eos: bool = True,
                       extra_body: dict | None = None, headers: dict | None = None,
                       progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request on its schedule; (results in request order, benchmark duration s)."""
    from tqdm import tqdm

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be at least 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress)

    async def one(req: SampleRequest) -> RequestResult:
        if gate is None:
            out = await stream_completion(client, api_url, model, req, ignore_eos=ignore_eos,
                                          extra_body=extra_body, headers=headers)
        else:
            async with gate:
                out = await stream_completion(client, api_url, model, req, ignore_eos=ignore_eos,
                                              extra_body=extra_body, headers=headers)
        bar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for req, at in zip(requests, offsets):
        wait = start + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


# ----------------------------------------------------------------------------- metrics


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """(most output chunks seen in one wall-clock second, most requests in flight at once)."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    per_second = np.zeros(int(math.ceil(end - t0)) + 1)
    for r in ok:
        t = r.start_time + r.ttft
        for stamp in [t, *np.cumsum(r.itl) + t]:
            per_second[int(stamp - t0)] += 1
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    live = peak = 0
    for _, delta in events:  # at equal times -1 sorts first: a finish frees its slot before a start
        live += delta
        peak = max(peak, live)
    return float(per_second.max()), peak


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float] = (99.0,),
                    selected: list[str] = PERCENTILE_METRICS) -> dict:
    """The benchmark's numbers under vLLM's result keys (latencies in ms in the summary keys)."""
    ok = [r for r in results if r.success]
    output_lens = [r.output_tokens if r.success else 0 for r in results]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    series = latency_series(results)
    peak_tokens, peak_requests = _peaks(ok)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    for name in selected:
        values_ms = np.asarray(series[name] or [0.0]) * 1000.0
        out[f"mean_{name}_ms"] = float(values_ms.mean())
        out[f"median_{name}_ms"] = float(np.median(values_ms))
        out[f"std_{name}_ms"] = float(values_ms.std())
        for p in percentiles:
            out[f"p{_pct_word(p)}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


def latency_series(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-metric samples in seconds over successful requests (ITL: every gap of every request;
    TPOT: requests with more than one output token)."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def _pct_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_report(metrics: dict, *, max_concurrency: int | None, request_rate: float,
                  percentiles: list[float] = (99.0,), selected: list[str] = PERCENTILE_METRICS) -> str:
    """The "Serving Benchmark Result" block, field for field as ``vllm bench serve`` prints it."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", metrics["duration"], ".2f")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", float(metrics["max_concurrent_requests"]), ".2f")
    row("Total token throughput (tok/s):", metrics["total_token_throughput"], ".2f")
    for name in selected:
        short, header = METRIC_TITLES[name]
        lines.append("{:-^50}".format(header))
        row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", metrics[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pct_word(p)} {short} (ms):", metrics[f"p{_pct_word(p)}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
