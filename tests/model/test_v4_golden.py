"""Our DeepSeek-V4 reproduces the golden values HF transformers 5.24 recorded on a bundled
tiny checkpoint (tests/fixtures/dev-v4-s0: 6 layers sliding/CSA/HCA/CSA/HCA/CSA, 2 hash-routed
MoE layers). Needs no transformers.

The checkpoint keeps 5.24's ``save_pretrained`` names, a hybrid of DeepSeek's released names
under ``model.`` (``model.layers.N.attn.wq_a``, ``head.weight``, ``attn.norm`` for kv_norm);
``hf_names`` below maps them to the HF module names our model uses.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file

from model.config import load_model_config
from model.v4.model import DeepseekV4ForCausalLM

torch.set_num_threads(1)

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dev-v4-s0")

_TOP = {"head.weight": "lm_head.weight", "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_LAYER = [  # (pattern on the part after "layers.N.", replacement), first match wins
    (r"attn\.indexer\.compressor\.(wkv|wgate|ape|norm)", lambda m: "self_attn.compressor.indexer." + _C[m[1]]),
    (r"attn\.indexer\.wq_b", "self_attn.compressor.indexer.q_b_proj"),
    (r"attn\.indexer\.weights_proj", "self_attn.compressor.indexer.scorer.weights_proj"),
    (r"attn\.compressor\.(wkv|wgate|ape|norm)", lambda m: "self_attn.compressor." + _C[m[1]]),
    (r"attn\.(wq_a|q_norm|wq_b|wkv|norm|kv_norm|wo_a|wo_b|attn_sink)",
     lambda m: "self_attn." + {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
                               "norm": "kv_norm", "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj",
                               "attn_sink": "sinks"}[m[1]]),
    (r"attn_norm", "input_layernorm"), (r"ffn_norm", "post_attention_layernorm"),
    (r"hc_(attn|ffn)_(fn|base|scale)", lambda m: f"{m[1]}_hc.{m[2]}"),
    (r"ffn\.gate\.bias", "mlp.gate.e_score_correction_bias"), (r"ffn\.gate\.", "mlp.gate."),
    (r"ffn\.shared_experts\.(w1|w2|w3)", lambda m: "mlp.shared_experts." + {"w1": "gate_proj", "w2": "down_proj",
                                                                             "w3": "up_proj"}[m[1]]),
]
_C = {"wkv": "kv_proj", "wgate": "gate_proj", "ape": "position_bias", "norm": "kv_norm"}


def hf_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Released/hybrid V4 names → HF module names; routed experts stacked into gate_up/down."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if name in _TOP.values():  # already an HF name (embed_tokens, norm, hc_head)
            out[name] = t
            continue
        key = name.removeprefix("model.")
        if key in _TOP:
            out[_TOP[key]] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", key)
        assert m, f"unexpected tensor {name}"
        layer, rest = int(m[1]), m[2]
        e = re.fullmatch(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight", rest)
        if e:
            experts[(layer, int(e[1]), e[2])] = t
            continue
        for pattern, repl in _LAYER:
            new, n = re.subn(r"^" + pattern, repl, rest)
            if n:
                out[f"model.layers.{layer}.{new}"] = t
                break
        else:
            raise AssertionError(f"unmapped tensor {name}")
    for layer in sorted({k[0] for k in experts}):
        n_exp = 1 + max(k[1] for k in experts if k[0] == layer)
        gate_up = [torch.cat([experts[(layer, i, "w1")], experts[(layer, i, "w3")]]) for i in range(n_exp)]
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([experts[(layer, i, "w2")]
                                                                          for i in range(n_exp)])
    return out


def load_fixture():
    config = load_model_config(FIXTURE)
    model = DeepseekV4ForCausalLM(config)
    model.load_weights(hf_names(load_file(os.path.join(FIXTURE, "model.safetensors"))).items())
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
