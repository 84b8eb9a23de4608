"""FP8 checkpoints on the GPU: weights kept as FP8 + block scales (FP8 GEMMs) give the logits
of the same checkpoint dequantized to bf16, and the engine serves it with decode graphs."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_config_dict, write_random_checkpoint

pytestmark = pytest.mark.gpu


def _r1_like() -> dict:
    """R1's layout (q_lora, 128-aligned dims, FP8 blocks, noaux_tc groups), scaled down."""
    return dict(load_config_dict("deepseek-r1"), vocab_size=4096, hidden_size=1024, intermediate_size=2048,
                moe_intermediate_size=256, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=8,
                num_key_value_heads=8, q_lora_rank=256, n_routed_experts=16, n_group=4, topk_group=2,
                num_experts_per_tok=4, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return write_random_checkpoint(_r1_like(), str(tmp_path_factory.mktemp("fp8gpu") / "r1ish"), fp8=True, seed=6)


def test_kept_fp8_weights_match_dequantized(fp8_ckpt):
    from model.loader import load_model

    kept = load_model(fp8_ckpt, dtype="bfloat16", device="cuda", progress=False)
    assert kept.layers[1].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn  # FP8 GEMM path
    deq = load_model(fp8_ckpt, dtype="bfloat16", device="cuda", keep_fp8=False, progress=False)
    ids = torch.randint(0, 4096, (40,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        a = torch.log_softmax(kept.compute_logits(kept(ids, torch.arange(40, device="cuda"))), -1)
        b = torch.log_softmax(deq.compute_logits(deq(ids, torch.arange(40, device="cuda"))), -1)
    kl = (b.exp() * (b - a)).sum(-1)
    # FP8 activations (1x128 groups, ~2.5 % per GEMM) are the only difference. A random model's
    # near-flat logits make argmax agreement meaningless here; KL is the measure.
    assert torch.isfinite(a).all() and kl.mean().item() < 0.05
    print(f"mean KL kept-FP8 vs dequantized: {kl.mean().item():.4f}")


def test_engine_serves_fp8_checkpoint_with_fp8_kv_and_graphs(fp8_ckpt):
    from server import LLM, SamplingParams

    llm = LLM(fp8_ckpt, device="cuda", kv_cache_dtype="fp8", max_model_len=1024, max_num_seqs=8,
              max_cudagraph_capture_size=8, num_gpu_blocks_override=128)
    # auto: our CUDA C++ kernel on Hopper when nvcc can build it, else Triton; both graph-safe
    assert llm.engine.runner.decode_graphs is not None and llm.engine.runner.decode_backend.name in ("cuda", "triton")
    outs = llm.generate(prompt_token_ids=[[5, 6, 7, 8], [9, 10]],
                        sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert llm.engine.stats()["num_free_blocks"] == 128
