"""Decode CUDA graphs: capture sizes on CPU; on the GPU, graph replay equals eager decode."""

from __future__ import annotations

import pytest

from server.cli import parse_serve_args
from server.cuda_graphs import capture_sizes, decode_capture_sizes


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    s = capture_sizes(512)
    assert s[:6] == [1, 2, 4, 8, 16, 24] and s[-1] == 512 and 256 in s and 272 in s
    assert all(b > a for a, b in zip(s, s[1:]))
    assert capture_sizes(20)[-1] == 20  # the maximum itself is always captured


def _sizes(argv: list[str]) -> list[int]:
    return decode_capture_sizes(parse_serve_args(argv).engine_config)


@pytest.mark.parametrize("argv", [
    ["--compilation-config", '{"cudagraph_capture_sizes": [8, 1, 4, 2, 4]}'],
    ["--compilation-config.cudagraph_capture_sizes", "[1,2,4,8]"],
    ["--cuda-graph-sizes", "1", "2", "4", "8"],
    ["--cudagraph-capture-sizes", "8", "4", "2", "1", "1"],
    ["--cuda-graph-sizes", "1", "2", "4", "8", "--max-cudagraph-capture-size", "8"],
])
def test_capture_size_flags_decide_the_captured_batches(argv):
    """vLLM's three spellings of the list: used as given (sorted, deduplicated); the largest
    is max_cudagraph_capture_size."""
    assert _sizes(argv) == [1, 2, 4, 8]
    assert parse_serve_args(argv).engine_config.max_cudagraph_capture_size == 8


def test_capture_sizes_capped_by_max_num_seqs_and_defaults():
    assert _sizes(["--cuda-graph-sizes", "1", "2", "4", "8", "16", "--max-num-seqs", "6"]) == [1, 2, 4]
    assert _sizes(["--cuda-graph-sizes", "32", "--max-num-seqs", "16"]) == []  # nothing fits: no graphs
    assert _sizes(["--max-num-seqs", "8"]) == [1, 2, 4, 8]
    assert _sizes(["--max-cudagraph-capture-size", "20"]) == [1, 2, 4, 8, 16, 20]
    assert _sizes([]) == capture_sizes(256)  # default max_num_seqs 256 < 512
    assert _sizes(["--max-num-seqs", "1024"]) == capture_sizes(512)


def test_capture_size_flags_that_contradict_are_errors(capsys):
    for argv, needle in (
        (["--cuda-graph-sizes", "1", "2", "--compilation-config.cudagraph_capture_sizes", "[1]"], "mutually exclusive"),
        (["--cuda-graph-sizes", "1", "8", "--max-cudagraph-capture-size", "4"], "contradicts the largest"),
        (["--cuda-graph-sizes", "0"], "--cudagraph-capture-sizes"),
        (["--compilation-config.cudagraph_capture_sizes", "[2, -1]"], "cudagraph_capture_sizes"),
    ):
        with pytest.raises(SystemExit):
            parse_serve_args(argv)
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize("level,mode", [("0", "NONE"), ("1", "FULL_DECODE_ONLY"), ("3", "FULL_DECODE_ONLY")])
def test_optimization_level_sets_the_graph_default(level, mode):
    args = parse_serve_args([f"-O{level}"])
    assert args.engine_config.cudagraph_mode == mode and args.engine_config.optimization_level == int(level)
    assert any(note.startswith(f"-O{level}:") for note in args.notes)
    explicit = parse_serve_args(["-O0", "--compilation-config.cudagraph_mode", "FULL_DECODE_ONLY"])
    assert explicit.engine_config.cudagraph_mode == "FULL_DECODE_ONLY"  # an explicit mode wins


def test_bad_optimization_level_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["-O7"])
    assert "--optimization-level" in capsys.readouterr().err


@pytest.mark.gpu
def test_graph_decode_equals_eager(tmp_path):
    from model.checkpoint import write_random_checkpoint
    from server import LLM, SamplingParams

    from model.checkpoint import load_config_dict

    # Real MLA head dims (latent 512, rope 64: what the Triton decode kernel takes), few layers.
    cfg = dict(load_config_dict("tiny-v3"), kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256)
    ckpt = write_random_checkpoint(cfg, str(tmp_path / "m"), seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = [[3 + i, 7, 9 + 2 * i] for i in range(5)]
    eager = LLM(ckpt, device="cuda", dtype="bfloat16", enforce_eager=True, num_gpu_blocks_override=64,
                block_size=64).generate(prompt_token_ids=prompts, sampling_params=params)
    graph_llm = LLM(ckpt, device="cuda", dtype="bfloat16", num_gpu_blocks_override=64, block_size=64,
                    max_cudagraph_capture_size=8, max_num_seqs=8)
    assert graph_llm.engine.runner.decode_backend.name == "triton"
    assert graph_llm.engine.runner.decode_graphs is not None
    graphed = graph_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = max(abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
        assert diff < 2e-2  # bf16; the same kernels, replayed


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_async_overlap_on_gpu_equals_sync(tmp_path, kv_cache_dtype):
    """Async scheduling on the GPU: steps launched before the previous tokens are read back
    (device-side placeholders, pinned non-blocking readback) give the synchronous tokens,
    with decode CUDA graphs and the FP8 decode backends."""
    from model.checkpoint import load_config_dict, write_random_checkpoint
    from server import LLM, SamplingParams

    cfg = dict(load_config_dict("tiny-v3"), kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256)
    ckpt = write_random_checkpoint(cfg, str(tmp_path / "m"), seed=3)
    prompts = [[3 + i, 7, 9 + 2 * i, 11] * (1 + i) for i in range(6)]
    params = [SamplingParams(temperature=0.7, seed=40 + i, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(6)]
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(ckpt, device="cuda", dtype="bfloat16", num_gpu_blocks_override=64, block_size=64,
                  max_cudagraph_capture_size=8, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype,
                  async_scheduling=async_scheduling)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)])
        if async_scheduling:
            assert llm.engine.runner.num_overlapped_steps > 0
    # Async steps can batch differently at the ends of requests (bf16 GEMMs of other shapes), so
    # allow one sequence to drift; a wrong placeholder input would derail nearly all of them.
    same = sum(a == b for a, b in zip(*outs))
    assert same >= len(prompts) - 1, outs


@pytest.mark.gpu
def test_fp8_engine_cuda_backend_matches_triton(tmp_path):
    """The engine with an FP8 cache decodes through the CUDA C++ kernel (auto, 16 heads) and
    gives what the Triton kernel gives, under decode CUDA graphs."""
    import torch

    from model.checkpoint import load_config_dict, write_random_checkpoint
    from server import LLM, SamplingParams

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the CUDA C++ decode kernel is built for Hopper")
    cfg = dict(load_config_dict("tiny-v3"), kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256,
               num_attention_heads=16)
    ckpt = write_random_checkpoint(cfg, str(tmp_path / "m"), seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = [[5 + i, 9, 13 + 3 * i] * (2 + 5 * i) for i in range(4)]
    runs = {}
    for backend in ("auto", "triton"):
        llm = LLM(ckpt, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_gpu_blocks_override=64,
                  block_size=64, max_cudagraph_capture_size=8, max_num_seqs=8, attention_backend=backend)
        runs[llm.engine.runner.decode_backend.name] = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert set(runs) == {"cuda", "triton"}
    for a, b in zip(runs["cuda"], runs["triton"]):
        lp_a = [x.logprob for x in a.outputs[0].logprobs]
        lp_b = [x.logprob for x in b.outputs[0].logprobs]
        n = next((i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y), 24)
        assert n >= 8, (a.outputs[0].token_ids, b.outputs[0].token_ids)  # same greedy path for a while
        assert max(abs(x - y) for x, y in zip(lp_a[:n], lp_b[:n])) < 5e-2
