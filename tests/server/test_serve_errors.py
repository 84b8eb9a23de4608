"""Bad checkpoints make `mlaserve serve` exit non-zero with one line naming the cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from model.checkpoint import write_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve(model_dir: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server", "serve", model_dir, "--device", "cpu", "--port", "0", *flags],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_random_checkpoint("tiny-v2", str(tmp_path_factory.mktemp("serve-err") / "m"), seed=1)


def _assert_one_line_error(proc, pattern: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and pattern in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize("flags", [(), ("-tp", "2")], ids=["tp1", "tp2"])
def test_missing_tensor(good, tmp_path, flags):
    """With -tp 2 the TP worker fails on the same tensor: it logs one line, no traceback."""
    bad = tmp_path / "bad"
    os.system(f"cp -r {good} {bad}")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    shard = bad / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard))
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_one_line_error(_serve(str(bad), *flags), f"missing tensor '{name}'")


def test_unknown_model_type_and_missing_field(good, tmp_path):
    bad = tmp_path / "bad"
    os.system(f"cp -r {good} {bad}")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="mistral")))
    _assert_one_line_error(_serve(str(bad)), "unsupported model_type 'mistral'")
    del cfg["qk_rope_head_dim"]
    (bad / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(_serve(str(bad)), "missing required field 'qk_rope_head_dim'")


def test_wrong_shape(good, tmp_path):
    bad = tmp_path / "bad"
    os.system(f"cp -r {good} {bad}")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    shard = bad / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(shard))
    _assert_one_line_error(_serve(str(bad)), name)


def test_r1_launch_line_on_the_bundled_model_is_one_line():
    """vLLM's R1 launch line (-tp 8, --max-model-len 10240) on the bundled model (limit 512):
    refused before any engine or TP worker starts, one line, no traceback per worker."""
    from tests.distributed.test_parallel_server import SEED_LAUNCH_LINE

    proc = subprocess.run([sys.executable, "-m", "server", "serve", *SEED_LAUNCH_LINE, "--device", "cpu",
                           "--port", "0"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    _assert_one_line_error(proc, "--max-model-len: 10240 exceeds the model's max_position_embeddings (512)")
    assert "worker" not in proc.stderr.lower()
