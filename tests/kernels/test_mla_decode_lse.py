"""The log-sum-exp the CUDA C++ MLA decode returns, against float64 on the same FP8 inputs.

The split-KV combine, speculative verification and cascade attention merge partial results by
their LSE, so it must be right to a few 1e-3 at serving shapes: 128 requests x 128 heads x 4096
tokens, 32k-token requests (split-KV), ragged lengths, s_q 1 and 2, both kernels. The other
GPU tests (test_mla_decode_cuda.py) check the LSE on a few short requests at 1.5e-2.

CPU: the float64 oracle and the poisoned case builder agree with
``kernels.mla_decode.mla_decode_reference``. GPU (``-m gpu``): the bound, and the CUDA
kernel's LSE against the Triton kernel's on the same inputs (both compute Q.K^T with the same
FP8 wgmma chain at 128 heads, so a gap between the two is the CUDA kernel's softmax, not the
tensor cores'; benchmarks/KERNEL_NOTES.md, "LSE accuracy").
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.fp8 import quantize_per_tensor
from kernels.mla_decode import mla_decode_reference

FP8 = torch.float8_e4m3fn
D, DV, PAGE = 576, 512, 64
SM_SCALE = 192 ** -0.5
Q_SCALE, K_SCALE = 0.02, 0.03
HAS_CUDA = torch.cuda.is_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not IS_HOPPER, reason="needs a compute capability 9.x GPU")
LSE_TOL = 5e-3  # natural log, absolute
OUT_TOL = 2e-2  # relative (P.V runs in FP8)


def make_poisoned_case(bsz, s_q, heads, lens, seed, device):
    """Fresh random e4m3 query and paged cache (per-tensor scales Q_SCALE, K_SCALE) built on
    ``device``. Pages no request owns, the slots past each sequence in its last page, and the
    block-table entries past each sequence (they point at an unowned page) hold NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-n // PAGE) for n in lens]
    num_blocks = sum(pages) + 4
    kv = quantize_per_tensor(torch.randn(num_blocks, PAGE, D, device=device, generator=g), K_SCALE)
    q = quantize_per_tensor(torch.randn(bsz, s_q, heads, D, device=device, generator=g), Q_SCALE)
    order = torch.randperm(num_blocks, device=device, generator=g)
    owned, spare = order[: sum(pages)], order[sum(pages):]
    tables = spare[0].repeat(bsz, max(pages)).int()
    bits = kv.view(torch.uint8)
    start = 0
    for b, (n, p) in enumerate(zip(lens, pages)):
        tables[b, :p] = owned[start:start + p].int()
        start += p
        if n % PAGE:
            bits[tables[b, p - 1], n % PAGE:] = 0x7F  # e4m3fn's NaN byte
    bits[spare] = 0x7F
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, kv, tables, seq_lens


def reference_f64(q, kv, tables, seq_lens):
    """(out [B, s_q, H, 512], lse [B, s_q, H]) in float64 from the dequantized inputs; query
    token j of a request of n keys sees keys 0 .. n - s_q + j."""
    bsz, s_q, heads, _ = q.shape
    out = torch.empty(bsz, s_q, heads, DV, dtype=torch.float64, device=q.device)
    lse = torch.empty(bsz, s_q, heads, dtype=torch.float64, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        keys = kv[tables[b, : -(-n // PAGE)].long()].reshape(-1, D)[:n].double() * K_SCALE
        scores = torch.einsum("shd,nd->shn", q[b].double() * Q_SCALE, keys) * SM_SCALE
        hidden = torch.arange(n, device=q.device)[None, :] > (n - s_q + torch.arange(s_q, device=q.device))[:, None]
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        lse[b] = torch.logsumexp(scores, -1)
        out[b] = torch.einsum("shn,nc->shc", torch.exp(scores - lse[b][..., None]), keys[:, :DV])
    return out, lse


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------- CPU


def test_float64_oracle_matches_the_reference_kernel_and_skips_the_poison():
    lens = [1, 64, 65, 200]
    q, kv, tables, seq_lens = make_poisoned_case(4, 2, 3, [max(n, 2) for n in lens], seed=1, device="cpu")
    assert kv.view(torch.uint8).eq(0x7F).any()  # poison present
    out, lse = reference_f64(q, kv, tables, seq_lens)
    ref, ref_lse = mla_decode_reference(q, kv, tables, seq_lens, SM_SCALE, q_scale=Q_SCALE, k_scale=K_SCALE,
                                        out_dtype=torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (lse - ref_lse.double()).abs().max().item() < 1e-4
    assert rel_err(ref, out) < 1e-5


# ----------------------------------------------------------------------------- GPU

LSE_CASES = {  # name: (B, s_q, H, lens, kernel); lengths >= s_q
    "b128-h128-s4096": (128, 1, 128, [4096] * 128, "wgmma"),
    "b16-h128-s32k": (16, 1, 128, [32768] * 16, "wgmma"),  # split-KV: the combine merges by LSE
    "ragged-h128-sq2": (24, 2, 128, "ragged", "wgmma"),
    "b128-h16-s4096": (128, 1, 16, [4096] * 128, "narrow"),
    "b16-h16-s32k": (16, 1, 16, [32768] * 16, "narrow"),
    "ragged-h16-sq2": (32, 2, 16, "ragged", "narrow"),  # 32 rows per request
}


def _lens(case, seed):
    bsz, s_q, _, lens, _ = case
    if lens != "ragged":
        return lens
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(s_q, 20000, (bsz,), generator=g).tolist()
    return lens[:-3] + [s_q, 64, 4097]  # the shortest possible, a whole tile, one token past a page


@functools.lru_cache(maxsize=1)
def _decoded(name):
    """The case's inputs and the CUDA kernel's (out, lse), written into NaN-filled buffers, and
    the float64 reference."""
    from kernels.mla_decode_cuda import mla_decode_cuda

    case = LSE_CASES[name]
    bsz, s_q, heads, _, kernel = case
    seed = sorted(LSE_CASES).index(name) + 23
    q, kv, tables, seq_lens = make_poisoned_case(bsz, s_q, heads, _lens(case, seed), seed, "cuda")
    out = torch.full((bsz, s_q, heads, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((bsz, s_q, heads), float("nan"), device="cuda")
    mla_decode_cuda(q, kv, tables, seq_lens, SM_SCALE, q_scale=Q_SCALE, k_scale=K_SCALE, out=out, lse=lse,
                    kernel=kernel)
    torch.cuda.synchronize()
    ref, ref_lse = reference_f64(q, kv, tables, seq_lens)
    return (q, kv, tables, seq_lens), out, lse, ref, ref_lse


def _describe(lse, ref_lse):
    """The error's size and shape: a mean near the max is a bias common to all rows (the
    tensor cores' truncation), a small mean with a few large rows points at some rows' path."""
    d = lse.double() - ref_lse
    over = (d.abs() > LSE_TOL).sum().item()
    return (f"max |lse - ref| {d.abs().max().item():.2e}, mean {d.mean().item():+.2e}, std {d.std().item():.2e}, "
            f"{over} of {d.numel()} rows over {LSE_TOL}")


@gpu
@needs_hopper
@pytest.mark.parametrize("name", list(LSE_CASES))
def test_lse_within_5e_3_of_float64_on_the_same_fp8_inputs(name):
    _, out, lse, ref, ref_lse = _decoded(name)
    assert not out.isnan().any() and not lse.isnan().any(), "an output element was not written"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    err = rel_err(out, ref)
    assert lse_err <= LSE_TOL and err <= OUT_TOL, f"{name}: {_describe(lse, ref_lse)}; out rel err {err:.2e}"


@gpu
@needs_hopper
@pytest.mark.parametrize("name", [n for n, c in LSE_CASES.items() if c[4] == "wgmma"])
def test_lse_matches_triton_on_the_same_tensor_core_scores(name):
    """At 128 heads the Triton kernel computes Q.K^T as the 64-row CUDA kernel does (e4m3
    m64n64k32 wgmma, one accumulator over the 576 dims in order) and its softmax in fp32, so the
    two LSEs differ only by the softmax bookkeeping. Where this passes and the float64 bound
    fails, the LSE error is the tensor cores' Q.K^T accumulation."""
    from kernels.mla_decode_triton import mla_decode_triton

    (q, kv, tables, seq_lens), _, lse, _, ref_lse = _decoded(name)
    _, lse_t = mla_decode_triton(q, kv, tables, seq_lens, SM_SCALE, q_scale=Q_SCALE, k_scale=K_SCALE)
    torch.cuda.synchronize()
    gap = (lse - lse_t).abs().max().item()
    assert gap <= 2e-3, (f"{name}: max |cuda - triton| {gap:.2e}; cuda {_describe(lse, ref_lse)}; "
                         f"triton {_describe(lse_t, ref_lse)}")


def test_lse_variants_still_find_the_kernel_lines_they_edit():
    """benchmarks/lse_mla_cuda.py edits verbatim kernel lines; keep it in step with the .cu."""
    from benchmarks.ablate_mla_wgmma import KERNEL_CUTS
    from benchmarks.lse_mla_cuda import VARIANTS

    for kernel, variants in VARIANTS.items():
        src = KERNEL_CUTS[kernel][0].read_text()
        for name, edits in variants.items():
            assert all(text in src for text, _ in edits), (kernel, name)
    # the 64-row kernel reads the scores after two waits (its first tile, its loop); a third,
    # rare one (before a rescale) precedes the loop's and must not add the chains again
    fence = VARIANTS["wgmma"]["qk2"][2][0]
    assert KERNEL_CUTS["wgmma"][0].read_text().count(fence) == 2
