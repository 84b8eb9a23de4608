"""Loads the arithmetic tasks' local jsonl files (no download), wherever lm-eval is run from.

The files sit next to this module; regenerate them with ``scripts/make_arith_tasks.py``
(``--fewshot`` for the arith_v41 tasks' docs, which carry a preamble of solved sums).
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_FILE = os.path.join(HERE, "arith_heldout.jsonl")
FEWSHOT_DATA_FILE = os.path.join(HERE, "arith_v41_heldout.jsonl")


def _load(path):
    import datasets

    with open(path, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load_arith_docs(**_metadata):
    """``custom_dataset`` hook: lm-eval passes the task metadata as keyword arguments."""
    return _load(DATA_FILE)


def load_arith_v41_docs(**_metadata):
    """``custom_dataset`` hook of the few-shot tasks (arith_v41_gen, arith_v41_mc)."""
    return _load(FEWSHOT_DATA_FILE)
