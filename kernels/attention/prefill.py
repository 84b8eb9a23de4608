"""Prefill backends: the non-absorbed causal attention of a prompt chunk (``kernels/mla_prefill.py``)."""

from __future__ import annotations

import torch

from kernels.attention.base import FP8_E4M3, LATENT_16_BIT, BackendSupport, PrefillBackend
from kernels.mla_prefill import mla_prefill_reference, mla_prefill_sdpa

_ANY_CACHE = (torch.float32, *LATENT_16_BIT, FP8_E4M3)  # prefill reads the dequantized context


class TorchPrefill(PrefillBackend):
    """Float32 SDPA with a dense causal mask: the reference, and what CPU runs."""

    name = "torch"
    support = BackendSupport(devices=("cpu", "cuda"), cache_dtypes=_ANY_CACHE)

    def forward(self, q, k, v, softmax_scale):
        return mla_prefill_reference(q, k, v, softmax_scale)


class SdpaPrefill(PrefillBackend):
    """torch's fused attention in the compute dtype, causality given as a structure (the
    fused SDPA kernels on the GPU)."""

    name = "sdpa"
    support = BackendSupport(devices=("cuda",), cache_dtypes=_ANY_CACHE)

    def forward(self, q, k, v, softmax_scale):
        return mla_prefill_sdpa(q, k, v, softmax_scale)

    def value_width(self, qk_head_dim, v_head_dim):
        # The fused kernels take equal head dims: v arrives zero-padded, built so by the layer
        # in the same pass as k, instead of padded here with a fill and a copy.
        return max(qk_head_dim, v_head_dim)
