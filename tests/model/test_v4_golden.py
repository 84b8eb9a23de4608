"""Our DeepSeek-V4 reproduces the golden values HF transformers 5.24 recorded on a bundled
tiny checkpoint (tests/fixtures/dev-v4-s0: 6 layers sliding/CSA/HCA/CSA/HCA/CSA, 2 hash-routed
MoE layers). Needs no transformers.

The checkpoint keeps 5.24's ``save_pretrained`` names, a hybrid of DeepSeek's released names
under ``model.`` (``model.layers.N.attn.wq_a``, ``head.weight``, ``attn.norm`` for kv_norm);
:func:`model.v4.model.load_deepseek_v4` reads them through the V4 loader.
"""

from __future__ import annotations

import json
import os

import torch

from model.v4.model import load_deepseek_v4

torch.set_num_threads(1)

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dev-v4-s0")

def load_fixture():
    model = load_deepseek_v4(FIXTURE, torch.float32)
    with open(os.path.join(FIXTURE, "golden.json"), encoding="utf-8") as f:
        return model, json.load(f)


def test_golden_prompt_logprobs_and_greedy():
    model, golden = load_fixture()
    ids = torch.tensor(golden["prompt_ids"])
    eos = model.config.eos_token_ids
    with torch.no_grad():
        state = model.new_state()
        logprobs = torch.log_softmax(model.compute_logits(model(ids, state)), dim=-1)
        got = logprobs[:-1].gather(1, ids[1:, None])[:, 0]
        ref = torch.tensor(golden["prompt_logprobs"])
        assert (got - ref).abs().max().item() < 2e-3
        logits, greedy = logprobs[-1:], []
        for _ in range(len(golden["greedy_ids"])):
            logits[:, eos] = float("-inf")  # the golden run masks EOS, as min_tokens does
            nxt = logits.argmax(-1)
            greedy.append(int(nxt))
            logits = model.compute_logits(model(nxt, state))
    assert greedy == golden["greedy_ids"]


def test_golden_chunked_prefill_matches_one_shot():
    model, golden = load_fixture()
    ids = torch.tensor(golden["prompt_ids"])
    with torch.no_grad():
        one = model.compute_logits(model(ids, model.new_state()))
        state, rows, start = model.new_state(), [], 0
        for n in (5, 7, 9, len(ids) - 21):
            rows.append(model.compute_logits(model(ids[start:start + n], state)))
            start += n
    assert (torch.cat(rows) - one).abs().max().item() <= 1e-4
