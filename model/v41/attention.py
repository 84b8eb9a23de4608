"""DeepSeek-V4.1 attention: one shared K=V latent head over [sliding window ‖ shared compressed entries].

Per layer: ``q_res = q_norm(wq_a·x)``, ``q = RoPE(wq_b·q_res)`` (no per-head q norm),
``kv = FP8_32(RoPE(kv_norm(wkv·x)))`` — the window rows, cached as they are used. Layers with
a compressed branch add the compressed cache of their KV source (a source first runs its
:class:`~model.v41.compressor.Compressor`, stores indexer keys, rotates each new latent at its
group's first position and FP4-fake-quantizes it with e4m3 scales in 16-blocks), masked by
the top-k bias of their index source. Scores are ``q·kᵀ/√head_dim`` plus a per-head sink
logit that only enlarges the softmax denominator; the output's RoPE tail is rotated back by
the query position and projected by the grouped low-rank ``wo_a`` (heads in ``o_groups``
contiguous groups) and ``wo_b``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0
from model.v41.compressor import Compressor
from model.v41.config import V41Config
from model.v41.indexer import Indexer
from model.v41.norm import RMSNorm
from model.v41.rope import Rope, apply_rope
from model.v41.state import RequestState


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float):
    """q [T, H, d], kv [n, d] (K = V), bias [T, n] additive, sinks [H] -> [T, H, d].

    Softmax over ``[scores, sink_h]`` with the sink column dropped afterwards; a row whose
    every key is masked still gets a finite (zero) output.
    """
    qh = q.transpose(0, 1)[None]  # [1, H, T, d]
    k = kv[None, None]  # [1, 1, n, d]
    logits = torch.matmul(qh, k.transpose(2, 3)) * scale + bias
    sink = sinks.float().reshape(1, -1, 1, 1).expand(1, -1, q.shape[0], 1)
    logits = torch.cat([logits, sink.to(logits.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, k)[0].transpose(0, 1)


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """0 where key position is within the query's causal window of ``window`` tokens, else -inf."""
    d = q_pos[:, None] - k_pos[None, :]
    ok = (d >= 0) & (d < window)
    return torch.zeros(ok.shape, dtype=torch.float32, device=q_pos.device).masked_fill(~ok, float("-inf"))


class GroupedOutputA(nn.Module):
    """``wo_a``: one [o_lora_rank, heads_per_group·head_dim] block per head group."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in_per_group] -> [T, groups, out_features // groups]."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.ratio = c.compress_ratios[layer_idx]
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.window = c.sliding_window
        self.o_groups = c.o_groups
        self.scale = c.head_dim**-0.5
        self.kv_source = c.kv_source_of(layer_idx)
        self.index_source = c.index_source_of(layer_idx)
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
        self.wq_b = nn.Linear(c.q_lora_rank, self.num_heads * self.head_dim, bias=False, dtype=dtype)
        self.wkv = nn.Linear(c.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.wo_a = GroupedOutputA(self.num_heads * self.head_dim // c.o_groups, c.o_groups * c.o_lora_rank,
                                   c.o_groups, dtype)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor = Compressor(c, layer_idx, dtype) if self.kv_source == layer_idx else None
        self.indexer = Indexer(c, layer_idx, dtype) if self.index_source == layer_idx else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, state: RequestState,
                step: dict) -> torch.Tensor:
        """x [T, hidden] normed; ``rope`` is this layer's flavour (compress iff ratio > 0).

        ``step`` is shared by the layers of one forward: index sources leave their top-k
        bias there for the reuse layers after them.
        """
        t = x.shape[0]
        cos, sin = rope(positions)
        q_res = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(q_res).view(t, self.num_heads, self.head_dim), cos, sin)
        kv = fake_quant_fp8_ue8m0(apply_rope(self.kv_norm(self.wkv(x)), cos, sin), 32)

        cached = state.windows[self.layer_idx]
        n_cached = 0 if cached is None else cached.shape[0]
        keys = kv if cached is None else torch.cat([cached, kv], dim=0)
        state.windows[self.layer_idx] = keys[max(0, keys.shape[0] - (self.window - 1)):]
        key_pos = torch.arange(int(positions[0]) - n_cached, int(positions[-1]) + 1, device=x.device)
        bias = window_bias(positions, key_pos, self.window)

        if self.ratio:
            source = state.sources[self.kv_source]
            if self.compressor is not None:
                latent, first = self.compressor(x, source)
                if latent is not None:
                    group_pos = first + self.ratio * torch.arange(latent.shape[0], device=x.device)
                    cos_g, sin_g = rope(group_pos)
                    if self.indexer is not None:
                        source.append_index_keys(self.indexer.keys_from_latents(latent, cos_g, sin_g))
                    entry = fake_quant_fp4(apply_rope(latent, cos_g, sin_g), 16, "e4m3")
                    source.append_entries(entry)
            if self.indexer is not None:
                step["topk_bias"] = None
                if source.index_keys is not None:
                    step["topk_bias"] = self.indexer.topk_bias(x, q_res, source.index_keys, positions, cos, sin, step)
            if source.entries is not None:
                keys = torch.cat([keys, source.entries], dim=0)
                topk = step.get("topk_bias")
                if topk is None:
                    topk = bias.new_full((t, source.num_entries), float("-inf"))
                bias = torch.cat([bias, topk.to(bias.dtype)], dim=-1)

        out = sink_attention(q, keys, bias, self.attn_sink, self.scale)
        out = apply_rope(out, cos, sin, inverse=True)
        grouped = out.reshape(t, self.o_groups, -1)
        return self.wo_b(self.wo_a(grouped).flatten(1))
