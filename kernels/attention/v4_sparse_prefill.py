"""V4 / V4.1 sparse prefill backends (contract: ``kernels.v4_sparse_prefill``): one request's
chunk over its window rows and its selected (or all visible) compressed entries, read where
the row pools store them.

    torch   the float32 reference; any device, any width (gathers and dequantizes once per
            chunk, masks over all entries)
    triton  our Triton kernels (kernels/v4_sparse_prefill_triton.py); SM90, 512-dim latents (V4
            records: 64 RoPE dims), up to 128 heads per GPU, packed records or bf16 rows; a
            float32 q is taken as bf16

The model's own torch attention (model/v4/attention.py) is what runs without a backend: the
default on a CPU. ``auto`` (:func:`select_v4_prefill_backend`): triton where it runs, else none.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from kernels.attention.base import AttentionSpec, BackendSupport, BackendUnavailable, missing_module_reason
from kernels.v4_cache_formats import V4_ROPE_DIMS

logger = logging.getLogger(__name__)
PREFILL_CACHE_DTYPES = (torch.uint8, torch.bfloat16)  # packed records, or bf16 rows (--kv-cache-dtype auto)


class V4SparsePrefillBackend:
    """One layer's chunk attention: ``prefill(q, start, window, entries, sinks, softmax_scale)``
    → out [T, H, d] in q's dtype."""

    name: ClassVar[str]
    support: ClassVar[BackendSupport]

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        self.spec = spec

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, formats: tuple[str, ...] = ()) -> str | None:
        return cls.support.unsupported_reason(spec)

    def prefill(self, q, start, window, entries, sinks, softmax_scale):
        raise NotImplementedError


class TorchV4SparsePrefill(V4SparsePrefillBackend):
    name = "torch"
    support = BackendSupport(devices=("cpu", "cuda"), cache_dtypes=(torch.uint8, torch.bfloat16, torch.float16,
                                                                     torch.float32, torch.float64))

    def prefill(self, q, start, window, entries, sinks, softmax_scale):
        from kernels.v4_sparse_prefill import v4_sparse_prefill_reference

        return v4_sparse_prefill_reference(q, start, window, entries, sinks, softmax_scale)


class TritonV4SparsePrefill(V4SparsePrefillBackend):
    name = "triton"
    support = BackendSupport(devices=("cuda",), cache_dtypes=PREFILL_CACHE_DTYPES, capability_majors=(9,),
                             kv_lora_ranks=(512,), max_heads=128)

    @classmethod
    def unsupported_reason(cls, spec, formats=()):
        reason = super().unsupported_reason(spec, formats)
        if reason is None and "v4" in formats and spec.rope_dim != V4_ROPE_DIMS:
            reason = f"reads V4 records with {V4_ROPE_DIMS} RoPE dims; the model has {spec.rope_dim}"
        return reason or missing_module_reason("triton", "triton")

    def prefill(self, q, start, window, entries, sinks, softmax_scale):
        from kernels.v4_sparse_prefill_triton import v4_sparse_prefill_triton

        q16 = q if q.dtype in (torch.bfloat16, torch.float16) else q.to(torch.bfloat16)
        return v4_sparse_prefill_triton(q16, start, window, entries, sinks, softmax_scale).to(q.dtype)


V4_PREFILL_BACKENDS: dict[str, type[V4SparsePrefillBackend]] = {
    cls.name: cls for cls in (TritonV4SparsePrefill, TorchV4SparsePrefill)
}


def select_v4_prefill_backend(requested: str, spec: AttentionSpec,
                              formats: tuple[str, ...] = ()) -> V4SparsePrefillBackend | None:
    """``auto``: triton where it runs ``spec`` and ``formats``, else None (the model's torch
    attention); ``torch``: None; ``triton``: the kernel, or ``BackendUnavailable`` naming the flag."""
    if requested in ("auto", "torch"):
        reason = ("requested" if requested == "torch"
                  else TritonV4SparsePrefill.unsupported_reason(spec, formats))
        if reason is None:
            logger.info("V4 sparse prefill backend: triton (auto)")
            return TritonV4SparsePrefill(spec)
        logger.info("V4 sparse prefill backend: none, the model's torch attention (%s: %s)", requested, reason)
        return None
    cls = V4_PREFILL_BACKENDS.get(requested)
    if cls is None:
        raise BackendUnavailable(f"--prefill-attention-backend {requested}: DeepSeek-V4 prefill runs auto, "
                                 f"{', '.join(V4_PREFILL_BACKENDS)}")
    reason = cls.unsupported_reason(spec, formats)
    if reason is not None:
        raise BackendUnavailable(f"--prefill-attention-backend {requested}: {reason}")
    logger.info("V4 sparse prefill backend: %s (requested)", cls.name)
    return cls(spec)
