"""The torch reference as a decode backend: every device and cache dtype, float32 math."""

from __future__ import annotations

import torch

from kernels.attention.base import FP8_E4M3, LATENT_16_BIT, BackendSupport, DecodeBackend, DecodeMetadata
from kernels.mla_decode import mla_decode_reference


class TorchDecode(DecodeBackend):
    """The spec the fast kernels answer to; what CPU runs. It reads the sequence lengths on
    the host in every layer, so it is not CUDA-graph safe."""

    name = "torch"
    support = BackendSupport(devices=("cpu", "cuda"), cache_dtypes=(torch.float32, *LATENT_16_BIT, FP8_E4M3))
    fp8_query = False  # the query stays in the compute dtype; the cache is dequantized in float32

    def decode(self, q, kv_cache, metadata: DecodeMetadata, softmax_scale, kv_lora_rank, k_scale=1.0, q_scale=1.0,
               out_dtype=None):
        return mla_decode_reference(q, kv_cache, metadata.block_tables, metadata.seq_lens, softmax_scale,
                                    kv_lora_rank, q_scale, k_scale, out_dtype)
