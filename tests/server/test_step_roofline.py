"""The step cost model behind the step profile's roofline lines (server.step_roofline): its FLOPs
and bytes against counts taken from a built model's parameters and from brute-force attention
masks, and the profile's roofline lines on the bundled model."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_config_dict
from model.config import parse_model_config
from model.deepseek import DeepseekForCausalLM
from server import LLM, SamplingParams
from server.step_profile import StepProfiler, format_summary
from server.step_roofline import Ceilings, MLAStepCostModel, StepCost, expected_distinct_experts, mla_step_costs


def _params_by_role(model) -> dict[str, float]:
    """A built model's per-token linear parameters, sorted by who reads them."""
    c = model.config
    roles = dict.fromkeys(("attention", "kv_b", "dense_mlp", "shared", "router", "one_expert", "lm_head"), 0.0)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "embed_tokens" in name or "e_score_correction_bias" in name:
            continue
        if "kv_b_proj" in name:
            roles["kv_b"] += p.numel()
        elif "self_attn" in name:
            roles["attention"] += p.numel()
        elif ".experts." in name:
            roles["one_expert"] += p.numel() / c.n_routed_experts
        elif "shared_experts" in name:
            roles["shared"] += p.numel()
        elif "gate_weight" in name:
            roles["router"] += p.numel()
        elif name.startswith("lm_head"):
            roles["lm_head"] += p.numel()
        elif ".mlp." in name:
            roles["dense_mlp"] += p.numel()
        else:
            raise AssertionError(f"unclassified parameter {name}")
    return roles


def _causal_pairs(context: int, new: int) -> int:
    """(query, key) pairs a chunk of ``new`` tokens after ``context`` cached ones attends: brute force."""
    q = torch.arange(context, context + new)[:, None]
    k = torch.arange(context + new)[None, :]
    return int((k <= q).sum())


@pytest.mark.parametrize("preset", ["tiny-v3", "tiny-v2"])
def test_flops_match_the_built_models_parameters_and_masks(preset):
    c = parse_model_config(load_config_dict(preset))
    model = DeepseekForCausalLM(c)
    roles = _params_by_role(model)
    costs = MLAStepCostModel(c, fp8_weights=False)
    # Two decode rows (contexts 7 and 30), then chunks 5:11 (cached:new) and 0:9; 3 logit rows.
    ctx, new = [7, 30, 5, 0], [1, 1, 11, 9]
    cost = costs.cost(ctx, new, num_decodes=2, num_logit_rows=3)
    rows, prefix = sum(new), 5
    k = c.num_experts_per_tok
    per_token = roles["attention"] + roles["dense_mlp"] + roles["shared"] + k * roles["one_expert"]
    quantized = 2 * (rows * per_token + (prefix + 20) * roles["kv_b"])
    h, lat = c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim
    decode = (8 + 31) * (lat + c.kv_lora_rank)  # scores over the latent, values over kv_c
    prefill = (_causal_pairs(5, 11) + _causal_pairs(0, 9)) * (c.qk_head_dim + c.v_head_dim)
    absorbed = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
    rest = 2 * (c.num_hidden_layers * h * prefill + 2 * absorbed + rows * roles["router"] + 3 * roles["lm_head"])
    decode_attention = 2 * c.num_hidden_layers * h * decode
    assert cost.fp8_flops == 0 and cost.bf16_flops == pytest.approx(quantized + rest + decode_attention)
    # An FP8 checkpoint's linears and decode attention over an FP8 cache run at the FP8 rate.
    fp8 = MLAStepCostModel(c, fp8_weights=True, kv_bytes_per_value=1.0).cost(ctx, new, 2, 3)
    assert fp8.fp8_flops == pytest.approx(quantized + decode_attention) and fp8.bf16_flops == pytest.approx(rest)


def test_bytes_count_touched_weights_and_cache_rows():
    c = parse_model_config(load_config_dict("tiny-v3"))
    roles = _params_by_role(DeepseekForCausalLM(c))
    fp8_kv = MLAStepCostModel(c, fp8_weights=False, weight_bytes=2, kv_bytes_per_value=1.0)
    cost = fp8_kv.cost([100, 200], [1, 1], num_decodes=2, num_logit_rows=2)
    lat, layers = c.kv_lora_rank + c.qk_rope_head_dim, c.num_hidden_layers
    assert cost.kv_bytes == pytest.approx(layers * lat * (101 + 201 + 2))  # read the contexts, write 2 rows
    hit = expected_distinct_experts(c.n_routed_experts, c.num_experts_per_tok, 2)
    absorbed = layers * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
    experts = hit * roles["one_expert"]  # one_expert: one expert of every MoE layer
    want = 2 * (roles["attention"] + roles["dense_mlp"] + roles["shared"] + roles["router"] + experts
                + roles["lm_head"]) + 2 * absorbed  # decode steps read W_UK / W_UV, not kv_b_proj
    assert cost.weight_bytes == pytest.approx(want)
    # FP8 weights: one byte per linear parameter; router, LM head and W_UK / W_UV stay bf16.
    got = MLAStepCostModel(c, fp8_weights=True, kv_bytes_per_value=1.0).cost([100, 200], [1, 1], 2, 2)
    bf16 = 2 * (roles["router"] + roles["lm_head"] + absorbed)
    assert got.weight_bytes == pytest.approx((want - bf16) / 2 + bf16)
    assert got.kv_bytes == cost.kv_bytes and got.flops == pytest.approx(cost.flops)
    # A prefill chunk reads kv_b_proj and its prefix's cache rows, and writes its own.
    chunk = fp8_kv.cost([40], [10], num_decodes=0, num_logit_rows=1)
    assert chunk.kv_bytes == pytest.approx(layers * lat * (40 + 10))


def test_tensor_parallel_divides_the_sharded_parts():
    c = parse_model_config(load_config_dict("tiny-v3"))
    one, two = MLAStepCostModel(c, fp8_weights=False), MLAStepCostModel(c, fp8_weights=False, tp_size=2)
    step = ([0], [64], 0, 1)
    a, b = one.cost(*step), two.cost(*step)
    b_attention = MLAStepCostModel(c, fp8_weights=True, tp_size=2).cost(*step)  # linears out of the bf16 sum
    a_attention = MLAStepCostModel(c, fp8_weights=True).cost(*step)
    router = 2 * 64 * c.hidden_size * c.n_routed_experts * (c.num_hidden_layers - c.first_k_dense_replace)
    # heads and LM head split, not the router
    assert b_attention.bf16_flops == pytest.approx((a_attention.bf16_flops - router) / 2 + router)
    assert a.bf16_flops / 2 < b.bf16_flops < a.bf16_flops  # q_a, kv_a and the router are replicated


def test_roofline_seconds_use_each_buckets_rate():
    c = parse_model_config(load_config_dict("tiny-v3"))
    cost = StepCost(fp8_flops=4e12, bf16_flops=1e12, weight_bytes=3e9, kv_bytes=1e9)
    ceil = Ceilings(bf16_flops=1e15, fp8_flops=2e15, hbm_bytes=4e12)
    assert MLAStepCostModel(c, fp8_weights=False).roofline_s(cost, ceil) == pytest.approx((3e-3, 1e-3))


def test_profile_prints_each_kinds_roofline(monkeypatch):
    """On the bundled model, with rates given (a CPU has none to measure): each kind's roofline ms
    per step is its steps' summed cost at those rates, and the table prints it."""
    monkeypatch.setenv("MLASERVE_STEP_PROFILE", "1")
    llm = LLM(device="cpu", max_num_batched_tokens=32, max_num_seqs=4, block_size=16)
    runner = llm.engine.runner
    prof = runner.step_profiler
    assert isinstance(prof.cost_model, MLAStepCostModel) and prof.ceilings is None
    prof.ceilings = Ceilings(bf16_flops=1e12, fp8_flops=2e12, hbm_bytes=1e11)
    prompts = [[3] * n for n in (20, 37, 9)]
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True))
    s = prof.summary()
    for name, kind in s["kinds"].items():
        recs = [r for r in prof.records if r.kind == name]
        total = recs[0].cost
        for r in recs[1:]:
            total = total + r.cost
        compute, nbytes = prof.cost_model.roofline_s(total, prof.ceilings)
        assert kind["roofline_ms"]["compute"] == pytest.approx(1e3 * compute / len(recs))
        assert kind["roofline_ms"]["bytes"] == pytest.approx(1e3 * nbytes / len(recs))
    text = format_summary(s)
    assert text.count("  roofline: compute") == len(s["kinds"]) and "ceilings (measured)" in text


def test_no_roofline_without_rates_or_cost_model():
    prof = StepProfiler(enabled=True, device=torch.device("cpu"))
    rec = prof.begin()
    rec.kind, rec.num_seqs, rec.num_tokens = "prefill", 1, 8
    prof.end_runner_step(rec, "sample")
    s = prof.summary()
    assert "roofline_ms" not in s["kinds"]["prefill"] and "ceilings" not in s
    assert "roofline" not in format_summary(s)
    assert mla_step_costs(torch.nn.Linear(2, 2), None) is None  # not a DeepSeek MLA model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ceilings_are_a_hopper_s_rates():
    from server.step_roofline import measure_ceilings

    c = measure_ceilings(torch.device("cuda"))
    assert 200e12 < c.bf16_flops < 1.2e15 and c.bf16_flops < c.fp8_flops < 2.4e15
    assert 1e12 < c.hbm_bytes < 6e12


def test_workload_plan_computes_every_token_once_within_the_limits():
    from benchmarks.workload_roofline import plan_steps

    steps = list(plan_steps(num_prompts=7, input_len=50, output_len=4, max_num_seqs=3, budget=64))
    prompt_tokens = sum(sum(new[nd:]) for _, new, nd, _ in steps)
    decode_rows = sum(nd for _, _, nd, _ in steps)
    assert prompt_tokens == 7 * 50 and decode_rows == 7 * 3  # the first token comes from the prefill
    assert all(sum(new) <= 64 and len(new) <= 3 for _, new, _, _ in steps)
    assert sum(rows for *_, rows in steps) == 7 * 4  # one logit row per sampled token
    for ctx, new, nd, _ in steps:
        assert all(50 <= c < 54 for c in ctx[:nd]) and all(c + n <= 50 for c, n in zip(ctx[nd:], new[nd:]))


def test_workload_roofline_sums_its_steps():
    from benchmarks.workload_roofline import plan_steps, workload_roofline

    c = parse_model_config(load_config_dict("tiny-v2"))
    costs = MLAStepCostModel(c, fp8_weights=False, kv_bytes_per_value=1.0)
    ceil = Ceilings(bf16_flops=1e12, fp8_flops=2e12, hbm_bytes=1e11)
    r = workload_roofline(costs, ceil, 5, 40, 6, max_num_seqs=4, budget=48)
    per_step = [costs.roofline_s(costs.cost(*s), ceil) for s in plan_steps(5, 40, 6, 4, 48)]
    assert r.seconds == pytest.approx(sum(max(s) for s in per_step)) and r.steps == len(per_step)
    assert r.seconds == pytest.approx(r.compute_bound_s + r.bytes_bound_s)
