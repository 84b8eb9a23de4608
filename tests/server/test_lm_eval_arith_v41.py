"""lm-eval ``local-completions`` against the bundled DeepSeek-V4.1 adder (``configs/arith-v41``).

The tasks (``arith_v41_gen``: greedy generation, exact match; ``arith_v41_mc``: the true sum
among near misses by log-likelihood, through ``echo`` + ``logprobs``) put 3-5 solved sums before
each question, so every prompt runs past the model's 16-token sliding window and the answer
depends on the compressed entries and the indexer. Scored with text prompts and with token ids
(``tokenized_requests`` False and True): both must reach 0.95, and give the same scores.
"""

from __future__ import annotations

import os

import pytest

from tests.server.live_server import ROOT, live_server
from tests.server.test_lm_eval_parity import run_lm_eval_both_modes, served_model_name

MODEL_DIR = os.path.join(ROOT, "configs", "arith-v41")
TASKS = {"arith_v41_gen": "exact_match,none", "arith_v41_mc": "acc,none"}
LIMIT = 64  # docs per task (of 200): keeps the two runs near 40 s on 2 cores
MIN_ACCURACY = 0.95

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isfile(os.path.join(MODEL_DIR, "model.safetensors")),
                       reason="configs/arith-v41 has no trained weights"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with live_server(MODEL_DIR, "--device", "cpu", "--disable-log-stats") as base_url:
        name = served_model_name(base_url)
        return run_lm_eval_both_modes("auto", name, base_url,
                                      lambda tok: str(tmp_path_factory.mktemp(f"v41_tok{int(tok)}")), TASKS, LIMIT)


@pytest.mark.parametrize("tokenized_requests", (False, True))
def test_arith_v41_scores_at_least_0_95(runs, tokenized_requests):
    run = runs[tokenized_requests]
    assert run.n_samples == {task: LIMIT for task in TASKS}, run.n_samples
    for task, score in run.scores.items():
        assert score >= MIN_ACCURACY, f"{task}, tokenized_requests={tokenized_requests}: {score}\n{run.table}"


def test_text_and_token_id_prompts_score_the_same(runs):
    assert runs[False].scores == runs[True].scores, (runs[False].table, runs[True].table)
