"""The bundled V4.1 arithmetic checkpoint (configs/arith-v41) and its few-shot lm-eval tasks.

The task files are checked always; the accuracy tests run once the trained checkpoint is
committed (``scripts/train_arith_v41.py --out configs/arith-v41``) and skip until then.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(REPO, "configs", "arith-v41")
TASK_DIR = os.path.join(REPO, "configs", "lm_eval_tasks")
WINDOW = 16
sys.path.insert(0, os.path.join(REPO, "scripts"))

import arith_data  # noqa: E402

needs_checkpoint = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MODEL_DIR, "model.safetensors")),
    reason="configs/arith-v41 is not trained yet (scripts/train_arith_v41.py --out configs/arith-v41)")


def _docs() -> list[dict]:
    with open(os.path.join(TASK_DIR, "arith_v41_heldout.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_fewshot_task_data_is_reproducible_held_out_and_longer_than_the_window():
    import make_arith_tasks

    committed = _docs()
    rows = [([(1, 2), (30, 45)], 999, 999), ([], 7, 0)]
    tok = arith_data.build_tokenizer()
    ids, labels = arith_data.encode_fewshot_batch(tok, rows, [False, True], 40)
    assert ids[0, :21].tolist() == tok.encode("1+2=3\n30+45=75\n999+999=1998\n").ids[:21]
    assert ids[1, :7].tolist() == tok.encode("7+0=7\n", add_special_tokens=False).ids + [1]
    answers = tok.encode("3\n75\n1998\n", add_special_tokens=False).ids + [1]
    assert [t for t in labels[0].tolist() if t != -100] == answers
    assert committed == make_arith_tasks.make_fewshot_docs(200, 1234)
    for d in committed:
        assert arith_data.is_held_out(d["a"], d["b"])
        assert d["prompt"] == d["preamble"] + f"{d['a']}+{d['b']}="
        assert d["choices"][d["label"]] == d["answer"] == str(d["a"] + d["b"])
        assert len(tok.encode(d["prompt"]).ids) > 2 * WINDOW
        for line in d["preamble"].splitlines():  # earlier sums: solved, training pairs
            x, rest = line.split("+")
            y, total = rest.split("=")
            assert int(x) + int(y) == int(total) and not arith_data.is_held_out(int(x), int(y))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fewshot_task_yamls_load_offline_with_lm_eval(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)
    tasks = TaskManager(include_path=TASK_DIR, include_defaults=False).load_task_or_group(
        ["arith_v41_gen", "arith_v41_mc"])
    gen, mc = tasks["arith_v41_gen"], tasks["arith_v41_mc"]
    assert gen.OUTPUT_TYPE == "generate_until" and mc.OUTPUT_TYPE == "multiple_choice"
    doc = mc.test_docs()[0]
    assert len(mc.test_docs()) == len(gen.test_docs()) == 200
    assert gen.doc_to_text(doc) == doc["prompt"] == mc.doc_to_text(doc)
    mc.build_all_requests(limit=1, rank=0, world_size=1)
    assert [inst.arguments[1] for inst in mc.instances] == doc["choices"]


@pytest.fixture(scope="module")
def model():
    from eval_arith_v41 import load

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load(MODEL_DIR)
    torch.set_num_threads(n)


@needs_checkpoint
def test_the_demo_prompt_through_prefill_and_decode(model):
    from eval_arith_v41 import greedy_text

    assert greedy_text(*model, "123+456=") == "579\n" + arith_data.EOS
    assert greedy_text(*model, "12+30=42\n7+5=12\n999+1=1000\n123+456=") == "579\n" + arith_data.EOS


@needs_checkpoint
def test_held_out_sums_bare_and_behind_a_preamble(model):
    from eval_arith_v41 import sequence_logits

    net, tok = model
    bare = [([], a, b) for a, b in arith_data.held_out_pairs(50)]
    acc, failures = arith_data.greedy_exact_match_logits(sequence_logits(net), tok, bare)
    assert acc >= 0.9, failures
    fewshot = arith_data.held_out_fewshot_rows(50)
    acc, failures = arith_data.greedy_exact_match_logits(sequence_logits(net), tok, fewshot)
    assert acc >= 0.9, failures


@needs_checkpoint
def test_the_lm_eval_docs(model):
    from eval_arith_v41 import _shots, multiple_choice_accuracy, sequence_logits

    net, tok = model
    docs = _docs()[:50]
    rows = [(_shots(d["preamble"]), d["a"], d["b"]) for d in docs]
    acc, failures = arith_data.greedy_exact_match_logits(sequence_logits(net), tok, rows)
    assert acc >= 0.9, failures
    assert multiple_choice_accuracy(net, tok, docs) >= 0.9
