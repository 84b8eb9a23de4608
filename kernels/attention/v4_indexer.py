"""Backends of the V4.1 lightning indexer's scores on packed key records (contract and
reference: kernels/v4_indexer.py):

    torch   the reference; any device, any index_head_dim multiple of 32; eager (gathers and
            decodes every key of a request in torch; the selection is ``torch.topk``)
    triton  our kernels (kernels/v4_indexer_triton.py, kernels/topk_triton.py): the queries'
            quantization, FP8 MMAs on the records in place with the selection's histogram
            (restricted layers on their allowed blocks only), and an exact radix/bitonic
            selection of the picks and candidate blocks; CUDA, index_head_dim 32, 64 or 128;
            CUDA-graph safe

:func:`choose_indexer`: ``auto`` takes the Triton kernel on CUDA for packed (FP8) records and
none elsewhere (the model's own path on decoded keys: the CPU path, and bf16 caches).
"""

from __future__ import annotations

import logging

import torch

from kernels.v4_indexer import index_picks_reference, index_scores_reference

logger = logging.getLogger(__name__)


class IndexerBackend:
    """The indexer on packed key records: ``picks(...)`` has :func:`index_picks_reference`'s
    contract (the model's step), ``scores(...)`` :func:`index_scores_reference`'s."""

    name = "torch"
    cuda_graph_safe = False

    def picks(self, *args, **kwargs):
        return index_picks_reference(*args, **kwargs)

    def scores(self, *args, **kwargs):
        return index_scores_reference(*args, **kwargs)


class TritonIndexer(IndexerBackend):
    name = "triton"
    cuda_graph_safe = True

    def picks(self, *args, **kwargs):
        from kernels.v4_indexer_triton import index_picks_triton

        return index_picks_triton(*args, **kwargs)

    def scores(self, *args, **kwargs):
        from kernels.v4_indexer_triton import index_scores_triton

        return index_scores_triton(*args, **kwargs)


INDEXER_BACKENDS = {cls.name: cls for cls in (TritonIndexer, IndexerBackend)}


def triton_unsupported_reason(device: torch.device, index_head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, the model is on {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    from kernels.v4_indexer_triton import supported_head_dim

    if not supported_head_dim(index_head_dim):
        return f"reads index_head_dim 32, 64 or 128 (a record's scales as one word); it is {index_head_dim}"
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
