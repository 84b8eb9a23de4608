"""Bad checkpoints make `mlaserve serve` exit non-zero with one line naming the cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file, save_file

from model.checkpoint import write_random_checkpoint
from tests.distributed.test_parallel_server import SEED_LAUNCH_LINE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve(*args: str) -> subprocess.CompletedProcess:
    """``mlaserve serve *args --device cpu --port 0``."""
    return subprocess.run(
        [sys.executable, "-m", "server", "serve", *args, "--device", "cpu", "--port", "0"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )


MISSING = "model.layers.2.self_attn.kv_b_proj.weight"  # dropped from its shard and the index
CUT = "model.layers.0.mlp.down_proj.weight"  # one column short


def _copy(good: str, bad) -> None:
    os.system(f"cp -r {good} {bad}")


def _without_tensor(good: str, bad) -> str:
    _copy(good, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"].pop(MISSING)
    tensors = load_file(str(shard))
    del tensors[MISSING]
    save_file(tensors, str(shard))
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(bad)


def _with_config(good: str, bad, edit) -> str:
    _copy(good, bad)
    (bad / "config.json").write_text(json.dumps(edit(json.loads((bad / "config.json").read_text()))))
    return str(bad)


def _with_cut_tensor(good: str, bad) -> str:
    _copy(good, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"][CUT]
    tensors = load_file(str(shard))
    tensors[CUT] = tensors[CUT][:, :-1].contiguous()
    save_file(tensors, str(shard))
    return str(bad)


def _without_field(cfg: dict) -> dict:
    del cfg["qk_rope_head_dim"]
    return cfg


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{case: future of its `serve` run}: every bad checkpoint written here (from one good
    tiny-v2) and the R1 launch line, run two at a time (a failing start still imports and loads on one core); a
    test waits for its cases, and cases no selected test waited for are dropped at the end."""
    d = tmp_path_factory.mktemp("serve-err")
    good = write_random_checkpoint("tiny-v2", str(d / "m"), seed=1)
    missing = _without_tensor(good, d / "missing")
    runs = {
        "missing tp1": (missing,),
        "missing tp2": (missing, "-tp", "2"),
        "mistral": (_with_config(good, d / "mistral", lambda cfg: dict(cfg, model_type="mistral")),),
        "no field": (_with_config(good, d / "no-field", _without_field),),
        "cut": (_with_cut_tensor(good, d / "cut"),),
        "r1 launch line": SEED_LAUNCH_LINE,  # on the bundled model
    }
    pool = ThreadPoolExecutor(2)
    try:
        yield {case: pool.submit(_serve, *args) for case, args in runs.items()}
    finally:
        pool.shutdown(cancel_futures=True)


def _assert_one_line_error(proc, pattern: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and pattern in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize("case", ["missing tp1", "missing tp2"], ids=["tp1", "tp2"])
def test_missing_tensor(served, case):
    """With -tp 2 the TP worker fails on the same tensor: it logs one line, no traceback."""
    _assert_one_line_error(served[case].result(), f"missing tensor '{MISSING}'")


def test_unknown_model_type_and_missing_field(served):
    _assert_one_line_error(served["mistral"].result(), "unsupported model_type 'mistral'")
    _assert_one_line_error(served["no field"].result(), "missing required field 'qk_rope_head_dim'")


def test_wrong_shape(served):
    _assert_one_line_error(served["cut"].result(), CUT)


def test_r1_launch_line_on_the_bundled_model_is_one_line(served):
    """vLLM's R1 launch line (-tp 8, --max-model-len 10240) on the bundled model (limit 512):
    refused before any engine or TP worker starts, one line, no traceback per worker."""
    proc = served["r1 launch line"].result()
    _assert_one_line_error(proc, "--max-model-len: 10240 exceeds the model's max_position_embeddings (512)")
    assert "worker" not in proc.stderr.lower()
