"""DeepSeek-V4.1 served with its FP8 linears as MXFP8 (``--linear-backend``, model/v41/fp8_linear.py).

CPU: the flag's one-line errors (an unknown value; ``mxfp8`` for a model without MXFP8
linears; a TP size that would cut a 32×32 scale block, refused before any worker starts),
and the engine with ``mxfp8`` (the torch reference) through its decode-graph path giving the
eager engine's tokens. GPU: the decode graphs capture the MXFP8 kernels: a replay equals the
eager decode, and the engine served with graphs gives ``--enforce-eager``'s tokens.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from model.loader import CheckpointError
from model.v41.fp8_linear import MXFP8Linear
from server.config import EngineConfig, EngineConfigError
from server.sampling_params import SamplingParams
from tests.distributed.test_v4_model_parallel import exact_rounding
from tests.model.test_v41_mxfp8_linears import mxfp8_checkpoint
from tests.server import test_v4_serving as serving
from tests.server.test_v4_cuda_graphs import EagerReplay, capture_over_fixed_pools, replay_errors
from tests.server.test_v4_serving import make_core, run, run_logprobs

tokenizer_dir = serving.tokenizer_dir  # the fixtures' servable 320-token tokenizer (a pytest fixture)
one_torch_thread = serving.one_torch_thread  # autouse: one intra-op thread, as the live servers run
ARITH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "configs", "arith")


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 20, (count,), generator=g)]


def test_linear_backend_errors_are_one_line(tmp_path, tokenizer_dir):
    from server.runner_setup import check_v4_family_parallel

    with pytest.raises(EngineConfigError, match=r"^--linear-backend: must be one of auto, mxfp8, dequantized, "
                                                r"got 'fp8'$"):
        EngineConfig(linear_backend="fp8")
    with pytest.raises(CheckpointError, match=r"^--linear-backend mxfp8: this checkpoint \(not DeepSeek-V4.1\) has "
                                              r"no MXFP8 linears"):
        make_core(ARITH, tokenizer_dir, linear_backend="mxfp8")
    narrow = mxfp8_checkpoint(tmp_path / "narrow")  # a 32-wide shared expert: 16 rows per TP2 rank
    check_v4_family_parallel(EngineConfig(tensor_parallel_size=2), narrow)  # auto: dequantized there, logged
    check_v4_family_parallel(EngineConfig(tensor_parallel_size=2, linear_backend="mxfp8"),
                             mxfp8_checkpoint(tmp_path / "wide", inter=64))
    with pytest.raises(CheckpointError) as err:
        check_v4_family_parallel(EngineConfig(tensor_parallel_size=2, linear_backend="mxfp8"), narrow)
    assert str(err.value) == ("--linear-backend mxfp8: --tensor-parallel-size 2 cuts "
                              "model.layers.0.ffn.shared_experts.w1.weight [32, 64] into 16-row shards, which split "
                              "its 32×32 FP8 scale blocks")


def test_served_mxfp8_graph_path_gives_the_eager_tokens(tmp_path, tokenizer_dir):
    ckpt = mxfp8_checkpoint(tmp_path / "ckpt")
    prompts = _prompts(4, seed=1)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    eager = make_core(ckpt, tokenizer_dir, max_num_seqs=4, linear_backend="mxfp8")
    assert eager.runner.model.mxfp8_linears
    assert isinstance(eager.runner.model.model.layers[0].ffn.shared_experts.w2, MXFP8Linear)
    want = run(eager, prompts, params)
    core = make_core(ckpt, tokenizer_dir, max_num_seqs=4, max_num_batched_tokens=32, linear_backend="mxfp8")
    graphs = EagerReplay(core.runner.model, [1, 2, 4], 1024)
    graphs.capture()
    core.runner.decode_graphs = graphs
    assert run(core, prompts, params) == want
    assert graphs.num_replays > 0


# ---- GPU -------------------------------------------------------------------------------------
def _gpu_checkpoint(tmp_path) -> str:
    """128 dims: the CUDA C++ GEMM takes every linear, wo_a's 128-row groups included. The
    indexer keeps every visible entry (top-64, 16 candidate blocks of 4: more than these
    requests have), so a 1e-7 difference that moves one MXFP8 activation by an e4m3 step
    cannot also change a top-k pick (tests/distributed/test_v41_mxfp8_parallel.py measures
    both: up to 0.8 on a log-prob with the picks, 2e-4 without)."""
    return mxfp8_checkpoint(tmp_path / "ckpt", dim=128, inter=128, o_lora_rank=128, index_topk=64,
                            candidate_topk_blocks=16)


@pytest.mark.gpu
def test_replay_equals_eager_decode_with_mxfp8_linears(tmp_path, monkeypatch):
    """float32, the QAT fake quantizers the identity (tests/distributed/test_v4_model_parallel.py):
    a replay of each captured size runs the same kernels on the same shapes as ``model.decode``,
    so only the page tables' padded widths differ (fp32 summation order); B = 3 also pads to 4."""
    from model.v41.model import load_deepseek_v41

    exact_rounding(monkeypatch.setattr)
    model = load_deepseek_v41(_gpu_checkpoint(tmp_path), torch.float32, "cuda")
    assert model.mxfp8_linears
    graphs = capture_over_fixed_pools(model)
    errors = replay_errors(model, graphs, (1, 3, 4, 8))
    assert all(e < 1e-3 for e in errors.values()), errors
    assert graphs.num_replays == 16
    assert model.cache_pools().num_free() == {k: p.num_units - 1 for k, p in model.cache_pools().items()}


@pytest.mark.gpu
def test_served_mxfp8_with_graphs_matches_enforce_eager(tmp_path, tokenizer_dir, monkeypatch):
    """float32 and the fake quantizers the identity, as above: the same greedy tokens, logprobs
    within 1e-3; both engines ran their linears as MXFP8."""
    exact_rounding(monkeypatch.setattr)
    ckpt = _gpu_checkpoint(tmp_path)
    prompts = _prompts(6, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    got = {}
    for eager in (True, False):
        core = make_core(ckpt, tokenizer_dir, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                         enforce_eager=eager, kv_cache_memory_bytes=1 << 30)
        assert core.runner.model.mxfp8_linears and (core.runner.decode_graphs is None) == eager
        got[eager] = run_logprobs(core, prompts, params)
        if not eager:
            assert core.runner.decode_graphs.num_replays > 0
        del core
        gc.collect()
        torch.cuda.empty_cache()
    for rid in got[True]:
        assert got[False][rid][1] == got[True][rid][1], rid
        diff = max(abs(a[1] - b[1]) for a, b in zip(got[True][rid][2], got[False][rid][2]))
        assert diff < 1e-3, (rid, diff)
