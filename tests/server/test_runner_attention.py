"""The runner's attention backends: chosen once at start-up, carried to every layer by the
forward context, their per-step metadata built once per step. FlashInfer (not installed on
CPU) is replaced by a stand-in ``flashinfer`` module whose wrapper computes the torch reference
from the CSR plan it was given and counts plans, runs and workspaces, and the engine is driven
through the real start-up, runner and model code."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from kernels.attention import BackendSupport, BackendUnavailable, FlashInferDecode, TorchDecode
from kernels.mla_decode import mla_decode_reference
from model.checkpoint import write_random_checkpoint
from server import LLM, SamplingParams
from tests.kernels.fake_flashinfer import FakeRaggedPrefillWrapper, install_fake_flashinfer

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
PROMPTS = [[3, 7, 9, 11, 5], [4, 8] * 9, [6] * 30]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny-v3", str(tmp_path_factory.mktemp("attn") / "m"), seed=7)


class FakeMLAWrapper:
    """Stands in for flashinfer.mla.BatchMLAPagedAttentionWrapper (the calls the adapter makes)."""

    created: list["FakeMLAWrapper"] = []

    def __init__(self, workspace: torch.Tensor, backend: str = "fa2") -> None:
        assert backend == "fa3" and workspace.dtype == torch.uint8
        self.workspace = workspace
        self.runs_per_plan: list[int] = []
        FakeMLAWrapper.created.append(self)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, query_layout, kv_cache_layout, lse_mode, scale_mode) -> None:
        assert query_layout == kv_cache_layout == "packed" and lse_mode == "basee" and q_data_type == torch.bfloat16
        self.csr, self.num_heads, self.page_size, self.sm_scale, self.rank = (metadata, num_heads, page_size, sm_scale,
                                                                              head_dim_ckv)
        self.runs_per_plan.append(0)

    def run(self, *, query, kv_cache, return_lse, return_lse_base_on_e, ckv_scale=1.0, kpe_scale=1.0):
        """The reference on block tables rebuilt from the planned CSR (so the CSR is checked too)."""
        qo_indptr, kv_indptr, kv_indices, kv_len = self.csr
        bsz = kv_len.shape[0]
        s_q = query.shape[0] // bsz
        assert qo_indptr.tolist() == [i * s_q for i in range(bsz + 1)] and kv_cache.shape[1] == self.page_size
        pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        tables = torch.zeros(bsz, max(pages), dtype=torch.int32)
        for b in range(bsz):
            tables[b, : pages[b]] = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
        q = query.reshape(bsz, s_q, self.num_heads, -1)
        out, lse = mla_decode_reference(q, kv_cache, tables, kv_len, self.sm_scale, self.rank, k_scale=ckv_scale)
        self.runs_per_plan[-1] += 1
        return out.reshape(bsz * s_q, self.num_heads, -1), lse.reshape(bsz * s_q, self.num_heads)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """``import flashinfer`` finds the stand-in; the flashinfer backend is allowed on CPU."""
    fi = types.ModuleType("flashinfer")
    fi.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    fi.mla = types.ModuleType("flashinfer.mla")
    fi.mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    fi.mla.MLAPlanMetadata = types.SimpleNamespace(csr=lambda *csr: csr)
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", fi.mla)
    monkeypatch.setattr(FlashInferDecode, "support", BackendSupport(devices=("cpu",), cache_dtypes=(torch.bfloat16,)))
    monkeypatch.setattr(FakeMLAWrapper, "created", [])
    return FakeMLAWrapper


def _outputs(llm):
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def _count_decode_steps(runner) -> list[int]:
    steps = []
    run_plan = runner.run_plan

    def counting(plan, *args, **kwargs):
        steps.append(plan.num_decodes)
        return run_plan(plan, *args, **kwargs)

    runner.run_plan = counting
    return steps


def test_flashinfer_plans_once_per_step_and_allocates_one_workspace(ckpt, fake_flashinfer):
    # Chunked prefill (16 tokens a step) mixes prefill chunks into decode steps too.
    args = dict(dtype="bfloat16", block_size=16, num_gpu_blocks_override=64, max_num_batched_tokens=16,
                max_num_seqs=4)
    want = _outputs(LLM(ckpt, **args))
    llm = LLM(ckpt, attention_backend="flashinfer", **args)
    runner = llm.engine.runner
    assert isinstance(runner.decode_backend, FlashInferDecode)
    steps = _count_decode_steps(runner)
    got = _outputs(llm)
    assert got == want  # the same reference math, reached through the plan's CSR
    (wrapper,) = fake_flashinfer.created  # one wrapper, one workspace for the runner's lifetime
    assert wrapper.workspace is runner.decode_backend.workspace
    decode_steps = sum(1 for n in steps if n)
    assert decode_steps >= PARAMS.max_tokens - 1 and len(steps) > decode_steps  # prefill-only steps plan nothing
    num_layers = len(runner.model.layers)
    assert num_layers > 1
    assert wrapper.runs_per_plan == [num_layers] * decode_steps  # one plan per step, one run per layer


def test_flashinfer_prefill_plans_once_per_prefill_step_and_serves_the_same_tokens(ckpt, fake_flashinfer,
                                                                                  monkeypatch):
    """Chunked prefill (16 tokens a step, prompts of 5-30 tokens: chunks with and without cached
    prefixes, mixed with decodes) through the ragged prefill backend: the same tokens and
    logprobs as the torch reference, one plan per prefill-carrying step, one run per layer."""
    install_fake_flashinfer(monkeypatch, sys.modules["flashinfer"])
    args = dict(dtype="bfloat16", block_size=16, num_gpu_blocks_override=64, max_num_batched_tokens=16,
                max_num_seqs=4)
    want = _outputs(LLM(ckpt, **args))
    llm = LLM(ckpt, prefill_attention_backend="flashinfer", attention_backend="flashinfer", **args)
    runner = llm.engine.runner
    assert runner.prefill_backend.name == "flashinfer"
    assert runner.prefill_backend.workspace is runner.decode_backend.workspace  # one shared workspace
    assert _outputs(llm) == want
    (wrapper,) = FakeRaggedPrefillWrapper.created
    assert len(wrapper.plans) >= 3 and wrapper.runs_per_plan == [len(runner.model.layers)] * len(wrapper.plans)
    assert any(p["kv_indptr"] != p["qo_indptr"] for p in wrapper.plans)  # some chunks had cached prefixes


def test_backends_are_chosen_at_startup_and_never_again(ckpt, monkeypatch):
    llm = LLM(ckpt, block_size=16, num_gpu_blocks_override=64)
    runner = llm.engine.runner
    assert runner.decode_backend.name == "torch" and runner.prefill_backend.name == "torch"

    def no_resolution(*args, **kwargs):
        raise AssertionError("a backend was resolved after start-up")

    for name in ("select_decode_backend", "select_prefill_backend", "auto_decode_backend"):
        monkeypatch.setattr(f"kernels.attention.{name}", no_resolution)
    monkeypatch.setattr(TorchDecode, "unsupported_reason", classmethod(no_resolution))
    seen = []
    decode = TorchDecode.decode
    monkeypatch.setattr(TorchDecode, "decode", lambda self, *a, **k: seen.append(self) or decode(self, *a, **k))
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    assert seen and all(b is runner.decode_backend for b in seen)  # the runner's object, in every layer


def test_an_explicit_backend_that_cannot_run_is_a_one_line_startup_error(ckpt):
    with pytest.raises(BackendUnavailable) as err:
        LLM(ckpt, attention_backend="cuda", block_size=16, num_gpu_blocks_override=64)
    assert str(err.value) == "--attention-backend cuda: needs a CUDA GPU (the engine runs on cpu)"


@pytest.mark.gpu
def test_engine_with_real_flashinfer_matches_the_triton_backend(tmp_path):
    """FlashInfer fa3 through the engine (planned once per step, eager) against Triton (graphs)."""
    import importlib.util

    from model.checkpoint import load_config_dict

    if importlib.util.find_spec("flashinfer") is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs flashinfer on a Hopper GPU")
    cfg = dict(load_config_dict("tiny-v3"), kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256)
    path = write_random_checkpoint(cfg, str(tmp_path / "m"), seed=9)
    runs = {}
    for backend in ("flashinfer", "triton"):
        llm = LLM(path, device="cuda", dtype="bfloat16", num_gpu_blocks_override=64, block_size=64,
                  max_cudagraph_capture_size=8, max_num_seqs=8, attention_backend=backend)
        assert llm.engine.runner.decode_backend.name == backend
        assert (llm.engine.runner.decode_graphs is None) == (backend == "flashinfer")
        runs[backend] = _outputs(llm)
    for (tok_a, lp_a), (tok_b, lp_b) in zip(runs["flashinfer"], runs["triton"]):
        n = next((i for i, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y), len(tok_a))
        assert n >= 3, (tok_a, tok_b)  # the same greedy path for a while (bf16 kernels differ in rounding)
        assert max(abs(x - y) for x, y in zip(lp_a[:n], lp_b[:n])) < 5e-2


@pytest.mark.gpu
def test_engine_with_flashinfer_prefill_matches_sdpa(tmp_path):
    """FlashInfer's ragged fa3 prefill through the engine (chunked prefill: chunks with cached
    prefixes) against the per-chunk SDPA path: the same greedy tokens for a while."""
    import importlib.util

    from model.checkpoint import load_config_dict

    if importlib.util.find_spec("flashinfer") is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs flashinfer on a Hopper GPU")
    cfg = dict(load_config_dict("tiny-v3"), kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128, hidden_size=256)
    path = write_random_checkpoint(cfg, str(tmp_path / "m"), seed=9)
    prompts = [[3, 7, 9] * 40, [4, 8] * 90, [6] * 300]
    runs = {}
    for backend in ("flashinfer", "sdpa"):
        llm = LLM(path, device="cuda", dtype="bfloat16", num_gpu_blocks_override=64, block_size=64,
                  max_num_batched_tokens=128, max_num_seqs=8, prefill_attention_backend=backend)
        assert llm.engine.runner.prefill_backend.name == backend
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        runs[backend] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    for (tok_a, lp_a), (tok_b, lp_b) in zip(runs["flashinfer"], runs["sdpa"]):
        n = next((i for i, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y), len(tok_a))
        assert n >= 3, (tok_a, tok_b)
        assert max(abs(x - y) for x, y in zip(lp_a[:n], lp_b[:n])) < 5e-2
