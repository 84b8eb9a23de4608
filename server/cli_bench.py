"""``mlaserve bench throughput|serve``: vLLM's two benchmarks, with vLLM's flags and output.

``bench throughput`` runs the offline engine on random token prompts (``--model`` is a
checkpoint directory or a preset from ``configs/``; engine flags as for ``serve``).
``bench serve`` drives a running OpenAI-compatible server with streaming completions.
Both print vLLM's result lines, can write vLLM's JSON result and, with matplotlib
installed, a PNG of latency percentiles (``--plot F.png``). The work lives in
``server/bench/``; this module only reads flags and wires the pieces together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from datetime import datetime

from server import envs
from server.cli import CLIError, Subcommand, bundled_model_dir
from server.config import EngineConfig, EngineConfigError
from server.engine_args import add_engine_arguments, engine_kwargs_from_namespace

logger = logging.getLogger("mlaserve.bench")


# ----------------------------------------------------------------------------- flags


def _add_dataset_arguments(p: argparse.ArgumentParser, prefix_flags: tuple[str, ...]) -> None:
    from server.bench.datasets import DATASETS

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS, default="random",
                   help="random token-id prompts of exact lengths (vLLM's random dataset)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="draw lengths uniformly from [len*(1-r), len*(1+r)]")
    g.add_argument(*prefix_flags, dest="prefix_len", type=int, default=0,
                   help="a random prefix of this many tokens shared by every prompt")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts (and of the engine)")


def _plot_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", metavar="F.png", default=None,
                   help="write a PNG of latency percentiles (needs matplotlib, which is optional)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory, or a preset from configs/ (tiny-v3, deepseek-r1, tiny-v41, "
                        "deepseek-v41-flash, ...: random weights in the real shape). Default: the bundled model")
    p.add_argument("--num-layers", type=int, default=None,
                   help="truncate a preset to this many layers (V4 / V4.1: per-layer lists and source layers cut "
                        "too, MTP / DSpark dropped)")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128,
                   help="prompt tokens per request")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=32,
                   help="generated tokens per request (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--output-json", default=None, metavar="F", help="write the result as JSON (vLLM's keys)")
    p.add_argument("--step-profile", action="store_true",
                   help="time every engine step by kind and phase (plan, forward, sample, scheduler); print a "
                        "table and add it to --output-json as \"step_profile\". Synchronizes CUDA per phase")
    _add_dataset_arguments(p, ("--prefix-len", "--random-prefix-len"))
    _plot_argument(p)
    add_engine_arguments(p, serve=False)  # the engine flags of `mlaserve serve` (server/engine_args.py)


def add_serve_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="a streaming completions endpoint")
    g.add_argument("--backend", choices=["openai", "vllm"], default="openai",
                   help="both speak /v1/completions; recorded in the result as in vLLM")
    g.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory giving the prompt vocabulary (default: ask the server's "
                        "/tokenizer_info and /tokenize)")
    g.add_argument("--header", nargs="*", metavar="KEY=VALUE", default=None, help="extra HTTP headers")
    g.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="wait up to this long for /health first (0: do not wait)")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=1024)
    g.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128)
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s; inf sends all at once, else Poisson (gamma with --burstiness) arrivals")
    g.add_argument("--burstiness", type=float, default=1.0, help="1.0: Poisson; <1 burstier, >1 more uniform")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--ignore-eos", action="store_true", default=True,
                   help="(always on for the random dataset, as in vLLM)")
    _add_dataset_arguments(p, ("--random-prefix-len",))
    g = p.add_argument_group("sampling (sent only when given; otherwise the server's defaults)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="extra fields for every request body")
    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="of ttft, tpot, itl, e2el")
    g.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    g.add_argument("--save-result", action="store_true", help="write the JSON result")
    g.add_argument("--save-detailed", action="store_true", help="keep per-request lists in the JSON result")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None,
                   help="default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, as vLLM")
    g.add_argument("--label", default=None, help="result label (default: --backend)")
    g.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=None, help="extra keys for the JSON")
    _plot_argument(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name, help_text, add, run in (
        ("throughput", "offline engine throughput (like `vllm bench throughput`)", add_throughput_arguments,
         run_throughput_command),
        ("serve", "latency and throughput of a running server (like `vllm bench serve`)",
         add_serve_bench_arguments, run_serve_command),
    ):
        sp = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add(sp)
        sp.set_defaults(_bench_run=run)


# ----------------------------------------------------------------------------- helpers


def _key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CLIError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise CLIError(f"--metric-percentiles: expected numbers like 50,90,99, got {text!r}") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise CLIError(f"--metric-percentiles: each must be in (0, 100], got {text!r}")
    return values


def _write_json(path: str, payload: dict) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=4)
    print(f"Result written to {path}")


def _maybe_plot(path: str | None, series_s: dict[str, list[float]], title: str) -> None:
    if not path:
        return
    from server.bench.plot import PlotUnavailable, plot_latency_percentiles

    try:
        print(f"Latency plot written to {plot_latency_percentiles(series_s, path, title)}")
    except PlotUnavailable as e:
        print(f"--plot skipped: {e}", file=sys.stderr)
    except ValueError as e:
        print(f"--plot skipped: {e}", file=sys.stderr)


# ----------------------------------------------------------------------------- throughput


def run_throughput_command(ns: argparse.Namespace) -> int:
    from server.bench.datasets import DatasetError, sample_random_requests
    from server.bench.throughput import (ModelSpecError, load_engine, materialize_model, prompt_vocabulary,
                                         run_throughput)

    engine_args, notes = engine_kwargs_from_namespace(ns, serve=False)
    engine_args["seed"] = ns.seed
    EngineConfig.from_kwargs(**engine_args)  # a bad engine flag fails before any weights are built
    for note in notes:
        logger.info("%s", note)
    model = ns.model or bundled_model_dir()
    try:
        with materialize_model(model, ns.num_layers, ns.seed) as model_dir:
            llm = load_engine(model_dir, engine_args)
            vocab_size, special = prompt_vocabulary(llm)
            requests = sample_random_requests(
                ns.num_prompts, ns.input_len, ns.output_len, vocab_size, special_token_ids=special,
                range_ratio=ns.random_range_ratio, prefix_len=ns.prefix_len, seed=ns.seed)
            result = run_throughput(llm, requests, use_tqdm=not ns.disable_tqdm, step_profile=ns.step_profile)
    except (ModelSpecError, DatasetError) as e:
        raise CLIError(str(e)) from None
    except EngineConfigError:
        raise  # a bad engine flag: main() reports it with the usage line
    except ValueError as e:  # an unloadable checkpoint, a request longer than max_model_len
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(result.report())
    if result.step_profile is not None:
        from server.step_profile import format_summary

        print(format_summary(result.step_profile))
    if ns.output_json:
        payload = result.to_json()
        payload["config"] = {"model": model, "num_layers": ns.num_layers, "dataset_name": ns.dataset_name,
                             "input_len": ns.input_len, "output_len": ns.output_len,
                             "num_prompts": ns.num_prompts, "seed": ns.seed, "engine_args": engine_args}
        _write_json(ns.output_json, payload)
    _maybe_plot(ns.plot, {"ttft": result.ttfts, "e2el": result.latencies},
                f"bench throughput: {os.path.basename(model.rstrip('/'))}, {result.num_requests} prompts "
                f"in {ns.input_len} / out {ns.output_len}")
    return 0


# ----------------------------------------------------------------------------- serve


async def _serve_benchmark(ns: argparse.Namespace):
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request

    from server.bench.datasets import DatasetError, sample_random_requests
    from server.bench.serve_client import fetch_model, fetch_vocabulary, run_requests, wait_until_healthy

    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    headers = {}
    if envs.OPENAI_API_KEY:  # as vLLM's client does
        headers["Authorization"] = f"Bearer {envs.OPENAI_API_KEY}"
    headers.update(_key_values(ns.header, "--header"))
    limits = httpx.Limits(max_connections=ns.max_concurrency, max_keepalive_connections=ns.max_concurrency)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        if ns.ready_check_timeout_sec > 0:
            await wait_until_healthy(client, base_url, ns.ready_check_timeout_sec)
        model_id, max_model_len = await fetch_model(client, base_url, ns.model)
        if ns.tokenizer:
            from server.tokenizer import Tokenizer, TokenizerLoadError

            try:
                tok = Tokenizer.from_pretrained(ns.tokenizer)
            except TokenizerLoadError as e:
                raise CLIError(f"--tokenizer: {e}") from None
            vocab_size, special = tok.vocab_size, tok.special_token_ids
        else:
            vocab_size, special = await fetch_vocabulary(client, base_url, model_id)
        try:
            requests = sample_random_requests(
                ns.num_prompts, ns.input_len, ns.output_len, vocab_size, special_token_ids=special,
                range_ratio=ns.random_range_ratio, prefix_len=ns.prefix_len, seed=ns.seed)
        except DatasetError as e:
            raise CLIError(str(e)) from None
        longest = max(r.prompt_len + r.expected_output_len for r in requests)
        if max_model_len is not None and longest > max_model_len:
            raise CLIError(f"requests need up to {longest} tokens but the server's max_model_len is {max_model_len}; "
                           "lower --random-input-len/--random-output-len")
        sampling = {k: v for k, v in (("temperature", ns.temperature), ("top_p", ns.top_p), ("top_k", ns.top_k),
                                      ("min_p", ns.min_p)) if v is not None}
        print(f"Traffic request rate: {ns.request_rate}")
        print(f"Burstiness factor: {ns.burstiness} "
              f"({'Poisson process' if ns.burstiness == 1.0 else 'Gamma distribution'})")
        print(f"Maximum request concurrency: {ns.max_concurrency}")
        try:
            results, duration = await run_requests(
                client, base_url + ns.endpoint, model_id, requests, request_rate=ns.request_rate,
                burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, seed=ns.seed, ignore_eos=True,
                extra_body={**sampling, **(ns.extra_body or {})}, progress=not ns.disable_tqdm)
        except ValueError as e:  # rate / burstiness / concurrency out of range
            raise CLIError(str(e)) from None
    return model_id, results, duration


def run_serve_command(ns: argparse.Namespace) -> int:
    from server.bench.serve_client import (DETAILED_KEYS, PERCENTILE_METRICS, ServerError, compute_metrics,
                                         format_report, latency_series)

    percentiles = _percentiles(ns.metric_percentiles)
    selected = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in selected if m not in PERCENTILE_METRICS]
    if unknown or not selected:
        raise CLIError(f"--percentile-metrics: choose from {', '.join(PERCENTILE_METRICS)}, "
                       f"got {ns.percentile_metrics!r}")
    metadata = _key_values(ns.metadata, "--metadata")
    try:
        model_id, results, duration = asyncio.run(_serve_benchmark(ns))
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    metrics = compute_metrics(results, duration, percentiles, selected)
    failures = [r.error for r in results if not r.success]
    if failures:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, err in enumerate(failures[:10]):
            print(f"Error {i}: {err}")
    print(format_report(metrics, max_concurrency=ns.max_concurrency, request_rate=ns.request_rate,
                        percentiles=percentiles, selected=selected))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = ns.label or ns.backend
    result = {
        "date": date, "endpoint_type": ns.backend, "backend": ns.backend, "label": label, "model_id": model_id,
        "tokenizer_id": ns.tokenizer, "num_prompts": ns.num_prompts, **metadata,
        "request_rate": ns.request_rate if not math.isinf(ns.request_rate) else "inf",
        "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency, **metrics,
    }
    _maybe_plot(ns.plot, {m: v for m, v in latency_series(results).items() if m in selected},
                f"bench serve: {model_id}, {ns.num_prompts} prompts, rate {ns.request_rate}, "
                f"concurrency {ns.max_concurrency}")
    if not ns.save_detailed:
        for key in DETAILED_KEYS:
            result.pop(key, None)
    if ns.save_result or ns.result_filename:
        name = ns.result_filename
        if not name:
            concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
            name = f"{label}-{ns.request_rate}qps{concurrency}-{model_id.rstrip('/').split('/')[-1]}-{date}.json"
        _write_json(os.path.join(ns.result_dir, name) if ns.result_dir else name, result)
    return 0 if metrics["completed"] else 1


def run(ns: argparse.Namespace) -> int:
    return ns._bench_run(ns)


SUBCOMMAND = Subcommand("bench", "benchmark offline throughput or a running server (like `vllm bench`)",
                        add_arguments, run)
