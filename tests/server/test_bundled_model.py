"""`mlaserve serve` with no model argument is a working demo: it serves the bundled adder.

The issue's "done when": the server started with no MODEL_DIR answers ``12+30=`` with ``42``.
"""

from __future__ import annotations

import os
import http.server
import subprocess
import sys
import threading
import tomllib

import httpx
import pytest

from server.cli import bundled_model_dir
from tests.server import live_server as live_server_module
from tests.server.live_server import ROOT, LiveServerError, free_port, live_server

BUNDLED_NAME = "arith"  # the served name: the checkpoint directory's basename


@pytest.fixture(scope="module")
def bundled_server():
    with live_server("--device", "cpu", "--disable-log-stats") as base_url:
        yield base_url


def test_bundled_checkpoint_is_in_the_package():
    model_dir = bundled_model_dir()
    assert os.path.basename(model_dir.rstrip("/")) == BUNDLED_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(model_dir, name)), name


@pytest.mark.slow
def test_no_model_argument_answers_12_plus_30(bundled_server):
    r = httpx.post(f"{bundled_server}/v1/completions",
                   json={"prompt": "12+30=", "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == BUNDLED_NAME
    choice = body["choices"][0]
    assert choice["text"].startswith("42"), choice
    # "42", "\n", then EOS: the model stops by itself well before max_tokens.
    assert choice["text"] == "42\n" and choice["finish_reason"] == "stop", choice


@pytest.mark.slow
def test_bundled_model_adds_other_pairs(bundled_server):
    """Not one memorized answer: a few sums (one with a carry into the thousands), greedy."""
    pairs = [(0, 0), (7, 5), (999, 1), (123, 877), (480, 365)]
    for a, b in pairs:
        r = httpx.post(f"{bundled_server}/v1/completions",
                       json={"prompt": f"{a}+{b}=", "max_tokens": 8, "temperature": 0, "stop": ["\n"]},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == str(a + b), (a, b, r.json())


@pytest.mark.slow
def test_models_endpoint_shows_the_served_name(bundled_server):
    r = httpx.get(f"{bundled_server}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    cards = r.json()["data"]
    assert [c["id"] for c in cards] == [BUNDLED_NAME]
    assert os.path.realpath(cards[0]["root"]) == os.path.realpath(bundled_model_dir())


def test_serve_help_mentions_the_bundled_model():
    out = subprocess.run([sys.executable, "-m", "server", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert "bundled" in text and "configs/arith" in text, out.stdout
    # argparse may wrap the path at a hyphen: compare with all whitespace removed
    assert bundled_model_dir() in "".join(out.stdout.split())


def test_mlaserve_console_script_runs_the_cli():
    """`pip install -e .` puts `mlaserve` on PATH; it must be the same `main` as `python -m server`."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["mlaserve"] == "server.cli:main"


# ---- the live_server helper (its first user is this file) -------------------------------------
def test_live_server_fails_with_the_log_tail_when_the_server_dies():
    missing = os.path.join(ROOT, "no-such-model-dir")
    with pytest.raises(LiveServerError) as exc:
        with live_server(missing, "--device", "cpu", timeout_s=60):
            pytest.fail("a server without a model must not become healthy")
    assert "exited with code" in str(exc.value) and missing in str(exc.value)


class _ImpostorHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_live_server_ignores_another_process_on_its_port(monkeypatch):
    """Port race: someone else holds the port we picked and answers /health. Our server fails
    to bind; the helper must notice (no "Uvicorn running" line of ours) and retry elsewhere."""
    impostor = http.server.HTTPServer(("127.0.0.1", 0), _ImpostorHandler)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    taken = impostor.server_address[1]
    ports = iter([taken])
    monkeypatch.setattr(live_server_module, "free_port", lambda: next(ports, None) or free_port())
    try:
        with live_server("--device", "cpu", "--disable-log-stats") as base_url:
            assert not base_url.endswith(f":{taken}")
            r = httpx.get(f"{base_url}/v1/models", timeout=30)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == BUNDLED_NAME
    finally:
        impostor.shutdown()
        impostor.server_close()
