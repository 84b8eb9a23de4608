"""One start-up path for the engine process and TP workers (server/runner_setup.py): the
context length is the flag or the model's limit (above the limit is an error naming the flag),
capped at the KV capacity the ranks agreed on."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import write_random_checkpoint
from model.config import load_model_config
from server.config import EngineConfig
from server.runner_setup import build_runner, fit_kv_capacity, resolve_max_model_len

LIMIT = 1024  # tiny-v3's max_position_embeddings


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny-v3", str(tmp_path_factory.mktemp("setup") / "m"), seed=3)


def test_max_model_len_is_the_flag_or_the_model_limit(ckpt):
    mc = load_model_config(ckpt)
    assert mc.max_position_embeddings == LIMIT
    assert resolve_max_model_len(EngineConfig(device="cpu"), mc) == LIMIT
    assert resolve_max_model_len(EngineConfig(device="cpu", max_model_len=300), mc) == 300
    with pytest.raises(ValueError, match=r"--max-model-len: 2048 exceeds the model's max_position_embeddings \(1024\)"):
        resolve_max_model_len(EngineConfig(device="cpu", max_model_len=2048), mc)


def test_kv_capacity_caps_the_default_and_refuses_the_flag():
    cfg = EngineConfig(device="cpu", block_size=16)
    assert fit_kv_capacity(cfg, 1024, capacity=1600) == 1024
    assert fit_kv_capacity(cfg, 1024, capacity=160) == 160
    assert fit_kv_capacity(cfg, 1024, capacity=None) == 1024  # a cache that holds any length
    with pytest.raises(ValueError, match="--max-model-len: 500 tokens do not fit the KV cache \\(160 tokens\\)"):
        fit_kv_capacity(EngineConfig(device="cpu", block_size=16, max_model_len=500), 500, capacity=160)


def test_build_runner_uses_the_agreed_block_count(ckpt):
    cfg = EngineConfig(device="cpu", block_size=16, num_gpu_blocks_override=40)
    seen = []

    def agree(n):  # a TP peer with less memory: the group takes the minimum
        seen.append(n)
        return 12

    setup = build_runner(cfg, ckpt, torch.device("cpu"), agree_num_blocks=agree, progress=False)
    assert seen == [40]
    assert setup.num_blocks == setup.runner.num_blocks == 12
    assert setup.max_model_len == 12 * 16  # capped at the agreed capacity, not this rank's 40 blocks
    assert setup.runner.decode_graphs is None  # CPU: no graphs


def test_engine_and_worker_share_the_start_up():
    """Both entry points build through build_runner (no second copy of the sequence)."""
    import inspect

    from server import engine_core, tp_worker

    for mod in (engine_core, tp_worker):
        src = inspect.getsource(mod)
        assert "build_runner(" in src
        assert "determine_num_blocks" not in src and "load_model(" not in src
