#!/usr/bin/env python3
"""Greedy exact match of an arithmetic checkpoint on held-out ``a+b=`` pairs, with HF on CPU.

    python scripts/eval_arith.py --model configs/arith --n 500

A pair counts as correct when the greedy continuation is exactly ``"{a+b}\\n"`` then EOS.
The pairs are the first ``--n`` of the fixed held-out order in ``arith_data.py`` (never seen in
training), scored with and without the leading BOS. ``--short`` adds the held-out pairs
with both operands below 100.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arith_data  # noqa: E402


def load(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The HF model and the ``tokenizers`` tokenizer of a checkpoint directory."""
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"no config.json in {model_dir!r}")
    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return model, tok


def evaluate(model_dir: str, n: int = 500, device: str = "cpu", short: bool = False) -> dict:
    model, tok = load(model_dir, device)
    t0 = time.perf_counter()
    pairs = arith_data.held_out_pairs(n)
    acc, failures = arith_data.greedy_exact_match(model, tok, pairs, device)
    result = {"n": len(pairs), "exact_match": acc, "failures": failures}
    result["exact_match_without_bos"], _ = arith_data.greedy_exact_match(
        model, tok, pairs, device, with_bos=False
    )
    if short:
        small = [(a, b) for a, b in arith_data.held_out_pairs() if a < 100 and b < 100]
        result["short_n"] = len(small)
        result["short_exact_match"], _ = arith_data.greedy_exact_match(model, tok, small, device)
    result["seconds"] = time.perf_counter() - t0
    return result


def multiple_choice_accuracy(model, tok, docs: list[dict], device="cpu", with_bos=True) -> float:
    """What lm-eval's ``arith_mc`` measures: is the true sum the most likely choice?

    Each choice is scored by the summed log-probability of its digit tokens right after the
    prompt (no delimiter), as lm-eval's ``multiple_choice`` does with ``target_delimiter: ""``.
    """
    correct = 0
    for doc in docs:
        ctx = tok.encode(doc["prompt"], add_special_tokens=with_bos).ids
        conts = [tok.encode(c, add_special_tokens=False).ids for c in doc["choices"]]
        width = len(ctx) + max(len(c) for c in conts)
        ids = torch.full((len(conts), width), tok.token_to_id(arith_data.EOS), dtype=torch.long)
        for i, c in enumerate(conts):
            ids[i, : len(ctx) + len(c)] = torch.tensor(ctx + c)
        logprobs = torch.log_softmax(model(input_ids=ids.to(device)).logits.float(), dim=-1)
        scores = []
        for i, c in enumerate(conts):
            positions = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(c), device=logprobs.device)
            scores.append(logprobs[i, positions, torch.tensor(c, device=logprobs.device)].sum())
        correct += int(int(torch.stack(scores).argmax()) == doc["label"])
    return correct / len(docs)


def evaluate_task_docs(model_dir: str, path: str, device: str = "cpu") -> dict:
    """HF reference numbers for the lm-eval tasks' docs (``configs/lm_eval_tasks``)."""
    import json

    model, tok = load(model_dir, device)
    with open(path, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    pairs = [(d["a"], d["b"]) for d in docs]
    out = {"n": len(docs)}
    for with_bos, tag in ((True, ""), (False, "_without_bos")):
        out["gen" + tag], _ = arith_data.greedy_exact_match(model, tok, pairs, device,
                                                             with_bos=with_bos)
        out["mc" + tag] = multiple_choice_accuracy(model, tok, docs, device, with_bos)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    p.add_argument("--n", type=int, default=500, help="number of held-out pairs")
    p.add_argument("--device", default="cpu")
    p.add_argument("--short", action="store_true", help="also score pairs with a, b < 100")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (one is fastest for a model this small)")
    p.add_argument("--show-failures", type=int, default=10)
    p.add_argument("--task-docs", metavar="JSONL",
                   help="also score the lm-eval docs (e.g. configs/lm_eval_tasks/"
                        "arith_heldout.jsonl) the way arith_gen and arith_mc do")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("--n must be positive")
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    r = evaluate(args.model, args.n, args.device, args.short)
    correct = round(r["exact_match"] * r["n"])
    print(f"held-out greedy exact match: {r['exact_match']:.4f} ({correct}/{r['n']})")
    print(f"same prompts without the leading BOS: {r['exact_match_without_bos']:.4f}")
    if args.short:
        print(f"held-out pairs with a, b < 100: {r['short_exact_match']:.4f} "
              f"({r['short_n']} pairs)")
    for a, b, got in r["failures"][: args.show_failures]:
        print(f"  miss: {a}+{b}= -> {got!r} (want {a + b!r})")
    print(f"({r['seconds']:.1f}s on {args.device})")
    if args.task_docs:
        t = evaluate_task_docs(args.model, args.task_docs, args.device)
        print(f"lm-eval docs ({t['n']}): arith_gen exact match {t['gen']:.4f} "
              f"(without BOS {t['gen_without_bos']:.4f}), arith_mc acc {t['mc']:.4f} "
              f"(without BOS {t['mc_without_bos']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
