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
    (``--load-format dummy``), so even R1's shape needs no disk."""
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
    if num_layers is not None:
        if num_layers < 1:
            raise ModelSpecError(f"--num-layers: must be at least 1, got {num_layers}")
        config["num_hidden_layers"] = num_layers
    from model.checkpoint import write_checkpoint_metadata

    with tempfile.TemporaryDirectory(prefix="mlaserve-bench-") as tmp:
        logger.info("preset %s (%d layers): random weights made on the device (--load-format dummy)",
                    model, config["num_hidden_layers"])
        write_checkpoint_metadata(config, tmp)
        yield tmp


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
        """The lines ``vllm bench throughput`` prints, in its wording."""
        return (f"Throughput: {self.requests_per_second:.2f} requests/s, {self.tokens_per_second:.2f} total "
                f"tokens/s, {self.output_tokens_per_second:.2f} output tokens/s\n"
                f"Total num prompt tokens:  {self.total_num_prompt_tokens}\n"
                f"Total num output tokens:  {self.total_num_output_tokens}")

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
    return ThroughputResult(elapsed, len(outputs), prompt_tokens, output_tokens, ttfts, latencies,
                            step_profile=profiler.summary() if profiler.enabled else None)
