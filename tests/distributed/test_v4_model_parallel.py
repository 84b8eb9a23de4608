"""DeepSeek-V4 / V4.1 under real process groups (gloo, fp32, 2 ranks) equal one process, on the
bundled tiny fixtures (tests/fixtures/dev-v4-s0, dev-v41-s0: 4 heads, 2 output groups, 4
experts, vocab 320, engram tables in V4.1):

* TP2 in reduce-scatter and all-reduce modes, and TP2 with --enable-expert-parallel (whole
  experts per rank, the TP reduction sums them);
* DP2 with the MoE over both ranks (whole experts: DEP; or every expert split), each DP rank
  running its own request with different chunk sizes, the rank with fewer forwards padding
  with dummy forwards (a one-token throwaway request) so the MoE collectives line up.

Each request runs a chunked prefill then token-by-token decode through its own state; every
rank's log-softmax rows must equal the single-process run. Tolerance 5e-5 on log-probs of
magnitude up to ~30: fp32 on CPU, the only difference is the order of the partial sums (heads,
expert slices, vocab rows), measured at ~1.2e-5. V4.1's quantization-aware rounding (FP8
window rows, FP4 entries and indexer keys) turns such a 1e-7 difference into a whole
quantization step when a value sits on a rounding boundary (seen: 9e-3 on one request, with
attention replicated and only the MoE combine order changed), so these runs replace the
fake quantizers by the identity in the reference and on every rank; the served test
(test_v4_parallel_server.py) covers TP with the rounding on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from model.v4_family import load_v4_family

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
MODELS = {"v4": os.path.join(FIXTURES, "dev-v4-s0"), "v41": os.path.join(FIXTURES, "dev-v41-s0")}
TOL = 5e-5
# (token seed, chunk sizes, decode steps): rank 0's request and DP rank 1's shorter one.
REQUESTS = [(0, (7, 9, 5), 4), (1, (5, 3), 2)]


def exact_rounding(setattr_=setattr) -> None:
    """V4.1's fake quantizers → identity (see the module doc); ``setattr_`` may be pytest's."""
    import model.v41.attention as attention
    import model.v41.indexer as indexer
    import model.v41.model as v41_model  # the cache rows' roundings (its ``auto`` row codecs)

    def identity(x, *args, **kwargs):
        return x

    for module, name in ((attention, "fake_quant_fp4"), (attention, "fake_quant_fp8_ue8m0"),
                         (indexer, "fake_quant_fp4"), (v41_model, "fake_quant_fp4"),
                         (v41_model, "fake_quant_fp8_ue8m0")):
        setattr_(module, name, identity)


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model, out: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(out) if hasattr(model, "compute_logits") else out


def run_request(model, seed: int, chunks, decode_steps: int) -> tuple[torch.Tensor, int]:
    """Chunked prefill then greedy decode; (log-softmax rows of every step, forwards run)."""
    ids = _ids(seed, sum(chunks))
    state, outs, start = model.new_state(), [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(_logits(model, model(ids[start:start + n], state)))
            start += n
        for _ in range(decode_steps):
            nxt = outs[-1][-1:].argmax(-1)
            outs.append(_logits(model, model(nxt, state)))
    return torch.log_softmax(torch.cat(outs), -1), len(chunks) + decode_steps


def dummy_forward(model) -> None:
    with torch.no_grad():
        model(torch.zeros(1, dtype=torch.long), model.new_state())


def _tp_worker(rank, world_size, local_rank, cfg, out_dir):
    from distributed.parallel_state import get_tp_group, init_distributed
    from model.parallel import ParallelContext

    torch.set_num_threads(1)
    exact_rounding()
    init_distributed(rank, world_size, local_rank, cfg, timeout_s=60)
    tp = get_tp_group()
    layouts = {"rs": ParallelContext.from_groups(tp), "ar": ParallelContext.from_groups(tp, tp_reduction="all_reduce"),
               "ep": ParallelContext.from_groups(tp, tp)}
    got = {}
    for name, path in MODELS.items():
        for layout, par in layouts.items():
            model = load_v4_family(path, torch.float32, par=par)
            got[f"{name}-{layout}"] = run_request(model, *REQUESTS[0])[0]
            got[f"{name}-{layout}-experts"] = len(model_experts(model))
    torch.save(got, Path(out_dir) / f"rank{rank}.pt")


def _dp_worker(rank, world_size, local_rank, cfg, out_dir):
    from distributed.parallel_state import get_tp_group, get_world_group, init_distributed
    from model.parallel import ParallelContext

    torch.set_num_threads(1)
    exact_rounding()
    init_distributed(rank, world_size, local_rank, cfg, timeout_s=60)
    got = {}
    for whole in (True, False):
        par = ParallelContext.from_groups(get_tp_group(), get_world_group(), dispatch_moe=True,
                                          moe_tensor_parallel=not whole)
        for name, path in MODELS.items():
            model = load_v4_family(path, torch.float32, par=par)
            out, forwards = run_request(model, *REQUESTS[rank])
            longest = max(len(c) + d for _, c, d in REQUESTS)
            for _ in range(longest - forwards):
                dummy_forward(model)
            got[f"{name}-{'dep' if whole else 'moe_tp'}"] = out
    torch.save(got, Path(out_dir) / f"rank{rank}.pt")


def model_experts(model) -> list:
    layer = model.model.layers[-1]
    moe = layer.mlp if hasattr(layer, "mlp") else layer.ffn
    if hasattr(moe.experts, "gate_up_proj"):
        return list(range(moe.experts.num_experts))
    return [e for e in moe.experts if not isinstance(e, torch.nn.Identity)]


@pytest.fixture
def references(monkeypatch):
    exact_rounding(monkeypatch.setattr)
    ref = {}
    for name, path in MODELS.items():
        model = load_v4_family(path, torch.float32)
        ref[name] = [run_request(model, *r)[0] for r in REQUESTS]
    return ref


def _spawn(fn, tmp_path, dp_size: int):
    from distributed.launcher import find_free_port, spawn_workers
    from distributed.parallel_state import ParallelConfig
    from tests.distributed.conftest import START_METHOD

    cfg = ParallelConfig(tp_size=2 // dp_size, dp_size=dp_size, enable_expert_parallel=dp_size > 1,
                         master_port=find_free_port())
    group = spawn_workers(fn, 2, (str(tmp_path),), cfg, device="cpu", start_method=START_METHOD,
                          join_timeout_s=120)
    codes = group.join()
    assert all(c == 0 for c in codes.values()), codes
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_tp2_matches_tp1(references, tmp_path):
    results = _spawn(_tp_worker, tmp_path, dp_size=1)
    for rank, got in enumerate(results):
        for name in MODELS:
            for layout in ("rs", "ar", "ep"):
                diff = (got[f"{name}-{layout}"] - references[name][0]).abs().max().item()
                assert diff < TOL, (rank, name, layout, diff)
            assert got[f"{name}-ep-experts"] == 2  # whole experts, 4 / 2 per rank
            assert got[f"{name}-rs-experts"] == 4  # every expert, half its intermediate dim


def test_dp2_matches_single_process(references, tmp_path):
    results = _spawn(_dp_worker, tmp_path, dp_size=2)
    for rank, got in enumerate(results):
        for name in MODELS:
            for layout in ("dep", "moe_tp"):
                diff = (got[f"{name}-{layout}"] - references[name][rank]).abs().max().item()
                assert diff < TOL, (rank, name, layout, diff)
