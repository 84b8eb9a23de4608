"""DeepSeek-V4.1 with its routed experts held as stacked MXFP4 (model/v41/moe.py): a checkpoint
storing them as MXFP4 loads into the stacks only (no per-expert copies), gives the logits of
the dequantized per-expert path, cuts under TP / EP to this rank's slice / experts,
``--load-format dummy`` makes random MXFP4 directly, and under CUDA-graph capture the MoE runs
the MXFP4 path (the Triton kernels, or the sync-free reference), not every expert."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import model.v41.moe as v41_moe
from kernels.weight_formats import E8M0_DTYPE, dequantize_mxfp4
from model.checkpoint import load_config_dict, write_checkpoint_metadata, write_random_checkpoint
from model.parallel import ParallelContext
from model.v4_family import load_v4_family, random_v4_family
from model.v41.model import DeepseekV41ForCausalLM, load_deepseek_v41
from model.v41.moe import stacked_mxfp4_unsupported

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def v41_config(**text) -> dict:
    """tiny-v41 (8 layers, 4 experts, D 64) with ``text`` overrides of its text config."""
    cfg = load_config_dict("tiny-v41")
    cfg["text_config"].update(text)
    return cfg


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> str:
    """Released format (FP8 linears, MXFP4 experts), expert intermediate 64 so TP2 keeps 32."""
    out = tmp_path_factory.mktemp("v41-mxfp4")
    return write_random_checkpoint(v41_config(moe_intermediate_size=64), str(out), fp8=True, seed=3)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, model.new_state())


def _ids(n=20, seed=0):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_checkpoint_loads_stacked_with_the_dequantized_logits(mxfp4_dir, dtype):
    stacked = load_v4_family(mxfp4_dir, dtype)
    plain = load_v4_family(mxfp4_dir, dtype, mxfp4_experts=False)
    assert stacked.mxfp4_experts and not plain.mxfp4_experts
    # the W4A16 reference is the per-expert math on the dequantized weights, bit for bit
    assert torch.equal(_logits(stacked, _ids()), _logits(plain, _ids()))
    for moe, ref in zip((la.ffn for la in stacked.model.layers), (la.ffn for la in plain.model.layers)):
        assert not any(True for _ in moe.experts.parameters())  # placeholders only
        assert moe.w13_mxfp4.dtype == torch.int8 and moe.w13_mxfp4_scale.dtype == E8M0_DTYPE
        w13 = torch.stack([torch.cat([ex.w1.weight, ex.w3.weight]) for ex in ref.experts])
        assert torch.equal(dequantize_mxfp4(moe.w13_mxfp4, moe.w13_mxfp4_scale, dtype=dtype), w13)
        w2 = torch.stack([ex.w2.weight for ex in ref.experts])
        assert torch.equal(dequantize_mxfp4(moe.w2_mxfp4, moe.w2_mxfp4_scale, dtype=dtype), w2)
    # memory: no tensor of the stacked model has an expert's full-precision shape, and the
    # routed experts take 17/64 of their bf16 bytes (4-bit codes + one E8M0 byte per 32)
    e, i, d = 4, 64, 64
    shapes = {(i, d), (d, i), (e, 2 * i, d), (e, d, i)}
    assert not [n for n, t in stacked.state_dict().items() if ".ffn." in n and tuple(t.shape) in shapes
                and "shared" not in n]
    moe = stacked.model.layers[0].ffn
    stack_bytes = sum(t.numel() * t.element_size() for t in (moe.w13_mxfp4, moe.w13_mxfp4_scale, moe.w2_mxfp4,
                                                              moe.w2_mxfp4_scale))
    assert stack_bytes == 3 * e * i * d * 2 * 17 // 64


def test_stacked_state_dict_and_in_memory_hf_tensors_load_back(mxfp4_dir):
    stacked = load_v4_family(mxfp4_dir, torch.float32)
    plain = load_v4_family(mxfp4_dir, torch.float32, mxfp4_experts=False)
    twin = DeepseekV41ForCausalLM(stacked.config, torch.float32, mxfp4_experts=True)
    twin.load_state_dict(stacked.state_dict())  # the stacks are in the state dict
    twin.bind_tokenizer(f"{mxfp4_dir}/tokenizer.json")
    assert torch.equal(_logits(twin, _ids()), _logits(stacked, _ids()))
    hf = DeepseekV41ForCausalLM(stacked.config, torch.float32, mxfp4_experts=True)
    hf.load_weights(plain.state_dict())  # HF per-expert names, dequantized values: quantized back exactly
    hf.bind_tokenizer(f"{mxfp4_dir}/tokenizer.json")
    assert torch.equal(_logits(hf, _ids()), _logits(plain, _ids()))
    assert "model.layers.0.ffn.experts.3.w2.weight" in hf.checkpoint_tensors()
    assert "model.layers.0.ffn.w2_mxfp4" not in hf.checkpoint_tensors()


def _routed(model, x):
    moe = model.model.layers[2].ffn
    with torch.no_grad():
        weights, ids = moe.gate(x)
        return moe.routed(x, weights, ids), moe


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_tp_and_ep_ranks_hold_their_slice_and_sum_to_the_whole(mxfp4_dir, layout):
    full = load_deepseek_v41(mxfp4_dir, torch.float32)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    want, whole = _routed(full, x)
    total = torch.zeros_like(want)
    for rank in range(2):
        par = (ParallelContext(tp_rank=rank, tp_size=2) if layout == "tp"
               else ParallelContext(tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2))
        part = load_deepseek_v41(mxfp4_dir, torch.float32, par=par)
        assert part.mxfp4_experts
        got, moe = _routed(part, x)
        total += got
        if layout == "ep":  # whole experts 2r, 2r+1
            assert moe.local_experts == range(2 * rank, 2 * rank + 2)
            assert torch.equal(moe.w13_mxfp4, whole.w13_mxfp4[2 * rank:2 * rank + 2])
            assert torch.equal(moe.w2_mxfp4_scale.view(torch.uint8),
                               whole.w2_mxfp4_scale[2 * rank:2 * rank + 2].view(torch.uint8))
        else:  # rows r·32.. of w1 and of w3, columns r·32.. of w2 (16 bytes, one scale)
            rows = [*range(32 * rank, 32 * rank + 32), *range(64 + 32 * rank, 64 + 32 * rank + 32)]
            assert torch.equal(moe.w13_mxfp4, whole.w13_mxfp4[:, rows])
            assert torch.equal(moe.w2_mxfp4, whole.w2_mxfp4[..., 16 * rank:16 * rank + 16])
            assert torch.equal(moe.w2_mxfp4_scale.view(torch.uint8), whole.w2_mxfp4_scale[..., rank:rank + 1]
                               .view(torch.uint8))
    assert (total - want).abs().max().item() < 1e-5  # fp32: only the partial sums' order differs


def test_a_slice_off_the_mxfp4_groups_is_named():
    from model.config import parse_model_config

    cfg = parse_model_config(v41_config())  # expert intermediate 32: 16 per rank under TP2
    assert stacked_mxfp4_unsupported(cfg) is None
    reason = stacked_mxfp4_unsupported(cfg, ParallelContext(tp_rank=0, tp_size=2))
    assert reason == "the per-rank expert intermediate size 16 is not a multiple of the MXFP4 group 32"
    with pytest.raises(ValueError, match="stacked MXFP4 experts: the per-rank"):
        v41_moe.MoE(cfg, torch.float32, ParallelContext(tp_rank=0, tp_size=2), mxfp4_experts=True)
    cfg = dataclasses.replace(cfg, hidden_size=48)
    assert "hidden_size 48" in stacked_mxfp4_unsupported(cfg)


def test_random_weights_make_stacked_mxfp4_experts(tmp_path):
    write_checkpoint_metadata(load_config_dict("tiny-v41"), str(tmp_path))  # expert_dtype fp4
    model = random_v4_family(str(tmp_path), torch.float32, seed=0)
    assert model.mxfp4_experts
    moe = model.model.layers[3].ffn
    assert set(moe.w13_mxfp4_scale.view(torch.uint8).unique().tolist()) == {119, 120}  # 2^-8, 2^-7
    assert len(moe.w13_mxfp4.unique()) == 256  # every byte, so every e2m1 code
    w = dequantize_mxfp4(moe.w13_mxfp4, moe.w13_mxfp4_scale)
    assert 0.01 < w.std().item() < 0.03  # about the config's initializer_range, 0.02
    state = model.new_state()
    ids = _ids()
    with torch.no_grad():
        outs = [model(ids, state)] + [model(ids[i:i + 1], state) for i in range(2)]
    assert all(torch.isfinite(o).all() and o.std() > 0 for o in outs)
    again = random_v4_family(str(tmp_path), torch.float32, seed=0).model.layers[3].ffn
    assert torch.equal(again.w2_mxfp4, moe.w2_mxfp4)
    plain = random_v4_family(str(tmp_path), torch.float32, seed=0, mxfp4_experts=False)
    assert not plain.mxfp4_experts and plain.model.layers[3].ffn.w13_mxfp4 is None


def test_under_capture_stacked_experts_run_the_mxfp4_path_not_every_expert(mxfp4_dir, monkeypatch):
    stacked = load_deepseek_v41(mxfp4_dir, torch.float32)
    plain = load_deepseek_v41(mxfp4_dir, torch.float32, mxfp4_experts=False)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    eager, moe = _routed(stacked, x)
    eager_plain, _ = _routed(plain, x)
    every = []
    real_every = v41_moe.MoE.routed_every_expert
    monkeypatch.setattr(v41_moe.MoE, "routed_every_expert",
                        lambda self, *a: every.append(self) or real_every(self, *a))
    monkeypatch.setattr(v41_moe, "stream_capturing", lambda x: True)
    captured, _ = _routed(stacked, x)  # CPU: the sync-free form of the reference
    assert not every and moe.mxfp4_path == "reference"
    assert (captured - eager).abs().max().item() < 1e-6
    captured_plain, _ = _routed(plain, x)  # per-expert modules: every expert on every row
    assert len(every) == 1 and (captured_plain - eager_plain).abs().max().item() < 1e-6
    # where the Triton kernels run (a GPU), capture hands them the batch as in eager mode
    calls = []
    real = v41_moe.moe_experts_mxfp4

    def record(*args, **kwargs):
        calls.append((args[9], kwargs["sync_free"]))
        return real(*args[:9], backend="reference", sync_free=False)

    monkeypatch.setattr(v41_moe, "mxfp4_backend", lambda *a: "w4a8")
    monkeypatch.setattr(v41_moe, "moe_experts_mxfp4", record)
    again, _ = _routed(stacked, x)
    assert calls == [("w4a8", True)] and moe.mxfp4_path == "w4a8" and torch.equal(again, eager)


def test_golden_fixtures_store_plain_experts_and_keep_per_expert_modules():
    """dev-v41-s0 / s1-rel store fp32 experts (no MXFP4): the default load keeps the per-expert
    modules, so the golden tests run the math they were made with."""
    for name in ("dev-v41-s0", "dev-v41-s1-rel"):
        model = load_deepseek_v41(os.path.join(FIXTURES, name), torch.float32)
        assert not model.mxfp4_experts and model.model.layers[0].ffn.w13_mxfp4 is None
