"""Batched, differentiable full-sequence forward of DeepSeek-V4.1, for training.

:func:`forward_sequences` runs ``B`` sequences of one length ``T`` from position 0 with no
request state, through the same layer modules as the inference forward (``model(ids, state)``):
row ``b``'s logits equal a one-shot prefill of ``ids[b]``. Right padding is harmless: the model
is causal (window rows and compressed entries of later positions are invisible), so a row's
logits before its padding equal the prefill of its unpadded tokens.

What training adds:

* the QAT fake-quant roundings are straight-through estimators
  (:mod:`kernels.microscaling`); the indexer's top-k and candidate blocks are hard masks, so
  the language-model loss reaches only the selected compressed entries;
* the indexer learns from its own loss, as DeepSeek trains its lightning indexer: at every
  index source, the KL divergence from the layer's main attention over the picked entries
  (summed over heads, renormalized, detached) to the softmax of the index scores over the
  same picks; the indexer's inputs are detached, so this loss trains the indexer only;
* the MoE runs every expert densely (:meth:`model.v41.moe.MoE.forward_dense`) and returns
  the chosen expert ids, for the router's bias update (:func:`update_router_biases`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.v4.attention_core import sink_attention, window_bias
from model.v41.attention import Attention, entry_bias
from model.v41.mhc import collapse_streams, one_hot_pre
from model.v41.model import DeepseekV41ForCausalLM


@dataclass
class SequenceOutput:
    logits: torch.Tensor  # [B, T, vocab] float32
    expert_ids: list[torch.Tensor] = field(default_factory=list)  # per layer [B*T, k]
    indexer_losses: list[torch.Tensor] = field(default_factory=list)  # per index source, scalar


class _Sequences:
    """What the layers of one batched forward share: shapes, RoPE at every position, the
    window mask, each KV source's entries and index keys, the top-k picks and candidate mask."""

    def __init__(self, model: DeepseekV41ForCausalLM, b: int, t: int, device, dtype) -> None:
        self.b, self.t = b, t
        self.positions = torch.arange(t, device=device)
        self.window = window_bias(self.positions, self.positions, model.config.sliding_window)
        self._rope = {}
        for table in (model.model.main_rope, model.model.compress_rope):
            cos, sin = table.cos_sin(self.positions, dtype)
            self._rope[id(table)] = (cos.repeat(b, 1), sin.repeat(b, 1))  # [B*T, r/2], row-major
        self.entries: dict[int, torch.Tensor | None] = {}
        self.index_keys: dict[int, torch.Tensor | None] = {}
        self.picks: dict[int, torch.Tensor] = {}
        self.candidates: torch.Tensor | None = None
        self.indexer_losses: list[torch.Tensor] = []

    def cos_sin(self, rope):
        return self._rope[id(rope)]


def _compress(attn: Attention, x: torch.Tensor, rope, seq: _Sequences) -> None:
    latent = attn.compressor.sequence_latents(x)
    entries = keys = None
    if latent is not None:
        g = latent.shape[1]
        group_pos = attn.ratio * torch.arange(g, device=x.device)
        cos, sin = (t.repeat(seq.b, 1) for t in rope.cos_sin(group_pos, latent.dtype))
        flat = latent.flatten(0, 1)
        entries = attn.shared_entries(flat, cos, sin).view(seq.b, g, -1)
        if attn.indexer is not None:
            keys = attn.indexer.keys_from_latents(flat.detach(), cos, sin).view(seq.b, g, -1)
    seq.entries[attn.layer_idx], seq.index_keys[attn.layer_idx] = entries, keys


def _index(attn: Attention, x, q_res, keys, cos, sin, seq: _Sequences):
    """The index source's picks [B, T, k] and its differentiable index scores [B, T, n]."""
    ix = attn.indexer
    b, t = seq.b, seq.t
    q = ix.queries(q_res.detach(), cos, sin).view(b, t, ix.num_heads, ix.head_dim)
    weights = ix.head_weights(x.detach()).view(b, t, ix.num_heads)
    visible = (seq.positions.unsqueeze(-1) + 1) // ix.ratio
    scores = ix.scores(q, weights, keys, visible)
    picks, candidates = ix.select(scores.detach(), visible, seq.candidates)
    if candidates is not None:
        seq.candidates = candidates
    seq.picks[attn.layer_idx] = picks
    return picks, scores


def _indexer_loss(scores, q, entries, picks, scale) -> torch.Tensor:
    """KL(main attention over the picks ‖ softmax(index scores over the picks)), mean over
    the queries that picked anything."""
    mask = entry_bias(picks, entries.shape[1], scores)  # [B, T, n]
    with torch.no_grad():
        logits = torch.einsum("bthd,bnd->bthn", q.float(), entries.float()) * scale + mask.unsqueeze(2)
        target = torch.softmax(logits.nan_to_num(neginf=-1e30), dim=-1).sum(dim=2)
        target = target / target.sum(-1, keepdim=True)
    has_pick = (picks >= 0).any(-1)  # [B, T]
    log_q = torch.log_softmax((scores + mask).nan_to_num(neginf=-1e30), dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-30)) - log_q)).masked_fill(mask.isinf(), 0.0).sum(-1)
    return kl.masked_fill(~has_pick, 0.0).sum() / has_pick.sum().clamp_min(1)


def _attention(attn: Attention, x: torch.Tensor, rope, seq: _Sequences) -> torch.Tensor:
    """x [B, T, hidden] (normed) -> [B, T, hidden], as :meth:`Attention.forward` on each row."""
    b, t = seq.b, seq.t
    cos, sin = seq.cos_sin(rope)
    flat = x.reshape(b * t, -1)
    q_res, q, kv = attn.project(flat, cos, sin)
    q = q.view(b, t, attn.num_heads, attn.head_dim)
    keys, bias = kv.view(b, t, -1), seq.window.expand(b, t, t)
    if attn.ratio:
        if attn.compressor is not None:
            _compress(attn, x, rope, seq)
        entries, index_keys = seq.entries[attn.kv_source], seq.index_keys[attn.kv_source]
        if attn.indexer is not None and index_keys is not None:
            picks, scores = _index(attn, flat, q_res, index_keys, cos, sin, seq)
            seq.indexer_losses.append(_indexer_loss(scores, q.detach(), entries.detach(), picks, attn.scale))
        if entries is not None:
            keys = torch.cat([keys, entries], dim=1)
            bias = torch.cat([bias, entry_bias(seq.picks.get(attn.index_source), entries.shape[1], bias)], dim=-1)
    out = sink_attention(q, keys, bias, attn.attn_sink, attn.scale)
    return attn.output(out.reshape(b * t, attn.num_heads, attn.head_dim), cos, sin).view(b, t, -1)


def forward_sequences(model: DeepseekV41ForCausalLM, input_ids: torch.Tensor) -> SequenceOutput:
    """input_ids [B, T] (each row a sequence from position 0) -> :class:`SequenceOutput`."""
    c = model.config
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"forward_sequences needs input_ids [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    hash_ids = None
    if c.engram_layer_ids:
        if model.hasher is None:
            raise RuntimeError("this model has engram layers: call bind_tokenizer(tokenizer.json) first")
        hash_ids = model.hasher.hash_sequences(input_ids)
    embed = model.model.embed(input_ids)
    seq = _Sequences(model, b, t, input_ids.device, embed.dtype)
    streams = embed.unsqueeze(2).expand(-1, -1, c.hc_mult, -1)
    pre = one_hot_pre(b * t, c.hc_mult, input_ids.device).view(b, t, c.hc_mult)
    expert_ids = []

    def feed_forward(moe):
        def run(x):
            out, ids = moe.forward_dense(x.reshape(b * t, -1))
            expert_ids.append(ids)
            return out.view(b, t, -1)
        return run

    for layer in model.model.layers:
        rope = model.model.compress_rope if layer.attn.ratio else model.model.main_rope
        streams, pre = layer.run_sites(streams, pre, hash_ids, lambda x, a=layer.attn, r=rope: _attention(a, x, r, seq),
                                       feed_forward(layer.ffn))
    hidden = model.model.norm(collapse_streams(streams, pre))
    return SequenceOutput(model.lm_head(hidden).float(), expert_ids, seq.indexer_losses)


# ---- training helpers --------------------------------------------------------------------

# Parameters no gradient step touches: the router's selection biases (moved by the balancing
# rule) and the engram tables' dequantization scales (ones in a float checkpoint).
FROZEN_SUFFIXES = ("gate.bias", "gate.bias_vl", "embed.scale")


def prepare_for_training(model: DeepseekV41ForCausalLM, seed: int, std: float = 0.02) -> DeepseekV41ForCausalLM:
    """Fresh initial weights (normal ``std`` for projections and mHC mixing weights, unit
    normal token and engram embeddings, ones for norms and engram gates, zeros for sinks,
    mHC bases and router biases) and ``requires_grad`` on every trained parameter."""
    if model.mxfp8_linears:
        raise ValueError("training updates the linears' values: load the model with linear_backend='dequantized'")
    g = torch.Generator().manual_seed(seed)

    def normal(p, s):
        return torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(s).to(p.dtype)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(FROZEN_SUFFIXES) or name.endswith(("hc_attn_base", "hc_ffn_base", "attn_sink")):
                p.copy_(torch.ones_like(p) if name.endswith("embed.scale") else torch.zeros_like(p))
            elif name.endswith(("norm.weight", "q_weight", "k_weight", "_scale")):
                p.fill_(1.0)
            elif name in ("model.embed.weight",) or name.endswith("engram.embed.weight"):
                p.copy_(normal(p, 1.0))
            else:
                p.copy_(normal(p, std))
            p.requires_grad_(not name.endswith(FROZEN_SUFFIXES))
    return model


@torch.no_grad()
def update_router_biases(model: DeepseekV41ForCausalLM, expert_ids: list[torch.Tensor], speed: float):
    """DeepSeek's auxiliary-loss-free balancing: each expert's selection bias moves ``speed``
    toward balanced load (up when under-loaded), then the layer's biases are shifted so the
    smallest is 0. Returns each layer's load fractions [E]."""
    fractions = []
    for layer, ids in zip(model.model.layers, expert_ids):
        bias = layer.ffn.gate.bias
        flat = ids.flatten()  # scatter_add, not bincount: no host sync on a GPU
        ones = torch.ones_like(flat, dtype=torch.float32)
        load = torch.zeros(bias.numel(), device=bias.device).scatter_add_(0, flat, ones)
        bias.add_(speed * torch.sign(load.mean() - load))
        bias.sub_(bias.min())
        fractions.append(load / load.sum())
    return fractions


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy where ``labels`` [B, T] (aligned with the inputs: the
    token position t should predict) is not -100."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

