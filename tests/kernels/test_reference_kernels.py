"""Each torch reference kernel against an independent formulation (float64, loops, complex)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.fp8 import (
    FP8_DTYPE, dequantize_per_token_group, dequantize_weight_blocks, quantize_per_tensor,
    quantize_per_token_group, quantize_weight_blocks,
)
from kernels.mla_decode import mla_decode_reference
from kernels.mla_prefill import mla_prefill_reference
from kernels.moe import RoutingConfig, moe_experts_reference, route_reference
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rope import apply_rope, build_cos_sin_cache, yarn_inv_freq

G = torch.Generator().manual_seed(1234)


def rnd(*shape):
    return torch.randn(*shape, generator=G)


def test_rms_norm_matches_float64_formula():
    x, w = rnd(7, 33), rnd(33)
    ref = (x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)) * w.double()
    assert torch.allclose(rms_norm(x, w, 1e-6).double(), ref, atol=1e-5)
    out, res = add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(res, 2 * x)


def test_rope_matches_complex_rotation():
    x, pos = rnd(9, 3, 16), torch.randint(0, 100, (9,), generator=G)
    inv = yarn_inv_freq(16, 10000.0, 1.0, 4096)
    out = apply_rope(x, pos, build_cos_sin_cache(inv, 128))
    z = torch.view_as_complex(x.double().reshape(9, 3, 8, 2))
    rot = torch.polar(torch.ones(9, 8, dtype=torch.float64), pos.double()[:, None] * inv.double()[None])
    ref = torch.view_as_real(z * rot[:, None]).reshape(9, 3, 16)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_yarn_frequencies_match_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    inv_hf, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = yarn_inv_freq(64, 10000.0, 40.0, 4096, 32, 1)
    assert torch.allclose(ours, inv_hf.float(), rtol=1e-6)
    assert factor == pytest.approx(1.0)


def _route_loop(logits, cfg: RoutingConfig, bias):
    """Per-token python loop over DeepSeek's routing rules."""
    ws, ids = [], []
    e = logits.shape[1]
    per = e // cfg.n_group
    for row in logits.double():
        s = row.sigmoid() if cfg.scoring_func == "sigmoid" else row.softmax(-1)
        choice = s + (bias.double() if bias is not None else 0)
        allowed = list(range(e))
        if cfg.n_group > 1:
            gs = []
            for g in range(cfg.n_group):
                vals = sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True)
                gs.append(sum(vals[:2]) if cfg.topk_method == "noaux_tc" else vals[0])
            keep = sorted(range(cfg.n_group), key=lambda g: -gs[g])[: cfg.topk_group]
            allowed = [x for x in allowed if x // per in keep]
        top = sorted(allowed, key=lambda x: -choice[x].item())[: cfg.top_k]
        w = torch.tensor([s[x].item() for x in top], dtype=torch.float64)
        if cfg.norm_topk_prob:
            w = w / w.sum()
        ws.append(w * cfg.routed_scaling_factor)
        ids.append(top)
    return torch.stack(ws), torch.tensor(ids)


@pytest.mark.parametrize("cfg", [
    RoutingConfig(top_k=3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5),
    RoutingConfig(top_k=2, scoring_func="softmax", topk_method="greedy"),
    RoutingConfig(top_k=2, scoring_func="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=2),
])
def test_routing_matches_loop(cfg):
    logits = rnd(40, 16)
    bias = torch.rand(16, generator=G) * 0.2 if cfg.topk_method == "noaux_tc" else None
    w, ids = route_reference(logits, cfg, bias)
    w_ref, ids_ref = _route_loop(logits, cfg, bias)
    a, b = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(a.values, b.values)
    assert torch.allclose(w.gather(1, a.indices).double(), w_ref.gather(1, b.indices), atol=1e-6)


def test_moe_experts_match_per_token_sum():
    t, h, i, e, k = 12, 16, 8, 6, 2
    x, w13, w2 = rnd(t, h), rnd(e, 2 * i, h), rnd(e, h, i)
    ids = torch.stack([torch.randperm(e, generator=G)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=G)
    out = moe_experts_reference(x, w13, w2, wts, ids)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for n in range(t):
        for j in range(k):
            ex = ids[n, j]
            g = w13[ex, :i].double() @ x[n].double()
            u = w13[ex, i:].double() @ x[n].double()
            ref[n] += wts[n, j] * (w2[ex].double() @ (torch.nn.functional.silu(g) * u))
    assert torch.allclose(out.double(), ref, atol=1e-4)
    # expert parallel: two halves with offsets sum to the whole
    half = (moe_experts_reference(x, w13[:3], w2[:3], wts, ids, 0)
            + moe_experts_reference(x, w13[3:], w2[3:], wts, ids, 3))
    assert torch.allclose(half, out, atol=1e-5)


def _attention_loop(q, k, v, scale, q_offset):
    tq, h = q.shape[:2]
    out = torch.zeros(tq, h, v.shape[-1], dtype=torch.float64)
    for i in range(tq):
        n = q_offset + i + 1
        for hh in range(h):
            s = (k[:n, hh].double() @ q[i, hh].double()) * scale
            out[i, hh] = torch.softmax(s, 0) @ v[:n, hh].double()
    return out


def test_mla_prefill_matches_loop_with_context_offset():
    q, k, v = rnd(5, 3, 12), rnd(9, 3, 12), rnd(9, 3, 7)
    out = mla_prefill_reference(q, k, v, 0.3)
    assert torch.allclose(out.double(), _attention_loop(q, k, v, 0.3, 4), atol=1e-5)


@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_mla_decode_matches_contiguous_loop(s_q):
    """Paged decode vs attention over contiguous per-sequence KV; unused pages are NaN."""
    b, h, d, lora, bs = 3, 4, 24, 16, 8
    lens = [1 + s_q, 17, 24]
    cache = torch.full((12, bs, d), float("nan"))
    tables = [[3], [7, 1, 10], [0, 5, 9]]
    contiguous = []
    for table, n in zip(tables, lens):
        kv = rnd(n, d)
        for p in range(n):
            cache[table[p // bs], p % bs] = kv[p]
        contiguous.append(kv)
    bt = torch.tensor([t + [11] * (3 - len(t)) for t in tables], dtype=torch.int32)
    q = rnd(b, s_q, h, d)
    out, lse = mla_decode_reference(q, cache, bt, torch.tensor(lens, dtype=torch.int32), 0.2, lora,
                                    out_dtype=torch.float32)
    for i, kv in enumerate(contiguous):
        n = lens[i]
        ref = _attention_loop(q[i], kv[:, None].expand(n, h, d), kv[:, None, :lora].expand(n, h, lora), 0.2, n - s_q)
        assert torch.allclose(out[i].double(), ref, atol=1e-5)
        s = torch.einsum("shd,nd->shn", q[i].double(), kv.double()) * 0.2
        mask = torch.arange(n)[None] > (n - s_q + torch.arange(s_q))[:, None]
        assert torch.allclose(lse[i].double(), s.masked_fill(mask[:, None], -math.inf).logsumexp(-1), atol=1e-5)


def test_mla_decode_fp8_scales():
    """Quantized q/kv with scales approximate the float result (the scales are applied)."""
    q, cache = rnd(2, 1, 4, 24), rnd(4, 8, 24)
    bt, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([16, 11], dtype=torch.int32)
    ref, _ = mla_decode_reference(q, cache, bt, lens, 0.2, 16, out_dtype=torch.float32)
    q8, kv8 = quantize_per_tensor(q, 0.02), quantize_per_tensor(cache, 0.01)
    out, _ = mla_decode_reference(q8, kv8, bt, lens, 0.2, 16, q_scale=0.02, k_scale=0.01, out_dtype=torch.float32)
    assert ((out - ref).norm() / ref.norm()).item() < 0.1


def test_fp8_token_group_quant():
    x = rnd(5, 300) * 10
    q, s = quantize_per_token_group(x, 128)
    assert q.dtype == FP8_DTYPE and s.shape == (5, 3)
    back = dequantize_per_token_group(q, s, 128)
    assert ((back - x).norm() / x.norm()).item() < 0.04
    # each group's max maps to ±448
    assert torch.allclose(q[:, :128].float().abs().amax(-1), torch.full((5,), 448.0))
    _, s8 = quantize_per_token_group(x, 128, ue8m0=True)
    assert torch.equal(torch.log2(s8), torch.log2(s8).round())


def test_fp8_weight_blocks_ragged():
    w = rnd(200, 130)
    w8, s = quantize_weight_blocks(w, (128, 128))
    assert w8.shape == (200, 130) and s.shape == (2, 2)
    back = dequantize_weight_blocks(w8, s, (128, 128))
    assert ((back - w).norm() / w.norm()).item() < 0.04
    blk = w[128:, 128:]
    assert s[1, 1].item() == pytest.approx(blk.abs().max().item() / 448.0, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_moe_matches_reference(dtype):
    """The graph-capturable grouped-GEMM MoE equals the per-expert reference, with EP offsets."""
    from kernels.moe import moe_experts_grouped

    t, h, i, e, k = 37, 32, 16, 8, 3
    x, w13, w2 = rnd(t, h).to(dtype), rnd(e, 2 * i, h).to(dtype), rnd(e, h, i).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=G)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=G)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    ref = moe_experts_reference(x, w13, w2, wts, ids).float()
    out = moe_experts_grouped(x, w13, w2, wts, ids).float()
    assert ((out - ref).norm() / ref.norm()).item() < tol
    # rank 1 of EP 2 holds experts 4..7: choices of 0..3 contribute nothing
    part = moe_experts_grouped(x, w13[4:], w2[4:], wts, ids, expert_offset=4).float()
    ref_part = moe_experts_reference(x, w13[4:], w2[4:], wts, ids, expert_offset=4).float()
    assert torch.isfinite(part).all()
    assert ((part - ref_part).norm() / ref_part.norm()).item() < tol


@pytest.mark.parametrize("tq,tk", [(9, 9), (5, 14)])
def test_mla_prefill_sdpa_path_matches_reference(tq, tk):
    """The fused-attention path (used on CUDA) computes the same function; checked on CPU."""
    from kernels.mla_prefill import mla_prefill_sdpa

    q, k, v = rnd(tq, 3, 24), rnd(tk, 3, 24), rnd(tk, 3, 16)
    assert torch.allclose(mla_prefill_sdpa(q, k, v, 0.2), mla_prefill_reference(q, k, v, 0.2), atol=1e-5)
    # lengths rounded up to a bucket (as on CUDA) with zero rows: the real rows are unchanged
    padded = mla_prefill_sdpa(q, k, v, 0.2, length_bucket=8)
    assert padded.shape == (tq, 3, 16)
    assert torch.allclose(padded, mla_prefill_reference(q, k, v, 0.2), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tq,tk", [(512, 512), (300, 812)])
def test_mla_prefill_sdpa_uses_a_fused_backend_on_gpu(tq, tk):
    """With the math backend disallowed, both the plain and the after-context causal forms must
    still run (a dense mask would need the math backend: 10x slower prefill, measured)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.mla_prefill import mla_prefill_sdpa

    q, k = (torch.randn(n, 16, 192, device="cuda", dtype=torch.bfloat16) for n in (tq, tk))
    v = torch.randn(tk, 16, 128, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = mla_prefill_sdpa(q, k, v, 192 ** -0.5)
    ref = mla_prefill_reference(q.float(), k.float(), v.float(), 192 ** -0.5)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
