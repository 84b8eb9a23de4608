"""Tiny random HF transformers DeepseekV4ForCausalLM models (the oracle) for the V4 tests.

Parameters HF initialises to zeros or ones (sinks, position_bias, router bias, mHC base and
scale, norm weights, tid2eid) are randomised, because those values hide bugs.
"""

from __future__ import annotations

import torch

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention", "heavily_compressed_attention"]
MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe"]
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


def tiny_hf_config(**overrides):
    from transformers import DeepseekV4Config

    kw = {
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": len(LAYER_TYPES), "num_attention_heads": 4,
        "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "index_n_heads": 8,
        "index_head_dim": 16, "index_topk": 3, "sliding_window": 8, "layer_types": list(LAYER_TYPES),
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": list(MLP_TYPES), "rope_parameters": dict(YARN), "max_position_embeddings": 1024,
        "num_nextn_predict_layers": 0, "swiglu_limit": 0.5,
    }
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def randomize_(model, seed: int, n_experts: int = 4) -> None:
    """Give every zero/one-initialised V4 parameter and buffer random values, in place."""
    g = torch.Generator().manual_seed(seed)
    n_experts = model.config.n_routed_experts if hasattr(model, "config") else n_experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".sinks", ".position_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith((".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                k = b.shape[1]
                b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.3)
        if hasattr(model, "lm_head"):
            model.lm_head.weight.mul_(10.0)


def build_hf_v4(seed: int = 0, **overrides):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_hf_config(**overrides)).float().eval()
    randomize_(model, seed + 1)
    return model
