"""MLA prefill attention (non-absorbed form) for one sequence: the torch reference and the GPU
SDPA path (the prefill backends of ``kernels/attention/prefill.py`` wrap them), and the
assembly of its keys/values from ``kv_b_proj``'s output.

Keys/values are the up-projected latents: k = [k_nope ‖ k_pe] (k_pe shared by all heads),
v per head. The query block holds the *last* ``Tq`` positions of a ``Tk``-long context
(chunked prefill: earlier tokens come from the cache), so query i sees keys 0..Tk-Tq+i.

``assemble_prefill_kv`` splits ``kv_b_proj``'s [Tk, H, nope + v] output into k (with the
rotated k_pe broadcast over the heads) and v, optionally zero-padded to the width a backend
wants (SDPA's fused kernels take v as wide as q/k). Unfused that is a ``torch.cat`` over an
expanded k_pe and a pad (a fill plus a strided copy); the Triton kernel reads each row once
and writes k and v in their final, contiguous layouts. Pure data movement: bit-exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fused_glue import HAS_TRITON, glue_kernels_apply

if HAS_TRITON:  # the GPU path needs Triton; the CPU reference does not
    import triton
    import triton.language as tl


SDPA_LENGTH_BUCKET = 256  # rows: chunk lengths SDPA sees on CUDA are rounded up to a multiple of this


def sdpa_warmup_lengths(max_tokens: int, device: torch.device, length_bucket: int = SDPA_LENGTH_BUCKET) -> list[int]:
    """Every chunk length ``mla_prefill_sdpa`` can hand SDPA for chunks of up to ``max_tokens``
    rows on ``device``: the bucket multiples on CUDA, where each first call at a new length
    costs host time (see ``mla_prefill_sdpa``); none elsewhere, where nothing is planned per
    length."""
    if device.type != "cuda" or max_tokens < 1:
        return []
    return list(range(length_bucket, -(-max_tokens // length_bucket) * length_bucket + 1, length_bucket))


def causal_offset_mask(tq: int, tk: int, device) -> torch.Tensor:
    """Boolean [tq, tk]: True where query i (at position tk - tq + i) may attend key j."""
    q_pos = torch.arange(tk - tq, tk, device=device)
    return torch.arange(tk, device=device)[None, :] <= q_pos[:, None]


def mla_prefill_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] → [Tq, H, Dv] (math in float32)."""
    tq, tk = q.shape[0], k.shape[0]
    mask = causal_offset_mask(tq, tk, q.device)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask,
        scale=softmax_scale,
    )
    return out.transpose(0, 1).to(q.dtype)


def mla_prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                     length_bucket: int | None = None) -> torch.Tensor:
    """GPU path: torch's fused attention in the compute dtype. Causality is always given as a
    structure, never as a dense mask, and inputs are 4-D: otherwise SDPA takes its math backend, which
    materializes fp32 scores (measured on the H200: 36 ms per layer for 8192 tokens, 90% of a
    prefill step). A block with no cached context is plain causal; a block after cached context
    is causal aligned to the bottom right (query i sees keys 0 .. tk - tq + i). v is zero-padded
    to the q/k head dim when they differ, as fused kernels want equal head dims, and the
    padding is sliced off the output.

    A block without context is also padded with zero rows to a multiple of ``length_bucket``
    (default: ``SDPA_LENGTH_BUCKET`` on CUDA, none elsewhere): SDPA's Hopper kernel (cuDNN)
    spends host time on every call with a sequence length it has not run before (~75 ms per
    27-layer step on an H100, against ~2 ms for lengths it has seen:
    benchmarks/bench_prefill_layout.py), and chunked prefill meets a new length in nearly every
    step. A causal row never attends the keys after it, so the padding rows change no real row,
    and their outputs are dropped."""
    from torch.nn.attention.bias import causal_lower_right

    tq, tk, dv = q.shape[0], k.shape[0], v.shape[-1]
    if length_bucket is None:
        length_bucket = SDPA_LENGTH_BUCKET if q.is_cuda else 1
    pad_rows = -tq % length_bucket if tq == tk else 0
    if dv < q.shape[-1] or pad_rows:
        v = F.pad(v, (0, q.shape[-1] - dv, 0, 0, 0, pad_rows))
    if pad_rows:
        q, k = (F.pad(t, (0, 0, 0, 0, 0, pad_rows)) for t in (q, k))
    # [1, H, T, D]: the fused kernels take 4-D inputs only (3-D ones fall back to math too).
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if tq == tk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=softmax_scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(tq, tk), scale=softmax_scale)
    return out[0, :, :tq].transpose(0, 1)[..., :dv]


def mla_prefill_flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                             cu_k: torch.Tensor, max_q: int, max_k: int, softmax_scale: float) -> torch.Tensor:
    """Chunks after cached context on the GPU: torch's flash kernel in its varlen form, q and
    k/v ragged by the device int32 offsets ``cu_q`` / ``cu_k`` (its causal mask is aligned to
    the bottom right, the contract above). SDPA's own route to that mask (``causal_lower_right``)
    synchronizes the host with the device on every call (measured on the H200: host time =
    device time per call), which in a layer loop leaves the GPU idle while the next layer's
    kernels are launched; this call does not. v must be as wide as q/k (callers pad it)."""
    return _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, True, softmax_scale)[0][..., : v.shape[-1]]


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, softmax_scale: float):
    """torch's varlen flash kernel (causal = aligned to the bottom right): (output, LSE)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                   scale=softmax_scale)[:2]


TAIL_SEGMENT_MIN_KEYS = 512  # shortest prefix piece a split tail chunk hands the flash kernel


def tail_segments(query_len: int, context_len: int, heads: int, num_sms: int, q_block: int = 128) -> int:
    """How many pieces to cut a chunk's cached prefix into for ``mla_prefill_after_context_split``:
    the flash kernel runs one CTA per 128 query rows and head, so a short chunk after a long
    context (a prompt's tail in the next step) leaves most SMs idle (301 rows x 16 heads: 48 CTAs
    on 132 SMs). Enough pieces for two waves, none shorter than ``TAIL_SEGMENT_MIN_KEYS``; 1
    means no split."""
    blocks = -(-query_len // q_block) * heads
    if blocks >= num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // blocks), context_len // TAIL_SEGMENT_MIN_KEYS))


def flash_varlen_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, q_len: int,
                          cu_k: torch.Tensor, max_k: int, causal: bool, softmax_scale: float):
    """``flash_varlen_lse`` over ``num_seqs`` query blocks of ``q_len`` rows each (q
    [num_seqs * q_len, H, D]) and the key ranges of the device int32 offsets ``cu_k``: the
    output and its natural-log LSE as [H, num_seqs * q_len]."""
    cu_q = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    return flash_varlen_lse(q, k, v, cu_q, cu_k, q_len, max_k, causal, softmax_scale)


def merge_by_lse(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Attention over disjoint key sets → attention over their union: outs [n, T, H, D], lses
    [n, H, T] (natural log; -inf where a part saw no key) → [T, H, D] in outs' dtype."""
    acc, lse = outs[0].to(torch.float32, copy=True), lses[0].to(torch.float32, copy=True)
    for out, part_lse in zip(outs[1:], lses[1:]):
        merge_lse_(acc, lse, out, part_lse)
    return acc.to(outs.dtype)


def attention_with_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                                 softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query block over one key block in float32: q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv]
    → (out [Tq, H, Dv] in q's dtype, natural-log LSE [H, Tq] in float32). ``causal``: aligned to
    the bottom right (``causal_offset_mask``); otherwise every query sees every key."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * softmax_scale
    if causal:
        scores = scores.masked_fill(~causal_offset_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def flash_varlen_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's varlen flash kernel over ragged query blocks of any lengths → (out, LSE [H, Tq]).
    The kernel returns the LSE per head and row, or padded per sequence as [num_seqs, H, max_q]
    depending on its version; the padded form is read back row by row (indices made on the
    device from ``cu_q``: no host sync). v as wide as q/k (callers pad it)."""
    out, lse = _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale)
    if lse.dim() == 3:
        rows = torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype)
        seq = torch.searchsorted(cu_q[1:], rows, right=True)
        lse = lse[seq, :, (rows - cu_q[seq]).long()].transpose(0, 1)
    return out, lse


def merge_lse_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold attention over another, disjoint key set into a running result, in place:
    acc_out [T, H, D] float32 and acc_lse [H, T] float32 become the attention over both key
    sets; out [T, H, >= D] (its first D columns are used) and lse [H, T] are the new part."""
    top = torch.maximum(acc_lse, lse)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w_acc, w_new = torch.exp(acc_lse - top), torch.exp(lse - top)
    total = w_acc + w_new
    acc_out.mul_((w_acc / total).transpose(0, 1).unsqueeze(-1))
    acc_out.add_(out[..., : acc_out.shape[-1]].float() * (w_new / total).transpose(0, 1).unsqueeze(-1))
    acc_lse.copy_(top + torch.log(total))


def mla_prefill_after_context_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                                    segments: int, softmax_scale: float) -> torch.Tensor:
    """One chunk after ``context_len`` cached keys (q [Tq, H, D], k/v [context_len + Tq, H, D],
    the contract of ``mla_prefill_reference``), with its prefix cut into ``segments`` pieces so a
    short chunk fills the GPU: every row sees all prefix keys, so the pieces run as separate
    non-causal sequences of one varlen call (q repeated per piece), the chunk's own keys as one
    causal call, and the parts are merged by their LSEs. v as wide as q/k (callers pad it)."""
    tq, heads, dim = q.shape
    edges = [context_len * i // segments for i in range(segments + 1)]
    # The same edges, made on the device (an upload from pageable host memory would wait).
    cu_k = (torch.arange(segments + 1, device=q.device) * context_len // segments).to(torch.int32)
    q_rep = q.unsqueeze(0).expand(segments, tq, heads, dim).reshape(segments * tq, heads, dim)
    out_p, lse_p = flash_varlen_with_lse(q_rep, k[:context_len], v[:context_len], segments, tq, cu_k,
                                         max(b - a for a, b in zip(edges, edges[1:])), False, softmax_scale)
    own = torch.arange(0, 2 * tq, tq, dtype=torch.int32, device=q.device)
    out_o, lse_o = flash_varlen_with_lse(q, k[context_len:], v[context_len:], 1, tq, own, tq, True, softmax_scale)
    outs = torch.cat([out_p.view(segments, tq, heads, -1), out_o.unsqueeze(0)])
    lses = torch.cat([lse_p.view(heads, segments, tq).transpose(0, 1), lse_o.unsqueeze(0)])
    return merge_by_lse(outs, lses)


def flash_varlen_unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why torch's varlen flash kernel cannot run these heads (None: it can)."""
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this torch build has no flash attention"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention needs fp16/bf16, got {dtype}"
    if head_dim > 256 or head_dim % 8:
        return f"flash attention needs a head dim <= 256 and a multiple of 8, got {head_dim}"
    return None


def _check_kv(kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int, v_width: int) -> int:
    """Validate; returns v's width in ``kv``."""
    if kv.dim() != 3 or k_pe.dim() != 2 or k_pe.shape[0] != kv.shape[0]:
        raise ValueError(f"need kv [Tk, H, nope + v] and k_pe [Tk, rope]; got {tuple(kv.shape)}, {tuple(k_pe.shape)}")
    if kv.dtype != k_pe.dtype:
        raise TypeError(f"kv and k_pe must share a dtype, got {kv.dtype} and {k_pe.dtype}")
    dv = kv.shape[-1] - nope_dim
    if not 0 < nope_dim < kv.shape[-1] or v_width < dv:
        raise ValueError(f"nope_dim {nope_dim} and v_width {v_width} do not fit kv's last dim {kv.shape[-1]}")
    return dv


def assemble_prefill_kv_reference(
    kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int, v_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [Tk, H, nope + v] (kv_b_proj's output) and the rotated k_pe [Tk, rope] → k [Tk, H,
    nope + rope] = [k_nope ‖ k_pe], v [Tk, H, v_width] = [v ‖ zeros] (a view of kv when
    v_width is v's own width)."""
    dv = _check_kv(kv, k_pe, nope_dim, v_width)
    k_nope, v = kv.split([nope_dim, dv], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, kv.shape[1], -1)], dim=-1)
    return k, (F.pad(v, (0, v_width - dv)) if v_width > dv else v)


if HAS_TRITON:

    @triton.jit
    def _assemble_kv_kernel(
        KV, PE, K, V, n_heads, stride_kvt, stride_kvh, stride_pe,
        NOPE: tl.constexpr, ROPE: tl.constexpr, DV: tl.constexpr, V_WIDTH: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_ROPE: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        hmask = (heads < n_heads)[:, None]
        src = KV + t * stride_kvt + heads[:, None] * stride_kvh
        k_row = K + (t * n_heads + heads[:, None]) * (NOPE + ROPE)
        v_row = V + (t * n_heads + heads[:, None]) * V_WIDTH
        cn = tl.arange(0, BLOCK_NOPE)[None, :]
        tl.store(k_row + cn, tl.load(src + cn, mask=hmask & (cn < NOPE)), mask=hmask & (cn < NOPE))
        cr = tl.arange(0, BLOCK_ROPE)
        pe = tl.load(PE + t * stride_pe + cr, mask=cr < ROPE)  # one row, broadcast over the heads
        pe = tl.broadcast_to(pe[None, :], (BLOCK_H, BLOCK_ROPE))
        tl.store(k_row + NOPE + cr[None, :], pe, mask=hmask & (cr[None, :] < ROPE))
        cv = tl.arange(0, BLOCK_V)[None, :]
        val = tl.load(src + NOPE + cv, mask=hmask & (cv < DV), other=0.0)  # zeros past v's width
        tl.store(v_row + cv, val, mask=hmask & (cv < V_WIDTH))


def assemble_prefill_kv_triton(
    kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int, v_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton pass (CUDA, or CPU under TRITON_INTERPRET=1): contiguous k and v, same values
    as the reference. kv and k_pe need a unit stride along their last dim."""
    if not HAS_TRITON:
        raise RuntimeError("the K/V assembly kernel needs the triton package")
    dv = _check_kv(kv, k_pe, nope_dim, v_width)
    if kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("the K/V assembly kernel needs kv and k_pe with a unit stride along their last dim")
    tk, h, _ = kv.shape
    rope = k_pe.shape[1]
    k = torch.empty(tk, h, nope_dim + rope, dtype=kv.dtype, device=kv.device)
    v = torch.empty(tk, h, v_width, dtype=kv.dtype, device=kv.device)
    if tk == 0 or h == 0:
        return k, v
    block_h = min(triton.next_power_of_2(h), 16)
    _assemble_kv_kernel[(tk, triton.cdiv(h, block_h))](
        kv, k_pe, k, v, h, kv.stride(0), kv.stride(1), k_pe.stride(0),
        NOPE=nope_dim, ROPE=rope, DV=dv, V_WIDTH=v_width, BLOCK_H=block_h,
        BLOCK_NOPE=triton.next_power_of_2(nope_dim), BLOCK_ROPE=triton.next_power_of_2(rope),
        BLOCK_V=triton.next_power_of_2(v_width), num_warps=4,
    )
    return k, v


def assemble_prefill_kv(
    kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int, v_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k [Tk, H, nope + rope], v [Tk, H, v_width] from kv_b_proj's output and the rotated k_pe
    (contract: ``assemble_prefill_kv_reference``): the Triton pass on CUDA, torch otherwise."""
    if glue_kernels_apply(kv) and kv.stride(-1) == 1 and k_pe.stride(-1) == 1:
        return assemble_prefill_kv_triton(kv, k_pe, nope_dim, v_width)
    return assemble_prefill_kv_reference(kv, k_pe, nope_dim, v_width)
