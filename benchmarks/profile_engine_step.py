"""Where one engine step's GPU time goes: torch.profiler around ``LLM.generate`` for one long
prompt (a prefill step) and, separately, a batch of decodes, on a preset's shape with random
weights. Prints the top kernels by CUDA time for each.

    python3 -m benchmarks.profile_engine_step --model deepseek-v2-lite --input-len 8192
"""

from __future__ import annotations

import argparse

import torch


from server.bench.throughput import materialize_model
from server import LLM, SamplingParams


def profile(llm, prompts, max_tokens: int, title: str, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    warm = [[(t + 7919) % 1000 + 10 for t in p[:64]] for p in prompts[:1]]  # no prefix shared with the prompts
    llm.generate(prompt_token_ids=warm, sampling_params=params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(f"==== {title}")
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=top, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    with materialize_model(args.model, args.num_layers) as model_dir:
        llm = LLM(model_dir, device=args.device, kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.input_len + 64,
                  load_format="dummy")
        vocab = llm.engine.vocab_size
        prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(4)]
        profile(llm, prompts[:1], 1, f"prefill of {args.input_len} tokens", args.top)
        profile(llm, prompts[1:], 8, f"3 prompts of {args.input_len} tokens, 8 tokens out (mixed steps)", args.top)


if __name__ == "__main__":
    main()
