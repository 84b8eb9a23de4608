"""Multi-head Latent Attention (DeepSeek V2/V3) with a paged latent cache.

Per token the cache holds [kv_c ‖ k_pe] (kv_lora_rank + rope dims = 576 for R1), the same
for every head and every TP rank. Two paths read it:

* **prefill** (non-absorbed): up-project the context's latents with ``kv_b_proj`` into
  per-head keys/values and run ordinary causal attention — cheap per token when the query
  block is long;
* **decode** (absorbed): fold W_UK into the query (q_nope · W_UK → 512 wide) and attend
  directly over the latents, then apply W_UV to the latent output — no up-projection of the
  whole context per step.

Both give the same result up to rounding; tests check decode against prefill.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kernels.attention import default_prefill_backend
from kernels.fp8 import FP8_DTYPE, dequantize_per_tensor, dequantize_weight_blocks
from kernels.mla_kv_write import write_kv_cache
from kernels.mla_prefill import assemble_prefill_kv, merge_lse_
from kernels.mla_query_stage import stage_query
from model.config import ModelConfig
from model.forward_context import AttentionMetadata, get_forward_context
from model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from model.layers.norm import RMSNorm
from model.layers.rotary import RotaryEmbedding


class MLAAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads
        self.num_local_heads = divide(c.num_attention_heads, tp_size, "num_attention_heads")
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_dim = c.qk_head_dim
        self.softmax_scale = c.softmax_scale
        self.rotary = rotary
        self.eps = c.rms_norm_eps
        lin = dict(dtype=dtype, fp8_block=fp8_block)
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)
        if c.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(c.hidden_size, c.q_lora_rank, **lin)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, self.num_heads * self.qk_dim, **tp, **lin)
            self.q_proj = None
        else:
            self.q_proj = ColumnParallelLinear(c.hidden_size, self.num_heads * self.qk_dim, **tp, **lin)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, c.kv_lora_rank + self.rope_dim, **lin)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(c.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                              **tp, **lin)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, c.hidden_size, **tp, **lin)
        # Absorbed per-head matrices, derived from kv_b_proj after loading.
        self.register_buffer("w_uk", torch.empty(0), persistent=False)  # [H_local, nope, kv_lora]
        self.register_buffer("w_uv", torch.empty(0), persistent=False)  # [H_local, v, kv_lora]
        self.compute_dtype = dtype

    # ---- weights ---------------------------------------------------------------------------
    def kv_b_weight_dense(self) -> torch.Tensor:
        w = self.kv_b_proj.weight
        if w.dtype == FP8_DTYPE:
            return dequantize_weight_blocks(w, self.kv_b_proj.weight_scale_inv, self.kv_b_proj.fp8_block)
        return w.float()

    def process_weights_after_loading(self) -> None:
        """Split this rank's kv_b_proj into W_UK and W_UV for the absorbed decode path."""
        w = self.kv_b_weight_dense().view(self.num_local_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope_dim].contiguous().to(self.compute_dtype)
        self.w_uv = w[:, self.nope_dim :].contiguous().to(self.compute_dtype)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_local_heads, self.qk_dim)  # [q_nope ‖ q_pe], q_pe not rotated yet
        kv = self.kv_a_proj_with_mqa(x)

        ctx = get_forward_context()
        if ctx is None or ctx.attn is None:
            kv_c = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
            k_pe = self.rotary(positions, kv[:, self.kv_lora_rank :].unsqueeze(1)).squeeze(1)
            out = self._prefill_one(positions, q, kv_c, k_pe)
        else:
            out = self._forward_paged(positions, q, kv, ctx)
        return self.o_proj(out.reshape(t, self.num_local_heads * self.v_dim))

    def _forward_paged(self, positions, q, kv, ctx) -> torch.Tensor:
        attn: AttentionMetadata = ctx.attn
        cache = ctx.kv_caches[self.layer_idx]
        # The per-layer scale only means something for an FP8 cache.
        k_scale = ctx.kv_scales[self.layer_idx] if (ctx.kv_scales and cache.dtype == FP8_DTYPE) else 1.0
        # One fused pass: norm kv_c, rotate k_pe, quantize, scatter to the slots (slot -1 and
        # rows past len(slot_mapping), i.e. TP padding, write nothing real).
        kv_c, k_pe = write_kv_cache(kv, self.kv_a_layernorm.weight, self.eps, positions,
                                    self.rotary.cos_sin_cache, cache, attn.slot_mapping, k_scale)
        t, nd, pm = q.shape[0], attn.num_decode_tokens, ctx.prefill_metadata
        # Rows no path writes (TP padding) must be zeros; when decodes and prefill chunks cover
        # every row, the buffer needs no fill.
        covered = nd + (0 if pm is None else pm.row_end - pm.row_start) == t and (pm is None or pm.row_start == nd)
        out = (q.new_empty if covered else q.new_zeros)(t, self.num_local_heads, self.v_dim)
        if nd:
            out[:nd] = self._decode(q[:nd, :, : self.nope_dim], q[:nd, :, self.nope_dim :], positions[:nd], cache,
                                    ctx, k_scale)
        if pm is not None:
            out[pm.row_start : pm.row_end] = self._prefill_chunks(positions, q, kv_c, k_pe, cache, ctx, k_scale)
        return out

    def _prefill_chunks(self, positions, q, kv_c, k_pe, cache, ctx, k_scale: float) -> torch.Tensor:
        """Every prefill chunk of the step at once: one gather of all chunks' cached latents,
        one ``kv_b_proj`` over [prefixes ‖ chunks] laid out ragged (chunk after chunk, see
        ``PrefillMetadata``), one call of the step's prefill backend. The chunks' rows of q
        (q_pe un-rotated) are rotated in place: q's own buffer is the attention input."""
        pm = ctx.prefill_metadata
        backend = ctx.prefill_backend
        s, e = pm.row_start, pm.row_end
        q = self.rotary.rotate_trailing_(positions[s:e], q[s:e])
        kv_c, k_pe = kv_c[s:e], k_pe[s:e]
        if pm.context_windows is not None:
            return self._prefill_in_context_windows(q, kv_c, k_pe, cache, pm, backend, k_scale)
        if pm.prefix_slots is not None:
            prefix = self._gather_prefix(cache, pm.prefix_slots, k_scale, kv_c.dtype)
            latent = torch.cat([prefix, torch.cat([kv_c, k_pe], dim=-1)]).index_select(0, pm.kv_order)
            kv_c, k_pe = latent[:, : self.kv_lora_rank], latent[:, self.kv_lora_rank :]
        k, v = self._up_project(kv_c, k_pe, backend.value_width(self.qk_dim, self.v_dim))
        return backend.forward_varlen(q, k, v, pm, self.softmax_scale)[..., : self.v_dim]

    @staticmethod
    def _gather_prefix(cache, slots, k_scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Cached latent rows [len(slots), kv_lora + rope] at the flat cache rows ``slots``."""
        rows = cache.view(-1, cache.shape[-1])
        if rows.dtype == FP8_DTYPE:  # gather the bytes, then widen only the rows read
            prefix = rows.view(torch.uint8).index_select(0, slots).view(FP8_DTYPE)
            return dequantize_per_tensor(prefix, k_scale, dtype)
        return rows.index_select(0, slots).to(dtype)

    def _prefill_in_context_windows(self, q, kv_c, k_pe, cache, pm, backend, k_scale: float) -> torch.Tensor:
        """The step's chunks when their cached prefixes exceed the context workspace: each
        chunk over its own rows (causal), then over its prefix one window of at most the
        workspace's rows at a time (up-projected, attended without a mask), the parts merged by
        their log-sum-exps. Memory stays that of one window, whatever the prefixes add up to."""
        width = backend.value_width(self.qk_dim, self.v_dim)
        k, v = self._up_project(kv_c, k_pe, width)
        out, lse = backend.attend_with_lse(q, k, v, pm.own_segments, True, self.softmax_scale)
        acc = out[..., : self.v_dim].float()
        del k, v, out
        for w in pm.context_windows:
            latent = self._gather_prefix(cache, pm.prefix_slots[w.prefix_start : w.prefix_end], k_scale, kv_c.dtype)
            k, v = self._up_project(latent[:, : self.kv_lora_rank], latent[:, self.kv_lora_rank :], width)
            if w.rows is None:
                part, part_lse = backend.attend_with_lse(q[w.row_start : w.row_end], k, v, w.segments, False,
                                                         self.softmax_scale)
                merge_lse_(acc[w.row_start : w.row_end], lse[:, w.row_start : w.row_end], part, part_lse)
            else:  # a chunk without a prefix lies between this window's chunks
                part, part_lse = backend.attend_with_lse(q.index_select(0, w.rows), k, v, w.segments, False,
                                                         self.softmax_scale)
                sub, sub_lse = acc.index_select(0, w.rows), lse.index_select(1, w.rows)
                merge_lse_(sub, sub_lse, part, part_lse)
                acc.index_copy_(0, w.rows, sub)
                lse.index_copy_(1, w.rows, sub_lse)
        return acc.to(q.dtype)

    def _up_project(self, kv_c, k_pe, v_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [T, kv_lora] and rotated k_pe [T, rope] → per-head k [T, H, nope + rope] and
        v [T, H, v_width] (v_dim, or zero-padded wider for a backend that wants it so)."""
        tk = kv_c.shape[0]
        kv = self.kv_b_proj(kv_c).view(tk, self.num_local_heads, self.nope_dim + self.v_dim)
        return assemble_prefill_kv(kv, k_pe, self.nope_dim, v_width or self.v_dim)

    def _prefill_one(self, positions, q, kv_c, k_pe) -> torch.Tensor:
        """Causal attention of a whole sequence without a cache (no forward context), on the
        device's default prefill backend."""
        backend = default_prefill_backend(q.device.type)
        q = self.rotary.rotate_trailing_(positions, q)
        k, v = self._up_project(kv_c, k_pe, backend.value_width(self.qk_dim, self.v_dim))
        return backend.forward(q, k, v, self.softmax_scale)[..., : self.v_dim]

    def _decode(self, q_nope, q_pe, positions, cache, ctx, k_scale: float) -> torch.Tensor:
        """Absorbed decode on the step's backend and metadata (built once for all layers)."""
        nd = q_nope.shape[0]
        md = ctx.decode_metadata
        backend = ctx.decode_backend
        # The stage buffer: W_UK's product fills [..., :512], the rotated q_pe [..., 512:], and
        # one pass quantizes the row for backends that take an FP8 query (a saturating cast:
        # per-tensor query scale 1.0, vLLM's default), so no torch.cat and no second launch.
        q_abs = stage_query(q_nope, self.w_uk, q_pe, positions, self.rotary.cos_sin_cache,
                            out_dtype=backend.query_dtype(cache.dtype, self.compute_dtype))
        out_latent, _ = backend.decode(
            q_abs.reshape(md.batch, md.query_len, self.num_local_heads, -1), cache, md, self.softmax_scale,
            self.kv_lora_rank, k_scale=k_scale, out_dtype=self.compute_dtype,
        )
        out_latent = out_latent.reshape(nd, self.num_local_heads, self.kv_lora_rank)
        return torch.einsum("thc,hvc->thv", out_latent, self.w_uv)
