"""One entry for DeepSeek-V4-family checkpoint directories: ``config.json``'s ``model_type``
picks :func:`model.v4.model.load_deepseek_v4` or :func:`model.v41.model.load_deepseek_v41`;
:func:`random_v4_family` builds either with random weights (``--load-format dummy``)."""

from __future__ import annotations

import logging
import os

import torch

from model.config import V41_MODEL_TYPES
from model.loader import CheckpointError
from model.parallel import ParallelContext
from model.v4.model import DeepseekV4ForCausalLM, load_deepseek_v4
from model.v4_loader import read_config_json, read_v4_config
from model.v4_random import init_random_weights, initializer_std
from model.v41.engram import build_compressed_token_map
from model.v41.fp8_linear import MXFP8_WEIGHT_BLOCK, check_dequantized_linears, choose_mxfp8_linears
from model.v41.model import DeepseekV41ForCausalLM, choose_stacked_mxfp4, load_deepseek_v41

logger = logging.getLogger(__name__)

V4_FAMILY_MODEL_TYPES = ("deepseek_v4", *V41_MODEL_TYPES)


def load_v4_family(checkpoint_dir: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                   par: ParallelContext | None = None, mxfp4_experts: bool = True, linear_backend: str = "auto",
                   ) -> DeepseekV4ForCausalLM | DeepseekV41ForCausalLM:
    """The V4 or V4.1 model of ``checkpoint_dir``, weights loaded (and, for V4.1, the tokenizer
    bound); ``par``: this rank's shard under TP / DP / EP; ``mxfp4_experts``: V4.1's MXFP4
    routed experts stay stacked MXFP4 (False: dequantized); ``linear_backend``: V4.1's FP8
    linears as MXFP8 or dequantized (``--linear-backend``, model/v41/fp8_linear.py; V4 takes
    ``auto`` or ``dequantized``: its 128×128 blocks are dequantized). Both take one request's next tokens
    and a ``new_state()``; V4's forward returns hidden states (``compute_logits`` makes logits),
    V4.1's returns float32 logits."""
    model_type = read_config_json(checkpoint_dir).get("model_type")
    if model_type == "deepseek_v4":
        check_dequantized_linears(linear_backend, "DeepSeek-V4")
        return load_deepseek_v4(checkpoint_dir, dtype, device, par)
    if model_type in V41_MODEL_TYPES:
        return load_deepseek_v41(checkpoint_dir, dtype, device, par, mxfp4_experts, linear_backend)
    raise CheckpointError(f"{checkpoint_dir!r} holds model_type {model_type!r}, not one of the "
                          f"DeepSeek-V4 family ({', '.join(V4_FAMILY_MODEL_TYPES)})")


def random_v4_family(checkpoint_dir: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     seed: int = 0, par: ParallelContext | None = None, mxfp4_experts: bool = True,
                     linear_backend: str = "auto") -> DeepseekV4ForCausalLM | DeepseekV41ForCausalLM:
    """The model ``config.json`` describes (this rank's shard under ``par``), built on ``device``
    with random weights (model/v4_random.py; the same ``seed`` gives the same weights, and the
    ranks of a group the same replicated tensors); no weight files are read. A V4.1 config
    with ``expert_dtype: fp4`` gets stacked MXFP4 experts (random codes and scales, made on
    the device) unless ``mxfp4_experts`` is False, and one with FP8 32×32 blocks
    (``quantization_config``) random e4m3 + UE8M0 linears where ``linear_backend`` picks MXFP8.

    V4.1's engram hasher takes the directory's ``tokenizer.json`` when its compressed vocabulary
    has the config's size, else the synthetic ``id mod engram_compressed_vocab_size`` map (one
    log line): hashing costs the same, and the weights mean nothing either way."""
    config = read_v4_config(checkpoint_dir, V4_FAMILY_MODEL_TYPES)
    if config.model_type == "deepseek_v4":
        check_dequantized_linears(linear_backend, "DeepSeek-V4")
    else:
        q = config.quantization
        fp4 = q is not None and q.expert_dtype == "fp4"
        stacked = mxfp4_experts and fp4 and choose_stacked_mxfp4(config, par)
        fp8 = q is not None and tuple(q.weight_block_size) == MXFP8_WEIGHT_BLOCK
        mxfp8 = choose_mxfp8_linears(config, linear_backend, device, dtype, par, fp8)
    with torch.device(device):
        if config.model_type == "deepseek_v4":
            cls, model = DeepseekV4ForCausalLM, DeepseekV4ForCausalLM(config, dtype, par)
        else:
            cls, model = DeepseekV41ForCausalLM, DeepseekV41ForCausalLM(config, dtype, par, stacked, mxfp8)
    init_random_weights(model, seed, initializer_std(config), config.n_routed_experts)
    if cls is DeepseekV41ForCausalLM and config.engram_layer_ids:
        tokenizer = os.path.join(checkpoint_dir, "tokenizer.json")
        compressed = config.engram_compressed_vocab_size
        if os.path.isfile(tokenizer) and build_compressed_token_map(tokenizer)[1] == compressed:
            model.bind_tokenizer(tokenizer)
        else:
            logger.info("engram hashing: the synthetic token map id mod %d (random weights; no tokenizer.json "
                        "with that compressed vocabulary)", compressed)
            model.bind_synthetic_token_map()
    return model.eval()
