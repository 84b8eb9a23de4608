"""One DeepSeek-V2-Lite-shaped layer's prefill on one GPU, attention and MoE apart, old path
vs new, at 8192-token steps made of 1, 4 or 16 equal chunks with 0 or 4096 cached tokens each.

    source .device-wheels/install.sh && python3 -m benchmarks.bench_prefill [--chunks 1 4 16]
        [--prefix 0 4096] [--cache bf16 fp8] [--moe-tokens 8192] [--skip-moe]

Attention (from rotated q, the step's new latents and the paged latent cache to the attention
output, o_proj excluded): ``old`` = one sequence at a time (per-chunk page gather, kv_b_proj
and one fused SDPA launch per chunk, the layer's code before the varlen path); ``sdpa`` /
``flashinfer`` = the layer's step-wide path (``MLAAttention._prefill_chunks``: one gather of
every chunk's cached latents, one kv_b_proj, one backend call) on each prefill backend.
FLOPs: kv_b_proj (2·rows·512·4096) plus causal attention (2·H·(192 + 128) per visible
query-key pair).

MoE (V2-Lite experts E=64, H=2048, I=1408, top-6, bf16; R1's block-FP8 experts under TP8 and
EP8): ``triton`` = the fused Triton kernels (``auto`` below prefill sizes), ``grouped`` =
``torch._grouped_mm`` (``auto`` for bf16 at prefill sizes), ``triton-m128`` = the Triton
kernels with 128-row tiles. It also probes whether ``torch._scaled_grouped_mm`` takes
128x128-block weight scales (R1's format) and prints the answer.

Correctness is checked first (each variant against the float32 reference on the same inputs;
a failure stops the run). Timing: ``triton.testing.do_bench`` median (it empties L2 before
each call; eager, as the engine runs prefill). The GEMM ceiling is a bf16 8192x4096x4096
``torch.matmul`` measured in the same run. With ``$OUT`` set, results go to
``$OUT/bench_prefill.json``; a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kernels.attention import AttentionSpec, FlashInferPrefill, SdpaPrefill, TorchPrefill
from kernels.fp8 import FP8_DTYPE, dequantize_per_tensor, dequantize_weight_blocks, quantize_weight_blocks
from kernels.mla_prefill import mla_prefill_sdpa
from kernels.moe import moe_experts_grouped, moe_experts_reference
from model.checkpoint import load_config_dict
from model.config import parse_model_config
from model.forward_context import ForwardContext, build_attention_metadata
from model.layers.mla import MLAAttention
from model.layers.rotary import RotaryEmbedding

TOKENS = 8192
PAGE = 64
DEV = "cuda"


def bench_us(fn) -> float:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gemm_ceiling() -> float:
    a = torch.randn(8192, 4096, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)
    return 2 * 8192 * 4096 * 4096 / bench_us(lambda: a @ b) / 1e6


# ---- attention ---------------------------------------------------------------------------------
def make_layer() -> MLAAttention:
    cfg = parse_model_config(load_config_dict("deepseek-v2-lite"))
    layer = MLAAttention(cfg, 0, RotaryEmbedding(cfg), dtype=torch.bfloat16).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, device=DEV, generator=g) * p.shape[-1] ** -0.5)
    return layer


def attention_case(layer: MLAAttention, chunks: int, prefix: int, cache_dtype: torch.dtype):
    """The step's inputs: q (rotated), new latents, a NaN-poisoned cache holding the prefixes."""
    g = torch.Generator(device=DEV).manual_seed(chunks * 7 + prefix)
    q_len = TOKENS // chunks
    pages_per_seq = -(-(prefix + q_len) // PAGE)
    num_pages = chunks * pages_per_seq + 8
    perm = torch.randperm(num_pages, device=DEV, generator=g).tolist()
    tables = [perm[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(chunks)]
    cache = torch.full((num_pages + 1, PAGE, 576), float("nan"), device=DEV).to(cache_dtype)
    if prefix:  # the prefixes hold latents; every other row stays NaN (the chunks' rows come from kv_c/k_pe)
        slots = torch.tensor([t[p // PAGE] * PAGE + p % PAGE for t in tables for p in range(prefix)], device=DEV)
        rows = torch.randn(slots.numel(), 576, device=DEV, generator=g).to(cache_dtype)
        cache.view(torch.uint8).view(-1, 576 * cache.element_size())[slots] = rows.view(torch.uint8)
    md = build_attention_metadata(tables, [prefix] * chunks, [q_len] * chunks, PAGE, device=DEV)
    h = layer.num_local_heads
    q = torch.randn(TOKENS, h, 192, device=DEV, generator=g, dtype=torch.bfloat16)
    kv_c = torch.randn(TOKENS, 512, device=DEV, generator=g, dtype=torch.bfloat16)
    k_pe = torch.randn(TOKENS, 64, device=DEV, generator=g, dtype=torch.bfloat16)
    return md, tables, cache, q, kv_c, k_pe


def old_attention(layer, md, tables, cache, q, kv_c, k_pe, k_scale):
    """The layer's prefill before the varlen path: one sequence at a time."""
    out = torch.empty(TOKENS, layer.num_local_heads, 128, device=DEV, dtype=torch.bfloat16)
    start = 0
    for i, n in enumerate(md.query_lens_cpu):
        end = start + n
        ctx = md.seq_lens_cpu[i] - n
        c, pe = kv_c[start:end], k_pe[start:end]
        if ctx:
            nblocks = -(-ctx // PAGE)
            entries = cache[md.block_tables[i, :nblocks].long()].reshape(nblocks * PAGE, -1)[:ctx]
            entries = (dequantize_per_tensor(entries, k_scale, torch.bfloat16) if entries.dtype == FP8_DTYPE
                       else entries)
            c, pe = torch.cat([entries[:, :512], c]), torch.cat([entries[:, 512:], pe])
        k, v = layer._up_project(c, pe)
        out[start:end] = mla_prefill_sdpa(q[start:end], k, v, layer.softmax_scale)
        start = end
    return out


def new_attention(layer, ctx: ForwardContext, cache, q, kv_c, k_pe, k_scale):
    """The layer's step-wide path; positions 0 (q's rope part is rotated there, as in ``rotated``).
    The layer rotates q's rope part in place: at position 0 that is the identity for V2-Lite
    (attention factor 1: cos 1, sin 0), so repeated calls see the same q."""
    positions = torch.zeros(TOKENS, dtype=torch.long, device=DEV)
    return layer._prefill_chunks(positions, q, kv_c, k_pe, cache, ctx, k_scale)


def rotated(layer, q):
    """q with its rope part rotated at position 0, what ``new_attention`` attends with."""
    positions = torch.zeros(TOKENS, dtype=torch.long, device=DEV)
    return torch.cat([q[..., :128], layer.rotary(positions, q[..., 128:])], dim=-1)


def attention_flops(chunks: int, prefix: int, heads: int) -> float:
    q_len = TOKENS // chunks
    pairs = chunks * (q_len * prefix + q_len * (q_len + 1) / 2)
    rows = chunks * (prefix + q_len)
    return 2 * rows * 512 * heads * 256 + 2 * heads * (192 + 128) * pairs


def run_attention(args, ceiling: float) -> list[dict]:
    layer = make_layer()
    spec = AttentionSpec(torch.device(DEV), torch.bfloat16, layer.num_local_heads, 512, 64, PAGE,
                         layer.softmax_scale, torch.bfloat16, qk_head_dim=192, v_head_dim=128)
    backends = {"sdpa": SdpaPrefill(spec)}
    reason = FlashInferPrefill.unsupported_reason(spec)
    if reason is None:
        backends["flashinfer"] = FlashInferPrefill(spec)
    else:
        print(f"flashinfer prefill skipped: {reason}")
    rows = []
    for cache_name in args.cache:
        cache_dtype = FP8_DTYPE if cache_name == "fp8" else torch.bfloat16
        k_scale = 0.5 if cache_name == "fp8" else 1.0
        for prefix in args.prefix:
            for chunks in args.chunks:
                md, tables, cache, q, kv_c, k_pe = attention_case(layer, chunks, prefix, cache_dtype)
                ref_ctx = ForwardContext(md, [cache], [k_scale], prefill_backend=TorchPrefill())
                ref = new_attention(layer, ref_ctx, cache, q, kv_c, k_pe, k_scale)
                q_rot = rotated(layer, q)
                fns = {"old": lambda: old_attention(layer, md, tables, cache, q_rot, kv_c, k_pe, k_scale)}
                for name, backend in backends.items():
                    ctx = ForwardContext(md, [cache], [k_scale], prefill_backend=backend)
                    fns[name] = (lambda c: lambda: new_attention(layer, c, cache, q, kv_c, k_pe, k_scale))(ctx)
                flops = attention_flops(chunks, prefix, layer.num_local_heads)
                for name, fn in fns.items():
                    out = fn()
                    err = rel_err(out, ref)
                    if not (err < 2e-2 and torch.isfinite(out).all()):
                        raise SystemExit(f"attention {name} chunks={chunks} prefix={prefix} {cache_name}: "
                                         f"rel.err {err}")
                    us = bench_us(fn)
                    rows.append(dict(part="attention", cache=cache_name, chunks=chunks, prefix=prefix, variant=name,
                                     us=us, tflops=flops / us / 1e6, pct_gemm=100 * flops / us / 1e6 / ceiling,
                                     relerr=err))
                    print(rows[-1], flush=True)
    return rows


# ---- MoE ---------------------------------------------------------------------------------------
MOE_SHAPES = {  # name: (E_local, H, I, k, E_global, fp8)
    "v2-lite": (64, 2048, 1408, 6, 64, False),
    "r1-tp8": (256, 7168, 256, 8, 256, True),
    "r1-ep8": (32, 7168, 2048, 8, 256, True),
}


def probe_scaled_grouped_mm() -> str:
    """Does torch._scaled_grouped_mm take R1's scales (activations 1x128, weights 128x128)?"""
    e, m, n, k = 4, 256, 256, 512
    a = torch.randn(m, k, device=DEV).to(FP8_DTYPE)
    b = torch.randn(e, n, k, device=DEV).to(FP8_DTYPE).transpose(1, 2)
    offs = torch.arange(1, e + 1, device=DEV, dtype=torch.int32) * (m // e)
    sa = torch.ones(m, k // 128, device=DEV)
    sb = torch.ones(e, n // 128, k // 128, device=DEV)
    try:
        torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - the answer is the message
        return f"blockwise scales refused: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return "blockwise scales accepted (check the result before using it)"


def run_moe(args, ceiling: float) -> list[dict]:
    from kernels.moe_triton import MoEConfig, moe_experts_fp8_triton, moe_experts_triton

    m128 = MoEConfig(128, 128, 128, 64, 8, 8, 3)
    m128_fp8 = MoEConfig(128, 128, 128, 128, 8, 8, 3)
    rows = []
    t = args.moe_tokens
    for name, (e, h, inter, k, e_global, fp8) in MOE_SHAPES.items():
        g = torch.Generator(device=DEV).manual_seed(1)
        x = torch.randn(t, h, device=DEV, generator=g, dtype=torch.bfloat16)
        w13 = torch.randn(e, 2 * inter, h, device=DEV, generator=g) * h ** -0.5
        w2 = torch.randn(e, h, inter, device=DEV, generator=g) * inter ** -0.5
        ids = torch.rand(t, e_global, device=DEV, generator=g).topk(k, dim=-1).indices
        wts = torch.rand(t, k, device=DEV, generator=g)
        if fp8:
            q13 = [quantize_weight_blocks(w, (128, 128)) for w in w13]
            q2 = [quantize_weight_blocks(w, (128, 128)) for w in w2]
            w13_8, s13 = torch.stack([a for a, _ in q13]), torch.stack([s for _, s in q13])
            w2_8, s2 = torch.stack([a for a, _ in q2]), torch.stack([s for _, s in q2])
            del q13, q2
            w13 = dequantize_weight_blocks(w13_8, s13, (128, 128))
            w2 = dequantize_weight_blocks(w2_8, s2, (128, 128))
            fns = {"triton": lambda: moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids),
                   "triton-m128": lambda: moe_experts_fp8_triton(x, w13_8, s13, w2_8, s2, wts, ids, config=m128_fp8)}
        else:
            wb13, wb2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
            w13, w2 = wb13.float(), wb2.float()
            fns = {"triton": lambda: moe_experts_triton(x, wb13, wb2, wts, ids),
                   "triton-m128": lambda: moe_experts_triton(x, wb13, wb2, wts, ids, config=m128),
                   "grouped": lambda: moe_experts_grouped(x, wb13, wb2, wts, ids)}
        ref = moe_experts_reference(x.float(), w13, w2, wts, ids)
        local = (ids < e).sum().item()
        flops = 6 * local * h * inter
        for variant, fn in fns.items():
            try:
                out = fn()
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                print(f"moe {name} {variant}: failed ({type(exc).__name__}: {exc})")
                continue
            err = rel_err(out, ref)
            if not (err < (6e-2 if fp8 else 1e-2) and torch.isfinite(out).all()):
                raise SystemExit(f"moe {name} {variant}: rel.err {err}")
            us = bench_us(fn)
            rows.append(dict(part="moe", shape=name, tokens=t, variant=variant, us=us, tflops=flops / us / 1e6,
                             pct_gemm=100 * flops / us / 1e6 / ceiling, relerr=err))
            print(rows[-1], flush=True)
        del w13, w2, ref
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], ceiling: float, probe: str) -> str:
    lines = [f"bf16 GEMM ceiling: {ceiling:.0f} TFLOP/s; torch._scaled_grouped_mm: {probe}", "",
             "| part | case | variant | µs | TFLOP/s | % GEMM | rel. err |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        case = (f"{r['cache']} {r['chunks']}x{TOKENS // r['chunks']} +{r['prefix']}" if r["part"] == "attention"
                else f"{r['shape']} T={r['tokens']}")
        lines.append(f"| {r['part']} | {case} | {r['variant']} | {r['us']:.0f} | {r['tflops']:.0f} | "
                     f"{r['pct_gemm']:.0f} | {r['relerr']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 4096])
    ap.add_argument("--cache", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--moe-tokens", type=int, default=TOKENS)
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        ceiling = gemm_ceiling()
        probe = probe_scaled_grouped_mm()
        print(f"ceiling {ceiling:.0f} TFLOP/s; {probe}", flush=True)
        rows = [] if args.skip_attention else run_attention(args, ceiling)
        rows += [] if args.skip_moe else run_moe(args, ceiling)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_prefill.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), ceiling_tflops=ceiling, scaled_grouped_mm=probe,
                           rows=rows), f, indent=1)
    print(table(rows, ceiling, probe))


if __name__ == "__main__":
    main()
