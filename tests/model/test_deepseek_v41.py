"""DeepSeek-V4.1 against golden checkpoints made by Hugging Face's upstream V4.1 modeling code.

``tests/fixtures/dev-v41-s0`` uses HF-V4.1 tensor names, ``dev-v41-s1-rel`` DeepSeek's released
names (another seed). Both: 8 layers, ratios [0,2,2,2,1,1,1,1], KV sources 1 and 4, index sources
1,3,4,6, candidate layer 4, window 8, engram at layers 1 and 5, FP8/FP4 fake-quant on; golden
values are HF's cached fp32 forward.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from model.v4_loader import load_v4_weights
from model.v41.config import V41Config
from model.v41.engram import (
    EngramHasher,
    build_compressed_token_map,
    engram_primes,
    hash_multipliers,
)
from model.v41.model import (
    DeepseekV41ForCausalLM,
    load_deepseek_v41,
    split_unused_weights,
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dir(name):
    return os.path.join(FIXTURES, name)


def _golden(name):
    with open(os.path.join(_dir(name), "golden.json")) as f:
        return json.load(f)


def _load(name: str) -> DeepseekV41ForCausalLM:
    model = load_deepseek_v41(_dir(name), torch.float32)  # HF-V4.1 or released names
    assert isinstance(model.config, V41Config)
    return model


_MODELS: dict = {}


def _model(name):
    if name not in _MODELS:
        _MODELS[name] = _load(name)
    return _MODELS[name]


def _greedy(model, prompt, n, eos_ids):
    state = model.new_state()
    logits = model(prompt, state)[-1]
    out, logprobs = [], []
    for i in range(n):
        masked = logits.clone()
        masked[eos_ids] = float("-inf")  # as min_tokens does; golden logprobs are of these scores
        tok = int(masked.argmax())
        out.append(tok)
        logprobs.append(float(torch.log_softmax(masked, -1)[tok]))
        if i + 1 < n:
            logits = model(torch.tensor([tok]), state)[-1]
    return out, logprobs


@pytest.mark.parametrize("name", ["dev-v41-s0", "dev-v41-s1-rel"])
def test_prompt_logprobs_and_greedy_match_hf(name):
    model, g = _model(name), _golden(name)
    ids = torch.tensor(g["prompt_ids"])
    logits = model(ids, model.new_state())
    lp = torch.log_softmax(logits, -1)
    ours = lp[:-1].gather(1, ids[1:, None])[:, 0]
    gold = torch.tensor(g["prompt_logprobs"])
    assert (ours - gold).abs().max().item() < 5e-5  # fp32 vs fp32: far inside the 2e-3 bound of the V4 golden
    top = lp[-1].topk(5)
    assert top.indices.tolist() == g["last_prompt_top5"]["ids"]
    torch.testing.assert_close(top.values, torch.tensor(g["last_prompt_top5"]["logprobs"]), atol=5e-5, rtol=0)

    greedy, greedy_lp = _greedy(model, ids, len(g["greedy_ids"]), model.config.eos_token_ids)
    assert greedy == g["greedy_ids"]
    torch.testing.assert_close(torch.tensor(greedy_lp), torch.tensor(g["greedy_logprobs"]), atol=5e-5, rtol=0)


@pytest.mark.parametrize("name", ["dev-v41-s0", "dev-v41-s1-rel"])
def test_checkpoint_loader_feeds_the_model(name):
    """The loader's dict of both name vocabularies into a fresh model's load_weights."""
    d, g = _dir(name), _golden(name)
    model = DeepseekV41ForCausalLM(_model(name).config, torch.float32)
    model.load_weights(load_v4_weights(d, model.state_dict()))
    model.bind_tokenizer(os.path.join(d, "tokenizer.json"))
    ids = torch.tensor(g["prompt_ids"])
    lp = torch.log_softmax(model(ids, model.new_state()), -1)[:-1].gather(1, ids[1:, None])[:, 0]
    assert (lp - torch.tensor(g["prompt_logprobs"])).abs().max().item() < 5e-5


def _chunked(model, ids, sizes):
    state, parts, start = model.new_state(), [], 0
    for size in sizes:
        parts.append(model(ids[start : start + size], state))
        start += size
    if start < len(ids):
        parts.append(model(ids[start:], state))
    assert state.num_tokens == len(ids)
    return torch.cat(parts)


def test_one_shot_equals_chunked_equals_token_by_token():
    model, g = _model("dev-v41-s0"), _golden("dev-v41-s0")
    ids = torch.tensor(g["prompt_ids"])
    one_shot = model(ids, model.new_state())
    # 5/7/9/rest, odd boundaries that split ratio-2 groups and candidate blocks, then one token at a time.
    for sizes in ((5, 7, 9), (1, 2, 3, 11), (13,), (1,) * len(ids)):
        diff = (_chunked(model, ids, sizes) - one_shot).abs().max().item()
        assert diff <= 1e-4, (sizes, diff)


def test_state_holds_windows_open_groups_and_shared_entries():
    model, g = _model("dev-v41-s0"), _golden("dev-v41-s0")
    ids = torch.tensor(g["prompt_ids"][:13])  # 13 tokens: layer 1 (ratio 2) has one token pending
    state = model.new_state()
    model(ids, state)
    cfg = model.config
    pools, units = state.lease.pools, state.lease.units
    assert set(units) == {"window", "src1.kv", "src1.gate", "src1.entries", "src1.keys", "src4.entries",
                          "src4.keys"}
    page = pools["src1.entries"].rows_per_unit
    assert len(units["src1.entries"]) == -(-6 // page) and len(units["src4.entries"]) == -(-13 // page)
    window = pools["window"].get(0, state.lease.rows("window", 13 - cfg.sliding_window, 13))
    assert window.shape == (cfg.sliding_window, cfg.head_dim) and torch.isfinite(window).all()
    pending = pools["src1.kv"].get(0, state.lease.rows("src1.kv", 12, 13))  # position 12 opens group 6
    assert pending.dtype == torch.float32 and torch.isfinite(pending).all()
    assert len(state.engram_history) == cfg.engram_max_ngram_size - 1
    snapshot = state.clone()
    a = model(torch.tensor([5]), state)
    b = model(torch.tensor([5]), snapshot)
    assert torch.equal(a, b)
    assert state.num_tokens == 14 and len(state.lease.units["src1.entries"]) == -(-7 // page)


def test_engram_hashing_state_matches_hf():
    d, g = _dir("dev-v41-s0"), _golden("dev-v41-s0")["engram"]
    cfg = _model("dev-v41-s0").config
    token_map, vocab = build_compressed_token_map(os.path.join(d, "tokenizer.json"))
    assert token_map == g["token_map"] and vocab == g["compressed_vocab_size"]
    assert engram_primes(cfg) == g["primes"]
    assert hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size, vocab).tolist() == g["multipliers"]
    hasher = EngramHasher(cfg, token_map)
    assert hasher.offsets.tolist() == g["offsets"]
    assert hasher.pad_id == g["pad_compressed_id"]
    ids = torch.tensor(_golden("dev-v41-s0")["prompt_ids"])
    one_shot, _ = hasher(ids, [])
    assert one_shot.tolist() == g["prompt_hash_ids"]
    history, parts = [], []
    for i in range(0, len(ids), 3):
        h, history = hasher(ids[i : i + 3], history)
        parts.append(h)
    assert torch.equal(torch.cat(parts), one_shot)


def test_engram_look_back_stops_at_dead_slots_and_the_start():
    """The chunk hasher's array look-back equals the per-position rule: ids at look-back
    0..N-1, pad from the first one that passes the start or a DEAD slot."""
    from model.v41.state import DEAD

    cfg = _model("dev-v41-s0").config
    hasher = EngramHasher(cfg, list(range(cfg.engram_compressed_vocab_size)))
    n = hasher.max_ngram
    g = torch.Generator().manual_seed(4)
    for history in ([], [DEAD], [5, DEAD, 7][-(n - 1):], [3, 9, 11][-(n - 1):]):
        ids = torch.randint(0, cfg.engram_compressed_vocab_size, (17,), generator=g)
        seq = history + ids.tolist()
        want = torch.full((len(ids), n), hasher.pad_id, dtype=torch.long)
        for i in range(len(ids)):
            for shift in range(n):
                j = len(history) + i - shift
                if j < 0 or seq[j] == DEAD:
                    break
                want[i, shift] = seq[j]
        got, tail = hasher(ids, history)
        assert torch.equal(got, hasher._hash(want))
        assert tail == seq[-(n - 1):]


def test_wrong_tokenizer_vocab_is_a_clear_error():
    cfg = _model("dev-v41-s0").config
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(cfg, list(range(10)))


def test_load_weights_skips_dspark_and_names_bad_tensors():
    model = _model("dev-v41-s0")
    tensors = load_file(os.path.join(_dir("dev-v41-s0"), "model.safetensors"))
    model.load_weights({**tensors, "mtp.0.ffn.gate.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"1 missing \(first: \['lm_head.weight'\]\)"):
        model.load_weights({k: v for k, v in tensors.items() if k != "lm_head.weight"})
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="tensor model.norm.weight: checkpoint shape"):
        model.load_weights(bad)


def test_dspark_and_vision_tensors_are_skipped(caplog):
    names = ["model.layers.0.attn.wq_a.weight", "mtp.0.ffn.gate.weight", "model.mtp.1.norm.weight",
             "vision.blocks.0.attn.qkv.weight", "aligner.proj.weight", "image_newline", "dspark.0.markov.weight",
             "lm_head.weight"]
    with caplog.at_level(logging.INFO, logger="model.v41.model"):
        keep, skip = split_unused_weights(names)
    assert keep == ["model.layers.0.attn.wq_a.weight", "lm_head.weight"]
    assert len(skip) == 6
    assert sum("skipping 6" in r.message for r in caplog.records) == 1


def test_state_rows_stay_in_the_pools():
    """A long chunk writes its rows into the request's units: the window ring keeps one unit,
    the entries take pages as they grow, and nothing else is kept per request."""
    model, g = _model("dev-v41-s0"), _golden("dev-v41-s0")
    state = model.new_state()
    model(torch.tensor(g["prompt_ids"][:21]), state)
    assert state.lease.units["window"] and len(state.lease.units["window"]) == 1
    assert sorted(vars(state)) == ["engram_history", "lease", "num_tokens"]
