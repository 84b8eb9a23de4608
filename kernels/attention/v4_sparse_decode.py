"""V4 / V4.1 sparse decode backends (contract: ``kernels.v4_sparse_decode``): a registry of
its own, since the call differs from MLA decode's (key scopes of quantized records and
per-request picks, not a block table over one latent cache).

    torch   the float32 reference; any device, any latent width; eager only (gathers on the
            host's terms)
    triton  our Triton kernel (kernels/v4_sparse_decode_triton.py); SM90, every record format
            at 512 dims (V4: 64 RoPE dims), 8..128 heads per GPU, CUDA graphs; a float32 q is
            taken as bf16
    cuda    our CUDA C++ kernels (kernels/v4_sparse_decode_cuda.py); SM90, V4 MODEL1 records
            and V4.1 window rows / entries (one family per call, each scope its own format),
            8..128 heads per GPU (records dequantized once per CTA of 64 heads, or of all
            heads up to 16 (32 for V4)), CUDA graphs, paged caches and one-record row pools;
            a call it does not read (bf16 rows, V4 beside V4.1 records, a cache not on 8
            bytes) goes to the Triton kernel. ``CUDA_VARIANT`` says which of its designs
            serves (v3: 64-record tiles with 65-128 heads as two independent 64-head CTAs, the
            tokens2 kernel up to 16 heads; V4.1 records at 17-63 heads run the 64-record
            kernel padded to 64, as the narrow kernel of 17-32 reads MODEL1 records only; v1,
            v2 (its tokens kernel up to 16 heads) and the 2-CTA cluster stay selectable for
            the bench)

``auto`` (:func:`select_v4_decode_backend`): cuda where it runs (one log line says why not),
then triton, then torch.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from kernels.attention.base import (AttentionSpec, BackendSupport, BackendUnavailable, missing_module_reason,
                                    requested_backend)
from kernels.v4_cache_formats import V4_ROPE_DIMS
from kernels.v4_sparse_decode import RECORD_BYTES

logger = logging.getLogger(__name__)
V4_CACHE_DTYPE = torch.uint8  # records are bytes; ``record_formats`` says which layout
# The design the cuda backend runs (kernels.v4_sparse_decode_cuda.VARIANTS) and whether it runs
# 65-128 heads as a 2-CTA cluster: v3 without the cluster was the fastest on every benched shape
# (benchmarks/RESULTS.md: B = 128, 8-128 heads, top-k 512/2048; v3 differs from v2 only up to
# 16 heads, where it is 1.06-1.13x v2 on V4.1 records and equal on V4 records).
CUDA_VARIANT = "v3"
CUDA_CLUSTER = False


class V4SparseDecodeBackend:
    """One layer's sparse decode: ``decode(q, scopes, sinks, softmax_scale) -> (out, lse)``."""

    name: ClassVar[str]
    support: ClassVar[BackendSupport]
    record_formats: ClassVar[tuple[str, ...]] = tuple(RECORD_BYTES)

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        self.spec = spec

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, formats: tuple[str, ...] = ()) -> str | None:
        reason = cls.support.unsupported_reason(spec)
        if reason is None:
            missing = [f for f in formats if f not in cls.record_formats]
            if missing:
                reason = f"does not read cache records {missing}; reads {list(cls.record_formats)}"
        return reason

    def decode(self, q, scopes, sinks, softmax_scale):
        raise NotImplementedError


class TorchV4SparseDecode(V4SparseDecodeBackend):
    name = "torch"
    support = BackendSupport(devices=("cpu", "cuda"), cache_dtypes=(V4_CACHE_DTYPE,))

    def decode(self, q, scopes, sinks, softmax_scale):
        from kernels.v4_sparse_decode import v4_sparse_decode_reference

        return v4_sparse_decode_reference(q, scopes, sinks, softmax_scale)


class TritonV4SparseDecode(V4SparseDecodeBackend):
    """fp16 products on records dequantized once per program, split-KV + LSE merge; launch
    shapes from tensor shapes only (CUDA-graph safe with preallocated out/lse)."""

    name = "triton"
    support = BackendSupport(devices=("cuda",), cache_dtypes=(V4_CACHE_DTYPE,), capability_majors=(9,),
                             kv_lora_ranks=(512,), max_heads=128, max_query_len=4, cuda_graph_safe=True)

    @classmethod
    def unsupported_reason(cls, spec, formats=()):
        reason = super().unsupported_reason(spec, formats)
        if reason is None and "v4" in formats and spec.rope_dim != V4_ROPE_DIMS:
            reason = f"reads V4 records with {V4_ROPE_DIMS} RoPE dims; the model has {spec.rope_dim}"
        return reason or missing_module_reason("triton", "triton")

    def decode(self, q, scopes, sinks, softmax_scale, out=None, lse=None):
        from kernels.v4_sparse_decode_triton import v4_sparse_decode_triton

        if q.dtype not in (torch.bfloat16, torch.float16):
            q = q.to(torch.bfloat16)
        return v4_sparse_decode_triton(q, scopes, sinks, softmax_scale, out=out, lse=lse)


class CudaV4SparseDecode(TritonV4SparseDecode):
    """The CUDA C++ kernels for V4 and V4.1 records; a call whose records they do not read (bf16
    rows, V4 beside V4.1 records) runs the Triton kernel instead (which, like them, refuses pages
    not on 8 bytes). The library is built in ``unsupported_reason``, so a failed build is a
    start-up fallback, not a first-step error."""

    name = "cuda"
    record_formats = ("v4", "v41_window", "v41_entry")

    @classmethod
    def unsupported_reason(cls, spec, formats=()):
        reason = super().unsupported_reason(spec, formats)
        if reason is None:
            from kernels.mla_decode_cuda import CudaKernelUnavailable
            from kernels.v4_sparse_decode_cuda import library

            try:
                library()
            except (CudaKernelUnavailable, OSError) as exc:
                reason = str(exc).splitlines()[0]
        return reason

    def decode(self, q, scopes, sinks, softmax_scale, out=None, lse=None):
        from kernels.v4_sparse_decode_cuda import unsupported_reason, v4_sparse_decode_cuda

        if unsupported_reason(scopes) is not None:
            return super().decode(q, scopes, sinks, softmax_scale, out=out, lse=lse)
        return v4_sparse_decode_cuda(q, scopes, sinks, softmax_scale, out=out, lse=lse, variant=CUDA_VARIANT,
                                     cluster=CUDA_CLUSTER)


V4_DECODE_BACKENDS: dict[str, type[V4SparseDecodeBackend]] = {
    cls.name: cls for cls in (CudaV4SparseDecode, TritonV4SparseDecode, TorchV4SparseDecode)
}


def select_v4_decode_backend(requested: str, spec: AttentionSpec, formats: tuple[str, ...] = ()
                             ) -> V4SparseDecodeBackend:
    """``auto``: the first of cuda, triton, torch that runs ``spec`` and ``formats`` here; an explicit
    request that cannot run raises ``BackendUnavailable`` naming the flag."""
    if requested == "auto":
        for cls in V4_DECODE_BACKENDS.values():
            reason = cls.unsupported_reason(spec, formats)
            if reason is None:
                logger.info("V4 sparse decode backend: %s (auto; %s)", cls.name, _graphs(cls))
                return cls(spec)
            if cls is CudaV4SparseDecode and spec.device.type == "cuda":
                logger.info("V4 sparse decode backend: not cuda (%s)", reason)
        raise BackendUnavailable(f"--attention-backend auto: no V4 sparse decode backend runs {spec}")
    cls = requested_backend(V4_DECODE_BACKENDS, requested, spec, "--attention-backend", formats, kind="V4 ")
    logger.info("V4 sparse decode backend: %s (requested; %s)", cls.name, _graphs(cls))
    return cls(spec)


def _graphs(cls: type[V4SparseDecodeBackend]) -> str:
    return "CUDA-graph safe" if cls.support.cuda_graph_safe else "eager only"
