"""TRTLLM-gen MLA decode through FlashInfer, Blackwell (SM100) only, as a decode backend.

UNTESTED: no SM100 GPU has run it yet (the kernel does not exist on Hopper). FlashInfer fetches
its cubins when the kernel is first used. The zeroed workspace is allocated once, when
the backend is built. Kept eager (not declared CUDA-graph safe) until it is tested under graphs.
"""

from __future__ import annotations

import torch

from kernels.attention.base import (FP8_E4M3, AttentionSpec, BackendSupport, DecodeBackend, DecodeMetadata,
                                    missing_module_reason)
from kernels.attention.flashinfer_decode import WORKSPACE_BYTES, import_flashinfer


class TrtllmDecode(DecodeBackend):
    name = "trtllm"
    support = BackendSupport(devices=("cuda",), cache_dtypes=(torch.bfloat16, FP8_E4M3), capability_majors=(10,),
                             kv_lora_ranks=(512,), rope_dims=(64,))

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        return super().unsupported_reason(spec) or missing_module_reason("flashinfer", "flashinfer-python")

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._fi = import_flashinfer()
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)

    def decode(self, q, kv_cache, metadata: DecodeMetadata, softmax_scale, kv_lora_rank, k_scale=1.0, q_scale=1.0,
               out_dtype=None):
        max_seq_len = int(metadata.block_tables.shape[1] * kv_cache.shape[1])
        out, lse = self._fi.mla.trtllm_batch_decode_with_kv_cache_mla(
            query=q, kv_cache=kv_cache.unsqueeze(1), workspace_buffer=self.workspace,
            qk_nope_head_dim=128, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=self.spec.rope_dim,
            block_tables=metadata.block_tables, seq_lens=metadata.seq_lens, max_seq_len=max_seq_len,
            bmm1_scale=float(softmax_scale) * float(q_scale) * float(k_scale), bmm2_scale=float(k_scale),
            return_lse=True, return_lse_base="basee")
        return (out if out_dtype is None else out.to(out_dtype)), lse.reshape(q.shape[:3]).float()
