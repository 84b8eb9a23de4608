"""Attention backends: a registry of classes, one module per backend, chosen once at start-up.

Decode (absorbed MLA over the paged latent cache, ``--attention-backend``):

    torch       reference; CPU or CUDA, any cache dtype; eager only
    triton      our Triton kernel; CUDA, bf16/fp16/e4m3 cache, rope 64, power-of-two latent; CUDA graphs
    cuda        our CUDA C++ wgmma kernels; SM90, e4m3 cache (<= 32 query rows per request: the
                narrow kernel, more: the 64-row one) or bf16 cache (<= 32 query rows per request),
                latent 512 + rope 64, block size % 64; CUDA graphs
    flashinfer  FlashInfer fa3; SM90, bf16/e4m3 cache, needs flashinfer-python; plans once per step,
                eager only
    trtllm      FlashInfer's TRTLLM-gen; SM100, bf16/e4m3 cache, latent 512; eager only (untested)

Each class declares what it runs in ``support`` (a ``BackendSupport``: devices, compute
capability, cache dtypes, latent/rope dims, block-size multiple, heads per GPU, query tokens
per request, CUDA-graph safety) and may refuse more in ``unsupported_reason`` (a package that
is not installed, a library that does not build).

``auto`` (``select_decode_backend``), one policy, by measurement on the H200
(benchmarks/RESULTS.md):

1. not on CUDA → torch;
2. an e4m3 cache on a GPU the cuda backend runs on (Hopper, library builds) → cuda
   (B=128, S=4096: 16 heads 84 vs 296 µs for Triton, 128 heads 195 vs 438 µs); a bf16 cache
   there with at most 32 query rows per request (heads x query tokens) → cuda too (H100, B=128,
   S=4096, 16 heads: 207 vs 312 µs for Triton, 96 % of HBM; V2-Lite end to end 2.81 vs 2.26 req/s);
3. otherwise, a cache Triton covers → triton (CUDA-graph safe; FlashInfer plans on the host
   every step, which rules decode graphs out, so it is only used when asked);
4. otherwise → torch.

The cuda backend's kernels run P.V in FP8 (P as e4m3): 1.5e-2 relative error against float64
on the same FP8 inputs, vs 2e-3 for Triton, which keeps P in fp16 (``--attention-backend triton``).

V4 / V4.1 sparse decode (window rows ‖ selected compressed entries, quantized records) has its
own registry (``kernels/attention/v4_sparse_decode.py``: triton on SM90, else torch), and so
does V4.1's lightning indexer on packed key records (``kernels/attention/v4_indexer.py``:
triton on CUDA, else the model's own torch path) and the family's chunked prefill
(``kernels/attention/v4_sparse_prefill.py``: triton on SM90, else the model's torch attention).

Prefill (the non-absorbed causal attention of a step's prompt chunks, each over its cached
prefix and itself; ``--prefill-attention-backend``) is chosen separately
(``select_prefill_backend``). The MLA layer gathers every chunk's cached latents in one pass,
up-projects all of them with one ``kv_b_proj`` GEMM and hands the backend the ragged q/k/v:

    torch       float32 reference, one chunk at a time; CPU or CUDA
    sdpa        torch's fused SDPA kernels, one launch per chunk from position 0 (cuDNN on Hopper)
                and one varlen flash launch for the chunks after cached context; CUDA
    flashinfer  FlashInfer's ragged prefill (fa3), one launch per layer for all chunks; SM90,
                bf16/fp16 model, q/k 192 + v 128 heads (or equal 64/128/256), flashinfer-python

``auto``: sdpa on CUDA, torch elsewhere. flashinfer is opt-in (``--prefill-attention-backend
flashinfer``): FlashInfer 0.7.2's wheel JIT-builds its SM90 prefill at first use and that
build fails (its CUTLASS ``tools/util`` headers are not shipped), so it has never been measured
faster here. Decode backends cannot
prefill and prefill backends cannot decode: the two registries are disjoint.
"""

from __future__ import annotations

import functools
import logging

import torch

from kernels.attention.base import (FP8_E4M3, AttentionSpec, BackendSupport, BackendUnavailable, ContextWindow,
                                    DecodeBackend, DecodeMetadata, PrefillBackend, PrefillMetadata, VarlenSegments,
                                    dtype_name, requested_backend)
from kernels.attention.cuda_decode import CudaDecode
from kernels.attention.flashinfer_decode import FlashInferDecode
from kernels.attention.flashinfer_prefill import FlashInferPrefill
from kernels.attention.prefill import SdpaPrefill, TorchPrefill
from kernels.attention.torch_decode import TorchDecode
from kernels.attention.triton_decode import TritonDecode
from kernels.attention.trtllm_decode import TrtllmDecode
from kernels.attention.v4_sparse_decode import (V4_DECODE_BACKENDS, CudaV4SparseDecode, TorchV4SparseDecode,
                                               TritonV4SparseDecode, V4SparseDecodeBackend, select_v4_decode_backend)
from kernels.attention.v4_sparse_prefill import (V4_PREFILL_BACKENDS, TorchV4SparsePrefill, TritonV4SparsePrefill,
                                                V4SparsePrefillBackend, select_v4_prefill_backend)

logger = logging.getLogger(__name__)

DECODE_BACKENDS: dict[str, type[DecodeBackend]] = {
    cls.name: cls for cls in (CudaDecode, TritonDecode, FlashInferDecode, TrtllmDecode, TorchDecode)
}
PREFILL_BACKENDS: dict[str, type[PrefillBackend]] = {
    cls.name: cls for cls in (FlashInferPrefill, SdpaPrefill, TorchPrefill)
}


def _describe_gpu(spec: AttentionSpec) -> str:
    major, minor = torch.cuda.get_device_capability(spec.device)
    arch = {9: "Hopper", 10: "Blackwell", 8: "Ampere/Ada"}.get(major, "a GPU")
    return f"{arch} SM{major}{minor}"


def auto_decode_backend(spec: AttentionSpec) -> tuple[type[DecodeBackend], str]:
    """The ``auto`` policy of the module docstring: (backend class, why)."""
    if spec.device.type != "cuda":
        return TorchDecode, f"{spec.device.type} device, the torch reference"
    cache = dtype_name(spec.cache_dtype)
    triton_reason = TritonDecode.unsupported_reason(spec)
    if spec.cache_dtype in (FP8_E4M3, torch.bfloat16):
        cuda_reason = CudaDecode.unsupported_reason(spec)
        short = "fp8" if spec.cache_dtype == FP8_E4M3 else "bf16"
        if cuda_reason is None:
            return CudaDecode, f"{_describe_gpu(spec)} with {'an' if short == 'fp8' else 'a'} {short} latent cache"
        if triton_reason is None:
            return TritonDecode, f"{short} latent cache, cuda backend unavailable ({cuda_reason})"
    elif triton_reason is None:
        return TritonDecode, f"{_describe_gpu(spec)} with a {cache} latent cache"
    return TorchDecode, f"no GPU kernel covers this model and cache: triton {triton_reason}"


def select_decode_backend(requested: str, spec: AttentionSpec) -> DecodeBackend:
    """The decode backend a runner holds for its lifetime; logs one line naming it and why.
    An explicit request that cannot run here raises ``BackendUnavailable`` naming the flag."""
    if requested == "auto":
        cls, why = auto_decode_backend(spec)
        why = f"auto: {why}"
    else:
        cls, why = requested_backend(DECODE_BACKENDS, requested, spec, "--attention-backend"), "requested"
    backend = cls(spec)
    graphs = "CUDA-graph safe" if cls.support.cuda_graph_safe else "eager only"
    logger.info("attention backend: %s (%s; %s)", cls.name, why, graphs)
    return backend


def auto_prefill_backend(spec: AttentionSpec) -> tuple[type[PrefillBackend], str]:
    """The prefill ``auto`` policy of the module docstring: (backend class, why)."""
    if spec.device.type != "cuda":
        return TorchPrefill, f"{spec.device.type} device, the torch reference"
    return SdpaPrefill, "one fused SDPA launch per chunk (flashinfer is opt-in)"


def select_prefill_backend(requested: str, spec: AttentionSpec) -> PrefillBackend:
    """The prefill backend a runner holds; logs one line naming it and why. An explicit
    request that cannot run here raises ``BackendUnavailable`` naming the flag."""
    if requested == "auto":
        cls, why = auto_prefill_backend(spec)
        why = f"auto: {why}"
    else:
        cls, why = requested_backend(PREFILL_BACKENDS, requested, spec, "--prefill-attention-backend"), "requested"
    logger.info("prefill attention backend: %s (%s)", cls.name, why)
    return cls(spec)


@functools.cache
def default_prefill_backend(device_type: str) -> PrefillBackend:
    """What a forward without a runner's context prefills with (whole-prompt calls: HF
    comparisons, the start-up activation profile, tests): sdpa on CUDA, torch elsewhere."""
    return SdpaPrefill() if device_type == "cuda" else TorchPrefill()


REFERENCE_DECODE = TorchDecode()  # what a forward context without a chosen backend decodes with

__all__ = ["DECODE_BACKENDS", "PREFILL_BACKENDS", "REFERENCE_DECODE", "AttentionSpec", "BackendSupport",
           "BackendUnavailable", "ContextWindow", "VarlenSegments",
           "CudaDecode", "DecodeBackend", "DecodeMetadata", "FlashInferDecode",
           "FlashInferPrefill", "PrefillBackend", "PrefillMetadata", "SdpaPrefill", "TorchDecode", "TorchPrefill",
           "TritonDecode", "TrtllmDecode", "V4_DECODE_BACKENDS", "CudaV4SparseDecode", "TorchV4SparseDecode",
           "TritonV4SparseDecode", "V4SparseDecodeBackend", "select_v4_decode_backend", "V4_PREFILL_BACKENDS",
           "TorchV4SparsePrefill", "TritonV4SparsePrefill", "V4SparsePrefillBackend", "select_v4_prefill_backend",
           "auto_decode_backend", "auto_prefill_backend", "default_prefill_backend", "select_decode_backend",
           "select_prefill_backend"]
