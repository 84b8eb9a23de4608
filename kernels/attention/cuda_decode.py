"""Our CUDA C++ FP8 wgmma kernels (``kernels/mla_decode_cuda.py``) as a decode backend."""

from __future__ import annotations

from kernels.attention.base import (FP8_E4M3, AttentionSpec, BackendSupport, DecodeBackend, DecodeMetadata,
                                    missing_module_reason)


class CudaDecode(DecodeBackend):
    """Hopper (SM90), e4m3 query and latent cache, latent 512 + rope 64, pages a multiple of
    the 64-token tile. Up to 32 query rows per request (s_q x heads) go to the tokens-major
    narrow kernel, more to the 64-row kernel. Launch shapes depend on tensor shapes only:
    CUDA-graph safe. The library is compiled with nvcc on first use; ``unsupported_reason``
    builds it, so a failed build is a start-up error, not a first-step one."""

    name = "cuda"
    support = BackendSupport(devices=("cuda",), cache_dtypes=(FP8_E4M3,), capability_majors=(9,),
                             kv_lora_ranks=(512,), rope_dims=(64,), page_size_multiple=64, cuda_graph_safe=True)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        reason = super().unsupported_reason(spec)
        if reason is not None:
            return reason
        if reason := missing_module_reason("triton", "triton"):  # its input checks are in mla_decode_triton
            return reason
        from kernels.mla_decode_cuda import CudaKernelUnavailable, default_library_path

        try:
            default_library_path()
        except CudaKernelUnavailable as exc:
            return str(exc).splitlines()[0]
        return None

    def decode(self, q, kv_cache, metadata: DecodeMetadata, softmax_scale, kv_lora_rank, k_scale=1.0, q_scale=1.0,
               out_dtype=None):
        from kernels.mla_decode_cuda import mla_decode_cuda

        return mla_decode_cuda(q, kv_cache, metadata.block_tables, metadata.seq_lens, softmax_scale, kv_lora_rank,
                               q_scale, k_scale, out_dtype)
