"""Our CUDA C++ wgmma kernels (``kernels/mla_decode_cuda.py``) as a decode backend."""

from __future__ import annotations

import torch

from kernels.attention.base import (FP8_E4M3, AttentionSpec, BackendSupport, DecodeBackend, DecodeMetadata,
                                    missing_module_reason)


class CudaDecode(DecodeBackend):
    """Hopper (SM90), latent 512 + rope 64, pages a multiple of the 64-token tile. An e4m3 query
    and cache: up to 32 query rows per request (s_q x heads) go to the tokens-major narrow
    kernel, more to the 64-row kernel. A bf16 cache: the bf16 narrow kernel, up to 32 query rows
    per request, with the query in bf16 (the base class's ``query_dtype``: the compute dtype,
    which is the cache's, bf16, since an unquantized cache takes the model's dtype). Launch
    shapes depend on tensor shapes only: CUDA-graph safe. The library is compiled with nvcc on
    first use; ``unsupported_reason`` builds it, so a failed build is a start-up error, not a
    first-step one."""

    name = "cuda"
    support = BackendSupport(devices=("cuda",), cache_dtypes=(FP8_E4M3, torch.bfloat16), capability_majors=(9,),
                             kv_lora_ranks=(512,), rope_dims=(64,), page_size_multiple=64, cuda_graph_safe=True)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        reason = super().unsupported_reason(spec)
        if reason is not None:
            return reason
        from kernels.mla_decode_cuda import NARROW_MAX_ROWS, CudaKernelUnavailable, default_library_path

        rows = spec.num_heads * spec.query_len
        if spec.cache_dtype == torch.bfloat16 and rows > NARROW_MAX_ROWS:
            return (f"a bf16 cache takes at most {NARROW_MAX_ROWS} query rows per request (heads x query tokens); "
                    f"got {rows} (--kv-cache-dtype fp8, or --attention-backend triton)")
        if reason := missing_module_reason("triton", "triton"):  # its input checks are in mla_decode_triton
            return reason
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
