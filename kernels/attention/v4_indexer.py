"""Backends of the V4.1 lightning indexer's scores on packed key records (contract and
reference: kernels/v4_indexer.py):

    torch   the reference; any device, any index_head_dim multiple of 32; eager (gathers and
            decodes every key of a request in torch)
    triton  our kernel (kernels/v4_indexer_triton.py): FP8 MMAs on the records in place;
            CUDA, index_head_dim a multiple of 32; CUDA-graph safe

:func:`choose_indexer`: ``auto`` takes the Triton kernel on CUDA for packed (FP8) records and
none elsewhere (the model's own path on decoded keys: the CPU path, and bf16 caches).
"""

from __future__ import annotations

import logging

import torch

from kernels.v4_indexer import SCALE_BLOCK, index_scores_reference

logger = logging.getLogger(__name__)


class IndexerBackend:
    """Scores of packed key records: ``scores(...)`` has :func:`index_scores_reference`'s contract."""

    name = "torch"
    cuda_graph_safe = False

    def scores(self, *args, **kwargs):
        return index_scores_reference(*args, **kwargs)


class TritonIndexer(IndexerBackend):
    name = "triton"
    cuda_graph_safe = True

    def scores(self, *args, **kwargs):
        from kernels.v4_indexer_triton import index_scores_triton

        return index_scores_triton(*args, **kwargs)


INDEXER_BACKENDS = {cls.name: cls for cls in (TritonIndexer, IndexerBackend)}


def triton_unsupported_reason(device: torch.device, index_head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, the model is on {device.type}"
    if index_head_dim % SCALE_BLOCK:
        return f"reads {SCALE_BLOCK}-dim blocks of keys; index_head_dim is {index_head_dim}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    return None


def choose_indexer(requested: str, kv_cache_dtype: str, device: torch.device | str,
                   index_head_dim: int) -> IndexerBackend | None:
    """The backend that scores a V4.1 model's packed key records, or None for the model's own
    path on decoded keys (rows kept in the model dtype, or ``auto`` off CUDA). ``requested``:
    auto, triton or torch; one that cannot run raises ValueError naming it."""
    device = torch.device(device)
    if requested not in ("auto", *INDEXER_BACKENDS):
        raise ValueError(f"indexer backend {requested!r}: one of auto, {', '.join(INDEXER_BACKENDS)}")
    packed = kv_cache_dtype.startswith("fp8")
    if not packed:
        if requested != "auto":
            raise ValueError(f"indexer backend {requested}: reads packed key records (--kv-cache-dtype fp8), got "
                             f"--kv-cache-dtype {kv_cache_dtype}")
        return None
    reason = triton_unsupported_reason(device, index_head_dim)
    if requested == "auto":
        if reason is not None:
            logger.info("V4.1 indexer: the model's torch path on decoded keys (triton: %s)", reason)
            return None
        requested = "triton"
    if requested == "triton" and reason is not None:
        raise ValueError(f"indexer backend triton: {reason}")
    logger.info("V4.1 indexer backend: %s", requested)
    return INDEXER_BACKENDS[requested]()
