#!/usr/bin/env python3
"""Write the local lm-eval datasets of the arithmetic tasks (``arith_gen``, ``arith_mc``, and
the few-shot ``arith_v41_gen``, ``arith_v41_mc``).

    python scripts/make_arith_tasks.py            # -> configs/lm_eval_tasks/arith_heldout.jsonl
    python scripts/make_arith_tasks.py --fewshot  # -> configs/lm_eval_tasks/arith_v41_heldout.jsonl

Each line is one held-out pair (never seen in training) drawn with a fixed seed::

    {"a": 12, "b": 30, "prompt": "12+30=", "answer": "42",
     "choices": ["43", "42", "24", "52"], "label": 1}

``choices`` holds the true sum among three near misses (digits swapped, +-1, +-10, +-100).
No two choices are prefixes of one another: lm-eval scores a choice by the log-likelihood of
its digits alone, and a prefix of the true sum would always score at least as high.

The few-shot docs add a ``preamble`` of 3-5 solved training sums (``"12+30=42\n..."``, at least
``FEWSHOT_MIN_CHARS`` characters, so the prompt runs well past the V4.1 model's 16-token window
and its compressed entries and indexer take part); ``prompt`` is the preamble then ``"{a}+{b}="``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arith_data  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "configs", "lm_eval_tasks", "arith_heldout.jsonl")
DEFAULT_FEWSHOT_OUT = os.path.join(REPO, "configs", "lm_eval_tasks", "arith_v41_heldout.jsonl")
N_CHOICES = 4
FEWSHOT_MIN_CHARS = 32


def _swaps(s: str) -> list[int]:
    out = []
    for i in range(len(s) - 1):
        t = s[:i] + s[i + 1] + s[i] + s[i + 2 :]
        if t != s and not t.startswith("0"):
            out.append(int(t))
    return out


def near_misses(total: int, rng: np.random.Generator, k: int = N_CHOICES - 1) -> list[int]:
    """``k`` distinct wrong sums close to ``total``, none a prefix of another choice."""
    s = str(total)
    primary = _swaps(s) + [total + d for d in (1, -1, 10, -10, 100, -100)]
    fallback = [total + d for d in (2, -2, 20, -20, 3, -3, 30, -30, 200, -200)]
    chosen: list[int] = []

    def ok(x: int) -> bool:
        if x < 0 or x == total or x in chosen:
            return False
        return all(not (str(x).startswith(str(y)) or str(y).startswith(str(x)))
                   for y in chosen + [total])

    for pool in (primary, fallback):
        for x in [pool[i] for i in rng.permutation(len(pool))]:
            if len(chosen) < k and ok(x):
                chosen.append(x)
    if len(chosen) < k:
        raise RuntimeError(f"could not find {k} near misses for {total}")
    return chosen


def make_docs(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    pool = arith_data.held_out_pairs()
    docs = []
    for i in rng.choice(len(pool), size=n, replace=False):
        a, b = pool[int(i)]
        total = a + b
        choices = [total] + near_misses(total, rng)
        order = rng.permutation(len(choices))
        choices = [str(choices[j]) for j in order]
        docs.append({
            "a": a, "b": b, "prompt": arith_data.prompt_text(a, b), "answer": str(total),
            "choices": choices, "label": choices.index(str(total)),
        })
    return docs


def make_fewshot_docs(n: int, seed: int) -> list[dict]:
    """:func:`make_docs` with a preamble of 3-5 solved training sums in front of each prompt."""
    rng = np.random.default_rng(seed + 1)
    docs = []
    for doc in make_docs(n, seed):
        preamble = ""
        while len(preamble) < FEWSHOT_MIN_CHARS:
            x, y = arith_data.sample_training_pairs(rng, int(rng.integers(3, 6)))
            preamble = arith_data.fewshot_text(list(zip(x.tolist(), y.tolist())), 0, 0)[: -len("0+0=")]
        docs.append({**doc, "preamble": preamble, "prompt": preamble + doc["prompt"]})
    return docs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fewshot", action="store_true", help="the few-shot docs of the arith_v41 tasks")
    p.add_argument("--out", default=None, help="output jsonl (default: configs/lm_eval_tasks/...)")
    args = p.parse_args(argv)
    docs = make_fewshot_docs(args.n, args.seed) if args.fewshot else make_docs(args.n, args.seed)
    args.out = args.out or (DEFAULT_FEWSHOT_OUT if args.fewshot else DEFAULT_OUT)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    print(f"wrote {len(docs)} held-out pairs to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
