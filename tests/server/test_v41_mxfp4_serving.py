"""DeepSeek-V4.1 served from a checkpoint whose routed experts are MXFP4 (the released format):
the engine keeps them stacked MXFP4 (model/v41/moe.py) unless MLASERVE_V41_DEQUANTIZE_EXPERTS=1.

CPU: the stacked experts (torch reference) through the engine and its decode-graph path give
the dequantized per-expert model's greedy tokens. GPU: served with decode CUDA graphs, every
MoE ran the W4A8 kernels on SM90 (W4A16 elsewhere) and the chosen tokens' logprobs match the
float32 CPU reference, teacher-forced on the same tokens.
"""

from __future__ import annotations

import gc

import pytest
import torch

from model.checkpoint import load_config_dict, write_random_checkpoint
from server.sampling_params import SamplingParams
from tests.server import test_v4_serving as serving
from tests.server.test_v4_cuda_graphs import EagerReplay
from tests.server.test_v4_serving import make_core, run, run_logprobs

tokenizer_dir = serving.tokenizer_dir  # the fixtures' servable 320-token tokenizer (a pytest fixture)


one_torch_thread = serving.one_torch_thread  # autouse: one intra-op thread, as the live servers run


def mxfp4_checkpoint(out_dir: str, dim: int = 64, inter: int = 32) -> str:
    """tiny-v41 (8 layers, 4 experts, two engram layers) in the released format: FP8 linears,
    MXFP4 routed experts; ``dim`` / ``inter``: hidden and expert intermediate size."""
    cfg = load_config_dict("tiny-v41")
    cfg["text_config"].update(hidden_size=dim, moe_intermediate_size=inter)
    return write_random_checkpoint(cfg, out_dir, fp8=True, seed=11)


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 20, (count,), generator=g)]


def test_served_stacked_mxfp4_gives_the_dequantized_tokens(tmp_path, tokenizer_dir, monkeypatch):
    ckpt = mxfp4_checkpoint(str(tmp_path / "ckpt"))
    prompts = _prompts(4, seed=1)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    core = make_core(ckpt, tokenizer_dir, max_num_seqs=4, max_num_batched_tokens=32)
    assert core.runner.model.mxfp4_experts
    graphs = EagerReplay(core.runner.model, [1, 2, 4], 1024)
    graphs.capture()
    core.runner.decode_graphs = graphs
    got = run(core, prompts, params)
    assert graphs.num_replays > 0
    assert {layer.ffn.mxfp4_path for layer in core.runner.model.model.layers} == {"reference"}
    monkeypatch.setenv("MLASERVE_V41_DEQUANTIZE_EXPERTS", "1")
    plain = make_core(ckpt, tokenizer_dir, max_num_seqs=4, max_num_batched_tokens=32)
    assert not plain.runner.model.mxfp4_experts
    assert run(plain, prompts, params) == got


def _logprob_diffs(ref, prompts, served) -> list[float]:
    """|served − reference| logprob of each chosen token, the reference teacher-forced."""
    diffs = []
    for rid, (_, ids, lps) in served.items():
        prompt = prompts[int(rid)]
        with torch.no_grad():
            logits = ref(torch.tensor(prompt + ids), ref.new_state())
        rows = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
        diffs += [abs(rows[j, tok].item() - lp) for j, (tok, lp, _) in enumerate(lps)]
    return diffs


@pytest.mark.gpu
def test_served_mxfp4_runs_the_w4a8_kernels_under_graphs_and_matches_the_cpu_reference(tmp_path, tokenizer_dir,
                                                                                      monkeypatch):
    """Served in bf16 with decode graphs, every MoE runs the W4A8 kernels on SM90 (W4A16
    elsewhere). Against the float32 CPU reference, teacher-forced on the served tokens, the
    W4A8 engine may differ no more than the same engine with bf16 per-expert modules
    (MLASERVE_V41_DEQUANTIZE_EXPERTS=1) does, plus e4m3 activations' share: bf16 activations
    already move V4.1's FP8/FP4 activation roundings across grid steps in this random model
    (0.9 nats max on one token seen), so an absolute bound would measure bf16, not the kernels."""
    from model.v41.model import load_deepseek_v41

    ckpt = mxfp4_checkpoint(str(tmp_path / "ckpt"), dim=128, inter=128)  # the kernels' 128 multiples
    prompts = _prompts(6, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def serve():
        core = make_core(ckpt, tokenizer_dir, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                         kv_cache_memory_bytes=1 << 30)
        assert core.runner.decode_graphs is not None
        out = run_logprobs(core, prompts, params)
        assert core.runner.decode_graphs.num_replays > 0
        paths = {getattr(layer.ffn, "mxfp4_path", None) for layer in core.runner.model.model.layers}
        del core
        gc.collect()
        torch.cuda.empty_cache()
        return out, paths

    w4a8, paths = serve()
    assert paths == {"w4a8" if torch.cuda.get_device_capability()[0] == 9 else "w4a16"}
    monkeypatch.setenv("MLASERVE_V41_DEQUANTIZE_EXPERTS", "1")
    bf16, _ = serve()
    ref = load_deepseek_v41(ckpt, torch.float32)
    ours, base = _logprob_diffs(ref, prompts, w4a8), _logprob_diffs(ref, prompts, bf16)
    mean = lambda d: sum(d) / len(d)  # noqa: E731
    print(f"chosen-token logprob |diff| vs the CPU reference: mxfp4 {paths} max {max(ours):.4f} mean "
          f"{mean(ours):.4f}; bf16 experts max {max(base):.4f} mean {mean(base):.4f} ({len(ours)} tokens)")
    assert mean(ours) <= 1.5 * mean(base) + 0.05 and max(ours) <= 1.5 * max(base) + 0.25
