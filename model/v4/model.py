"""DeepSeek-V4 causal LM (torch reference): embedding → hc streams → layers → HyperHead → head.

Usage, one request at a time::

    model = DeepseekV4ForCausalLM(config)          # parameters named as HF 5.24's state_dict
    state = model.new_state()                      # per-request decode state (model/v4/state.py)
    hidden = model(prompt_ids, state)              # [T, D]; any chunking of the prompt works
    logits = model.compute_logits(hidden[-1:])     # float32 [1, vocab]
    hidden = model(next_id.view(1), state)         # decode: one token at state.num_tokens

Each call appends its tokens at positions ``state.num_tokens …``. ``model.decode(ids [B],
states)`` advances many requests by one token each in one forward (the rows B one-token
calls compute); the states' rows live in the model's shared pools (model/v4/cache_pool.py,
built by :meth:`~DeepseekV4ForCausalLM.cache_pools`). With ``fp8`` records its attention runs
on ``model.sparse_decode``, the backend :meth:`configure_cache` chose (model/v4/sparse_attention.py);
a prompt chunk's attention on ``model.sparse_prefill`` (on a GPU: the Triton kernel).

The embedding is copied into ``hc_mult`` streams; each layer runs an mHC site →
``input_layernorm`` → attention → expand, then an mHC site → ``post_attention_layernorm`` →
MoE (needs the token ids for its hash-routed layers) → expand. The HyperHead collapses the streams, then ``norm`` and
``lm_head``. Norms, mHC parameters, sinks and position biases stay float32 whatever the
model dtype, as HF keeps them.

Under TP / DP / EP (``par``, model/v4_parallel.py) a rank holds its heads, output groups,
vocab rows and experts, and its token rows of the streams under the reduce-scatter mode.

MTP weights (``mtp.*``) are not part of this model: :meth:`load_weights` skips them.
A checkpoint directory (released, 5.24-saved or HF names; FP8/MXFP4 or BF16) loads with
:func:`load_deepseek_v4`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from model.layers.norm import RMSNorm
from model.v4.attention import V4Attention
from model.v4.config import V4Config
from model.v4.mhc import HyperConnection, HyperHead, collapse_streams, expand_streams
from model.v4.moe import V4MoE
from model.v4.rope import RotaryTable
from model.parallel import ParallelContext, StepRows
from model.v4.cache_pool import BatchIndex, CachePools, PoolPlan, plain_codec
from model.v4.decode_buffers import DecodeBuffers, DecodeInputs
from model.v4.sparse_attention import (V4SparseDecodeBackend, V4SparsePrefillBackend, choose_sparse_decode,
                                       choose_sparse_prefill)
from model.v4.state import V4RequestState
from model.v4_loader import load_v4_into_module, read_v4_config
from model.v4_parallel import final_rows, first_rows, row_parallel_site, shard_spec, vocab_embedding

logger = logging.getLogger(__name__)


class V4DecoderLayer(nn.Module):
    def __init__(self, config: V4Config, layer_idx: int, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.par = par
        self.uses_compress_rope = c.layer_kinds[layer_idx] != "sliding"
        hc_args = (c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc_args)
        self.ffn_hc = HyperConnection(*hc_args)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, torch.float32)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, torch.float32)
        self.self_attn = V4Attention(c, layer_idx, dtype, par.tp_size)
        self.mlp = V4MoE(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.moe_intermediate_size * c.n_shared_experts, c.swiglu_limit, c.routed_scaling_factor,
                         c.hash_layers[layer_idx], c.vocab_size, dtype, par)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, attend,
                rows: StepRows | None = None) -> torch.Tensor:
        """streams [T, hc, D] → [T, hc, D] (this rank's rows of the step's ``input_ids``);
        ``attend`` runs the attention on all valid rows of its normed input (one request's
        chunk, or one decode token of each of B requests)."""
        n = input_ids.shape[0]
        attend = row_parallel_site(self.par, n, attend)
        feed_forward = row_parallel_site(self.par, n, lambda x: self.mlp(x, input_ids, rows))
        pre, post, comb = self.attn_hc(streams)
        attn = attend(self.input_layernorm(collapse_streams(streams, pre)))
        streams = expand_streams(streams, attn, post, comb)
        pre, post, comb = self.ffn_hc(streams)
        ffn = feed_forward(self.post_attention_layernorm(collapse_streams(streams, pre)))
        return expand_streams(streams, ffn, post, comb)


class V4Backbone(nn.Module):
    """HF's ``model.``: ``embed_tokens``, ``layers``, ``norm``, ``hc_head``."""

    def __init__(self, config: V4Config, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        c = config
        self.hc_mult = c.hc_mult
        self.embed_tokens = vocab_embedding(c.vocab_size, c.hidden_size, par, dtype)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(V4DecoderLayer(c, i, dtype, par) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, torch.float32)
        self.hc_head = HyperHead(c.hidden_size, c.hc_mult, c.hc_eps, c.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: V4Config, dtype: torch.dtype = torch.float32,
                 par: ParallelContext | None = None) -> None:
        """``par``: this rank's place in TP / DP / EP (model/v4_parallel.py); None: one device."""
        super().__init__()
        self.config, self.dtype = config, dtype
        self.par = par = par or ParallelContext()
        self.model = V4Backbone(config, dtype, par)
        self.lm_head = nn.Linear(config.hidden_size, -(-config.vocab_size // par.tp_size), bias=False, dtype=dtype)
        self.lm_head.requires_grad_(False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.main_rope = RotaryTable(config.qk_rope_head_dim, config.main_rope)
        self.compress_rope = RotaryTable(config.qk_rope_head_dim, config.compress_rope)
        self.sparse_decode: V4SparseDecodeBackend | None = None  # see configure_cache
        self.sparse_prefill: V4SparsePrefillBackend | None = None
        self.kv_write = "auto"  # the decode's KV writes: auto, torch or triton (kernels/attention/v4_kv_write.py)

    def configure_cache(self, kv_cache_dtype: str = "auto", page_rows: int = 64, plan: PoolPlan | None = None,
                        attention_backend: str = "auto", prefill_backend: str = "auto") -> None:
        """How new states store their rows: ``auto`` (the model dtype) or ``fp8`` (V4's 584-byte
        records for window rows and entries, e4m3 + one fp32 scale for index keys; lossy), in
        pages of ``page_rows`` entries that grow on demand — or, with ``plan``, in pools of the
        plan's fixed sizes, allocated now — and the sparse-decode backend the batched decode
        attends packed records with (``attention_backend``: model/v4/sparse_attention.py), and
        the sparse-prefill backend of the chunks (``prefill_backend``; None on a CPU: the torch
        attention). Replaces the pools: states made before keep the old ones."""
        c = self.config
        v4_row_codecs(c, kv_cache_dtype, self.dtype)[0](c.head_dim)  # validates
        heads, device = self.model.layers[0].self_attn.num_heads, self.lm_head.weight.device
        self.sparse_decode = choose_sparse_decode(
            attention_backend, kv_cache_dtype, device, heads, c.head_dim, c.qk_rope_head_dim, page_rows, self.dtype,
            ("v4",))
        self.sparse_prefill = choose_sparse_prefill(prefill_backend, kv_cache_dtype, device, heads, c.head_dim,
                                                    c.qk_rope_head_dim, self.dtype, ("v4",))
        self._cache_settings = (kv_cache_dtype, page_rows, plan)
        self._pools = None
        if plan is not None:
            self.cache_pools()

    def cache_pools(self) -> CachePools:
        """The row pools every state of this model leases units of (model/v4/state.py)."""
        if getattr(self, "_pools", None) is None:
            self._pools = self._build_pools(*getattr(self, "_cache_settings", ("auto", 64, None)))
        return self._pools

    def _build_pools(self, kv_cache_dtype: str, page_rows: int, plan: PoolPlan | None) -> CachePools:
        c, device, dtype = self.config, self.lm_head.weight.device, self.dtype
        row_codec, key_codec = v4_row_codecs(c, kv_cache_dtype, dtype)
        pools = CachePools(plan)
        pools.ring("window", c.num_hidden_layers, c.sliding_window, row_codec(c.head_dim), device)
        self._paged: list[tuple[str, int]] = []
        groups: dict[str, list[V4Attention]] = {}
        for layer in self.model.layers:
            attn = layer.self_attn
            if attn.compressor is not None:
                groups.setdefault(f"{attn.kind}{attn.ratio}.", []).append(attn)
        for prefix, attns in groups.items():
            comp = attns[0].compressor
            parts = [(prefix, comp, row_codec, "entries")]
            if attns[0].kind == "csa":
                parts.append((prefix + "index_", comp.indexer, key_codec, "keys"))
            for name, module, codec, kind in parts:
                width = module.kv_proj.weight.shape[0]
                raw = plain_codec(width, dtype)
                pools.ring(name + "kv", len(attns), module.ring_rows, raw, device)
                pools.ring(name + "gate", len(attns), module.ring_rows, raw, device)
                pools.paged(name + "entries", kind, module.ratio, len(attns), page_rows, codec(module.head_dim),
                            device)
                self._paged.append((name + "entries", module.ratio))
            for i, attn in enumerate(attns):
                attn.compressor.bind_pools(prefix, i)
                if attn.kind == "csa":
                    attn.compressor.indexer.bind_pools(prefix + "index_", i)
        return pools

    def new_state(self) -> V4RequestState:
        """An empty per-request state (no tokens consumed)."""
        return V4RequestState(self.cache_pools().lease())

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 1 or input_ids.shape[0] == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(input_ids.shape)}")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.config.vocab_size})")

    def _check_state(self, state) -> None:
        if not isinstance(state, V4RequestState) or state.lease.pools is not self.cache_pools():
            raise ValueError("state was not made by this model's new_state()")

    def _reserve(self, state: V4RequestState, num_tokens: int) -> None:
        for name, ratio in self._paged:
            state.lease.reserve(name, num_tokens // ratio)

    def forward(self, input_ids: torch.Tensor, state: V4RequestState) -> torch.Tensor:
        """Final-normed hidden states [T, D] of one request's next T tokens ``input_ids`` [T]."""
        self._check_ids(input_ids)
        self._check_state(state)
        t, par, pools = input_ids.shape[0], self.par, self.cache_pools()
        self._reserve(state, state.num_tokens + t)
        positions = torch.arange(state.num_tokens, state.num_tokens + t, device=input_ids.device)
        rows = par.step_rows(t, input_ids.device)
        x = first_rows(par, t)(self.model.embed_tokens(input_ids))
        streams = x.unsqueeze(1).expand(x.shape[0], self.model.hc_mult, x.shape[-1]).contiguous()
        for layer in self.model.layers:
            rope = self.compress_rope if layer.uses_compress_rope else self.main_rope
            streams = layer(streams, input_ids,
                            lambda h, a=layer.self_attn, r=rope: a(h, positions, state.lease, pools, r,
                                                                   self.sparse_prefill), rows)
        state.num_tokens += t
        return final_rows(par, self.model.norm(self.model.hc_head(streams)), t)

    def decode(self, input_ids: torch.Tensor, states: list[V4RequestState]) -> torch.Tensor:
        """Final-normed hidden states [B, D] of one new token per request: ``input_ids[b]`` at
        position ``states[b].num_tokens``; advances every state by one (as B calls of
        :meth:`forward` with one token each would)."""
        inputs = self.prepare_decode(input_ids, states)
        out = self.decode_batch(input_ids, inputs)
        self.finish_decode(states, inputs)
        return out

    def prepare_decode(self, input_ids: torch.Tensor, states: list[V4RequestState],
                       page_widths: dict[str, int] | None = None, check_ids: bool = True) -> DecodeInputs:
        """The host side of :meth:`decode`: check the states, reserve the pages of the new
        entries, build the batch index (page tables ``page_widths`` wide, default the widest
        request). ``check_ids=False`` skips the vocabulary range check (a device sync; the
        captured decode's ids come from the sampler and admitted prompts)."""
        if check_ids:
            self._check_ids(input_ids)
        if input_ids.dim() != 1 or len(states) != input_ids.shape[0] or len({id(s) for s in states}) != len(states):
            raise ValueError(f"decode needs one distinct state per token: {tuple(input_ids.shape)} tokens, "
                             f"{len(states)} states")
        pools = self.cache_pools()
        for s in states:
            self._check_state(s)
            self._reserve(s, s.num_tokens + 1)
        index = BatchIndex.build(pools, [s.lease for s in states], [s.num_tokens for s in states],
                                 input_ids.device, page_widths)
        return DecodeInputs(index)

    def decode_batch(self, input_ids: torch.Tensor, inputs: DecodeInputs) -> torch.Tensor:
        """The device side of :meth:`decode`: no host sync, shapes from B and the page-table
        widths only (what a CUDA graph captures, model/v4/decode_buffers.py)."""
        batch, pools = inputs.index, self.cache_pools()
        n, par = input_ids.shape[0], self.par
        rows = par.step_rows(n, input_ids.device)
        x = first_rows(par, n)(self.model.embed_tokens(input_ids))
        streams = x.unsqueeze(1).expand(x.shape[0], self.model.hc_mult, x.shape[-1]).contiguous()
        for layer in self.model.layers:
            rope = self.compress_rope if layer.uses_compress_rope else self.main_rope
            streams = layer(streams, input_ids,
                            lambda h, a=layer.self_attn, r=rope: a.decode(h, batch, pools, r, self.sparse_decode,
                                                                        self.kv_write), rows)
        return final_rows(par, self.model.norm(self.model.hc_head(streams)), n)

    def finish_decode(self, states: list[V4RequestState], inputs: DecodeInputs) -> None:
        """Advance the states of a :meth:`decode_batch` by their token."""
        for s in states:
            s.num_tokens += 1

    def decode_buffers(self, max_batch: int, max_tokens: int) -> DecodeBuffers:
        """Persistent decode inputs for up to ``max_batch`` requests of up to ``max_tokens`` tokens."""
        pools = self.cache_pools()
        return DecodeBuffers(pools, max_batch, pools.page_widths(max_tokens), self.lm_head.weight.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab] for hidden rows [T, D]."""
        return self.par.gather_vocab(self.lm_head(hidden).float())[..., : self.config.vocab_size]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy in-memory HF-named tensors (the names of ``state_dict()``) in; every model tensor
        is required. (A checkpoint directory goes through :func:`load_deepseek_v4`.)

        ``mtp.*`` tensors (the multi-token-prediction block) are skipped with one log line.
        Unknown names and shape mismatches raise ``ValueError`` naming the tensor.
        """
        own = self.state_dict()
        seen, skipped_mtp = set(), 0
        for name, t in tensors:
            if name.startswith("mtp.") or ".mtp." in name:
                skipped_mtp += 1
                continue
            if name not in own:
                raise ValueError(f"unexpected tensor {name!r} for DeepseekV4ForCausalLM")
            if tuple(own[name].shape) != tuple(t.shape):
                raise ValueError(f"shape mismatch for {name}: expected {tuple(own[name].shape)}, got {tuple(t.shape)}")
            own[name].copy_(t.to(own[name].dtype))
            seen.add(name)
        if skipped_mtp:
            logger.info("skipped %d MTP tensors (mtp.*): multi-token prediction is not loaded", skipped_mtp)
        if self.config.tie_word_embeddings:
            seen.add("lm_head.weight")  # shares the embedding's tensor
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(f"missing tensor {missing[0]!r} (and {len(missing) - 1} more)" if len(missing) > 1
                             else f"missing tensor {missing[0]!r}")


def v4_row_codecs(config: V4Config, kv_cache_dtype: str, dtype: torch.dtype):
    """(window row / entry codec, index key codec) factories ``dim → RowCodec`` for ``kv_cache_dtype``."""
    if kv_cache_dtype == "auto":
        return (lambda dim: plain_codec(dim, dtype)), (lambda dim: plain_codec(dim, dtype))
    if kv_cache_dtype.startswith("fp8"):
        from model.v4.cache_codecs import v4_fp8_index_key_codec, v4_fp8_row_codec
        return (lambda dim: v4_fp8_row_codec(dim, config.qk_rope_head_dim, dtype),
                lambda dim: v4_fp8_index_key_codec(dim, dtype))
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: DeepSeek-V4 supports auto and fp8")


def load_deepseek_v4(checkpoint_dir: str, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu", par: ParallelContext | None = None) -> DeepseekV4ForCausalLM:
    """Build the model ``config.json`` describes on ``device`` and stream its weights in.

    Any name spelling :mod:`model.v4_loader` reads; FP8 / MXFP4 tensors are dequantized on
    the CPU to ``dtype`` one at a time. MTP tensors are skipped with one log line. Errors are
    one :class:`model.loader.CheckpointError` line naming the file or tensor. ``par``: load
    this rank's shard (model/v4_parallel.py)."""
    config = read_v4_config(checkpoint_dir, ("deepseek_v4",))
    par = par or ParallelContext()
    with torch.device(device):
        model = DeepseekV4ForCausalLM(config, dtype, par)
    load_v4_into_module(model, checkpoint_dir, device=device, shard_spec=shard_spec(par))
    return model.eval()
