"""DeepSeek-V4.1's FP8 linears as MXFP8 (model/v41/fp8_linear.py, ``--linear-backend``).

CPU: the switch's choices and one-line errors (the flag, the tensor a TP size would cut
inside a 32×32 block); a model loaded with ``mxfp8`` holds the checkpoint's e4m3 bytes and
UE8M0 scales (dequantizing to exactly the dequantized model's weights) and, on the torch
reference, its logits stay near the dequantized model's while a scale off by one binade does
not; under TRITON_INTERPRET=1 the Triton kernels inside the model give the reference's logits.
GPU: the same comparison with the CUDA C++ / Triton kernels in bf16.

The logit bound: per-token relative L2 error against the float32 dequantized model, median
over the tokens. MXFP8 activations (3 mantissa bits) cost 0.14-0.17 at 64 dims (float32) and 0.23
at 128 (bf16) in these random models, whose FP8/FP4 KV roundings and top-k picks turn small
input changes into whole grid steps (bf16 dequantized alone: 0.11); layer 0's ``wq_b`` scales
one binade high (a 2× weight) cost 0.53 and 0.58. Bound: 0.35 (CPU), 0.4 (GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics

import pytest
import torch

from kernels.mxfp8_gemm import choose_linear_backend
from model.checkpoint import load_config_dict, write_random_checkpoint
from model.config import parse_model_config
from model.loader import CheckpointError
from model.parallel import ParallelContext
from model.v41 import fp8_linear
from model.v41.fp8_linear import MXFP8Linear, check_dequantized_linears, choose_mxfp8_linears, mxfp8_shape_problem
from model.v41.model import load_deepseek_v41

CPU_BOUND, GPU_BOUND = 0.35, 0.4


def mxfp8_checkpoint(out_dir, dim: int = 64, inter: int = 32, o_lora_rank: int = 32, num_layers: int | None = None,
                     seed: int = 11, **text) -> str:
    """tiny-v41 in the released format (FP8 linears with 32×32 UE8M0 blocks, MXFP4 experts) at
    an ``o_lora_rank`` the grouped MXFP8 ``wo_a`` takes (a multiple of 32); ``text``: more
    ``text_config`` fields."""
    cfg = load_config_dict("tiny-v41")
    cfg["text_config"].update(hidden_size=dim, moe_intermediate_size=inter, o_lora_rank=o_lora_rank, **text)
    return write_random_checkpoint(cfg, str(out_dir), fp8=True, seed=seed, num_layers=num_layers)


def prompts(count: int, length: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (length,), generator=g) for _ in range(count)]


def logits(model, batch: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(ids.to(model.lm_head.weight.device), model.new_state()).float().cpu() for ids in batch]


def median_error(model, want: list[torch.Tensor], batch: list[torch.Tensor]) -> float:
    """Median over the tokens of |logits − wanted logits| / |wanted logits|."""
    errors = []
    for got, ref in zip(logits(model, batch), want):
        errors += ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
    return statistics.median(errors)


def break_one_scale(model) -> None:
    """Layer 0's ``wq_b`` scales one binade high: a 2× weight, as an off-by-one E8M0 bias would give."""
    with torch.no_grad():
        model.model.layers[0].attn.wq_b.scale.view(torch.uint8).add_(1)


def tiny_config(**changes):
    return dataclasses.replace(parse_model_config(load_config_dict("tiny-v41")), **changes)


# ---- the switch (CPU) ------------------------------------------------------------------------
def test_backend_choices_and_errors():
    cpu = torch.device("cpu")
    assert choose_linear_backend("auto", cpu, torch.float32)[0] == "dequantized"  # the CPU reference CI runs
    assert choose_linear_backend("mxfp8", cpu, torch.bfloat16) == ("mxfp8", "requested")  # torch reference
    assert choose_linear_backend("dequantized", cpu, torch.float32) == ("dequantized", "requested")
    with pytest.raises(ValueError, match=r"^--linear-backend: unknown backend 'fp8'; one of auto, mxfp8, dequantized$"):
        choose_linear_backend("fp8", cpu, torch.float32)
    with pytest.raises(ValueError, match=r"^--linear-backend mxfp8: .*bfloat16 or float32 activations, not float16$"):
        choose_linear_backend("mxfp8", cpu, torch.float16)
    with pytest.raises(ValueError, match=r"^--linear-backend mxfp8: .* not on meta$"):
        choose_linear_backend("mxfp8", torch.device("meta"), torch.bfloat16)
    assert choose_linear_backend("auto", torch.device("meta"), torch.bfloat16)[0] == "dequantized"
    for ok in ("auto", "dequantized"):
        check_dequantized_linears(ok, "DeepSeek-V4")
    with pytest.raises(CheckpointError, match=r"^--linear-backend mxfp8: DeepSeek-V4 has no MXFP8 linears"):
        check_dequantized_linears("mxfp8", "DeepSeek-V4")


def test_shapes_that_cut_a_32_block_are_one_line_naming_the_tensor(monkeypatch, caplog):
    assert mxfp8_shape_problem(tiny_config()) == (
        "model.layers.0.attn.wo_a.weight: o_lora_rank 16 (rows per output group) is not a multiple of 32, which "
        "the grouped MXFP8 GEMM needs")
    fits = tiny_config(o_lora_rank=32)
    assert mxfp8_shape_problem(fits) is None
    cut = ("--tensor-parallel-size 2 cuts model.layers.0.ffn.shared_experts.w1.weight [32, 64] into 16-row shards, "
           "which split its 32×32 FP8 scale blocks")
    assert mxfp8_shape_problem(fits, 2) == cut
    wide = dataclasses.replace(fits, moe_intermediate_size=64)
    assert mxfp8_shape_problem(wide, 2) is None  # 32-row shards of w1/w3, 32-column shards of w2 and wo_b
    assert "model.layers.0.attn.wo_a.weight [64, 128] into 16-row shards" in mxfp8_shape_problem(wide, 4)
    assert "not divisible by 3 ranks" in mxfp8_shape_problem(wide, 3)

    tp2 = ParallelContext(tp_rank=1, tp_size=2)
    with pytest.raises(CheckpointError) as err:
        choose_mxfp8_linears(fits, "mxfp8", "cpu", torch.float32, tp2)
    assert str(err.value) == f"--linear-backend mxfp8: {cut}"
    with pytest.raises(CheckpointError, match=r"^--linear-backend mxfp8: the checkpoint does not store its FP8"):
        choose_mxfp8_linears(fits, "mxfp8", "cpu", torch.float32, stored_fp8=False)
    assert choose_mxfp8_linears(wide, "mxfp8", "cpu", torch.float32, tp2)
    assert not choose_mxfp8_linears(wide, "auto", "cpu", torch.float32, tp2)
    # auto where the kernels could run (as on a GPU) but the TP cut cannot: dequantized, logged
    monkeypatch.setattr(fp8_linear, "choose_linear_backend", lambda *a: ("mxfp8", "auto: FP8 tensor cores"))
    with caplog.at_level(logging.INFO, logger="model.v41.fp8_linear"):
        assert not choose_mxfp8_linears(fits, "auto", "cuda", torch.bfloat16, tp2)
        assert choose_mxfp8_linears(wide, "auto", "cuda", torch.bfloat16, tp2)
    assert f"FP8 linears dequantized to bfloat16 (--linear-backend auto: {cut})" in caplog.text
    assert "FP8 linears run as MXFP8" in caplog.text


# ---- the model (CPU: torch reference) --------------------------------------------------------
def test_mxfp8_model_holds_the_stored_weights_and_tracks_the_dequantized_logits(tmp_path, caplog):
    ckpt = mxfp8_checkpoint(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="model.v41.fp8_linear"):  # per-expert modules: faster on the CPU
        mx = load_deepseek_v41(ckpt, torch.float32, mxfp4_experts=False, linear_backend="mxfp8")
        ref = load_deepseek_v41(ckpt, torch.float32, mxfp4_experts=False)
    assert "FP8 linears run as MXFP8" in caplog.text and "dequantized to float32 (--linear-backend auto" in caplog.text
    assert mx.mxfp8_linears and not ref.mxfp8_linears
    linears = {name: m for name, m in mx.named_modules() if isinstance(m, MXFP8Linear)}
    kinds = {".".join(name.split(".")[3:]) for name in linears}
    assert kinds == {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
                     "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "engram.wkv"}
    plain = dict(ref.named_modules())
    for name, m in linears.items():
        assert m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(m.dequantized(), plain[name].weight), name  # the same stored values, exactly
    batch = prompts(4, 12)
    want = logits(ref, batch)
    assert median_error(mx, want, batch) <= CPU_BOUND
    break_one_scale(mx)
    assert median_error(mx, want, batch) > CPU_BOUND


def test_in_memory_weights_must_be_the_stored_form(tmp_path):
    mx = load_deepseek_v41(mxfp8_checkpoint(tmp_path / "ckpt", num_layers=2), torch.float32, linear_backend="mxfp8")
    with pytest.raises(ValueError, match=r"^tensor model\.layers\.0\.attn\.wq_a\.weight: this MXFP8 model takes"):
        mx.load_tensor("model.layers.0.attn.wq_a.weight", torch.zeros(32, 64))


_INTERPRET_SCRIPT = """
import sys, torch
from tests.kernels.test_mla_decode_gpu import INTERPRETER_PATCH
exec(INTERPRETER_PATCH)
import kernels.mxfp8_gemm as gemm, kernels.mxfp8_o_proj as o_proj
from model.v41.model import load_deepseek_v41
torch.set_num_threads(1)
model = load_deepseek_v41(sys.argv[1], torch.float32, linear_backend="mxfp8")
ids = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(0))

def run():
    state, other = model.new_state(), model.new_state()
    out = [model(ids, state), model(ids[:4], other)]
    for step in range(2):  # batched decode of both requests
        out.append(model.decode(torch.tensor([5 + step, 7 + step]), [state, other]))
    return torch.cat(out)

kernels = run()
assert gemm.triton_interpreting()
gemm.triton_interpreting = o_proj.triton_interpreting = lambda: False  # the torch references
reference = run()
err = ((kernels - reference).norm() / reference.norm()).item()
assert err < 1e-5, err
print("interpreter ok", err)
"""


def test_triton_kernels_inside_the_model_under_interpreter(tmp_path):
    """Every MXFP8 linear and the fused output projection on their Triton kernels (prefill of
    two requests, then two batched decode steps) = the same model on the torch references, to
    float32 summation order (measured 1e-7)."""
    pytest.importorskip("triton")
    from tests.kernels.test_mxfp8_gemm import run_interpreted

    run_interpreted(_INTERPRET_SCRIPT.replace("sys.argv[1]", repr(mxfp8_checkpoint(tmp_path / "ckpt",
                                                                                        num_layers=3))))


# ---- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_mxfp8_model_tracks_the_dequantized_logits(tmp_path):
    """bf16 on the GPU at 128 dims (the CUDA C++ GEMM's 128-multiples, wo_a's groups included):
    the MXFP8 model within the bound of the float32 dequantized CPU model, and within 0.3 of
    the CPU torch reference of the same MXFP8 numerics (bf16 alone costs 0.11 here); the
    broken scale outside the bound."""
    from kernels.mxfp8_gemm_cuda import cuda_gemm_available

    ckpt = mxfp8_checkpoint(tmp_path / "ckpt", dim=128, inter=128, o_lora_rank=128)
    mx = load_deepseek_v41(ckpt, torch.bfloat16, "cuda")  # auto
    assert mx.mxfp8_linears
    if torch.cuda.get_device_capability() == (9, 0):
        assert cuda_gemm_available()
    batch = prompts(8, 16)
    want = logits(load_deepseek_v41(ckpt, torch.float32), batch)
    emulated = logits(load_deepseek_v41(ckpt, torch.float32, linear_backend="mxfp8"), batch)
    bf16 = load_deepseek_v41(ckpt, torch.bfloat16, "cuda", linear_backend="dequantized")
    errors = {"mxfp8": median_error(mx, want, batch), "bf16": median_error(bf16, want, batch),
              "vs_reference": median_error(mx, emulated, batch)}
    print(errors)
    assert errors["mxfp8"] <= GPU_BOUND and errors["vs_reference"] <= 0.3
    break_one_scale(mx)
    assert median_error(mx, want, batch) > GPU_BOUND
