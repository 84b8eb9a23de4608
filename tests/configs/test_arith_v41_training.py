"""``scripts/train_arith_v41.py`` on a very small V4.1 config: the loss falls, and the exported
checkpoint reads back through the serving loader as the model that was trained."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import arith_data  # noqa: E402
import train_arith_v41  # noqa: E402


def _small_config() -> dict:
    """configs/arith-v41.json, narrower and shallower; every V4.1 feature stays on."""
    from model.v4_checkpoint import engram_table_rows

    cfg = train_arith_v41.load_config(train_arith_v41.DEFAULT_CONFIG)
    t = cfg["text_config"]
    t.update({
        "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 2, "head_dim": 32,
        "q_lora_rank": 32, "o_lora_rank": 16, "moe_intermediate_size": 32, "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 1, 1], "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 2, 3],
        "candidate_source_layer_id": 3, "index_topk": 4, "candidate_topk_blocks": 2,
        "engram_layer_ids": [1], "engram_vocab_size": 31, "hc_sinkhorn_iters": 5,
    })
    t["engram_num_embeddings"] = engram_table_rows(31, 1, t["engram_n_heads"], t["engram_max_ngram_size"])
    return cfg


def test_the_committed_config_has_every_v41_feature():
    from model.config import parse_model_config
    from model.v41.engram import build_compressed_token_map

    c = parse_model_config(train_arith_v41.load_config(train_arith_v41.DEFAULT_CONFIG))
    ratios = c.compress_ratios
    assert {ratios[s] for s in c.kv_source_layer_ids} == {1, 2}
    assert any(i not in c.kv_source_layer_ids for i in c.index_source_layer_ids)  # re-indexing
    assert any(ratios[i] and c.index_source_of(i) != i for i in range(len(ratios)))  # top-k reuse
    assert c.candidate_source_layer_id in c.index_source_layer_ids
    assert c.engram_layer_ids and c.hc_mult == 4 and c.o_groups == 2
    assert c.sliding_window == 16 < arith_data.fewshot_max_tokens(2)
    assert c.head_dim % 32 == 0 and c.index_head_dim == 32 and c.index_n_heads >= 8
    tokenizer = os.path.join(REPO, "configs", "arith", "tokenizer.json")
    assert build_compressed_token_map(tokenizer)[1] == c.engram_compressed_vocab_size


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("one_thread")
def test_a_few_steps_lower_the_loss_and_the_checkpoint_reloads(tmp_path):
    from model.v4_family import load_v4_family
    from model.v41.training import forward_sequences

    config_path = tmp_path / "small.json"
    config_path.write_text(json.dumps(_small_config()))
    out = tmp_path / "ckpt"
    model, log = train_arith_v41.run([
        "--config", str(config_path), "--device", "cpu", "--out", str(out), "--steps", "40",
        "--batch-size", "16", "--max-shots", "2", "--lr", "3e-3", "--warmup", "5", "--log-every", "1",
        "--eval-every", "1000", "--eval-n", "4", "--final-eval-n", "4",
    ])
    losses = [loss for _, loss in log["loss_curve"]]
    assert len(losses) == 40 and log["steps"] == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "train_log.json"):
        assert (out / name).is_file(), name

    reloaded = load_v4_family(str(out), torch.float32)
    tok = arith_data.build_tokenizer()
    rows = arith_data.held_out_fewshot_rows(3, 2, 2)
    ids, _ = arith_data.encode_fewshot_batch(tok, rows)
    assert ids.shape[1] > 16  # past the window: compressed entries and the indexer take part
    with torch.no_grad():
        assert torch.equal(forward_sequences(reloaded, ids).logits, forward_sequences(model, ids).logits)
        one = tok.encode(arith_data.fewshot_text(*rows[0])).ids
        prefill = reloaded(torch.tensor(one), reloaded.new_state())
        assert (prefill - forward_sequences(model, torch.tensor([one])).logits[0]).abs().max() <= 1e-5
    assert log["final"]["reload_max_logit_diff"] == 0.0
    assert set(log["final"]) >= {"heldout_exact_match", "heldout_exact_match_fewshot", "demo"}
