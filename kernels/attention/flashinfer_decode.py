"""FlashInfer's SM90 fa3 MLA kernel as a decode backend (optional: the flashinfer-python package).

It takes our cache layout as is ([num_pages, page_size, 576] = kv_c ‖ k_pe, see
``kernels/mla_decode.py``). FlashInfer splits its work by a plan built on the host from the
step's sequence lengths, so ``build_metadata`` plans once per step and every layer's
``decode`` runs on that plan. The 128 MiB workspace and the wrapper are allocated once, when
the backend is built (one per runner). Planning reads the lengths on the host: not CUDA-graph
safe, so decode graphs stay off with this backend.

fa3 constraints (FlashInfer 0.7.2): the query must be bf16 (an e4m3 query is dequantized with
``q_scale`` first), the cache bf16 or e4m3 with one per-tensor scale (passed as both
``ckv_scale`` and ``kpe_scale``). Measured on the H200 (benchmarks/RESULTS.md) its e4m3 mode is
slower than its bf16 mode, because it widens the cache to bf16 inside the kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.attention.base import (FP8_E4M3, AttentionSpec, BackendSupport, DecodeBackend, DecodeMetadata,
                                    missing_module_reason)

WORKSPACE_BYTES = 128 * 1024 * 1024


@functools.cache
def shared_workspace(device: torch.device) -> torch.Tensor:
    """The float workspace every FlashInfer wrapper of a device shares (decode and prefill run
    one after the other on one stream, so one scratch buffer serves both)."""
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def import_flashinfer():
    try:
        import flashinfer
        import flashinfer.mla  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("the flashinfer attention backend needs the flashinfer-python package "
                           "(pip install 'mlaserve[gpu]')") from exc
    return flashinfer


def paged_csr(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, s_q: int):
    """FlashInfer's CSR page metadata (qo_indptr, kv_indptr, kv_indices, kv_len) as int32."""
    bsz = block_tables.shape[0]
    lens = seq_lens.to(torch.int64)
    pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(bsz + 1, dtype=torch.int64, device=block_tables.device)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    width = block_tables.shape[1]
    keep = torch.arange(width, device=block_tables.device)[None, :] < pages[:, None]
    kv_indices = block_tables[keep].to(torch.int32)
    qo_indptr = torch.arange(bsz + 1, dtype=torch.int32, device=block_tables.device) * s_q
    return qo_indptr, kv_indptr.to(torch.int32), kv_indices, seq_lens.to(torch.int32)


@dataclass
class FlashInferMetadata(DecodeMetadata):
    plan_id: int = 0  # which plan of the wrapper this step's layers run on


class FlashInferDecode(DecodeBackend):
    """Plan once per step, run once per layer, on FlashInfer's SM90 fa3 MLA kernel."""

    name = "flashinfer"
    support = BackendSupport(devices=("cuda",), cache_dtypes=(torch.bfloat16, FP8_E4M3), capability_majors=(9,),
                             rope_dims=(64,))

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        return super().unsupported_reason(spec) or missing_module_reason("flashinfer", "flashinfer-python")

    def __init__(self, spec: AttentionSpec, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        super().__init__(spec)
        self._fi = import_flashinfer()
        self.workspace = (shared_workspace(spec.device) if workspace_bytes == WORKSPACE_BYTES
                          else torch.empty(workspace_bytes, dtype=torch.uint8, device=spec.device))
        self.wrapper = self._fi.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend="fa3")
        self._plan_id = 0

    def build_metadata(self, block_tables, seq_lens, query_len) -> FlashInferMetadata:
        spec = self.spec
        qo_indptr, kv_indptr, kv_indices, kv_len = paged_csr(block_tables, seq_lens, spec.page_size, query_len)
        fp8 = spec.cache_dtype == FP8_E4M3
        self.wrapper.plan(
            metadata=self._fi.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len),
            num_heads=spec.num_heads,
            head_dim_ckv=spec.kv_lora_rank,
            head_dim_kpe=spec.rope_dim,
            page_size=spec.page_size,
            causal=query_len > 1,
            sm_scale=spec.softmax_scale,
            q_data_type=torch.bfloat16,
            kv_data_type=spec.cache_dtype,
            query_layout="packed",
            kv_cache_layout="packed",
            lse_mode="basee",
            scale_mode="kv-per-tensor" if fp8 else "default",
        )
        self._plan_id += 1
        return FlashInferMetadata(block_tables, seq_lens, query_len, plan_id=self._plan_id)

    def decode(self, q, kv_cache, metadata: FlashInferMetadata, softmax_scale, kv_lora_rank, k_scale=1.0,
               q_scale=1.0, out_dtype=None):
        """q [B, s_q, H, 576] (bf16, or e4m3 dequantized here); returns (out, lse)."""
        if metadata.plan_id != self._plan_id:
            raise RuntimeError("FlashInfer decode metadata from an earlier step: build_metadata() once per step")
        bsz, s_q, h, d = q.shape
        if (bsz, s_q, h) != (metadata.batch, metadata.query_len, self.spec.num_heads):
            raise ValueError(f"planned for B={metadata.batch} s_q={metadata.query_len} H={self.spec.num_heads}, "
                             f"got q {tuple(q.shape)}")
        if kv_cache.dtype != self.spec.cache_dtype or softmax_scale != self.spec.softmax_scale:
            raise ValueError(f"planned for a {self.spec.cache_dtype} cache and softmax scale "
                             f"{self.spec.softmax_scale}, got {kv_cache.dtype} and {softmax_scale}")
        if q.dtype != FP8_E4M3 and q.dtype != torch.bfloat16:
            raise TypeError(f"fa3 MLA takes a bf16 or e4m3 query, got {q.dtype}")
        if q.dtype == FP8_E4M3 or q_scale != 1.0:
            q = (q.float() * q_scale).to(torch.bfloat16)
        packed_q = q.reshape(bsz * s_q, h, d)
        if kv_cache.dtype == FP8_E4M3:
            out, lse = self.wrapper.run(query=packed_q, kv_cache=kv_cache, return_lse=True, return_lse_base_on_e=True,
                                        ckv_scale=float(k_scale), kpe_scale=float(k_scale))
        else:
            if k_scale != 1.0:
                raise ValueError("a 16-bit cache carries no scale (k_scale must be 1.0)")
            out, lse = self.wrapper.run(query=packed_q, kv_cache=kv_cache, return_lse=True, return_lse_base_on_e=True)
        out = out.reshape(bsz, s_q, h, -1)
        if out_dtype is not None and out.dtype != out_dtype:
            out = out.to(out_dtype)
        return out, lse.reshape(bsz, s_q, h).float()
