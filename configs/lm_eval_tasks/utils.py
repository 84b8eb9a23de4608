"""Loads the arithmetic tasks' local jsonl (no download), wherever lm-eval is run from.

The file sits next to this module; regenerate it with ``scripts/make_arith_tasks.py``.
"""

import json
import os

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith_heldout.jsonl")


def load_arith_docs(**_metadata):
    """``custom_dataset`` hook: lm-eval passes the task metadata as keyword arguments."""
    import datasets

    with open(DATA_FILE, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
