"""Our Triton paged MLA decode (``kernels/mla_decode_triton.py``) as a decode backend."""

from __future__ import annotations

from kernels.attention.base import (FP8_E4M3, LATENT_16_BIT, AttentionSpec, BackendSupport, DecodeBackend,
                                    DecodeMetadata, missing_module_reason)


class TritonDecode(DecodeBackend):
    """Any CUDA GPU Triton targets; bf16/fp16 or e4m3 latent cache (e4m3 query: Q·Kᵀ on FP8
    tensor cores, P·V in fp16). Launch shapes depend on tensor shapes only: CUDA-graph safe."""

    name = "triton"
    support = BackendSupport(devices=("cuda",), cache_dtypes=(*LATENT_16_BIT, FP8_E4M3), rope_dims=(64,),
                             cuda_graph_safe=True)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        reason = super().unsupported_reason(spec)
        if reason is None and spec.kv_lora_rank & (spec.kv_lora_rank - 1):
            reason = f"needs a power-of-two kv_lora_rank; the model has {spec.kv_lora_rank}"
        return reason or missing_module_reason("triton", "triton")

    def decode(self, q, kv_cache, metadata: DecodeMetadata, softmax_scale, kv_lora_rank, k_scale=1.0, q_scale=1.0,
               out_dtype=None):
        from kernels.mla_decode_triton import mla_decode_triton

        return mla_decode_triton(q, kv_cache, metadata.block_tables, metadata.seq_lens, softmax_scale, kv_lora_rank,
                                 q_scale, k_scale, out_dtype)
