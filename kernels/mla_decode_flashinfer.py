"""FlashInfer adapters for paged MLA decode: the SM90 fa3 kernel and TRTLLM-gen (SM100).

Both take our cache layout as is ([num_pages, page_size, 576] = kv_c ‖ k_pe, see
``kernels/mla_decode.py``). FlashInfer plans once per step (CPU work: it builds a split
schedule from the sequence lengths) and then runs once per layer, so the adapter is a class
with ``plan`` and ``run``; ``mla_decode_flashinfer`` is the one-shot functional form with
the reference's signature, for tests and the dispatch.

fa3 constraints (FlashInfer 0.7.2): the query must be bf16 (an e4m3 query is dequantized
with ``q_scale`` first), the cache bf16 or e4m3 with one per-tensor scale (passed as both
``ckv_scale`` and ``kpe_scale``). Measured on an H200 (benchmarks/KERNEL_NOTES.md) its e4m3 mode is
slower than bf16, because it widens the cache to bf16 inside the kernel.
"""

from __future__ import annotations

import torch

D_ROPE = 64
WORKSPACE_BYTES = 128 * 1024 * 1024


def _import_flashinfer():
    try:
        import flashinfer  # noqa: F401
        import flashinfer.mla
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "the flashinfer attention backend needs the flashinfer-python package "
            "(pip install 'mlaserve[gpu]')"
        ) from exc
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


class FlashInferMLADecode:
    """Plan once per step, run once per layer, on FlashInfer's SM90 fa3 MLA kernel."""

    def __init__(self, device: torch.device | str = "cuda", backend: str = "fa3",
                 workspace_bytes: int = WORKSPACE_BYTES):
        fi = _import_flashinfer()
        self.device = torch.device(device)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=backend)
        self.backend = backend
        self._planned: tuple | None = None

    def plan(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        s_q: int,
        num_heads: int,
        page_size: int,
        softmax_scale: float,
        kv_dtype: torch.dtype,
        kv_lora_rank: int = 512,
    ) -> None:
        fi = _import_flashinfer()
        qo_indptr, kv_indptr, kv_indices, kv_len = paged_csr(block_tables, seq_lens, page_size, s_q)
        fp8 = kv_dtype == torch.float8_e4m3fn
        self.wrapper.plan(
            metadata=fi.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len),
            num_heads=num_heads,
            head_dim_ckv=kv_lora_rank,
            head_dim_kpe=D_ROPE,
            page_size=page_size,
            causal=s_q > 1,
            sm_scale=softmax_scale,
            q_data_type=torch.bfloat16,
            kv_data_type=kv_dtype,
            query_layout="packed",
            kv_cache_layout="packed",
            lse_mode="basee",
            scale_mode="kv-per-tensor" if fp8 else "default",
        )
        self._planned = (block_tables.shape[0], s_q, num_heads, kv_dtype)

    def run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, q_scale: float = 1.0, k_scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, s_q, H, 576] (bf16, or e4m3 dequantized here); returns (out bf16, lse)."""
        if self._planned is None:
            raise RuntimeError("call plan() before run()")
        bsz, s_q, h, d = q.shape
        if self._planned[:3] != (bsz, s_q, h) or self._planned[3] != kv_cache.dtype:
            raise ValueError(f"planned for {self._planned}, got q {tuple(q.shape)} / cache {kv_cache.dtype}")
        if q.dtype == torch.float8_e4m3fn:
            q = (q.float() * q_scale).to(torch.bfloat16)
        elif q.dtype != torch.bfloat16:
            raise TypeError(f"fa3 MLA takes a bf16 or e4m3 query, got {q.dtype}")
        elif q_scale != 1.0:
            q = (q.float() * q_scale).to(torch.bfloat16)
        packed_q = q.reshape(bsz * s_q, h, d)
        if kv_cache.dtype == torch.float8_e4m3fn:
            out, lse = self.wrapper.run(
                query=packed_q, kv_cache=kv_cache, return_lse=True, return_lse_base_on_e=True,
                ckv_scale=float(k_scale), kpe_scale=float(k_scale))
        else:
            if k_scale != 1.0:
                raise ValueError("a 16-bit cache carries no scale (k_scale must be 1.0)")
            out, lse = self.wrapper.run(query=packed_q, kv_cache=kv_cache, return_lse=True,
                                        return_lse_base_on_e=True)
        return out.reshape(bsz, s_q, h, -1), lse.reshape(bsz, s_q, h).float()


def mla_decode_flashinfer(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot fa3 decode with the reference's signature (plans on every call)."""
    runner = FlashInferMLADecode(q.device)
    bsz, s_q, h, _ = q.shape
    runner.plan(block_tables, seq_lens, s_q=s_q, num_heads=h, page_size=kv_cache.shape[1],
                softmax_scale=softmax_scale, kv_dtype=kv_cache.dtype, kv_lora_rank=kv_lora_rank)
    out, lse = runner.run(q, kv_cache, q_scale, k_scale)
    if out_dtype is not None and out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out, lse


def mla_decode_trtllm(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    max_seq_len: int | None = None,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRTLLM-gen MLA decode through FlashInfer, Blackwell (SM100) only; (out, lse).

    Untested: it exists only on SM100 (the project's GPUs are SM90 H200s), and it downloads
    cubins at run time.
    """
    if not q.is_cuda:
        raise RuntimeError("the trtllm MLA backend needs a CUDA device")
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 10:
        raise RuntimeError(
            f"the trtllm MLA backend is Blackwell-only (SM100); this GPU is SM{major}{minor}. "
            "Use --attention-backend triton or flashinfer on Hopper."
        )
    fi = _import_flashinfer()
    if max_seq_len is None:
        max_seq_len = int(block_tables.shape[1] * kv_cache.shape[1])
    if workspace is None:
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    out, lse = fi.mla.trtllm_batch_decode_with_kv_cache_mla(
        query=q, kv_cache=kv_cache.unsqueeze(1), workspace_buffer=workspace,
        qk_nope_head_dim=128, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=D_ROPE,
        block_tables=block_tables, seq_lens=seq_lens, max_seq_len=max_seq_len,
        bmm1_scale=float(softmax_scale) * float(q_scale) * float(k_scale), bmm2_scale=float(k_scale),
        return_lse=True, return_lse_base="basee")
    return (out if out_dtype is None else out.to(out_dtype)), lse.reshape(q.shape[:3]).float()
