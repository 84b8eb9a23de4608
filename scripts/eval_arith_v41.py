#!/usr/bin/env python3
"""Greedy exact match of the V4.1 arithmetic checkpoint, through mlaserve's V4.1 model.

    python scripts/eval_arith_v41.py --model configs/arith-v41 --n 500 \\
        --task-docs configs/lm_eval_tasks/arith_v41_heldout.jsonl

Scores the first ``--n`` held-out pairs bare, without BOS and behind a fixed preamble of
solved sums (longer than the model's sliding window); ``--task-docs`` adds what lm-eval's
``arith_v41_gen`` and ``arith_v41_mc`` measure on their docs, and the demo prompt
``123+456=`` goes through the inference path (prefill, then decode token by token).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arith_data  # noqa: E402
import eval_arith  # noqa: E402


def load(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from tokenizers import Tokenizer

    from model.v4_family import load_v4_family

    model = load_v4_family(model_dir, dtype, device)
    return model, Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def sequence_logits(model):
    from model.v41.training import forward_sequences

    return lambda ids: forward_sequences(model, ids).logits


def greedy_text(model, tok, text: str, max_tokens: int = 8) -> str:
    """The inference path: one request's prefill, then one decode step per token until EOS."""
    device = next(model.parameters()).device
    state = model.new_state()
    eos = tok.token_to_id(arith_data.EOS)
    logits = model(torch.tensor(tok.encode(text).ids, device=device), state)[-1]
    out = []
    for _ in range(max_tokens):
        token = int(logits.argmax())
        out.append(token)
        if token == eos:
            break
        logits = model(torch.tensor([token], device=device), state)[-1]
    return tok.decode(out, skip_special_tokens=False)


class _LogitsOutput:
    """What ``eval_arith``'s HF-shaped helpers call: ``model(input_ids=ids).logits``."""

    def __init__(self, model) -> None:
        self.logits_of = sequence_logits(model)

    def __call__(self, input_ids, **_kwargs):
        return SimpleNamespace(logits=self.logits_of(input_ids))


def multiple_choice_accuracy(model, tok, docs: list[dict], device="cpu", with_bos=True) -> float:
    """lm-eval's ``multiple_choice`` with ``target_delimiter: ""`` (see ``eval_arith``)."""
    with torch.no_grad():
        return eval_arith.multiple_choice_accuracy(_LogitsOutput(model), tok, docs, device, with_bos)


def evaluate(model_dir: str, n: int = 500, device: str = "cpu", task_docs: str | None = None,
             dtype: torch.dtype = torch.float32) -> dict:
    model, tok = load(model_dir, device, dtype)
    logits_of = sequence_logits(model)
    t0 = time.perf_counter()
    bare = [([], a, b) for a, b in arith_data.held_out_pairs(n)]
    fewshot = arith_data.held_out_fewshot_rows(n)
    out = {"n": n}
    out["exact_match"], out["failures"] = arith_data.greedy_exact_match_logits(logits_of, tok, bare, device)
    out["exact_match_without_bos"], _ = arith_data.greedy_exact_match_logits(
        logits_of, tok, bare, device, with_bos=False)
    out["exact_match_fewshot"], out["failures_fewshot"] = arith_data.greedy_exact_match_logits(
        logits_of, tok, fewshot, device)
    out["demo"] = greedy_text(model, tok, "123+456=")
    if task_docs:
        with open(task_docs, encoding="utf-8") as f:
            docs = [json.loads(line) for line in f if line.strip()]
        rows = [(_shots(d.get("preamble", "")), d["a"], d["b"]) for d in docs]
        out["task_n"] = len(docs)
        for with_bos, tag in ((True, ""), (False, "_without_bos")):
            out["gen" + tag], _ = arith_data.greedy_exact_match_logits(logits_of, tok, rows, device,
                                                                       with_bos=with_bos)
            out["mc" + tag] = multiple_choice_accuracy(model, tok, docs, device, with_bos)
    out["seconds"] = time.perf_counter() - t0
    return out


def _shots(preamble: str) -> list[tuple[int, int]]:
    """``"12+30=42\\n7+5=12\\n"`` -> [(12, 30), (7, 5)]."""
    shots = []
    for line in preamble.splitlines():
        a, rest = line.split("+")
        shots.append((int(a), int(rest.split("=")[0])))
    return shots


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="V4.1 checkpoint directory")
    p.add_argument("--n", type=int, default=500, help="number of held-out pairs")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (default float32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--show-failures", type=int, default=5)
    p.add_argument("--task-docs", metavar="JSONL", help="also score the lm-eval docs the way "
                   "arith_v41_gen and arith_v41_mc do (configs/lm_eval_tasks/arith_v41_heldout.jsonl)")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("--n must be positive")
    torch.set_num_threads(args.threads)
    r = evaluate(args.model, args.n, args.device, args.task_docs, torch.bfloat16 if args.bf16 else torch.float32)
    print(f"held-out greedy exact match: {r['exact_match']:.4f} ({r['n']} pairs); without BOS "
          f"{r['exact_match_without_bos']:.4f}; behind a preamble {r['exact_match_fewshot']:.4f}")
    for text, got in r["failures_fewshot"][: args.show_failures]:
        print(f"  miss: {text!r} -> {got!r}")
    print(f"123+456= -> {r['demo']!r}")
    if args.task_docs:
        print(f"lm-eval docs ({r['task_n']}): arith_v41_gen exact match {r['gen']:.4f} (without BOS "
              f"{r['gen_without_bos']:.4f}), arith_v41_mc acc {r['mc']:.4f} (without BOS {r['mc_without_bos']:.4f})")
    print(f"({r['seconds']:.1f}s on {args.device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
