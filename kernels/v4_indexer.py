"""DeepSeek-V4.1 lightning indexer on the packed key records: the contract, its torch reference
and the backend switch (the Triton kernel: kernels/v4_indexer_triton.py).

A query q of request r scores key j of that request as

    score[q, j] = Σ_h w[q, h] · ReLU(q_h · k_j) · d^-½        (w already holds H^-½)

with the query heads and the keys FP4 e2m1 in blocks of 32 with a UE8M0 scale per block (the
roundings V4.1 trains with). Keys are 68-byte records (d = 128: 64 bytes of e2m1 pairs, 4
scale bytes; ``kernels.v4_cache_formats.pack_v41_index_keys``) in a pool of rows
``keys [rows, bytes]``; request r's key j is row ``page_table[r, j // R]·R + j % R``. A query
sees keys j < ``visible[q]`` (the others score −inf) and, when a candidate mask is given,
only keys whose block of ``block_size`` is allowed. Queries come as e4m3 values (e2m1 → e4m3
is exact) and float32 power-of-two scales per 32 (:func:`quantize_index_queries`), so a
kernel's per-block products on FP8 tensor cores are exact and only the fp32 sums round.

The whole step (quantization, scores, picks, candidate blocks) is :func:`index_picks_reference`.

Selection on top of the scores (shared by every backend; fixed shapes, no host sync):
:func:`topk_picks` (the top ``k``, −1 where fewer keys are visible; :func:`topk_picks_from_keys`
when a backend returns the scores' top-k keys) and V4.1's two-level
step, :func:`candidate_blocks`: per query the ``topk_blocks`` blocks with the highest max
score, the block of its newest visible key always among them. Ties go to the lower index
(:mod:`kernels.topk`), so a request's picks do not depend on its batch.

The backends that compute the scores (this reference, the Triton kernel) are chosen in
kernels/attention/v4_indexer.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.microscaling import quantize_fp4_blocks
from kernels.topk import NEG_INF_KEY_MAX, order_keys, ordered_topk
from kernels.v4_cache_formats import V41_INDEX_KEY_BLOCK, unpack_v41_index_keys, v41_index_key_bytes
from kernels.weight_formats import fp4_codes_to_float

SCALE_BLOCK = V41_INDEX_KEY_BLOCK  # 32: queries and keys share the block


# ---- selection (shared by the model's own path and every backend) ----------------------------
def block_max(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., ceil(n / block_size)]: the max of each block of consecutive entries (−inf padded)."""
    n = scores.shape[-1]
    padded = F.pad(scores, (0, (-n) % block_size), value=float("-inf"))
    return padded.view(*scores.shape[:-1], -1, block_size).amax(dim=-1)


def candidate_blocks(block_scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                     block_size: int) -> torch.Tensor:
    """Boolean mask over blocks, like ``block_scores`` [..., blocks]: the ``topk_blocks`` blocks
    with the highest score (−inf never), always including the block that holds a query's
    newest visible entry; ``visible`` [..., 1] is the number of visible entries per query."""
    num_blocks = block_scores.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")
    block_ids = torch.arange(num_blocks, device=block_scores.device)
    pinned = block_scores.masked_fill(block_ids == newest, float("inf"))
    values, indices = ordered_topk(pinned, min(topk_blocks, num_blocks))
    return torch.zeros_like(pinned, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """:func:`candidate_blocks` of the index scores [..., n] (invisible entries at −inf)."""
    return candidate_blocks(block_max(scores, block_size), visible, topk_blocks, block_size)


def blocks_to_entries(blocks: torch.Tensor, block_size: int, num_entries: int) -> torch.Tensor:
    """[..., blocks] block mask → [..., num_entries] entry mask."""
    return blocks.repeat_interleave(block_size, dim=-1)[..., :num_entries]


def topk_picks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The top ``min(k, n)`` entries of scores [..., n] (ties to the lower index,
    :func:`kernels.topk.ordered_topk`), −1 where the score is −inf."""
    values, indices = ordered_topk(scores, min(k, scores.shape[-1]))
    return torch.where(values > float("-inf"), indices, torch.full_like(indices, -1))


def topk_picks_from_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_picks` of the scores whose :func:`kernels.topk.order_keys` are ``keys``."""
    values, indices = keys.topk(min(k, keys.shape[-1]), dim=-1)
    return torch.where(values > NEG_INF_KEY_MAX, indices, torch.full_like(indices, -1))


def score_values(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Unmasked scores [B, T, n] (float32) of queries q [B, T, heads, d], head weights
    [B, T, heads] and keys [B, n, d]: the formula of the module doc."""
    scores = torch.einsum("bshd,btd->bsht", q.float(), keys.float())
    scores = scores.relu() * softmax_scale
    return (scores * weights.unsqueeze(-1)).sum(dim=2)


# ---- the records ----------------------------------------------------------------------------
def quantize_index_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrounded queries [..., d] → (e4m3 values [..., d], float32 scales [..., d/32]) with
    ``values · scale`` = the model's ``fake_quant_fp4(q, 32, "ue8m0")`` exactly."""
    codes, scale = quantize_fp4_blocks(q, SCALE_BLOCK, "ue8m0")
    return fp4_codes_to_float(codes).to(torch.float8_e4m3fn), scale.float()


def dequantize_index_queries(q8: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    d = q8.shape[-1]
    blocks = q8.float().view(*q8.shape[:-1], d // SCALE_BLOCK, SCALE_BLOCK) * q_scale.unsqueeze(-1)
    return blocks.view(q8.shape)


def key_rows(page_table: torch.Tensor, page_rows: int, num_keys: int) -> torch.Tensor:
    """Flat pool rows [R, num_keys] of every request's keys 0 … num_keys − 1."""
    j = torch.arange(num_keys, device=page_table.device)
    return page_table[:, j // page_rows] * page_rows + j % page_rows


def check_inputs(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys, queries_per_request,
                 allowed, block_size) -> None:
    """Shapes and dtypes; one line naming the tensor on a mismatch."""
    if q8.dtype != torch.float8_e4m3fn or q8.dim() != 3 or q8.shape[-1] % SCALE_BLOCK:
        raise ValueError(f"q8 must be float8_e4m3fn [Q, heads, d] with d a multiple of {SCALE_BLOCK}, got "
                         f"{q8.dtype} {tuple(q8.shape)}")
    nq, heads, d = q8.shape
    if q_scale.dtype != torch.float32 or tuple(q_scale.shape) != (nq, heads, d // SCALE_BLOCK):
        raise ValueError(f"q_scale must be float32 [{nq}, {heads}, {d // SCALE_BLOCK}], got {q_scale.dtype} "
                         f"{tuple(q_scale.shape)}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (nq, heads):
        raise ValueError(f"weights must be float32 [{nq}, {heads}], got {weights.dtype} {tuple(weights.shape)}")
    if keys.dtype != torch.uint8 or keys.dim() != 2 or keys.shape[1] != v41_index_key_bytes(d):
        raise ValueError(f"keys must be uint8 [rows, {v41_index_key_bytes(d)}], got {keys.dtype} {tuple(keys.shape)}")
    if queries_per_request < 1 or nq % queries_per_request or page_table.shape[0] != nq // queries_per_request:
        raise ValueError(f"page_table must have one row per {queries_per_request} queries ({nq} queries), got "
                         f"{tuple(page_table.shape)}")
    if page_table.dim() != 2 or page_table.shape[1] * page_rows < num_keys:
        raise ValueError(f"page_table [R, pages] must address the {num_keys} keys in pages of {page_rows}, got "
                         f"{tuple(page_table.shape)}")
    if visible.shape != (nq,):
        raise ValueError(f"visible must be [{nq}], got {tuple(visible.shape)}")
    if allowed is not None and (allowed.dtype != torch.bool
                                or tuple(allowed.shape) != (nq, -(-num_keys // block_size))):
        raise ValueError(f"allowed must be bool [{nq}, {-(-num_keys // block_size)}], got {allowed.dtype} "
                         f"{tuple(allowed.shape)}")


def index_scores_reference(
    q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, page_table: torch.Tensor,
    page_rows: int, visible: torch.Tensor, num_keys: int, softmax_scale: float, queries_per_request: int = 1,
    allowed: torch.Tensor | None = None, block_size: int = 8, want_block_max: bool = False,
    keys_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores float32 [Q, num_keys] with −inf where masked — or, ``keys_out``, their int64
    :func:`kernels.topk.order_keys` — and their :func:`block_max` or None).

    q8 / q_scale [Q, heads, d] / [Q, heads, d/32] (:func:`quantize_index_queries`), weights
    [Q, heads] float32, keys the uint8 record pool [rows, d/2 + d/32], page_table [R, pages]
    (R = Q / ``queries_per_request``: queries r·qpr … are request r's), visible [Q] (≤ num_keys),
    allowed [Q, ceil(num_keys / block_size)] bool or None."""
    check_inputs(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys, queries_per_request, allowed,
                 block_size)
    nq, heads, d = q8.shape
    rows = key_rows(page_table, page_rows, num_keys)  # [R, n]
    entry = torch.arange(num_keys, device=keys.device)
    per_req = visible.view(-1, queries_per_request).amax(-1, keepdim=True)  # [R, 1]: never read past it
    records = keys[torch.where(entry < per_req, rows, torch.zeros_like(rows))]
    k = torch.where((entry < per_req).unsqueeze(-1), unpack_v41_index_keys(records), 0.0)
    q = dequantize_index_queries(q8, q_scale).view(-1, queries_per_request, heads, d)
    scores = score_values(q, weights.view(-1, queries_per_request, heads), k, softmax_scale).view(nq, num_keys)
    masked = entry >= visible.view(-1, 1)
    if allowed is not None:
        masked |= ~blocks_to_entries(allowed, block_size, num_keys)
    scores = scores.masked_fill(masked, float("-inf"))
    bmax = block_max(scores, block_size) if want_block_max else None
    return (order_keys(scores) if keys_out else scores), bmax


def index_picks_reference(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, page_table: torch.Tensor, page_rows: int,
    visible: torch.Tensor, num_keys: int, softmax_scale: float, index_topk: int, queries_per_request: int = 1,
    allowed: torch.Tensor | None = None, block_size: int = 8, topk_blocks: int | None = None,
    allowed_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The indexer step of Q queries on packed records: (picks [Q, min(index_topk, num_keys)]
    int64 (:func:`topk_picks`), the candidate block mask [Q, blocks] of
    :func:`candidate_blocks` when ``topk_blocks`` is given, else None).

    q [Q, heads, d]: the rotated queries before their FP4 rounding (any float dtype; rounded
    by :func:`quantize_index_queries`); ``allowed_blocks``: a bound on the blocks any row of
    ``allowed`` allows, which a backend may use to score only those (unused here); the other
    arguments as :func:`index_scores_reference`'s."""
    q8, q_scale = quantize_index_queries(q)
    scores, bmax = index_scores_reference(q8, q_scale, weights, keys, page_table, page_rows, visible, num_keys,
                                          softmax_scale, queries_per_request, allowed, block_size,
                                          want_block_max=topk_blocks is not None)
    picks = topk_picks(scores, index_topk)
    if topk_blocks is None:
        return picks, None
    return picks, candidate_blocks(bmax, visible.view(-1, 1), topk_blocks, block_size)
