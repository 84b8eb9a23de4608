"""CPU cost of one engine step without a model: scheduler (+ sampler) at a full decode batch.

Every step of a decode batch pays ``Scheduler.schedule`` + ``update_after_step`` on the host
and, unless async scheduling hides it, the sampler. This measures both at ``--batch``
running decodes (default 256) with random logits of ``--vocab`` (default 32k) columns, so a
regression in the per-step host work shows up before it shows up in a GPU profile.

    python3 -m benchmarks.bench_scheduler [--batch 256] [--steps 200] [--vocab 32000]
                                         [--temperature 1.0] [--top-p 1.0] [--no-sampler]

Prints ms/step; nothing is asserted on time.
"""

from __future__ import annotations

import argparse
import time

import torch


from server.config import EngineConfig
from server.kv_cache import BlockManager
from server.sampler import Sampler, SamplingRow
from server.sampling_params import SamplingParams
from server.scheduler import Scheduler
from server.sequence import Sequence


def _build(batch: int, prompt_len: int, params: SamplingParams, block_size: int) -> tuple[Scheduler, list[Sequence]]:
    max_model_len = prompt_len + params.max_tokens
    blocks_per_seq = -(-max_model_len // block_size)
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, batch),
        enable_prefix_caching=True,
    )
    scheduler = Scheduler(config, BlockManager.from_config(config, batch * blocks_per_seq + 8), max_model_len)
    seqs = []
    for i in range(batch):
        prompt = [(i * 131 + j * 7) % 30000 + 1 for j in range(prompt_len)]
        seq = Sequence(i, f"bench-{i}", prompt, params)
        scheduler.add_seq(seq)
        seqs.append(seq)
    return scheduler, seqs


def run(
    batch: int = 256,
    steps: int = 200,
    warmup: int = 20,
    vocab: int = 32000,
    prompt_len: int = 128,
    block_size: int = 64,
    with_sampler: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> dict:
    """Prefill ``batch`` sequences, then time ``steps`` pure-decode steps; returns the timings."""
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=steps + warmup + 12)
    scheduler, seqs = _build(batch, prompt_len, params, block_size)
    while any(seq.num_output_tokens == 0 for seq in seqs):  # prefill, untimed
        out = scheduler.schedule()
        scheduler.update_after_step(out, {e.seq.seq_id: 1 for e in out.scheduled if e.sample})

    sampler = Sampler(global_seed=0) if with_sampler else None
    gen = torch.Generator().manual_seed(0)
    logits_pool = [torch.randn(batch, vocab, generator=gen) for _ in range(4)]
    sched_s = sample_s = 0.0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        assert out.is_decode_only and len(out.scheduled) == batch
        if sampler is not None:
            rows = [
                SamplingRow(e.seq.sampling_params, e.seq.prompt_token_ids, e.seq.output_token_ids)
                for e in out.scheduled
            ]
            token_ids = sampler(logits_pool[i % len(logits_pool)], rows).token_ids
        else:
            token_ids = [1] * len(out.scheduled)
        t2 = time.perf_counter()
        scheduler.update_after_step(out, {e.seq.seq_id: t for e, t in zip(out.scheduled, token_ids)})
        t3 = time.perf_counter()
        if i >= warmup:
            sched_s += (t1 - t0) + (t3 - t2)
            sample_s += t2 - t1

    result = {
        "batch": batch,
        "steps": steps,
        "vocab": vocab,
        "temperature": temperature,
        "top_p": top_p,
        "scheduler_ms_per_step": 1e3 * sched_s / steps,
        "sampler_ms_per_step": 1e3 * sample_s / steps if with_sampler else None,
        "ms_per_step": 1e3 * (sched_s + sample_s) / steps,
    }
    sampler_txt = f"{result['sampler_ms_per_step']:.3f} ms/step" if with_sampler else "off"
    print(
        f"batch {batch} decodes, vocab {vocab}, temperature {temperature}, top_p {top_p}: "
        f"scheduler {result['scheduler_ms_per_step']:.3f} ms/step, "
        f"sampler {sampler_txt}, total {result['ms_per_step']:.3f} ms/step "
        f"({1e3 * result['ms_per_step'] / batch:.2f} us per sequence)"
    )
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--no-sampler", action="store_true", help="time the scheduler alone")
    a = p.parse_args(argv)
    run(a.batch, a.steps, a.warmup, a.vocab, a.prompt_len, a.block_size, with_sampler=not a.no_sampler,
        temperature=a.temperature, top_p=a.top_p)


if __name__ == "__main__":
    main()
