"""MLA decode attention over a paged latent cache: the torch reference and the dispatch.

Cache layout: ``kv_cache[num_blocks, block_size, 576]`` holds, per token, the normalized
latent kv_c (first ``kv_lora_rank`` = 512 values) followed by the rotated k_pe (64). In FP8
mode the whole entry is e4m3 with one per-tensor ``k_scale`` per layer.

Query layout: ``q[B, s_q, H, 576]`` = absorbed nope part (q_nope · W_UK, 512) ‖ q_pe (64),
optionally e4m3 with ``q_scale``. Query token j of request b sits at position
``seq_lens[b] - s_q + j`` and sees keys ``0 .. seq_lens[b] - s_q + j`` (causal among the s_q
tokens, for MTP). The value is the latent itself, so the output is [B, s_q, H, 512] in the
latent space, scaled back by ``k_scale``, plus the log-sum-exp [B, s_q, H] (natural log).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


def mla_decode_reference(
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
    """Plain-torch paged MLA decode in float32; the spec every fast kernel answers to."""
    b, s_q, h, d = q.shape
    block_size = kv_cache.shape[1]
    out_dtype = out_dtype or (q.dtype if q.dtype.is_floating_point and q.element_size() > 1 else torch.bfloat16)
    qf = q.float() * q_scale
    out = torch.empty(b, s_q, h, kv_lora_rank, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    for i in range(b):
        n = int(lens[i])
        nblocks = -(-n // block_size)
        pages = block_tables[i, :nblocks].long()
        kv = kv_cache[pages].reshape(nblocks * block_size, d)[:n].float() * k_scale  # [n, 576]
        scores = torch.einsum("shd,nd->shn", qf[i], kv) * softmax_scale  # [s_q, H, n]
        pos = torch.arange(n, device=q.device)
        q_pos = n - s_q + torch.arange(s_q, device=q.device)
        mask = pos[None, :] > q_pos[:, None]  # [s_q, n]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        lse_i = torch.logsumexp(scores, dim=-1)  # [s_q, H]
        p = torch.exp(scores - lse_i[..., None])
        out[i] = torch.einsum("shn,nc->shc", p, kv[:, :kv_lora_rank]).to(out_dtype)
        lse[i] = lse_i
    return out, lse


BACKENDS = ("auto", "cuda", "triton", "flashinfer", "trtllm", "torch")


def choose_auto_backend(kv_dtype: torch.dtype, cuda_kernel_ok: bool = False) -> str:
    """``auto`` on CUDA, by measurement on the H200 (benchmarks/RESULTS.md, B=128, S=4096): with
    an FP8 cache, our CUDA C++ library when it can be built here (16 heads: 110 vs 297 µs for
    Triton; 128 heads: 247 vs 443 µs), else our Triton kernel (FlashInfer's fp8 mode widens to
    bf16 and is slower than its own bf16 mode); FlashInfer fa3 for a bf16 cache when installed.

    The library's 64+-row kernel runs P.V in FP8 (P as e4m3): 1.5e-2 relative error against
    float64 on the same FP8 inputs, vs 2e-3 for Triton — inside the 2e-2 bound its tests hold it to and below
    what storing the cache in e4m3 already costs (4e-2 on random data, H=128, S=2048, CPU
    reference). ``--attention-backend triton`` keeps P in fp16."""
    if kv_dtype == torch.float8_e4m3fn:
        return "cuda" if cuda_kernel_ok else "triton"
    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


def cuda_kernel_available(device: torch.device, kv_dtype: torch.dtype, kv_lora_rank: int, rope_dim: int,
                          page_size: int = 64) -> bool:
    """The CUDA C++ kernel covers this GPU and cache, and its library builds (or is cached) here."""
    from kernels.mla_decode_cuda import CudaKernelUnavailable, default_library_path, supports

    if not supports(device, kv_dtype, kv_dtype, kv_lora_rank, rope_dim, page_size):
        return False
    try:
        default_library_path()
    except CudaKernelUnavailable as exc:
        logger.warning("CUDA C++ MLA decode unavailable, using Triton: %s", str(exc).splitlines()[0])
        return False
    return True


def resolve_backend(requested: str, device: torch.device, kv_dtype: torch.dtype, kv_lora_rank: int,
                    rope_dim: int, page_size: int = 64) -> str:
    """The decode backend a model will use: ``torch`` on CPU and for shapes or dtypes the GPU
    kernels do not cover (float32 caches, rope dim != 64, non-power-of-two latents); ``auto`` on
    CUDA means one of our CUDA-graph-safe kernels (FlashInfer re-plans on the host): the CUDA C++
    library for an FP8 cache where it builds, else Triton."""
    if device.type != "cuda" or requested == "torch":
        return "torch"
    fits_triton = (kv_dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) and rope_dim == 64
                   and kv_lora_rank & (kv_lora_rank - 1) == 0)
    if requested == "auto":
        if not fits_triton:
            return "torch"
        ok = cuda_kernel_available(device, kv_dtype, kv_lora_rank, rope_dim, page_size)
        return "cuda" if choose_auto_backend(kv_dtype, ok) == "cuda" else "triton"
    if requested == "cuda":
        from kernels.mla_decode_cuda import D_LATENT, CudaKernelUnavailable, default_library_path, supports

        if not supports(device, kv_dtype, kv_dtype, kv_lora_rank, rope_dim, page_size):
            raise ValueError(
                f"--attention-backend cuda: needs a Hopper (sm_90) GPU, an fp8 KV cache (--kv-cache-dtype fp8), "
                f"kv_lora_rank {D_LATENT} + rope 64 and a --block-size that is a multiple of 64 (got {kv_dtype}, "
                f"{kv_lora_rank}, {rope_dim}, block size {page_size})"
            )
        try:
            default_library_path()  # now, not at the first decode step: a failed build is a start-up error
        except CudaKernelUnavailable as exc:
            raise ValueError(f"--attention-backend cuda: {exc}") from None
        return requested
    if requested == "triton" and not fits_triton:
        raise ValueError(
            f"--attention-backend triton: needs a bf16/fp16/fp8 cache, rope dim 64 and a power-of-two "
            f"kv_lora_rank (got {kv_dtype}, {rope_dim}, {kv_lora_rank})"
        )
    return requested


GRAPH_SAFE_BACKENDS = ("triton", "cuda")


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to a decode backend: ``torch`` everywhere (and for any CPU tensor);
    ``cuda`` (our C++ FP8 kernel, Hopper), ``triton``, ``flashinfer`` (SM90 fa3), ``trtllm`` (SM100) or
    ``auto`` on CUDA.
    GPU backends are imported lazily so CPU installs need neither Triton nor FlashInfer."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown MLA decode backend {backend!r}; one of {BACKENDS}")
    args = (q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, q_scale, k_scale, out_dtype)
    if backend == "torch" or not q.is_cuda:
        return mla_decode_reference(*args)
    if backend == "auto":
        rope = kv_cache.shape[-1] - kv_lora_rank
        ok = q.dtype == kv_cache.dtype and cuda_kernel_available(q.device, kv_cache.dtype, kv_lora_rank, rope,
                                                                 kv_cache.shape[1])
        backend = choose_auto_backend(kv_cache.dtype, ok)
    if backend == "cuda":
        from kernels.mla_decode_cuda import mla_decode_cuda

        return mla_decode_cuda(*args)
    if backend == "triton":
        from kernels.mla_decode_triton import mla_decode_triton

        return mla_decode_triton(*args)
    if backend == "flashinfer":
        from kernels.mla_decode_flashinfer import mla_decode_flashinfer

        return mla_decode_flashinfer(*args)
    from kernels.mla_decode_flashinfer import mla_decode_trtllm

    return mla_decode_trtllm(*args)
