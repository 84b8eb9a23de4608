"""The bundled arithmetic checkpoint (configs/arith) and its lm-eval tasks.

HF transformers on CPU is the oracle: the committed weights must load into
``DeepseekV3ForCausalLM`` and answer held-out sums; the tokenizer must round-trip through
both ``tokenizers`` and ``AutoTokenizer``; the task YAMLs must load offline.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(REPO, "configs", "arith")
TASK_DIR = os.path.join(REPO, "configs", "lm_eval_tasks")
sys.path.insert(0, os.path.join(REPO, "scripts"))

import arith_data  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def config() -> dict:
    with open(os.path.join(MODEL_DIR, "config.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 6.5 M-parameter model runs fastest on one thread
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    model.eval()
    yield model
    torch.set_num_threads(threads)


# ---- architecture -------------------------------------------------------------------------


def test_config_is_a_small_deepseek_v3_with_every_feature(config):
    assert config["model_type"] == "deepseek_v3"
    assert config["q_lora_rank"] and config["kv_lora_rank"]
    assert config["n_group"] >= 2 and 1 <= config["topk_group"] < config["n_group"]
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"
    assert config["n_shared_experts"] == 1
    assert config["first_k_dense_replace"] == 1 < config["num_hidden_layers"]
    assert config["rope_interleave"] is True
    assert config["num_nextn_predict_layers"] == 0


def test_yarn_is_spelled_both_ways_and_read_by_mlaserve(config):
    from model.config import load_model_config

    legacy, native = config["rope_scaling"], config["rope_parameters"]
    assert {k: v for k, v in legacy.items() if k != "type"} == {
        k: v for k, v in native.items() if k != "rope_theta"
    }
    assert native["rope_type"] == legacy["type"] == "yarn" and native["factor"] > 1
    assert native["rope_theta"] == config["rope_theta"]
    ours = load_model_config(MODEL_DIR)
    assert ours.rope_scaling.factor == native["factor"]
    assert ours.rope_scaling.mscale_all_dim == native["mscale_all_dim"]
    assert ours.softmax_scale > ours.qk_head_dim**-0.5  # mscale_all_dim is applied
    # the longest training sequence (BOS 999+999= 1998 \n EOS) stays inside the original window
    assert 15 < native["original_max_position_embeddings"] < config["max_position_embeddings"]


def test_hf_sees_the_same_architecture(hf_model, config):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    layers = hf_model.model.layers
    assert isinstance(layers[0].mlp, hf.DeepseekV3MLP)
    assert all(isinstance(layer.mlp, hf.DeepseekV3MoE) for layer in layers[1:])
    assert hf_model.config.rope_parameters["rope_type"] == "yarn"
    assert hf_model.model.rotary_emb.rope_type == "yarn"
    n = sum(p.numel() for p in hf_model.parameters())
    assert 5e6 < n < 8e6


def test_weights_use_deepseek_names_bf16_and_trained_router_bias(config):
    from safetensors import safe_open

    path = os.path.join(MODEL_DIR, "model.safetensors")
    assert os.path.getsize(path) < 16 * 2**20
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        biases = [f.get_tensor(k) for k in sorted(keys) if k.endswith("e_score_correction_bias")]
        dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
    for layer in range(1, config["num_hidden_layers"]):
        for e in range(config["n_routed_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in keys
    assert len(biases) == config["num_hidden_layers"] - config["first_k_dense_replace"]
    for b in biases:
        assert b.dtype == torch.float32
        assert b.min() == 0 and b.max() > 0  # balanced during training, shifted non-negative
    assert {d for k, d in dtypes.items() if not k.endswith("e_score_correction_bias")} == {"BF16"}


# ---- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_unknown_characters(tok):
    enc = tok.encode("12+30=")
    assert enc.tokens == [arith_data.BOS, "1", "2", "+", "3", "0", "="]
    assert tok.decode(enc.ids) == "12+30="
    assert tok.decode(enc.ids, skip_special_tokens=False) == arith_data.BOS + "12+30="
    assert tok.decode(tok.encode("1998\n", add_special_tokens=False).ids) == "1998\n"
    unk = tok.token_to_id(arith_data.UNK)
    assert tok.encode("1 x+2", add_special_tokens=False).ids[1:3] == [unk, unk]
    assert tok.get_vocab_size() == 16
    assert tok.token_to_id(arith_data.BOS) == 0 and tok.token_to_id(arith_data.EOS) == 1


def test_committed_tokenizer_is_what_the_script_builds(tok):
    assert json.loads(tok.to_str()) == json.loads(arith_data.build_tokenizer().to_str())
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f) == arith_data.tokenizer_config()


def test_auto_tokenizer_agrees_and_chat_template_renders_bos_content(tok, config):
    hf_tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    assert hf_tok("12+30=").input_ids == tok.encode("12+30=").ids
    assert hf_tok.decode(hf_tok("12+30=").input_ids, skip_special_tokens=True) == "12+30="
    assert hf_tok.bos_token_id == config["bos_token_id"]
    assert hf_tok.eos_token_id == config["eos_token_id"]
    assert hf_tok.model_max_length == config["max_position_embeddings"]
    text = hf_tok.apply_chat_template(
        [{"role": "user", "content": "12+30="}], tokenize=False, add_generation_prompt=True
    )
    assert text == arith_data.BOS + "12+30="
    with open(os.path.join(MODEL_DIR, "generation_config.json"), encoding="utf-8") as f:
        assert json.load(f)["eos_token_id"] == config["eos_token_id"]


# ---- accuracy -------------------------------------------------------------------------------


def test_held_out_pairs_are_never_sampled_for_training():
    import numpy as np

    pairs = arith_data.held_out_pairs()
    assert len(pairs) == len(set(pairs)) == 10310
    assert all(arith_data.is_held_out(a, b) for a, b in pairs[:100])
    a, b = arith_data.sample_training_pairs(np.random.default_rng(0), 20000)
    assert not arith_data.is_held_out(a, b).any()
    assert a.min() == 0 and a.max() == arith_data.MAX_OPERAND


def test_greedy_answers_on_held_out_pairs(hf_model, tok):
    pairs = arith_data.held_out_pairs(50)
    acc, failures = arith_data.greedy_exact_match(hf_model, tok, pairs)
    assert acc >= 0.9, failures
    acc_no_bos, failures = arith_data.greedy_exact_match(hf_model, tok, pairs, with_bos=False)
    assert acc_no_bos >= 0.9, failures


def test_the_demo_prompt(hf_model, tok):
    ids = torch.tensor([tok.encode("12+30=").ids])
    out = hf_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False) == (
        "42\n" + arith_data.EOS
    )


# ---- lm-eval tasks --------------------------------------------------------------------------


def test_task_data_is_reproducible_and_held_out():
    import make_arith_tasks

    with open(os.path.join(TASK_DIR, "arith_heldout.jsonl"), encoding="utf-8") as f:
        committed = [json.loads(line) for line in f]
    assert committed == make_arith_tasks.make_docs(200, 1234)
    for d in committed:
        assert arith_data.is_held_out(d["a"], d["b"])
        assert d["choices"][d["label"]] == d["answer"] == str(d["a"] + d["b"])
        assert len(set(d["choices"])) == len(d["choices"]) == 4
        for x in d["choices"]:
            assert not any(y != x and y.startswith(x) for y in d["choices"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_task_yamls_load_offline_with_lm_eval(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)  # the data path must not depend on the working directory
    tasks = TaskManager(include_path=TASK_DIR, include_defaults=False).load_task_or_group(
        ["arith_gen", "arith_mc"]
    )
    gen, mc = tasks["arith_gen"], tasks["arith_mc"]
    assert gen.OUTPUT_TYPE == "generate_until" and mc.OUTPUT_TYPE == "multiple_choice"
    doc = mc.test_docs()[0]
    assert len(mc.test_docs()) == len(gen.test_docs()) == 200
    assert gen.doc_to_text(doc) == f"{doc['a']}+{doc['b']}=" == mc.doc_to_text(doc)
    assert gen.config.generation_kwargs["until"] == ["\n"]
    mc.build_all_requests(limit=1, rank=0, world_size=1)
    continuations = [inst.arguments[1] for inst in mc.instances]
    assert continuations == doc["choices"]  # digits only, no delimiter in front
    assert mc.doc_to_target(doc) == doc["label"]
