"""Prometheus metrics under vLLM's ``vllm:*`` names, so existing dashboards work unchanged.

Engine-side numbers (queue lengths, KV usage, token and preemption counters) are read from
``engine.stats()`` at scrape time by a custom collector, so they can never drift from the
engine. Latency histograms (TTFT, inter-token, end-to-end) and finished-request counts are
observed by the HTTP layer as outputs stream back, through one :class:`RequestTimer` per
engine request.

Every app gets its own ``CollectorRegistry`` (tests build several apps in one process).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.errors import EngineDeadError

logger = logging.getLogger(__name__)

# Decode steps take ~10 ms on a GPU and tens of ms on CPU; prefill of long prompts, seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

StatsFn = Callable[[], dict]


class _EngineStatsCollector:
    """Turns ``engine.stats()`` into gauges and counters on every scrape."""

    def __init__(self, stats: StatsFn, model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def describe(self):
        return []  # registered unchecked: families are produced at scrape time

    def collect(self):
        try:
            s = self._stats()
        except EngineDeadError as e:
            logger.warning("metrics: engine stats unavailable: %s", e)
            return
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, float(value))
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"])
        usage = s["kv_cache_usage"]
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", usage)
        yield gauge("vllm:gpu_cache_usage_perc",
                    "KV-cache usage, 1 means 100 percent (older name of vllm:kv_cache_usage_perc).", usage)
        yield gauge("mlaserve:kv_cache_free_blocks", "Free KV-cache blocks.", s["num_free_blocks"])
        yield gauge("mlaserve:kv_cache_total_blocks", "Total KV-cache blocks.", s["num_total_blocks"])
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", s["prompt_tokens_total"])
        yield counter("vllm:generation_tokens", "Generation tokens produced.", s["generation_tokens_total"])
        yield counter("vllm:num_preemptions", "Cumulative preemptions.", s["num_preemptions"])
        if "engine_heartbeat_age_s" in s:
            yield gauge("mlaserve:engine_heartbeat_age_seconds", "Seconds since the engine loop last completed "
                        "an iteration (the slowest engine).", s["engine_heartbeat_age_s"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hits", 0))
        coll = CounterMetricFamily("mlaserve:collectives", "Collectives run by the engine ranks, by kind "
                                   "(reduce_scatter_tensor = one ReduceScatter; *_v = uneven sizes).",
                                   labels=["model_name", "kind"])
        for kind, n in sorted(s.get("collectives", {}).items()):
            coll.add_metric([self._model_name, kind], float(n))
        yield coll


class ServerMetrics:
    def __init__(self, stats: StatsFn, model_name: str) -> None:
        disable_created_metrics()  # no *_created series, as vLLM (a process-wide exposition setting)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name))
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              lbl, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive outputs.",
                             lbl, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Older name of vllm:inter_token_latency_seconds.",
                              lbl, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             lbl, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time a request waited in the engine's queue before it was first scheduled.",
                                    lbl, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)

    def request_timer(self) -> "RequestTimer":
        return RequestTimer(self)

    def record_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Latency bookkeeping for one engine request, fed with each cumulative output."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self.start = time.monotonic()
        self._first: float | None = None
        self._last: float | None = None
        self._done = False
        self._queued = False

    def on_tokens(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        t = time.monotonic()
        if self._first is None:
            self._first = t
            self._m.ttft.observe(t - self.start)
        else:
            self._m.itl.observe(t - self._last)
            self._m.tpot.observe(t - self._last)
        self._last = t

    def on_queue_time(self, seconds: float | None) -> None:
        if seconds is not None and not self._queued:
            self._queued = True
            self._m.queue_time.observe(seconds)

    def on_finish(self, reasons: list[str]) -> None:
        """``reasons``: one finish reason per sequence of the request (``n`` of them)."""
        if self._done:
            return
        self._done = True
        self._m.e2e.observe(time.monotonic() - self.start)
        for reason in reasons:
            self._m.record_finished(reason)
