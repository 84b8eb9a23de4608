"""Offline throughput, as ``vllm bench throughput`` measures it.

Every request is handed to the offline engine (``server.LLM``) at once and the clock runs
around ``generate`` alone (model loading is excluded). Requests use vLLM's settings for
this benchmark: temperature 1.0, top_p 1.0, ``ignore_eos``, ``max_tokens`` = the requested
output length, so every request produces exactly that many tokens.

``--model`` may name a preset from ``configs/`` instead of a checkpoint directory: random
weights in the preset's real shape are written to a temporary directory first (optionally
truncated to ``--num-layers``), because the engine loads checkpoints from disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from server.bench.datasets import SampleRequest

logger = logging.getLogger("mlaserve.bench")

# Sampling that vLLM's throughput benchmark uses for every request.
BENCH_TEMPERATURE = 1.0
BENCH_TOP_P = 1.0


class ModelSpecError(ValueError):
    """``--model`` names neither a checkpoint directory nor a preset."""


# ----------------------------------------------------------------------------- the model


def preset_names() -> list[str]:
    from model.checkpoint import CONFIGS_DIR

    return sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))


@contextlib.contextmanager
def materialize_model(model: str, num_layers: int | None = None, seed: int = 0) -> Iterator[str]:
    """Yield a checkpoint directory for ``model``: the directory itself, or, for a preset name
    (or a config.json path), a temporary directory with its config and tokenizer but no
    weights: the engine then makes random weights in that shape on the device
    (``--load-format dummy``), so even R1's shape needs no disk. A V4-family preset is cut
    by :func:`v4_preset_config`."""
    if os.path.isdir(model):
        if num_layers is not None:
            raise ModelSpecError("--num-layers applies to a preset only; --model is a checkpoint directory")
        yield model
        return
    from model.checkpoint import load_config_dict

    try:
        config = load_config_dict(model)
    except FileNotFoundError:
        raise ModelSpecError(f"--model {model!r} is neither a checkpoint directory nor a preset "
                             f"(presets: {', '.join(preset_names())})") from None
    if num_layers is not None and num_layers < 1:
        raise ModelSpecError(f"--num-layers: must be at least 1, got {num_layers}")
    from model.v4_family import V4_FAMILY_MODEL_TYPES

    if config.get("model_type") in V4_FAMILY_MODEL_TYPES:
        config = v4_preset_config(config, num_layers)
    elif num_layers is not None:
        config["num_hidden_layers"] = num_layers
    from model.checkpoint import write_checkpoint_metadata
    from model.v4_layout import text_config

    with tempfile.TemporaryDirectory(prefix="mlaserve-bench-") as tmp:
        logger.info("preset %s (%d layers): random weights made on the device (--load-format dummy)",
                    model, text_config(config)["num_hidden_layers"])
        write_checkpoint_metadata(config, tmp)
        yield tmp


# Engram table rows a V4.1 preset keeps per layer: the released tables (384 M rows, ~200 GB
# each in bf16) cannot sit on one GPU beside the experts; the hash then addresses the capped
# table (a smaller engram_vocab_size, model/v4_checkpoint.py), at the same cost per token.
PRESET_ENGRAM_ROWS = 1 << 21


def v4_preset_config(config: dict, num_layers: int | None) -> dict:
    """A V4 / V4.1 preset's config.json cut to its first ``num_layers`` layers as a valid model:
    per-layer lists cut, V4.1's KV / index / candidate source and engram layer ids kept only
    below the cut (the candidate source becomes -1, none, when cut away), MTP / DSpark layers
    dropped, engram tables capped at :data:`PRESET_ENGRAM_ROWS` rows (one log line). A cut
    that is no valid model, or has no compressed layer to size the KV cache by, is one
    :class:`ModelSpecError` line."""
    from model.config import ConfigError, parse_model_config
    from model.v4_checkpoint import slice_config
    from model.v4_layout import text_config

    rows = text_config(config).get("engram_num_embeddings") or []
    flag = "--num-layers" if num_layers is None else f"--num-layers {num_layers}"
    try:
        out = slice_config(config, num_layers, engram_rows=PRESET_ENGRAM_ROWS if rows else None, with_mtp=False)
        cut = parse_model_config(out)
    except ConfigError as exc:
        raise ModelSpecError(f"{flag}: the cut preset is not a valid model: {exc}") from None
    except ValueError as exc:
        raise ModelSpecError(str(exc) if str(exc).startswith("--") else f"{flag}: {exc}") from None
    if not any(cut.compress_ratios):
        ratios = [int(r) for r in text_config(config).get("compress_ratios") or []]
        first = next((i for i, r in enumerate(ratios) if r), None)
        hint = f"; use at least {first + 1}" if first is not None else ""
        raise ModelSpecError(f"{flag}: the cut has sliding-window layers only, and the V4-family engine sizes its "
                             f"KV cache from the compressed layers{hint}")
    kept = [r for r, layer in zip(rows, text_config(config).get("engram_layer_ids") or [])
            if layer in (text_config(out).get("engram_layer_ids") or [])]
    if kept and max(kept) > PRESET_ENGRAM_ROWS:
        logger.info("engram tables capped at %d rows per layer (preset: up to %d; engram_vocab_size %d for the "
                    "hash) so the preset fits one GPU", PRESET_ENGRAM_ROWS, max(kept),
                    text_config(out)["engram_vocab_size"])
    return out


# ----------------------------------------------------------------------------- the run


@dataclass
class ThroughputResult:
    elapsed_time: float  # seconds spent in generate()
    num_requests: int
    total_num_prompt_tokens: int
    total_num_output_tokens: int
    # Per request, seconds from submission: first token, last token (all submitted at t=0).
    ttfts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    step_profile: dict | None = None  # StepProfiler.summary() when run with step_profile=True
    # V4 family: the KV cache's bytes per token / fixed bytes per request (server/v4_kv_specs.py)
    # and, with step_profile, the decode step's HBM roofline (server/bench/roofline.py).
    kv_cache: dict | None = None
    decode_roofline: dict | None = None

    @property
    def total_num_tokens(self) -> int:
        return self.total_num_prompt_tokens + self.total_num_output_tokens

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.elapsed_time

    @property
    def tokens_per_second(self) -> float:
        return self.total_num_tokens / self.elapsed_time

    @property
    def output_tokens_per_second(self) -> float:
        return self.total_num_output_tokens / self.elapsed_time

    def report(self) -> str:
        """The lines ``vllm bench throughput`` prints, in its wording; then the V4 family's KV
        cache sizes and decode roofline when measured."""
        lines = [f"Throughput: {self.requests_per_second:.2f} requests/s, {self.tokens_per_second:.2f} total "
                 f"tokens/s, {self.output_tokens_per_second:.2f} output tokens/s",
                 f"Total num prompt tokens:  {self.total_num_prompt_tokens}",
                 f"Total num output tokens:  {self.total_num_output_tokens}"]
        if self.kv_cache is not None:
            kv = self.kv_cache
            lines.append(f"KV cache: {kv['bytes_per_token']:g} bytes per token of context, "
                         f"{kv['fixed_bytes_per_request']} fixed bytes per request")
        if self.decode_roofline is not None:
            from server.bench.roofline import format_roofline

            lines.append(format_roofline(self.decode_roofline))
        return "\n".join(lines)

    def to_json(self) -> dict:
        """vLLM's result keys first (same names and meaning), then ours."""
        return {
            "elapsed_time": self.elapsed_time,
            "num_requests": self.num_requests,
            "total_num_tokens": self.total_num_tokens,
            "requests_per_second": self.requests_per_second,
            "tokens_per_second": self.tokens_per_second,
            "output_tokens_per_second": self.output_tokens_per_second,
            "total_num_prompt_tokens": self.total_num_prompt_tokens,
            "total_num_output_tokens": self.total_num_output_tokens,
            **({"step_profile": self.step_profile} if self.step_profile is not None else {}),
            **({"kv_cache": self.kv_cache} if self.kv_cache is not None else {}),
            **({"decode_roofline": self.decode_roofline} if self.decode_roofline is not None else {}),
        }


def load_engine(model_dir: str, engine_args: dict):
    """The offline engine for ``model_dir``; ``engine_args`` are EngineConfig field names.
    A directory without weights (a preset) gets random weights made on the device."""
    from server import LLM

    has_weights = any(f.endswith(".safetensors") for f in os.listdir(model_dir))
    if not has_weights:
        engine_args = {**engine_args, "load_format": "dummy"}
    return LLM(model=model_dir, **engine_args)


def prompt_vocabulary(llm) -> tuple[int, set[int]]:
    """(ids prompts may use: below both the model's and the tokenizer's vocab size, special ids)."""
    return min(llm.engine.vocab_size, llm.tokenizer.vocab_size), llm.tokenizer.special_token_ids


def run_throughput(llm, requests: list[SampleRequest], use_tqdm: bool = True,
                   step_profile: bool = False) -> ThroughputResult:
    """Time one ``generate`` over all ``requests`` (vLLM's sampling settings, see module doc).
    ``step_profile``: record the engine's per-step time breakdown (server.step_profile) for
    this run; on CUDA it synchronizes at phase boundaries, so the throughput drops a little."""
    from server import SamplingParams

    max_model_len = llm.engine.max_model_len
    too_long = [r for r in requests if r.prompt_len + r.expected_output_len > max_model_len]
    if too_long:
        r = too_long[0]
        raise ValueError(f"a request needs {r.prompt_len} prompt + {r.expected_output_len} output tokens but "
                         f"the model's max_model_len is {max_model_len}; lower --input-len/--output-len or raise "
                         "--max-model-len")
    params = [SamplingParams(n=1, temperature=BENCH_TEMPERATURE, top_p=BENCH_TOP_P, ignore_eos=True,
                             max_tokens=r.expected_output_len) for r in requests]
    profiler = llm.engine.step_profiler
    if step_profile:
        profiler.reset()
        profiler.enabled = True
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=[r.prompt_token_ids for r in requests], sampling_params=params,
                           use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttfts = [o.first_token_time - o.arrival_time for o in outputs if o.first_token_time is not None]
    latencies = [o.last_token_time - o.arrival_time for o in outputs if o.last_token_time is not None]
    result = ThroughputResult(elapsed, len(outputs), prompt_tokens, output_tokens, ttfts, latencies,
                              step_profile=profiler.summary() if profiler.enabled else None)
    add_v4_family_report(llm, requests, result)
    return result


def add_v4_family_report(llm, requests: list[SampleRequest], result: ThroughputResult) -> None:
    """A V4 / V4.1 engine's KV bytes per token and per request, and (with a step profile) the
    decode roofline with each request's cache at its mean decode context: prompt + half the
    output (every cached byte read once per step)."""
    from model.v4_family import V4_FAMILY_MODEL_TYPES

    engine = llm.engine
    if engine.model_config.model_type not in V4_FAMILY_MODEL_TYPES:
        return
    from server.bench.roofline import decode_roofline
    from server.v4_kv_specs import v4_capacity

    result.kv_cache = v4_capacity(engine.block_manager.groups, engine.max_model_len)
    if result.step_profile is None or not requests:
        return
    context = sum(r.prompt_len + r.expected_output_len / 2 for r in requests) / len(requests)
    kv_per_request = result.kv_cache["bytes_per_token"] * context + result.kv_cache["fixed_bytes_per_request"]
    result.decode_roofline = decode_roofline(engine.model, result.step_profile, kv_per_request)
    if result.decode_roofline is not None:
        result.decode_roofline["mean_context_tokens"] = context
