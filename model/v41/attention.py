"""DeepSeek-V4.1 attention: one shared K=V latent head over [sliding window ‖ shared compressed entries].

Per layer: ``q_res = q_norm(wq_a·x)``, ``q = RoPE(wq_b·q_res)`` (no per-head q norm),
``kv = FP8_32(RoPE(kv_norm(wkv·x)))`` — the window rows, cached as they are used. Layers with
a compressed branch add the compressed cache of their KV source (a source first runs its
:class:`~model.v41.compressor.Compressor`, stores indexer keys, rotates each new latent at its
group's first position and FP4-fake-quantizes it with e4m3 scales in 16-blocks), masked by
the top-k bias of their index source. Scores are ``q·kᵀ/√head_dim`` plus a per-head sink
logit that only enlarges the softmax denominator; the output's RoPE tail is rotated back by
the query position and projected by the grouped low-rank ``wo_a`` (heads in ``o_groups``
contiguous groups) and ``wo_b``. The core, masks, grouped projection and RoPE are V4's
(``model.v4``); what differs is the QAT rounding and the KV sharing. With ``mxfp8`` the FP8
projections keep the checkpoint's e4m3 + UE8M0 blocks and run as MXFP8, the output
projection as one fused call (model/v41/fp8_linear.py).

The roundings are the row codecs of the request's pools (model/v41/model.py): ``auto``
fake-quantizes and stores the model dtype, ``fp8`` stores the packed FP8/FP4 records and
decodes them, the same values bit for bit. :meth:`Attention.forward` runs one request's
chunk, :meth:`Attention.decode` one token of each of B requests (window rows and shared
entries gathered into padded [B, W + N, d] keys with a bias, or with ``fp8`` records attended
in place by a sparse-decode backend, model/v4/sparse_attention.py; the compressor and
indexer updates batched too).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention import V4SparseDecodeBackend, V4SparsePrefillBackend
from kernels.microscaling import fake_quant_fp4, fake_quant_fp8_ue8m0
from kernels.mxfp8_o_proj import mxfp8_o_proj
from kernels.attention.v4_kv_write import compress_step, write_rows
from kernels.v4_kv_write import RowNorm, RowStore, RowTarget, norm_rope_rows
from kernels.v4_sparse_prefill import PrefillEntries, PrefillWindow
from model.layers.norm import RMSNorm
from model.v4.attention import gather_window
from model.v4.attention_core import selected_entry_bias, sink_attention, window_bias
from model.v4.cache_pool import BatchIndex, CachePools, RowLease
from model.v4.output_proj import GroupedLinear
from model.v4.rope import RotaryTable, apply_trailing_rope
from model.v4.sparse_attention import entry_scope, sparse_attend, stored_rows, window_scope, write_window_row
from model.v41.compressor import Compressor
from model.v41.config import V41Config
from model.v41.fp8_linear import MXFP8Linear, fp8_linear
from model.v41.indexer import QUERY_BLOCK, Indexer
from model.v41.state import RequestState
from model.v4_parallel import local_heads_and_groups


class Attention(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype, tp_size: int = 1,
                 mxfp8: bool = False) -> None:
        """``tp_size`` > 1: this rank's heads and output groups (the output is a partial sum).
        ``mxfp8``: the FP8 projections are held as stored and run as MXFP8 (model/v41/fp8_linear.py)."""
        super().__init__()
        self.mxfp8 = mxfp8
        c = config
        self.layer_idx = layer_idx
        self.ratio = c.compress_ratios[layer_idx]
        self.head_dim = c.head_dim
        self.num_heads, self.o_groups = local_heads_and_groups(c.num_attention_heads, c.o_groups, tp_size)
        self.window = c.sliding_window
        self.scale = c.head_dim**-0.5
        self.kv_source = c.kv_source_of(layer_idx)
        self.index_source = c.index_source_of(layer_idx)
        self.source_ratio = c.compress_ratios[self.kv_source] if self.ratio else 0
        self.source_pools = f"src{self.kv_source}."  # this layer's KV source's pools
        self.wq_a = fp8_linear(c.hidden_size, c.q_lora_rank, dtype, mxfp8)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype, weight_after_cast=True)
        self.wq_b = fp8_linear(c.q_lora_rank, self.num_heads * self.head_dim, dtype, mxfp8)
        self.wkv = fp8_linear(c.hidden_size, self.head_dim, dtype, mxfp8)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype, weight_after_cast=True)
        per_group = c.num_attention_heads * self.head_dim // c.o_groups
        self.wo_a = (MXFP8Linear(per_group, self.o_groups * c.o_lora_rank, self.o_groups) if mxfp8
                     else GroupedLinear(per_group, c.o_lora_rank, self.o_groups, dtype))
        self.wo_b = fp8_linear(self.o_groups * c.o_lora_rank, c.hidden_size, dtype, mxfp8)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor = Compressor(c, layer_idx, dtype) if self.kv_source == layer_idx else None
        self.indexer = Indexer(c, layer_idx, dtype, mxfp8) if self.index_source == layer_idx else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_res [N, q_lora_rank], q [N, heads, head_dim], window K=V rows [N, head_dim]) of
        normed x [N, hidden]; cos/sin at the tokens' positions. The rows are FP8-rounded."""
        q_res, q, kv = self.project_raw(x, cos, sin)
        return q_res, q, fake_quant_fp8_ue8m0(kv, 32)

    def project_raw(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """:meth:`project` with the window rows before their FP8 rounding (the pools' codec does it)."""
        q_res, q = self.project_queries(x, cos, sin)
        return q_res, q, norm_rope_rows(self.wkv(x), self.row_norm, cos, sin)

    def project_queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q_res [N, q_lora_rank], q [N, heads, head_dim]) of normed x [N, hidden]."""
        q_res = self.q_norm(self.wq_a(x))
        return q_res, apply_trailing_rope(self.wq_b(q_res).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)

    @property
    def row_norm(self) -> RowNorm:
        return RowNorm(self.kv_norm.weight, self.kv_norm.eps, weight_after_cast=True)

    def shared_entries(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """KV source: the rotated, FP4-fake-quantized entries of compressor latents [G, head_dim];
        cos/sin at the groups' first positions (the indexer keys come from the same latents)."""
        return fake_quant_fp4(apply_trailing_rope(latent, cos, sin), 16, "e4m3")

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[N, hidden] from the attention output [N, heads, head_dim]: undo the RoPE, then the
        grouped low-rank projection (with ``mxfp8`` one fused call, kernels/mxfp8_o_proj.py)."""
        if self.mxfp8:
            return mxfp8_o_proj(out, cos, sin, self.wo_a.operands, self.wo_b.operands, self.o_groups)
        out = apply_trailing_rope(out, cos, sin, inverse=True)
        return self.wo_b(self.wo_a(out.reshape(out.shape[0], self.o_groups, -1)).flatten(1))

    def _store_groups(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pools: CachePools,
                      rows: torch.Tensor) -> None:
        """KV source: store the entries (and indexer keys) of latents [G, head_dim] at flat rows
        ``rows`` [G] of the entry (and key) pools; cos/sin at the groups' first positions."""
        entries = pools[self.source_pools + "entries"]
        entries.put(0, rows, entries.codec.encode(apply_trailing_rope(latent, cos, sin)))
        if self.indexer is not None:
            keys = pools[self.source_pools + "keys"]
            keys.put(0, rows, keys.codec.encode(self.indexer.raw_keys(latent, cos, sin)))

    def _compress(self, x: torch.Tensor, start: int, lease: RowLease, pools: CachePools, rope: RotaryTable) -> None:
        """KV source, one request: pool the groups these tokens complete into the shared
        entries (and indexer keys); keep the open group's rows in the request's rings."""
        r, end, pre = self.ratio, start + x.shape[0], self.source_pools
        pending_kv = pending_gate = None
        if r > 1 and start % r:
            rows = lease.rows(pre + "kv", start - start % r, start)
            pending_kv, pending_gate = pools[pre + "kv"].get(0, rows), pools[pre + "gate"].get(0, rows)
        latent, first, pending_kv, pending_gate = self.compressor(x, start, pending_kv, pending_gate)
        if pending_kv is not None and pending_kv.shape[0]:
            rows = lease.rows(pre + "kv", end - pending_kv.shape[0], end)
            pools[pre + "kv"].put(0, rows, pending_kv)
            pools[pre + "gate"].put(0, rows, pending_gate)
        if latent is None:
            return
        g0 = first // r
        group_pos = first + r * torch.arange(latent.shape[0], device=x.device)
        cos, sin = rope.cos_sin(group_pos, latent.dtype)
        self._store_groups(latent, cos, sin, pools, lease.rows(pre + "entries", g0, g0 + latent.shape[0]))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, state: RequestState,
                step: dict, sparse: V4SparsePrefillBackend | None = None) -> torch.Tensor:
        """One request: x [T, hidden] normed at ``positions``; ``rope`` is this layer's flavour
        (compress iff ratio > 0).

        ``step`` is shared by the layers of one forward: index sources leave their top-k
        picks there (``step["topk_picks"][layer]``) for the reuse layers after them, and the
        candidate source its block mask. Queries attend ``QUERY_BLOCK`` at a time, or, with
        ``sparse``, the backend attends the pool rows in place (model/v4/sparse_attention.py).
        """
        t, start, lease = x.shape[0], int(positions[0]), state.lease
        pools = lease.pools
        cos, sin = rope.cos_sin(positions, x.dtype)
        q_res, q, raw = self.project_raw(x, cos, sin)

        window = pools["window"]
        first_row = max(0, start - (self.window - 1))
        n_cached, keep = start - first_row, min(t, self.window)
        stored = window.codec.encode(raw)
        new_rows = lease.rows("window", start + t - keep, start + t)
        if sparse is not None:  # the new rows go to the ring after the attention read the old ones
            win = PrefillWindow(window.codec.decode(stored).to(q.dtype), stored_rows(window, self.layer_idx,
                                                                                     "v41_window"),
                                lease.rows("window", first_row, start), self.window)
            n, picks = self._entries_and_picks(x, q_res, positions, cos, sin, lease, pools, rope, step, q.dtype)
            entries = None
            if n and picks is not None:  # without an index source the entries stay masked
                name = self.source_pools + "entries"
                entries = PrefillEntries(stored_rows(pools[name], 0, "v41_entry"), lease.rows(name, 0, n), picks)
            out = sparse.prefill(q, start, win, entries, self.attn_sink, self.scale)
            window.put(self.layer_idx, new_rows, stored[t - keep:])
            return self.output(out, cos, sin)
        old = window.get(self.layer_idx, lease.rows("window", first_row, start))
        window.put(self.layer_idx, new_rows, stored[t - keep:])
        window_rows = torch.cat([old, window.codec.decode(stored)]).to(q.dtype)
        row_pos = torch.arange(first_row, start + t, device=x.device)

        entries, picks = None, None
        if self.ratio:
            n, picks = self._entries_and_picks(x, q_res, positions, cos, sin, lease, pools, rope, step, q.dtype)
            if n:
                name = self.source_pools + "entries"
                entries = pools[name].get(0, lease.rows(name, 0, n)).to(q.dtype)

        out = torch.empty_like(q)
        for s in range(0, t, QUERY_BLOCK):
            e = min(t, s + QUERY_BLOCK)
            lo = max(0, n_cached + s - (self.window - 1))  # first window row a query of the block sees
            keys = window_rows[lo : n_cached + e]
            bias = window_bias(positions[s:e], row_pos[lo : n_cached + e], self.window)
            if entries is not None:
                keys = torch.cat([keys, entries], dim=0)
                bias = torch.cat([bias, entry_bias(None if picks is None else picks[s:e], entries.shape[0],
                                                   bias)], dim=-1)
            out[s:e] = sink_attention(q[s:e], keys, bias, self.attn_sink, self.scale)
        return self.output(out, cos, sin)

    def _entries_and_picks(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, lease: RowLease, pools: CachePools, rope: RotaryTable, step: dict,
                           dtype: torch.dtype) -> tuple[int, torch.Tensor | None]:
        """One request's chunk: run the KV source's compressor and the index source's top-k;
        returns the entries visible by the chunk's end and the picks [T, k] this layer uses
        (None: no index source, or not a compressed layer)."""
        if not self.ratio:
            return 0, None
        start, t = int(positions[0]), x.shape[0]
        if self.compressor is not None:
            self._compress(x, start, lease, pools, rope)
        n = (start + t) // self.source_ratio
        all_picks = step.setdefault("topk_picks", {})
        if n and self.indexer is not None and self.source_pools + "keys" in pools:
            name = self.source_pools + "keys"
            if self.indexer.backend is not None:  # packed records scored in place
                pool = pools[name]
                all_picks[self.layer_idx] = self.indexer.prefill_packed_picks(
                    x, q_res, pool.flat(0), lease.units[name], pool.rows_per_unit, n, positions, cos, sin, step)
            else:
                keys = pools[name].get(0, lease.rows(name, 0, n)).to(dtype)
                all_picks[self.layer_idx] = self.indexer.topk_picks(x, q_res, keys, positions, cos, sin, step)
        return n, all_picks.get(self.index_source)

    def decode(self, x: torch.Tensor, batch: BatchIndex, rope: RotaryTable, step: dict,
               pools: CachePools, sparse: V4SparseDecodeBackend | None = None, kv_write: str = "auto") -> torch.Tensor:
        """B requests, one token each: x [B, hidden] normed at ``batch.positions`` → [B, hidden].
        ``step`` as in :meth:`forward`, with [B, 1, …] picks and block masks. ``sparse``: the
        backend that attends the packed pool rows in place (model/v4/sparse_attention.py; None:
        padded gathers); ``kv_write``: the implementation of the row writes (kernels/v4_kv_write.py)."""
        p = batch.positions
        cos, sin = rope.cos_sin(p, x.dtype)
        q_res, q = self.project_queries(x, cos, sin)
        window = pools["window"]
        write_window_row(window, self.layer_idx, batch, pools, self.wkv(x), self.row_norm, cos, sin, kv_write)
        if sparse is None:
            keys, bias = gather_window(window, self.layer_idx, batch, pools, self.window)
            keys = keys.to(q.dtype)
        else:
            scopes = [window_scope(window, self.layer_idx, batch, pools, self.window, "v41_window")]
        if self.ratio:
            if self.compressor is not None:
                self._decode_compress(x, batch, pools, rope, kv_write)
            counts = (p + 1) // self.source_ratio
            all_picks = step.setdefault("topk_picks", {})
            if self.indexer is not None and self.source_pools + "keys" in pools:
                name = self.source_pools + "keys"
                if self.indexer.backend is not None:  # packed records scored in place
                    pool = pools[name]
                    all_picks[self.layer_idx] = self.indexer.decode_packed_picks(
                        x, q_res, pool.flat(0), batch.page_tables[name], pool.rows_per_unit, counts,
                        batch.capacity(pools, name), cos, sin, step)
                else:
                    index_keys = batch.gather_prefix(pools, name, 0, counts)
                    all_picks[self.layer_idx] = self.indexer.decode_picks(x, q_res, index_keys, counts, cos, sin,
                                                                          step)
            picks = all_picks.get(self.index_source)
            if sparse is None:
                entries = batch.gather_prefix(pools, self.source_pools + "entries", 0, counts).to(q.dtype)
                keys = torch.cat([keys, entries], dim=1)
                bias = torch.cat([bias, entry_bias(picks, entries.shape[1], bias)], dim=-1)
            elif picks is not None:  # without an index source the entries stay masked
                scopes.append(entry_scope(pools[self.source_pools + "entries"], 0, batch, pools, "v41_entry",
                                          picks=picks))
        if sparse is not None:
            return self.output(sparse_attend(sparse, q, scopes, self.attn_sink, self.scale), cos, sin)
        out = sink_attention(q.unsqueeze(1), keys, bias.unsqueeze(1), self.attn_sink, self.scale).squeeze(1)
        return self.output(out, cos, sin)

    def _decode_compress(self, x: torch.Tensor, batch: BatchIndex, pools: CachePools, rope: RotaryTable,
                         kv_write: str) -> None:
        """KV source, B requests: keep each new token's fp32 rows in its ring, pool the group that
        ends at it, and store the entry (and key) of the requests whose group closed (the rest
        go to the scratch unit), by kernels/v4_kv_write.py."""
        r, p, pre = self.ratio, batch.positions, self.source_pools
        cos, sin = rope.cos_sin(((p + 1) // r - 1).clamp_min(0) * r, x.dtype)
        comp, entries = self.compressor, pools[pre + "entries"]
        norm = RowNorm(comp.norm.weight, comp.norm.eps, weight_after_cast=True)
        store = RowStore(entries.flat(0), entries.codec.encode, entries.codec.format)
        target = RowTarget(p, entries.rows_per_unit, page_table=batch.page_tables[pre + "entries"], ratio=r)
        want = self.indexer is not None
        if r > 1:
            kv, gate = comp.project(x)
            ring = RowTarget(p, pools[pre + "kv"].rows_per_unit, ring_base=batch.ring_base[pre + "kv"])
            latent = compress_step(kv, gate, pools[pre + "kv"].flat(0), pools[pre + "gate"].flat(0), ring,
                                   batch.ring_base[pre + "gate"], r, False, None, norm, cos, sin, store, target,
                                   kv_write, want)
        else:
            latent = write_rows(comp.wkv(x), norm, cos, sin, store, target, kv_write, want)
        if want:
            keys, ix = pools[pre + "keys"], self.indexer
            write_rows(ix.wk(latent), RowNorm(ix.k_norm.weight, ix.k_norm.eps, weight_after_cast=True), cos, sin,
                       RowStore(keys.flat(0), keys.codec.encode, keys.codec.format),
                       RowTarget(p, keys.rows_per_unit, page_table=batch.page_tables[pre + "keys"], ratio=r),
                       kv_write)


def entry_bias(picks: torch.Tensor | None, num_entries: int, window: torch.Tensor) -> torch.Tensor:
    """[..., T, n] float32 bias over the shared entries: 0 on the picks (``picks`` [..., T, k]);
    all -inf when the KV source has no index source (``picks`` None, shaped like ``window``'s rows)."""
    if picks is None:  # no index source for this KV source: entries stay masked
        return window.new_full((*window.shape[:-1], num_entries), float("-inf"))
    return selected_entry_bias(picks, num_entries)
