"""One entry for DeepSeek-V4-family checkpoint directories: ``config.json``'s ``model_type``
picks :func:`model.v4.model.load_deepseek_v4` or :func:`model.v41.model.load_deepseek_v41`."""

from __future__ import annotations

import torch

from model.config import V41_MODEL_TYPES
from model.loader import CheckpointError
from model.parallel import ParallelContext
from model.v4.model import DeepseekV4ForCausalLM, load_deepseek_v4
from model.v4_loader import read_config_json
from model.v41.model import DeepseekV41ForCausalLM, load_deepseek_v41

V4_FAMILY_MODEL_TYPES = ("deepseek_v4", *V41_MODEL_TYPES)


def load_v4_family(checkpoint_dir: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                   par: ParallelContext | None = None) -> DeepseekV4ForCausalLM | DeepseekV41ForCausalLM:
    """The V4 or V4.1 model of ``checkpoint_dir``, weights loaded (and, for V4.1, the tokenizer
    bound); ``par``: this rank's shard under TP / DP / EP. Both take one request's next tokens
    and a ``new_state()``; V4's forward returns hidden states (``compute_logits`` makes logits),
    V4.1's returns float32 logits."""
    model_type = read_config_json(checkpoint_dir).get("model_type")
    if model_type == "deepseek_v4":
        return load_deepseek_v4(checkpoint_dir, dtype, device, par)
    if model_type in V41_MODEL_TYPES:
        return load_deepseek_v41(checkpoint_dir, dtype, device, par)
    raise CheckpointError(f"{checkpoint_dir!r} holds model_type {model_type!r}, not one of the "
                          f"DeepSeek-V4 family ({', '.join(V4_FAMILY_MODEL_TYPES)})")
