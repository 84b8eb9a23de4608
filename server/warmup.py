"""Start-up warm-up: a few engine steps on throwaway requests before the engine serves.

Triton kernels compile on first use, once per specialization (an integer argument's
divisibility by 16 or being 1 makes a new one), and so does the CUDA decode library: on a fresh
machine the first real prefill, the first step that mixes decode rows with a chunk, and the
first chunk that starts after cached context each stall for seconds of compiling, inside some
request's latency (and inside a benchmark's timed region). Decode graphs already compile the
pure-decode shapes at capture. The warm-up runs the other shapes a serving step takes through
the real scheduler and runner: a step-budget-wide chunk from position 0, a chunk one token
shorter (the other divisibility) beside a decode row, the one-token tail of a prompt after its
cached context, decode rows sampled greedily and with temperature / top-p / top-k / logprobs.
Then it forgets them: prefix cache, token counters, preemption and step-profile statistics.

Before that, on every rank, the prefill attention backend runs each chunk length it would
otherwise meet for the first time while serving (``warm_up_prefill_attention``): cuDNN's SDPA
plans per sequence length, tens of ms of host time each, and the chunks of chunked prefill
come in every bucket length.

It runs on CUDA only (CPU kernels are torch ops: nothing to compile) and not under data
parallelism (each DP engine would warm up alone, outside the lockstep of their MoE collectives).
``MLASERVE_SKIP_WARMUP=1`` turns it off.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from distributed.comm import reset_collective_counts
from server import envs
from server.sampling_params import SamplingParams
from server.scheduler import resolve_max_num_batched_tokens

logger = logging.getLogger(__name__)

WARMUP_OUTPUT_TOKENS = 3  # decode steps after the prompts: greedy, random and logprob rows
WARMUP_REQUEST_PREFIX = "mlaserve-warmup-"


def warmup_skip_reason(core) -> str | None:
    """Why the engine does not warm up (None: it does)."""
    if envs.MLASERVE_SKIP_WARMUP:
        return "MLASERVE_SKIP_WARMUP is set"
    if core.device.type != "cuda":
        return "CPU kernels need no compiling"
    if core.max_model_len < 2:
        return "--max-model-len below 2 leaves no room for a prompt and a token"
    if core.config.data_parallel_size > 1:
        return "data parallelism: the DP engines would warm up outside their lockstep"
    return None


def warm_up_prefill_attention(runner, config, max_model_len: int) -> None:
    """Run the prefill backend's per-length warm-up for chunks up to the step budget (skipped
    where ``warmup_skip_reason`` would skip the step warm-up, except under data parallelism:
    this runs no collective). Call it on the thread that will run the steps."""
    if envs.MLASERVE_SKIP_WARMUP or runner.device.type != "cuda":
        return
    max_chunk = min(resolve_max_num_batched_tokens(config, max_model_len), max_model_len)
    t0 = time.perf_counter()
    count = runner.prefill_backend.warm_up(max_chunk)
    if count:
        torch.cuda.synchronize(runner.device)
        logger.info("prefill attention warm-up (%s): %d chunk lengths up to %d tokens in %.1f s",
                    runner.prefill_backend.name, count, max_chunk, time.perf_counter() - t0)


def warmup_prompt_lengths(step_budget: int, max_model_len: int, max_num_seqs: int,
                          capacity_tokens: int) -> list[int]:
    """Prompt lengths whose prefill fills at least one whole step: prompts of the budget (or of
    the longest a sequence may be, leaving room for the outputs), as many as one step takes
    plus two. With budget-long prompts the steps are: A whole; A's decode + B less one token;
    A's decode + B's last token (a decode row too) + C less two; then C's two-token tail after
    its cached context beside the decodes. Capped by the sequence limit and the KV capacity."""
    length = min(step_budget, max(1, max_model_len - WARMUP_OUTPUT_TOKENS))
    count = math.ceil(step_budget / length) + 2
    per_seq = length + warmup_output_tokens(length, max_model_len)
    return [length] * min(count, max_num_seqs, max(1, capacity_tokens // per_seq))


def warmup_output_tokens(prompt_len: int, max_model_len: int) -> int:
    return min(WARMUP_OUTPUT_TOKENS, max_model_len - prompt_len)


def warmup_sampling_params(i: int, max_tokens: int, vocab_size: int, max_logprobs: int) -> SamplingParams:
    """Greedy, random (temperature, top-p, top-k; seeded, so the warm-up draws nothing from the
    global generator) and, every third request, logprobs (when the server allows any): the
    sampler's distinct paths."""
    common = dict(max_tokens=max_tokens, ignore_eos=True)
    if i % 3 == 0:
        return SamplingParams(temperature=0.0, **common)
    if i % 3 == 1 or max_logprobs < 1:
        return SamplingParams(temperature=0.8, top_p=0.95, top_k=min(50, vocab_size), seed=i, **common)
    return SamplingParams(temperature=1.0, logprobs=1, seed=i, **common)


def warm_up(core) -> float | None:
    """Run the warm-up requests to completion on ``core`` (an EngineCore), then reset what they
    counted. Returns the seconds it took, or None when skipped (the reason is logged)."""
    reason = warmup_skip_reason(core)
    if reason is not None:
        logger.info("start-up warm-up skipped: %s", reason)
        return None
    bm = core.block_manager
    budget = resolve_max_num_batched_tokens(core.config, core.max_model_len)
    lengths = warmup_prompt_lengths(budget, core.max_model_len, core.config.max_num_seqs,
                                    bm.num_total_blocks * core.config.block_size)
    outputs = warmup_output_tokens(lengths[0], core.max_model_len)
    gen = torch.Generator().manual_seed(0)
    vocab = core.vocab_size
    t0 = time.perf_counter()
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        core.add_request(f"{WARMUP_REQUEST_PREFIX}{i}", ids,
                         warmup_sampling_params(i, outputs, vocab, core.config.max_logprobs))
    steps = 0
    while core.has_unfinished():
        core.step()
        steps += 1
    if core.device.type == "cuda":
        torch.cuda.synchronize(core.device)
    seconds = time.perf_counter() - t0
    forget_warmup(core)
    logger.info("start-up warm-up: %d prompts of %d tokens, %d steps in %.1f s (kernels compiled before serving)",
                len(lengths), lengths[0], steps, seconds)
    return seconds


def forget_warmup(core) -> None:
    """Clear what the warm-up left in the engine's caches and counters."""
    core.block_manager.reset_prefix_cache()
    core.block_manager.prefix_cache_queries = core.block_manager.prefix_cache_hits = 0
    core.prompt_tokens_total = core.generation_tokens_total = 0
    core.scheduler.num_preemptions = 0
    core.runner.num_overlapped_steps = 0
    core.runner.step_profiler.reset()
    reset_collective_counts()
