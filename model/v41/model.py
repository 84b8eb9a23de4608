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
``model.decode(ids [B], states)`` advances B requests by one token each in one forward (the
same logits B one-token calls give); the states' rows live in the model's shared pools
(model/v4/cache_pool.py), stored per ``configure_cache``'s cache dtype; with ``fp8`` records
the decode attends them in place on ``model.sparse_decode`` (model/v4/sparse_attention.py).

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

from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0
from kernels.weight_formats import E8M0_DTYPE, FP8_DTYPE
from kernels.attention.v4_indexer import choose_indexer
from model.layers.norm import RMSNorm
from model.v4.rope import RotaryTable
from model.v4_loader import CheckpointError, iter_v4_weights, read_v4_config, stored_fp8_blocks, stored_mxfp4_experts
from model.v41.attention import Attention
from model.v41.config import V41Config
from model.v41.fp8_linear import FP8_LINEAR_WEIGHTS, MXFP8_WEIGHT_BLOCK, choose_mxfp8_linears
from model.v41.engram import Engram, EngramHasher, build_compressed_token_map, synthetic_compressed_token_map
from model.v41.mhc import (
    collapse_streams,
    expand_streams_fp32,
    mhc_site_weights,
    one_hot_pre,
)
from model.v41.moe import MoE, stacked_mxfp4_unsupported
from model.v4.cache_pool import BatchIndex, CachePools, PoolPlan, plain_codec
from model.v4.decode_buffers import DecodeBuffers, DecodeInputs
from model.v4.sparse_attention import (V4SparseDecodeBackend, V4SparsePrefillBackend, choose_sparse_decode,
                                       choose_sparse_prefill)
from model.v41.state import RequestState
from model.parallel import ParallelContext, StepRows
from model.v4_parallel import final_rows, first_rows, row_parallel_site, shard_spec, vocab_embedding

logger = logging.getLogger(__name__)

# Checkpoint tensors of parts this model does not build: DSpark draft blocks, vision tower,
# aligner and image delimiter embeddings.
_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.ffn\.(experts\.\d+\.w[123]\.weight)")
_STACKED_EXPERTS = re.compile(r"\.ffn\.w(13|2)_mxfp4(_scale)?$")
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
                 par: ParallelContext | None = None, mxfp4_experts: bool = False, mxfp8_linears: bool = False) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.par = par = par or ParallelContext()
        self.norm_eps, self.hc_eps, self.sinkhorn_iters = c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters
        self.attn = Attention(c, layer_idx, dtype, par.tp_size, mxfp8_linears)
        self.ffn = MoE(c, dtype, par, mxfp4_experts, mxfp8_linears)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.engram = Engram(c, layer_idx, dtype, par, mxfp8_linears) if layer_idx in c.engram_layer_ids else None
        mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(mix, width, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _mixes(self, streams: torch.Tensor, site: str):
        return mhc_site_weights(streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                                getattr(self, f"hc_{site}_scale"), hc_eps=self.hc_eps,
                                sinkhorn_iters=self.sinkhorn_iters, norm_eps=self.norm_eps)

    def forward(self, streams, pre, hash_ids, n: int, attend, rows: StepRows | None = None):
        """streams [T, hc, D], pre [T, hc] from the previous site -> (streams, this FFN site's pre);
        ``attend`` runs the attention on the normed input of the step's ``n`` valid rows (one
        request's chunk, or one decode token of each of B requests). Under TP the streams are
        this rank's rows (model/v4_parallel.py)."""
        attend = row_parallel_site(self.par, n, attend)
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
    def __init__(self, config: V41Config, dtype: torch.dtype, par: ParallelContext,
                 mxfp4_experts: bool = False, mxfp8_linears: bool = False) -> None:
        super().__init__()
        c = config
        self.embed = vocab_embedding(c.vocab_size, c.hidden_size, par, dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, par, mxfp4_experts, mxfp8_linears)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.main_rope = RotaryTable(c.qk_rope_head_dim, c.main_rope)
        self.compress_rope = RotaryTable(c.qk_rope_head_dim, c.compress_rope)


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, config: V41Config, dtype: torch.dtype = torch.bfloat16,
                 par: ParallelContext | None = None, mxfp4_experts: bool = False, mxfp8_linears: bool = False) -> None:
        """``par``: this rank's place in TP / DP / EP (model/v4_parallel.py); None: one device.
        ``mxfp4_experts``: the routed experts are held as stacked MXFP4 only (model/v41/moe.py);
        ``mxfp8_linears``: the FP8 linears are held as stored and run as MXFP8 (model/v41/fp8_linear.py)."""
        super().__init__()
        self.config = config
        self.par = par = par or ParallelContext()
        self.mxfp4_experts = mxfp4_experts
        self.mxfp8_linears = mxfp8_linears
        self.model = TextModel(config, dtype, par, mxfp4_experts, mxfp8_linears)
        self.lm_head = nn.Linear(config.hidden_size, -(-config.vocab_size // par.tp_size), bias=False, dtype=dtype)
        self.hasher: EngramHasher | None = None
        self.sparse_decode: V4SparseDecodeBackend | None = None  # see configure_cache
        self.sparse_prefill: V4SparsePrefillBackend | None = None
        self.kv_write = "auto"  # the decode's KV writes: auto, torch or triton (kernels/attention/v4_kv_write.py)

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

    def checkpoint_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The HF-V4.1 tensors this model loads, {name: (shape on this rank, dtype)}: its state
        dict, with stacked MXFP4 experts listed as the checkpoint's per-expert tensors."""
        out = {name: (tuple(t.shape), t.dtype) for name, t in self.state_dict(keep_vars=True).items()
               if not (self.mxfp4_experts and _STACKED_EXPERTS.search(name))}
        if self.mxfp4_experts:
            for i, layer in enumerate(self.model.layers):
                for name, shape in layer.ffn.expert_tensor_shapes().items():
                    out[f"model.layers.{i}.ffn.{name}"] = (shape, torch.int8)
        return out

    def stacked_expert(self, name: str) -> tuple[MoE, str] | None:
        """(the MoE, the name inside it) of a per-expert tensor held in stacked MXFP4, else None."""
        m = _EXPERT_TENSOR.fullmatch(name) if self.mxfp4_experts else None
        return (self.model.layers[int(m[1])].ffn, m[2]) if m else None

    @torch.no_grad()
    def load_tensor(self, name: str, value, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy one :meth:`checkpoint_tensors` tensor in (plain values are cast; per-expert
        tensors of stacked MXFP4 experts are placed in the stacks, quantized if given plain;
        MXFP8 linears take the stored e4m3 values and UE8M0 scales only)."""
        expert = self.stacked_expert(name)
        if expert is not None:
            expert[0].load_expert(expert[1], value)
            return
        dst = (state if state is not None else self.state_dict(keep_vars=True))[name]
        if dst.dtype in (FP8_DTYPE, E8M0_DTYPE) and value.dtype != dst.dtype:
            raise ValueError(f"tensor {name}: this MXFP8 model takes the checkpoint's {dst.dtype} tensor as stored, "
                             f"got {value.dtype}")
        dst.copy_(value.to(dst.dtype))

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy in-memory HF-V4.1-named tensors in (cast to each parameter's dtype); DSpark/vision
        tensors are skipped (a checkpoint directory goes through :func:`load_deepseek_v41`).
        A missing, unexpected or mis-shaped tensor is one ValueError line naming it."""
        names, _ = split_unused_weights(tensors)
        params = self.checkpoint_tensors()
        missing = sorted(set(params) - set(names))
        unexpected = sorted(set(names) - set(params))
        if missing or unexpected:
            raise ValueError(
                f"DeepSeek-V4.1 checkpoint does not match the config: {len(missing)} missing "
                f"(first: {missing[:1]}), {len(unexpected)} unexpected (first: {unexpected[:1]})"
            )
        for name in names:
            src, (shape, _) = tensors[name], params[name]
            if tuple(src.shape) != tuple(shape):
                raise ValueError(
                    f"tensor {name}: checkpoint shape {tuple(src.shape)}, model expects {tuple(shape)}")
        state = self.state_dict(keep_vars=True)
        for name in names:
            self.load_tensor(name, tensors[name], state)

    def configure_cache(self, kv_cache_dtype: str = "auto", page_rows: int = 64, plan: PoolPlan | None = None,
                        attention_backend: str = "auto", indexer_backend: str = "auto",
                        prefill_backend: str = "auto") -> None:
        """How new states store their rows: ``auto`` (the model dtype, values already rounded to
        the trained FP8/FP4 grids) or ``fp8`` (the packed records: window rows e4m3 + ue8m0 per
        32, entries e2m1 + e4m3 per 16, index keys e2m1 + ue8m0 per 32; the same values), in
        pages of ``page_rows`` entries that grow on demand — or, with ``plan``, in pools of the
        plan's fixed sizes, allocated now — and the sparse-decode backend the batched decode
        attends packed records with (``attention_backend``: model/v4/sparse_attention.py), and
        the indexer's scorer of packed key records (``indexer_backend``: auto, triton or torch;
        kernels/attention/v4_indexer.py), and the sparse-prefill backend of the chunks
        (``prefill_backend``; None on a CPU: the torch attention). Replaces the pools: states
        made before keep the old ones."""
        c, weight = self.config, self.lm_head.weight
        v41_row_codecs(c, kv_cache_dtype, weight.dtype)  # validates
        heads, formats = self.model.layers[0].attn.num_heads, ("v41_window", "v41_entry")
        self.sparse_decode = choose_sparse_decode(
            attention_backend, kv_cache_dtype, weight.device, heads, c.head_dim, c.qk_rope_head_dim, page_rows,
            weight.dtype, formats)
        self.sparse_prefill = choose_sparse_prefill(prefill_backend, kv_cache_dtype, weight.device, heads, c.head_dim,
                                                    c.qk_rope_head_dim, weight.dtype, formats)
        scorer = choose_indexer(indexer_backend, kv_cache_dtype, weight.device, c.index_head_dim)
        for layer in self.model.layers:
            if layer.attn.indexer is not None:
                layer.attn.indexer.backend = scorer
        self._cache_settings = (kv_cache_dtype, page_rows, plan)
        self._pools = None
        if plan is not None:
            self.cache_pools()

    def cache_pools(self) -> CachePools:
        """The row pools every state of this model leases units of (model/v41/state.py)."""
        if getattr(self, "_pools", None) is None:
            self._pools = self._build_pools(*getattr(self, "_cache_settings", ("auto", 64, None)))
        return self._pools

    def _build_pools(self, kv_cache_dtype: str, page_rows: int, plan: PoolPlan | None) -> CachePools:
        c, weight = self.config, self.lm_head.weight
        window, entry, key = v41_row_codecs(c, kv_cache_dtype, weight.dtype)
        pools = CachePools(plan)
        pools.ring("window", c.num_hidden_layers, c.sliding_window, window, weight.device)
        self._paged: list[tuple[str, int]] = []
        for s in c.kv_source_layer_ids:
            attn, ratio, pre = self.model.layers[s].attn, c.compress_ratios[s], f"src{s}."
            if ratio > 1:
                for part in ("kv", "gate"):
                    pools.ring(pre + part, 1, ratio, plain_codec(c.head_dim, torch.float32), weight.device)
            parts = [("entries", entry)] + ([("keys", key)] if attn.indexer is not None else [])
            for part, codec in parts:
                pools.paged(pre + part, part, ratio, 1, page_rows, codec, weight.device)
                self._paged.append((pre + part, ratio))
        return pools

    def new_state(self) -> RequestState:
        return RequestState(self.cache_pools().lease())

    def _begin(self, input_ids: torch.Tensor, state: RequestState, num_new: int) -> None:
        if not isinstance(state, RequestState) or state.lease.pools is not self.cache_pools():
            raise ValueError("state was not made by this model's new_state()")
        for name, ratio in self._paged:
            state.lease.reserve(name, (state.num_tokens + num_new) // ratio)

    def _hash_ids(self, input_ids: torch.Tensor, histories: list[list[int]]):
        if not self.config.engram_layer_ids:
            return None, histories
        if self.hasher is None:
            raise RuntimeError("this checkpoint has engram layers: call bind_tokenizer(tokenizer.json) first")
        if len(histories) == 1:
            hash_ids, history = self.hasher(input_ids, histories[0])
            return hash_ids, [history]
        return self.hasher.decode_rows(input_ids, histories)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: RequestState) -> torch.Tensor:
        """input_ids [T] (the request's next tokens) -> logits [T, vocab] fp32; advances ``state``."""
        c = self.config
        t = input_ids.shape[0]
        if t == 0:
            raise ValueError("DeepSeek-V4.1 forward needs at least one token")
        self._begin(input_ids, state, t)
        positions = torch.arange(state.num_tokens, state.num_tokens + t, device=input_ids.device)
        hash_ids, (state.engram_history,) = self._hash_ids(input_ids, [state.engram_history])
        par = self.par
        rows = par.step_rows(t, input_ids.device)
        x = first_rows(par, t)(self.model.embed(input_ids))
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        pre = one_hot_pre(x.shape[0], c.hc_mult, input_ids.device)
        step: dict = {}
        for layer in self.model.layers:
            rope = self.model.compress_rope if layer.attn.ratio else self.model.main_rope
            streams, pre = layer(streams, pre, hash_ids, t,
                                 lambda h, a=layer.attn, r=rope: a(h, positions, r, state, step, self.sparse_prefill),
                                 rows)
        hidden = final_rows(par, self.model.norm(collapse_streams(streams, pre)), t)
        state.num_tokens += t
        return par.gather_vocab(self.lm_head(hidden).float())[..., : c.vocab_size]

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        """One new token per request (``input_ids[b]`` at ``states[b].num_tokens``) -> logits
        [B, vocab] fp32; advances every state by one, as B one-token :meth:`forward` calls would."""
        inputs = self.prepare_decode(input_ids, states)
        out = self.decode_batch(input_ids, inputs)
        self.finish_decode(states, inputs)
        return out

    def prepare_decode(self, input_ids: torch.Tensor, states: list[RequestState],
                       page_widths: dict[str, int] | None = None, check_ids: bool = True) -> DecodeInputs:
        """The host side of :meth:`decode`: check the states, reserve the pages of the new
        entries, build the batch index (page tables ``page_widths`` wide, default the widest
        request) and hash the engram n-grams (``check_ids`` is V4's flag; V4.1 checks none)."""
        if input_ids.dim() != 1 or len(states) != input_ids.shape[0] or len({id(s) for s in states}) != len(states):
            raise ValueError(f"decode needs one distinct state per token: {tuple(input_ids.shape)} tokens, "
                             f"{len(states)} states")
        for s in states:
            self._begin(input_ids, s, 1)
        pools = self.cache_pools()
        index = BatchIndex.build(pools, [s.lease for s in states], [s.num_tokens for s in states], input_ids.device,
                                 page_widths)
        hash_ids, histories = self._hash_ids(input_ids, [s.engram_history for s in states])
        return DecodeInputs(index, hash_ids, histories)

    @torch.no_grad()
    def decode_batch(self, input_ids: torch.Tensor, inputs: DecodeInputs) -> torch.Tensor:
        """The device side of :meth:`decode`: no host sync, shapes from B and the page-table
        widths only (what a CUDA graph captures, model/v4/decode_buffers.py)."""
        c, batch, pools = self.config, inputs.index, self.cache_pools()
        n, par = input_ids.shape[0], self.par
        rows = par.step_rows(n, input_ids.device)
        x = first_rows(par, n)(self.model.embed(input_ids))
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        pre = one_hot_pre(x.shape[0], c.hc_mult, input_ids.device)
        step: dict = {}
        for layer in self.model.layers:
            rope = self.model.compress_rope if layer.attn.ratio else self.model.main_rope
            streams, pre = layer(streams, pre, inputs.hash_ids, n,
                                 lambda h, a=layer.attn, r=rope: a.decode(h, batch, r, step, pools, self.sparse_decode,
                                                                       self.kv_write),
                                 rows)
        hidden = final_rows(par, self.model.norm(collapse_streams(streams, pre)), n)
        return par.gather_vocab(self.lm_head(hidden).float())[..., : c.vocab_size]

    def finish_decode(self, states: list[RequestState], inputs: DecodeInputs) -> None:
        """Advance the states of a :meth:`decode_batch` by their token (position, engram look-back)."""
        for s, history in zip(states, inputs.histories):
            s.num_tokens += 1
            s.engram_history = history

    def decode_buffers(self, max_batch: int, max_tokens: int) -> DecodeBuffers:
        """Persistent decode inputs for up to ``max_batch`` requests of up to ``max_tokens`` tokens."""
        pools, device = self.cache_pools(), self.lm_head.weight.device
        hash_shape = None
        if self.config.engram_layer_ids:
            if self.hasher is None:
                raise RuntimeError("this checkpoint has engram layers: call bind_tokenizer(tokenizer.json) first")
            hash_shape = tuple(self.hasher.decode_rows(torch.zeros(1, dtype=torch.long), [[]])[0].shape[1:])
        return DecodeBuffers(pools, max_batch, pools.page_widths(max_tokens), device, hash_shape)


def v41_row_codecs(config: V41Config, kv_cache_dtype: str, dtype: torch.dtype):
    """(window row, compressed entry, index key) codecs for ``kv_cache_dtype``."""
    d, k = config.head_dim, config.index_head_dim
    if kv_cache_dtype == "auto":
        return (plain_codec(d, dtype, lambda x: fake_quant_fp8_ue8m0(x, 32), "fake_v41_window"),
                plain_codec(d, dtype, lambda x: fake_quant_fp4(x, 16, "e4m3"), "fake_v41_entry"),
                plain_codec(k, dtype, lambda x: fake_quant_fp4(x, 32, "ue8m0"), "fake_v41_key"))
    if kv_cache_dtype.startswith("fp8"):
        from model.v4.cache_codecs import v41_fp8_codecs
        return v41_fp8_codecs(config, dtype)
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: DeepSeek-V4.1 supports auto and fp8")


def load_deepseek_v41(checkpoint_dir: str, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", par: ParallelContext | None = None,
                      mxfp4_experts: bool = True, linear_backend: str = "auto") -> DeepseekV41ForCausalLM:
    """Build the text model ``config.json`` describes on ``device``, stream its weights in
    (engram tables keep their scale tensor) and, when it has engram layers, bind the
    checkpoint's ``tokenizer.json``. FP8 linears stay e4m3 + UE8M0 and run as MXFP8 where
    ``linear_backend`` (``--linear-backend``: auto, mxfp8, dequantized) picks it, else they are
    dequantized to ``dtype`` (model/v41/fp8_linear.py). Routed experts stored as MXFP4 stay
    packed in stacked MXFP4 tensors on the device (model/v41/moe.py) unless ``mxfp4_experts``
    is False (then, as other experts, per-expert modules in ``dtype``). Errors are one
    :class:`model.loader.CheckpointError` line. ``par``: load this rank's shard
    (model/v4_parallel.py)."""
    config = read_v4_config(checkpoint_dir, ("deepseek_v41", "deepseek_v41_text"))
    par = par or ParallelContext()
    tokenizer = os.path.join(checkpoint_dir, "tokenizer.json")
    if config.engram_layer_ids and not os.path.isfile(tokenizer):
        raise CheckpointError(f"{checkpoint_dir!r} has engram layers but no tokenizer.json to hash tokens with")
    stacked = mxfp4_experts and stored_mxfp4_experts(checkpoint_dir) and choose_stacked_mxfp4(config, par)
    stored_fp8 = stored_fp8_blocks(checkpoint_dir, FP8_LINEAR_WEIGHTS, MXFP8_WEIGHT_BLOCK)
    mxfp8 = choose_mxfp8_linears(config, linear_backend, device, dtype, par, stored_fp8)
    with torch.device(device):
        model = DeepseekV41ForCausalLM(config, dtype, par, stacked, mxfp8)
    state = model.state_dict(keep_vars=True)
    for name, value in iter_v4_weights(checkpoint_dir, model.checkpoint_tensors(), device=device,
                                       shard_spec=shard_spec(par),
                                       keep_quantized=lambda n: model.stacked_expert(n) is not None):
        model.load_tensor(name, value, state)
    if config.engram_layer_ids:
        model.bind_tokenizer(tokenizer)
    return model.eval()


def choose_stacked_mxfp4(config: V41Config, par: ParallelContext | None = None) -> bool:
    """Whether MXFP4 routed experts can be held stacked on this rank; logs why not."""
    reason = stacked_mxfp4_unsupported(config, par)
    if reason:
        logger.info("DeepSeek-V4.1: MXFP4 routed experts dequantized to per-expert modules (%s)", reason)
    return reason is None
