"""DeepSeek V2/V3/R1 causal LM: decoder layers, final norm and LM head (MTP layers are skipped at load).

``forward(input_ids, positions)`` takes one step's flattened tokens (all sequences
concatenated) and returns hidden states; the attention layout of the step comes from the
forward context (model/forward_context.py). ``compute_logits`` maps chosen rows to vocab.

``weight_map()`` names every checkpoint tensor this rank needs (HF names) and how to place
it; model/loader.py streams tensors into it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from model.config import ModelConfig
from model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model.layers.mla import MLAAttention
from model.layers.moe import MoE, DenseMLP
from model.layers.norm import RMSNorm
from model.layers.rotary import RotaryEmbedding
from model.parallel import ParallelContext, StepRows

# A loader callback: takes the checkpoint tensor (already dequantized if asked) and copies it in.
WeightLoader = Callable[[torch.Tensor], None]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, par: ParallelContext,
                 dtype: torch.dtype, fp8_block) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = MLAAttention(c, layer_idx, rotary, par.tp_rank, par.tp_size, dtype, fp8_block)
        self.is_moe = c.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = MoE(c, par, dtype, fp8_block)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, par.tp_rank, par.tp_size, dtype, fp8_block)
        self.par = par

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rows: StepRows | None = None):
        """``hidden``/``residual`` hold this rank's rows (all rows unless sequence parallel);
        ``rows``: the step's layout (see ``ParallelContext.step_rows``), used by the MoE."""
        par = self.par
        h, residual = self.input_layernorm.add_and_norm(hidden, residual)
        h = par.scatter_partial_rows(self.self_attn(positions, par.gather_rows(h)))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        h = par.gather_rows(h)
        h = par.scatter_partial_rows(self.mlp(h, rows) if self.is_moe else self.mlp(h))
        return h, residual

    def weight_map(self, prefix: str, fp8: bool) -> dict[str, WeightLoader]:
        m: dict[str, WeightLoader] = {}
        attn = self.self_attn
        for name in ("input_layernorm", "post_attention_layernorm"):
            m[f"{prefix}.{name}.weight"] = _param_loader(getattr(self, name).weight)
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            mod = getattr(attn, name)
            if mod is not None:
                m[f"{prefix}.self_attn.{name}.weight"] = _param_loader(mod.weight)
        for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            mod = getattr(attn, name)
            if mod is not None:
                _add_linear(m, f"{prefix}.self_attn.{name}", mod, fp8)
        mlp_prefix = f"{prefix}.mlp"
        if self.is_moe:
            m[f"{mlp_prefix}.gate.weight"] = _param_loader(self.mlp.gate_weight)
            if self.mlp.e_score_correction_bias is not None:
                m[f"{mlp_prefix}.gate.e_score_correction_bias"] = _param_loader(self.mlp.e_score_correction_bias)
            experts = self.mlp.experts
            for e in range(experts.num_experts):
                if experts.local_index(e) is None:
                    continue
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    name = f"{mlp_prefix}.experts.{e}.{proj}"
                    m[f"{name}.weight"] = _expert_loader(experts, e, proj, False, f"{name}.weight")
                    if fp8 and experts.fp8_block:
                        m[f"{name}.weight_scale_inv"] = _expert_loader(experts, e, proj, True,
                                                                       f"{name}.weight_scale_inv")
            if self.mlp.shared_experts is not None:
                _add_dense_mlp(m, f"{mlp_prefix}.shared_experts", self.mlp.shared_experts, fp8)
        else:
            _add_dense_mlp(m, mlp_prefix, self.mlp, fp8)
        return m


def _param_loader(param: nn.Parameter) -> WeightLoader:
    def load(t: torch.Tensor, name: str = "") -> None:
        if tuple(param.shape) != tuple(t.shape):
            raise ValueError(f"shape mismatch for {name}: expected {tuple(param.shape)}, got {tuple(t.shape)}")
        param.data.copy_(t.to(param.dtype))

    return load


def _add_linear(m: dict, name: str, mod, fp8: bool) -> None:
    m[f"{name}.weight"] = lambda t, n="": mod.weight.weight_loader(mod.weight, t, n)
    if fp8 and mod.weight_scale_inv is not None:
        m[f"{name}.weight_scale_inv"] = lambda t, n="": mod.weight_scale_inv.weight_loader(mod.weight_scale_inv, t, n)


def _add_dense_mlp(m: dict, prefix: str, mlp: DenseMLP, fp8: bool) -> None:
    for idx, proj in enumerate(("gate_proj", "up_proj")):
        m[f"{prefix}.{proj}.weight"] = lambda t, n="", i=idx: mlp.gate_up_proj.load_part(i, t, False, n)
        if fp8 and mlp.gate_up_proj.weight_scale_inv is not None:
            m[f"{prefix}.{proj}.weight_scale_inv"] = lambda t, n="", i=idx: mlp.gate_up_proj.load_part(i, t, True, n)
    _add_linear(m, f"{prefix}.down_proj", mlp.down_proj, fp8)


def _expert_loader(experts, e: int, proj: str, is_scale: bool, full_name: str) -> WeightLoader:
    return lambda t, n="": experts.load_expert(e, proj, t, is_scale, full_name)


class DeepseekForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        keep_fp8: bool = False,
        par: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.dtype = dtype
        self.par = par or ParallelContext()
        self.fp8_block = c.quantization.weight_block_size if (keep_fp8 and c.quantization) else None
        self.rotary = RotaryEmbedding(c)
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, self.par.tp_rank, self.par.tp_size,
                                                   dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i, self.rotary, self.par, dtype, self.fp8_block) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, self.par.tp_rank, self.par.tp_size, dtype)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the step's T tokens (on every TP rank)."""
        par = self.par
        n = input_ids.shape[0]
        padded = par.padded_rows(n)
        if padded != n:  # sequence parallel: pad rows write no KV and never reach routing
            input_ids = torch.cat([input_ids, input_ids.new_zeros(padded - n)])
            positions = torch.cat([positions, positions.new_zeros(padded - n)])
        rows = par.step_rows(n, input_ids.device)
        hidden = par.scatter_partial_rows(self.embed_tokens(input_ids))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, rows)
        out = par.gather_rows(self.norm.add_and_norm(hidden, residual)[0])
        return out[:n]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab_size] for the given rows."""
        logits = self.par.gather_vocab(self.lm_head(hidden))
        return logits[..., : self.config.vocab_size]

    # ---- weights ---------------------------------------------------------------------------
    def weight_map(self) -> dict[str, WeightLoader]:
        """Checkpoint tensor name → loader, for the tensors this rank must load."""
        fp8 = self.fp8_block is not None
        m: dict[str, WeightLoader] = {}
        emb, head = self.embed_tokens, self.lm_head
        m["model.embed_tokens.weight"] = lambda t, n="": emb.weight.weight_loader(emb.weight, t, n)
        for layer in self.layers:
            m.update(layer.weight_map(f"model.layers.{layer.layer_idx}", fp8))
        m["model.norm.weight"] = _param_loader(self.norm.weight)
        if not self.config.tie_word_embeddings:
            m["lm_head.weight"] = lambda t, n="": head.weight.weight_loader(head.weight, t, n)
        return m

    def process_weights_after_loading(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight.data.copy_(self.embed_tokens.weight.data)
        for layer in self.layers:
            layer.self_attn.process_weights_after_loading()
