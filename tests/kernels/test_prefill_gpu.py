"""GPU checks of the prefill-sized paths against their torch references: FlashInfer's ragged
fa3 prefill and the SDPA backend (q/k 192, v 128; several chunks, with and without cached
prefixes) against the per-chunk float32 reference, and the grouped-GEMM MoE at prefill sizes against the per-expert
reference (``auto`` picking it there)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.attention import AttentionSpec, FlashInferPrefill, PrefillMetadata, SdpaPrefill, TorchPrefill
from kernels.moe import bf16_experts_backend, moe_experts, moe_experts_grouped, moe_experts_reference

pytestmark = pytest.mark.gpu


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _ragged(q_lens, c_lens, heads, gen):
    kv_lens = [c + q for c, q in zip(c_lens, q_lens)]
    q = torch.randn(sum(q_lens), heads, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(sum(kv_lens), heads, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(sum(kv_lens), heads, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731
    md = PrefillMetadata(row_start=0, query_lens=list(q_lens), context_lens=list(c_lens), qo_indptr=cum(q_lens),
                         kv_indptr=cum(kv_lens), prefix_slots=None, kv_order=None)
    return q, k, v, md


@pytest.mark.parametrize("tq,context,segments", [(301, 7891, 6), (700, 7110, 3), (13, 1300, 2)])
def test_split_tail_matches_reference(tq, context, segments):
    """A short chunk after a long prefix with the prefix cut into pieces (the flash kernel's LSE,
    whatever its layout, merges the parts) equals the float32 reference."""
    _needs_cuda()
    from kernels.mla_prefill import mla_prefill_after_context_split

    q, k, v, _ = _ragged([tq], [context], 16, torch.Generator(device="cuda").manual_seed(tq))
    v = torch.nn.functional.pad(v, (0, 64))
    got = mla_prefill_after_context_split(q, k, v, context, segments, 192 ** -0.5)[..., :128]
    want = TorchPrefill().forward(q, k, v[..., :128], 192 ** -0.5)
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_attention_with_lse_matches_reference_at_unequal_lengths(causal):
    """The flash kernel's output and LSE (whatever its LSE layout) for ragged blocks of unequal
    lengths, as the context windows use them, against the float32 reference."""
    _needs_cuda()
    from kernels.attention import VarlenSegments

    gen = torch.Generator(device="cuda").manual_seed(9)
    q_lens, k_lens = [301, 1, 77, 1024], [4096, 9, 300, 1500] if not causal else [301, 1, 77, 1024]
    q = torch.randn(sum(q_lens), 16, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), 16, 192, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731
    segments = VarlenSegments(q_lens, k_lens, cum(q_lens), cum(k_lens))
    out, lse = SdpaPrefill().attend_with_lse(q, k, v, segments, causal, 0.07)
    want, want_lse = TorchPrefill().attend_with_lse(q, k, v, segments, causal, 0.07)
    assert lse.shape == want_lse.shape == (16, sum(q_lens))
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=0)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_sdpa_warm_up_runs_on_the_gpu_and_leaves_the_path_exact():
    """The start-up sweep of chunk lengths runs (every bucket up to 2048 rows at V2-Lite's
    heads), and a chunk of a warmed length afterwards still matches the reference."""
    _needs_cuda()
    spec = AttentionSpec(torch.device("cuda"), torch.bfloat16, 16, 512, 64, 64, 192 ** -0.5, torch.bfloat16,
                         qk_head_dim=192, v_head_dim=128)
    backend = SdpaPrefill(spec)
    assert backend.warm_up(2000) == 8
    q, k, v, md = _ragged([1900], [0], 16, torch.Generator(device="cuda").manual_seed(5))
    got = backend.forward(q, k, torch.nn.functional.pad(v, (0, 64)), 192 ** -0.5)[..., :128]
    want = TorchPrefill().forward(q, k, v, 192 ** -0.5)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("q_lens,c_lens", [([8192], [0]), ([1000, 17, 2048, 1], [0, 300, 4096, 77]),
                                           ([512] * 16, [4096] * 16)])
def test_flashinfer_ragged_prefill_matches_reference(q_lens, c_lens):
    _needs_cuda()
    if importlib.util.find_spec("flashinfer") is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs flashinfer on a Hopper GPU")
    heads = 16
    spec = AttentionSpec(torch.device("cuda"), torch.bfloat16, heads, 512, 64, 64, 192 ** -0.5, torch.bfloat16,
                         qk_head_dim=192, v_head_dim=128)
    assert FlashInferPrefill.unsupported_reason(spec) is None
    backend = FlashInferPrefill(spec)
    q, k, v, md = _ragged(q_lens, c_lens, heads, torch.Generator(device="cuda").manual_seed(0))
    got = backend.forward_varlen(q, k, v, backend.plan(md), spec.softmax_scale)
    want = TorchPrefill().forward_varlen(q, k, v, md, spec.softmax_scale)
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("q_lens,c_lens", [([8192], [0]), ([56, 8125], [8136, 0]),
                                           ([1000, 17, 2048, 1], [0, 300, 4096, 77]), ([512] * 4, [4096] * 4),
                                           ([300], [812]), ([301, 7866], [7891, 0])])
@pytest.mark.parametrize("split_tails", [False, True])
def test_sdpa_backend_steps_match_reference_without_host_syncs(q_lens, c_lens, split_tails):
    """The SDPA backend over a step's chunks (chunks from 0 on SDPA's causal form, chunks after
    cached context on the varlen flash kernel; with ``split_tails`` a short one after a long
    prefix in pieces) equals the float32 reference, and launches without synchronizing the host
    (a sync in the layer loop idles the GPU while the next layer's kernels are launched)."""
    _needs_cuda()
    heads = 16
    q, k, v, md = _ragged(q_lens, c_lens, heads, torch.Generator(device="cuda").manual_seed(2))
    v = torch.nn.functional.pad(v, (0, 64))  # SdpaPrefill.value_width: v as wide as q/k, zero columns
    backend = SdpaPrefill(split_short_tails=split_tails)
    assert backend.value_width(192, 128) == 192
    backend.forward_varlen(q, k, v, md, 192 ** -0.5)  # first call: kernel selection, allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = backend.forward_varlen(q, k, v, md, 192 ** -0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = TorchPrefill().forward_varlen(q, k, v[..., :128], md, 192 ** -0.5)
    got = got[..., :128]
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err


@pytest.mark.parametrize("t,e,k,offset", [(4096, 64, 6, 0), (2048, 32, 8, 32)])
def test_grouped_moe_at_prefill_sizes_matches_reference(t, e, k, offset):
    """V2-Lite-like experts (H 2048, I 1408), bf16, grouped GEMMs and the auto path (Triton,
    128-row tiles); the second case is EP rank 1 of 2."""
    _needs_cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    h, inter = 2048, 1408
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * inter ** -0.5).to(torch.bfloat16)
    ids = torch.rand(t, e * (2 if offset else 1), device="cuda", generator=g).topk(k, dim=-1).indices
    wts = torch.rand(t, k, device="cuda", generator=g)
    ref = moe_experts_reference(x.float(), w13.float(), w2.float(), wts, ids, offset)
    assert bf16_experts_backend(x) == "triton"  # 128-row Triton tiles beat grouped GEMMs at these sizes
    for out in (moe_experts_grouped(x, w13, w2, wts, ids, offset), moe_experts(x, w13, w2, wts, ids, offset)):
        assert torch.isfinite(out).all()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
