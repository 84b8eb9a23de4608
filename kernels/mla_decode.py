"""MLA decode attention over a paged latent cache: the torch reference, the contract every decode
backend (``kernels/attention/``) answers to.

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

import torch


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
