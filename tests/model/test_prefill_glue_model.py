"""The whole model with the fused glue kernels (kernels/fused_glue.py) gives the logits of the
torch references: tiny V2 (no q_lora, 2 shared experts, softmax routing) and V3 (q_lora,
sigmoid groups) in bf16, over a cache-less prefill and two paged steps (two fresh chunks;
then a decode plus a chunk after a cached prefix), bf16 and FP8 caches with NaN-poisoned
unused pages. It also checks the fused model stays as close to HF's (fp32) as the reference.

CPU (CI): the kernels run under TRITON_INTERPRET=1 in a subprocess, the dispatch forced onto
them (on CPU tensors it would pick the references), one cache dtype per model. GPU
(``-m gpu``): the real dispatch, both cache dtypes.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from kernels.fp8 import FP8_DTYPE
from kernels.fused_glue import unfused_glue
from model.forward_context import ForwardContext, build_attention_metadata, forward_context
from model.loader import load_model
from tests.kernels.test_mla_fused_kernels import run_under_interpreter
from tests.model.hf_oracle import build_hf_model, tiny_config_dict

BLOCK = 4
NUM_PAGES = 24
HAS_TRITON = importlib.util.find_spec("triton") is not None
# The dispatch modules that read the switch; the interpreter test forces them onto Triton.
GLUE_MODULES = ("kernels.rmsnorm", "kernels.rope", "kernels.mla_prefill", "kernels.activation")


def build_pair(name: str, out_dir: str, device: str = "cpu"):
    """(HF fp32 model, ours in bf16 on ``device``) with the same random weights."""
    hf = build_hf_model(tiny_config_dict(name), seed=3)
    hf.save_pretrained(out_dir)
    return hf, load_model(out_dir, dtype="bfloat16", device=device, progress=False)


def run_steps(model, cache_dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    """Log-softmax of: a cache-less prefill of A[:29]; step 1 = A[:20] and B[:13] as two fresh
    chunks; step 2 = B's next token as a decode, then A[20:29] after its 20 cached tokens."""
    c = model.config
    g = torch.Generator().manual_seed(11)
    a, b = (torch.randint(0, c.vocab_size, (n,), generator=g) for n in (29, 14))
    caches = [torch.full((NUM_PAGES + 1, BLOCK, c.kv_cache_entry_dim), float("nan"), device=device).to(cache_dtype)
              for _ in range(c.num_hidden_layers)]
    scales = [0.05 if cache_dtype == FP8_DTYPE else 1.0] * c.num_hidden_layers
    tables = {"a": [17, 2, 9, 20, 5, 11, 0, 14], "b": [6, 21, 3, 12]}  # other pages stay NaN
    outs = []

    def run(ids, positions, md=None):
        ctx = ForwardContext(md, caches, scales) if md is not None else None
        with torch.no_grad(), forward_context(ctx):
            h = model(ids.to(device), positions.to(device))
            outs.append(torch.log_softmax(model.compute_logits(h).float(), -1).cpu())

    run(a, torch.arange(29))
    md = build_attention_metadata([tables["a"], tables["b"]], [0, 0], [20, 13], BLOCK, device=device)
    run(torch.cat([a[:20], b[:13]]), torch.cat([torch.arange(20), torch.arange(13)]), md)
    md = build_attention_metadata([tables["b"], tables["a"]], [13, 20], [1, 9], BLOCK, num_decode_seqs=1,
                                  num_pad_tokens=2, device=device)
    ids = torch.cat([b[13:14], a[20:29], torch.zeros(2, dtype=torch.long)])
    run(ids, torch.cat([torch.tensor([13]), torch.arange(20, 29), torch.zeros(2, dtype=torch.long)]), md)
    outs[-1] = outs[-1][:10]  # the pad rows' logits mean nothing
    return outs


def hf_log_softmax(hf, model) -> torch.Tensor:
    """HF's log-softmax of the cache-less prefill's tokens (the same A[:29] as ``run_steps``)."""
    g = torch.Generator().manual_seed(11)
    a = torch.randint(0, model.config.vocab_size, (29,), generator=g)
    with torch.no_grad():
        return torch.log_softmax(hf(a[None]).logits[0].float(), -1)


def row_gaps(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean |Δ|, 90th percentile over rows of the row's max |Δ|). Robust to the rare token
    whose bf16 routing flips an expert (a large gap on that row alone); a wrong kernel moves
    every row."""
    d = (a - b).abs()
    return d.mean().item(), d.amax(-1).quantile(0.9).item()


def compare(fused: list[torch.Tensor], ref: list[torch.Tensor], hf: torch.Tensor) -> float:
    """Fused vs reference logits, and both against HF's; returns the largest fused-vs-ref gap."""
    worst = 0.0
    for f, r in zip(fused, ref):
        assert f.shape == r.shape and torch.isfinite(f).all()
        mean, p90 = row_gaps(f, r)
        # bf16 activations: the fused kernels' one-ulp differences (norm sum order, exp) stay
        # far below the gap to fp32 HF, which they must not widen.
        assert mean < 0.01 and p90 < 0.05, (mean, p90)
        worst = max(worst, (f - r).abs().max().item())
    gap_fused, gap_ref = (row_gaps(x[0], hf)[0] for x in (fused, ref))
    assert gap_fused <= 1.25 * gap_ref + 0.01, (gap_fused, gap_ref)
    # The paged steps' rows of A agree with the cache-less prefill of A (same positions).
    for f in (fused, ref):
        mean, p90 = row_gaps(f[1][:20], f[0][:20])
        assert mean < 0.01 and p90 < 0.05, (mean, p90)
    return worst


def check_model(name: str, out_dir: str, device: str, cache_dtypes=(torch.bfloat16, FP8_DTYPE)) -> None:
    hf, model = build_pair(name, out_dir, device)
    hf_out = hf_log_softmax(hf, model)
    for cache_dtype in cache_dtypes:
        fused = run_steps(model, cache_dtype, device)
        with unfused_glue():
            ref = run_steps(model, cache_dtype, device)
        print(name, cache_dtype, "fused vs reference max |Δ log p|:", compare(fused, ref, hf_out))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be run")
@pytest.mark.parametrize("name,cache", [("tiny-v3", "torch.float8_e4m3fn")])  # tiny-v2 bf16: the GPU test
def test_fused_glue_model_under_interpreter(name, cache, tmp_path):
    run_under_interpreter(textwrap.dedent(f"""
        import importlib, torch
        import kernels.fused_glue as switch
        for mod in {GLUE_MODULES!r}:  # the kernels run on CPU tensors under the interpreter
            importlib.import_module(mod).glue_kernels_apply = lambda x: switch._enabled
        torch.set_num_threads(1)
        from tests.model.test_prefill_glue_model import check_model
        check_model({name!r}, {str(tmp_path)!r}, "cpu", ({cache},))
        print("interpreter ok")
        """), timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["tiny-v2", "tiny-v3"])
def test_fused_glue_model_gpu(name, tmp_path):
    check_model(name, str(tmp_path), "cuda")
