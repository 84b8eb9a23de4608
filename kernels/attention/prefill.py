"""Prefill backends: the non-absorbed causal attention of a prompt chunk (``kernels/mla_prefill.py``)."""

from __future__ import annotations

import torch

from kernels.gpu import num_sms
from kernels.attention.base import (FP8_E4M3, LATENT_16_BIT, BackendSupport, PrefillBackend, PrefillMetadata,
                                    VarlenSegments)
from kernels.mla_prefill import (flash_varlen_lse, flash_varlen_unsupported_reason, mla_prefill_after_context_split,
                                 mla_prefill_flash_varlen, mla_prefill_reference, mla_prefill_sdpa, sdpa_warmup_lengths,
                                 tail_segments)

_ANY_CACHE = (torch.float32, *LATENT_16_BIT, FP8_E4M3)  # prefill reads the dequantized context


class TorchPrefill(PrefillBackend):
    """Float32 SDPA with a dense causal mask: the reference, and what CPU runs."""

    name = "torch"
    support = BackendSupport(devices=("cpu", "cuda"), cache_dtypes=_ANY_CACHE)

    def forward(self, q, k, v, softmax_scale):
        return mla_prefill_reference(q, k, v, softmax_scale)


class SdpaPrefill(PrefillBackend):
    """torch's fused attention in the compute dtype, causality given as a structure (the
    fused SDPA kernels on the GPU). In a step, a chunk from position 0 runs SDPA's plain causal
    form (cuDNN on Hopper: the fastest here, 0.68 ms per layer for 8192 tokens at 16 heads);
    chunks after cached context run together in one call of torch's varlen flash kernel, which,
    unlike SDPA's after-context form, does not synchronize the host (the two-chunk steps of
    chunked prefill otherwise ran ~50 ms over their GPU time)."""

    name = "sdpa"
    support = BackendSupport(devices=("cuda",), cache_dtypes=_ANY_CACHE)

    def __init__(self, spec=None, split_short_tails: bool = False) -> None:
        """``split_short_tails``: chunks after context whose flash grid would leave SMs idle run
        with their prefix cut into pieces (``mla_prefill_after_context_split``); off until its
        device measurement (benchmarks/bench_prefill_layout.py) says it pays."""
        super().__init__(spec)
        self.split_short_tails = split_short_tails

    def forward(self, q, k, v, softmax_scale):
        return mla_prefill_sdpa(q, k, v, softmax_scale)

    def value_width(self, qk_head_dim, v_head_dim):
        # The fused kernels take equal head dims: v arrives zero-padded, built so by the layer
        # in the same pass as k, instead of padded here with a fill and a copy.
        return max(qk_head_dim, v_head_dim)

    def warm_up(self, max_chunk_tokens):
        """A chunk from position 0 reaches cuDNN at one of the bucket lengths, and cuDNN builds
        an execution plan (tens of ms of host time) the first time it meets each one; chunked
        prefill meets a new one in most steps until all have been seen. So they are all run
        here, on slices of one buffer laid out as the step's q/k/v are. cuDNN keeps its plans
        per thread: this must run on the thread that runs the steps."""
        spec = self.spec
        if spec is None or not spec.qk_head_dim:
            return 0
        lengths = sdpa_warmup_lengths(max_chunk_tokens, spec.device)
        if not lengths:
            return 0
        rows, heads = lengths[-1], spec.num_heads
        v_width = self.value_width(spec.qk_head_dim, spec.v_head_dim)
        with torch.inference_mode():
            q, k = (torch.randn(rows, heads, spec.qk_head_dim, device=spec.device, dtype=spec.compute_dtype)
                    for _ in range(2))
            v = torch.randn(rows, heads, v_width, device=spec.device, dtype=spec.compute_dtype)
            for n in lengths:
                self.forward(q[:n], k[:n], v[:n], spec.softmax_scale)
        return len(lengths)

    def attend_with_lse(self, q, k, v, segments: VarlenSegments, causal: bool, softmax_scale):
        if q.device.type != "cuda" or flash_varlen_unsupported_reason(q.shape[-1], q.dtype) is not None:
            return super().attend_with_lse(q, k, v, segments, causal, softmax_scale)
        return flash_varlen_lse(q, k, v, segments.cu_q, segments.cu_k, max(segments.q_lens), max(segments.k_lens),
                                causal, softmax_scale)

    def _tail_segments(self, metadata: PrefillMetadata, after: list[int], q) -> dict[int, int]:
        """Pieces per chunk after context (1: unsplit). Chunks are split only when all of them
        together would not fill the SMs in one flash call."""
        heads = q.shape[1]
        if not self.split_short_tails:
            return dict.fromkeys(after, 1)
        sms = num_sms(q.device)
        if sum(-(-metadata.query_lens[i] // 128) for i in after) * heads >= sms:
            return dict.fromkeys(after, 1)
        return {i: tail_segments(metadata.query_lens[i], metadata.context_lens[i], heads, sms) for i in after}

    def forward_varlen(self, q, k, v, metadata: PrefillMetadata, softmax_scale):
        after = [i for i, c in enumerate(metadata.context_lens) if c]
        if (not after or q.device.type != "cuda"
                or flash_varlen_unsupported_reason(q.shape[-1], q.dtype) is not None):
            return super().forward_varlen(q, k, v, metadata, softmax_scale)
        qo, kv = metadata.qo_indptr_cpu, metadata.kv_indptr_cpu
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for i in range(metadata.num_chunks):
            if not metadata.context_lens[i]:
                out[qo[i] : qo[i + 1]] = self.forward(q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]],
                                                      v[kv[i] : kv[i + 1]], softmax_scale)
        segments = self._tail_segments(metadata, after, q)
        for i in after:
            if segments[i] > 1:
                c = metadata.context_lens[i]
                out[qo[i] : qo[i + 1]] = mla_prefill_after_context_split(
                    q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]], c, segments[i], softmax_scale)
        after = [i for i in after if segments[i] == 1]
        if not after:
            return out
        if len(after) == metadata.num_chunks:  # every chunk: one call over the whole layout
            return mla_prefill_flash_varlen(q, k, v, metadata.qo_indptr, metadata.kv_indptr, max(metadata.query_lens),
                                            max(c + n for c, n in zip(metadata.context_lens, metadata.query_lens)),
                                            softmax_scale)
        for i in after:  # beside chunks from 0: each on its own slice of the device offsets
            cu_q = metadata.qo_indptr[i : i + 2] - metadata.qo_indptr[i]
            cu_k = metadata.kv_indptr[i : i + 2] - metadata.kv_indptr[i]
            out[qo[i] : qo[i + 1]] = mla_prefill_flash_varlen(
                q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]], cu_q, cu_k,
                qo[i + 1] - qo[i], kv[i + 1] - kv[i], softmax_scale)
        return out
