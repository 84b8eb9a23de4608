"""DeepSeek-V4.1 causal LM (text backbone) in plain torch, one request per forward.

Usage::

    model = DeepseekV41ForCausalLM(config, dtype=torch.float32)
    model.load_weights(tensors)                 # HF-V4.1 names (see below)
    model.bind_tokenizer("path/tokenizer.json") # needed when the config has engram layers
    state = model.new_state()
    logits = model(prompt_ids, state)           # [T, vocab] fp32; any chunking of the prompt
    logits = model(next_id[None], state)        # decode: same state, one token

Each call consumes the next tokens of the request whose :class:`~model.v41.state.RequestState`
it is given, at absolute positions ``state.num_tokens ...``, and advances the state.

Layer: engram (at its layers) → attention site (mHC mixes from the streams, collapse with
the previous site's ``pre``, ``attn_norm``, attention, expand) → FFN site (same with
``ffn_norm`` and the MoE). Final: collapse with the last FFN-site ``pre``, ``norm``,
``lm_head``. ``state_dict()`` keys and shapes are HF-V4.1's (``model.layers.N.attn.wq_a.weight``,
``model.embed.weight``, ``lm_head.weight``, …). DSpark draft blocks (``mtp.*``), the vision
tower and aligner are not built: :func:`split_unused_weights` sets their tensors aside.
A checkpoint directory (released or HF-V4.1 names; FP8/FP4 or BF16) loads with
:func:`load_deepseek_v41`, which also binds the tokenizer.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

import torch
from torch import nn

from model.layers.norm import RMSNorm
from model.v4.rope import RotaryTable
from model.v4_loader import CheckpointError, load_v4_into_module, read_v4_config
from model.v41.attention import Attention
from model.v41.config import V41Config
from model.v41.engram import Engram, EngramHasher, build_compressed_token_map, synthetic_compressed_token_map
from model.v41.mhc import (
    collapse_streams,
    expand_streams_fp32,
    mhc_site_weights,
    one_hot_pre,
)
from model.v41.moe import MoE
from model.v41.state import RequestState
from model.parallel import ParallelContext, StepRows
from model.v4_parallel import final_rows, first_rows, row_parallel_site, shard_spec, vocab_embedding

logger = logging.getLogger(__name__)

# Checkpoint tensors of parts this model does not build: DSpark draft blocks, vision tower,
# aligner and image delimiter embeddings.
UNUSED_WEIGHT_PATTERN = re.compile(r"((^|\.)(mtp|dspark)\.|^(model\.)?vision\.|^(model\.)?aligner\."
                                   r"|^(model\.)?image_(start|end|newline)$)")


def split_unused_weights(names) -> tuple[list[str], list[str]]:
    """(names this model loads, names it skips); logs one line when it skips any."""
    keep, skip = [], []
    for name in names:
        (skip if UNUSED_WEIGHT_PATTERN.search(name) else keep).append(name)
    if skip:
        logger.info("DeepSeek-V4.1: skipping %d DSpark/vision tensors (not implemented: mtp.*, vision.*, aligner.*)",
                    len(skip))
    return keep, skip


class DecoderLayer(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype,
                 par: ParallelContext | None = None) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.par = par = par or ParallelContext()
        self.norm_eps, self.hc_eps, self.sinkhorn_iters = c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters
        self.attn = Attention(c, layer_idx, dtype, par.tp_size)
        self.ffn = MoE(c, dtype, par)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.engram = Engram(c, layer_idx, dtype, par) if layer_idx in c.engram_layer_ids else None
        mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(mix, width, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _mixes(self, streams: torch.Tensor, site: str):
        return mhc_site_weights(streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                                getattr(self, f"hc_{site}_scale"), hc_eps=self.hc_eps,
                                sinkhorn_iters=self.sinkhorn_iters, norm_eps=self.norm_eps)

    def forward(self, streams, pre, hash_ids, positions, rope, state, step, rows: StepRows | None = None):
        """streams [T, hc, D], pre [T, hc] from the previous site -> (streams, this FFN site's pre).
        Under TP the streams are this rank's rows of the step's ``positions`` (model/v4_parallel.py)."""
        n = positions.shape[0]
        attend = row_parallel_site(self.par, n, lambda x: self.attn(x, positions, rope, state, step))
        feed_forward = row_parallel_site(self.par, n, lambda x: self.ffn(x, rows=rows))
        return self.run_sites(streams, pre, hash_ids, attend, feed_forward)

    def run_sites(self, streams, pre, hash_ids, attend, feed_forward):
        """The layer's schedule with the attention and FFN given as functions of their normed
        input; streams [..., hc, D], pre [..., hc], hash_ids [..., engram layers, cols]."""
        if self.engram is not None:
            streams = self.engram(streams, hash_ids[..., self.engram.table_index, :])
        attn_pre, post, comb = self._mixes(streams, "attn")
        out = attend(self.attn_norm(collapse_streams(streams, pre)))
        streams = expand_streams_fp32(out, streams, post, comb)
        ffn_pre, post, comb = self._mixes(streams, "ffn")
        out = feed_forward(self.ffn_norm(collapse_streams(streams, attn_pre)))
        return expand_streams_fp32(out, streams, post, comb), ffn_pre


class TextModel(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        c = config
        self.embed = vocab_embedding(c.vocab_size, c.hidden_size, par, dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, par) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.main_rope = RotaryTable(c.qk_rope_head_dim, c.main_rope)
        self.compress_rope = RotaryTable(c.qk_rope_head_dim, c.compress_rope)


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype = torch.bfloat16,
                 par: ParallelContext | None = None) -> None:
        """``par``: this rank's place in TP / DP / EP (model/v4_parallel.py); None: one device."""
        super().__init__()
        self.config = config
        self.par = par = par or ParallelContext()
        self.model = TextModel(config, dtype, par)
        self.lm_head = nn.Linear(config.hidden_size, -(-config.vocab_size // par.tp_size), bias=False, dtype=dtype)
        self.hasher: EngramHasher | None = None

    def bind_tokenizer(self, tokenizer_json_path: str) -> DeepseekV41ForCausalLM:
        """Build the engram hasher from the checkpoint's ``tokenizer.json``."""
        token_map, _ = build_compressed_token_map(tokenizer_json_path)
        self.hasher = EngramHasher(self.config, token_map)
        return self

    def bind_synthetic_token_map(self) -> DeepseekV41ForCausalLM:
        """Build the engram hasher from ``id mod engram_compressed_vocab_size`` (random weights
        without a matching tokenizer: :func:`~model.v41.engram.synthetic_compressed_token_map`)."""
        c = self.config
        self.hasher = EngramHasher(c, synthetic_compressed_token_map(c.vocab_size, c.engram_compressed_vocab_size))
        return self

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy in-memory HF-V4.1-named tensors in (cast to each parameter's dtype); DSpark/vision
        tensors are skipped (a checkpoint directory goes through :func:`load_deepseek_v41`).
        A missing, unexpected or mis-shaped tensor is one ValueError line naming it."""
        names, _ = split_unused_weights(tensors)
        params = self.state_dict()
        missing = sorted(set(params) - set(names))
        unexpected = sorted(set(names) - set(params))
        if missing or unexpected:
            raise ValueError(
                f"DeepSeek-V4.1 checkpoint does not match the config: {len(missing)} missing "
                f"(first: {missing[:1]}), {len(unexpected)} unexpected (first: {unexpected[:1]})"
            )
        for name in names:
            src, dst = tensors[name], params[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"tensor {name}: checkpoint shape {tuple(src.shape)}, model expects {tuple(dst.shape)}")
        for name in names:
            params[name].copy_(tensors[name].to(params[name].dtype))

    def new_state(self) -> RequestState:
        c = self.config
        return RequestState.empty(c.num_hidden_layers, {s: c.compress_ratios[s] for s in c.kv_source_layer_ids})

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: RequestState) -> torch.Tensor:
        """input_ids [T] (the request's next tokens) -> logits [T, vocab] fp32; advances ``state``."""
        c = self.config
        t = input_ids.shape[0]
        if t == 0:
            raise ValueError("DeepSeek-V4.1 forward needs at least one token")
        positions = torch.arange(state.num_tokens, state.num_tokens + t, device=input_ids.device)
        hash_ids = None
        if c.engram_layer_ids:
            if self.hasher is None:
                raise RuntimeError("this checkpoint has engram layers: call bind_tokenizer(tokenizer.json) first")
            hash_ids, state.engram_history = self.hasher(input_ids, state.engram_history)
        par = self.par
        rows = par.step_rows(t, input_ids.device)
        x = first_rows(par, t)(self.model.embed(input_ids))
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        pre = one_hot_pre(x.shape[0], c.hc_mult, input_ids.device)
        step: dict = {}
        for layer in self.model.layers:
            rope = self.model.compress_rope if layer.attn.ratio else self.model.main_rope
            streams, pre = layer(streams, pre, hash_ids, positions, rope, state, step, rows)
        hidden = final_rows(par, self.model.norm(collapse_streams(streams, pre)), t)
        state.num_tokens += t
        return par.gather_vocab(self.lm_head(hidden).float())[..., : c.vocab_size]


def load_deepseek_v41(checkpoint_dir: str, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", par: ParallelContext | None = None) -> DeepseekV41ForCausalLM:
    """Build the text model ``config.json`` describes on ``device``, stream its weights in
    (FP8/FP4 dequantized on the CPU to ``dtype``; engram tables keep their scale tensor) and,
    when it has engram layers, bind the checkpoint's ``tokenizer.json``. Errors are one
    :class:`model.loader.CheckpointError` line. ``par``: load this rank's shard
    (model/v4_parallel.py)."""
    config = read_v4_config(checkpoint_dir, ("deepseek_v41", "deepseek_v41_text"))
    par = par or ParallelContext()
    tokenizer = os.path.join(checkpoint_dir, "tokenizer.json")
    if config.engram_layer_ids and not os.path.isfile(tokenizer):
        raise CheckpointError(f"{checkpoint_dir!r} has engram layers but no tokenizer.json to hash tokens with")
    with torch.device(device):
        model = DeepseekV41ForCausalLM(config, dtype, par)
    load_v4_into_module(model, checkpoint_dir, device=device, shard_spec=shard_spec(par))
    if config.engram_layer_ids:
        model.bind_tokenizer(tokenizer)
    return model.eval()
