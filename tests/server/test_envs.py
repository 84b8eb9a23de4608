"""server/envs.py is the one place environment variables are read, and the README lists them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from server import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "model", "kernels", "distributed", "configs", "benchmarks", "scripts")


def environ_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of each ``os.environ[...]``/``.get``/``.pop``/``.setdefault`` and
    ``os.getenv`` whose name is a string literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        elif isinstance(node, ast.Call) and node.args:
            fn = ast.unparse(node.func)
            if fn in ("os.getenv", "os.environ.get", "os.environ.pop", "os.environ.setdefault"):
                key = node.args[0]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append((node.lineno, key.value))
    return found


def test_environ_reads_finds_every_form():
    src = "import os\na = os.environ['A']\nb = os.environ.get('B', 1)\nc = os.getenv('C')\nos.environ.pop('D')\n"
    assert sorted(n for _, n in environ_reads(src)) == ["A", "B", "C", "D"]


def name_literals(source: str) -> list[tuple[int, str]]:
    """(line, name) of each string literal that is exactly a variable's name: a name kept in a
    constant and read through it elsewhere is a read too."""
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in envs.ENV_VARS]


def test_mlaserve_variables_are_read_only_in_envs():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "server" / "envs.py":
                continue
            source = path.read_text()
            for line, name in environ_reads(source):
                if name.startswith("MLASERVE_") or name in envs.ENV_VARS:
                    bad.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
            for line, name in name_literals(source):
                bad.append(f"{path.relative_to(ROOT)}:{line} names {name}")
    assert not bad, "read these through server.envs:\n" + "\n".join(bad)


def test_readme_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.M)
    assert sorted(listed) == sorted(envs.ENV_VARS)


def test_values_are_read_when_accessed(monkeypatch):
    monkeypatch.delenv("MLASERVE_DIST_INIT_TIMEOUT", raising=False)
    assert envs.MLASERVE_DIST_INIT_TIMEOUT == 120.0
    monkeypatch.setenv("MLASERVE_DIST_INIT_TIMEOUT", "7.5")
    assert envs.MLASERVE_DIST_INIT_TIMEOUT == 7.5
    monkeypatch.setenv("MLASERVE_STEP_PROFILE", "off")
    assert envs.MLASERVE_STEP_PROFILE is False
    monkeypatch.setenv("MLASERVE_STEP_PROFILE", "1")
    assert envs.MLASERVE_STEP_PROFILE is True
    monkeypatch.setenv("MLASERVE_KERNEL_CACHE", "/tmp/k")
    assert envs.MLASERVE_KERNEL_CACHE == Path("/tmp/k")


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("MLASERVE_ENGINE_STARTUP_TIMEOUT", value)
    with pytest.raises(ValueError, match="MLASERVE_ENGINE_STARTUP_TIMEOUT"):
        envs.MLASERVE_ENGINE_STARTUP_TIMEOUT


def test_cli_refuses_a_bad_value_in_one_line(monkeypatch, capsys):
    from server.cli import main

    monkeypatch.setenv("MLASERVE_DIST_INIT_TIMEOUT", "soon")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "MLASERVE_DIST_INIT_TIMEOUT='soon'" in err[-1] and "Traceback" not in "\n".join(err)


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError):
        envs.MLASERVE_NO_SUCH_THING
