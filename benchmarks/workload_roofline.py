"""The roofline of a whole ``bench throughput`` workload on an MLA model: the least time its
steps can take on a GPU, so an end-to-end req/s can be read as a fraction of what is possible.

The steps are planned as our scheduler plans them (decodes first, then the running prefill's
next chunk, then admissions, all inside ``--max-num-batched-tokens`` and ``--max-num-seqs``;
every prompt submitted at once, every request running to its output length), and each step
costs the larger of its compute and byte rooflines (``server.step_roofline``: useful FLOPs at
the measured GEMM rate, unavoidable HBM bytes at the copy rate). No step overhead, no
overlap between steps' compute and bytes beyond the max: a bound, not a prediction.

    python3 -m benchmarks.workload_roofline --model deepseek-v2-lite --input-len 8192 \\
        --output-len 1024 --num-prompts 100 --kv-cache-dtype fp8

The default rates are the H200's measured in this repository's runs (HBM copy 4.27 TB/s, bf16
GEMM 687 TFLOP/s, FP8 GEMM 1,260 TFLOP/s: benchmarks/RESULTS.md); give the run's own with
``--bf16-tflops/--fp8-tflops/--hbm-tbs``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from model.checkpoint import load_config_dict
from model.config import parse_model_config
from server.step_roofline import Ceilings, MLAStepCostModel

H200_CEILINGS = Ceilings(bf16_flops=687e12, fp8_flops=1260e12, hbm_bytes=4.27e12)


@dataclass
class _Request:
    prompt: int
    output: int
    computed: int = 0  # tokens in the cache
    generated: int = 0


@dataclass
class WorkloadRoofline:
    seconds: float
    steps: int
    prefill_steps: int  # steps that carry a prompt chunk
    compute_bound_s: float  # time of the steps whose compute roofline is the larger
    bytes_bound_s: float

    def requests_per_s(self, num_prompts: int) -> float:
        return num_prompts / self.seconds


def plan_steps(num_prompts: int, input_len: int, output_len: int, max_num_seqs: int, budget: int):
    """Yield each step as (context_lens, query_lens, num_decodes, logit_rows)."""
    waiting = [_Request(input_len, output_len) for _ in range(num_prompts)]
    running: list[_Request] = []
    while waiting or running:
        decodes = [r for r in running if r.computed >= r.prompt]
        left = budget - len(decodes)
        chunks: list[tuple[_Request, int]] = []
        for r in running:
            if r.computed < r.prompt and left > 0:
                n = min(left, r.prompt - r.computed)
                chunks.append((r, n))
                left -= n
        while waiting and left > 0 and len(running) < max_num_seqs:
            r = waiting.pop(0)
            running.append(r)
            n = min(left, r.prompt)
            chunks.append((r, n))
            left -= n
        ctx = [r.prompt + r.generated - 1 for r in decodes] + [r.computed for r, _ in chunks]
        new = [1] * len(decodes) + [n for _, n in chunks]
        logit_rows = len(decodes) + sum(1 for r, n in chunks if r.computed + n == r.prompt)
        yield ctx, new, len(decodes), logit_rows
        for r in decodes:
            r.generated += 1
        for r, n in chunks:
            r.computed += n
            if r.computed == r.prompt:
                r.generated = 1  # the prompt's last position samples the first token
        running = [r for r in running if r.generated < r.output]


def workload_roofline(costs: MLAStepCostModel, ceilings: Ceilings, num_prompts: int, input_len: int,
                      output_len: int, max_num_seqs: int = 256, budget: int = 8192) -> WorkloadRoofline:
    total = compute_s = bytes_s = 0.0
    steps = prefill_steps = 0
    for ctx, new, nd, logit_rows in plan_steps(num_prompts, input_len, output_len, max_num_seqs, budget):
        compute, nbytes = costs.roofline_s(costs.cost(ctx, new, nd, logit_rows), ceilings)
        total += max(compute, nbytes)
        compute_s += compute if compute >= nbytes else 0.0
        bytes_s += nbytes if nbytes > compute else 0.0
        steps += 1
        prefill_steps += len(new) > nd
    return WorkloadRoofline(total, steps, prefill_steps, compute_s, bytes_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", help="a preset name or a directory with config.json")
    p.add_argument("--num-layers", type=int, default=None, help="keep only this many decoder layers (a slice)")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--bf16-tflops", type=float, default=H200_CEILINGS.bf16_flops / 1e12)
    p.add_argument("--fp8-tflops", type=float, default=H200_CEILINGS.fp8_flops / 1e12)
    p.add_argument("--hbm-tbs", type=float, default=H200_CEILINGS.hbm_bytes / 1e12)
    a = p.parse_args(argv)
    d = load_config_dict(a.model)
    if a.num_layers is not None:
        d = {**d, "num_hidden_layers": a.num_layers}
    cfg = parse_model_config(d)
    costs = MLAStepCostModel(cfg, fp8_weights=cfg.is_fp8_checkpoint,
                             kv_bytes_per_value=1.0 if a.kv_cache_dtype == "fp8" else 2.0,
                             tp_size=a.tensor_parallel_size)
    ceil = Ceilings(a.bf16_tflops * 1e12, a.fp8_tflops * 1e12, a.hbm_tbs * 1e12)
    r = workload_roofline(costs, ceil, a.num_prompts, a.input_len, a.output_len, a.max_num_seqs,
                          a.max_num_batched_tokens)
    out_tokens = a.num_prompts * a.output_len
    print(f"{a.model}: {a.num_prompts} x {a.input_len} in / {a.output_len} out, KV {a.kv_cache_dtype}, "
          f"TP{a.tensor_parallel_size}, rates bf16 {a.bf16_tflops:.0f} / FP8 {a.fp8_tflops:.0f} TFLOP/s, "
          f"HBM {a.hbm_tbs:.2f} TB/s")
    print(f"roofline: {r.seconds:.2f} s over {r.steps} steps ({r.prefill_steps} with prefill) = "
          f"{r.requests_per_s(a.num_prompts):.2f} req/s, {out_tokens / r.seconds:,.0f} output tok/s; "
          f"compute-bound steps {r.compute_bound_s:.2f} s, byte-bound {r.bytes_bound_s:.2f} s")


if __name__ == "__main__":
    main()
