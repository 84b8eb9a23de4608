"""``pip install .`` from exactly what the Dockerfile copies into the image.

The image is not built in CI (no Docker engine), so this test rebuilds its build context:
every ``COPY`` line of the Dockerfile is replayed into a temporary directory, the project is
installed from there (``--no-deps --no-build-isolation``: offline, with the installed
setuptools) into a temporary target, and the packages must import from that target. A package
listed in pyproject.toml but never copied, or a module that imports a file outside the copied
tree, fails here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("server", "model", "kernels", "distributed", "configs")


def repo_packages() -> list[str]:
    """Every package under the installed roots: a directory with an ``__init__.py``."""
    return sorted(".".join(p.parent.relative_to(ROOT).parts) for root in ROOTS
                  for p in (ROOT / root).rglob("__init__.py") if "__pycache__" not in p.parts)


def dockerfile_copies(text: str) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY instruction (line continuations joined)."""
    copies = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0].upper() != "COPY":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        assert len(args) >= 2, f"COPY needs a source and a destination: {line!r}"
        copies.append((args[:-1], args[-1]))
    return copies


def replay_copies(copies, src_root: Path, dst_root: Path) -> None:
    """Docker's rules (destinations relative to WORKDIR): a directory source copies its
    *contents* into the destination; a file goes into ``dest/`` (or with several sources)
    by name, else becomes ``dest``."""
    for sources, dest in copies:
        target = dst_root / dest
        for s in sources:
            src = src_root / s
            assert src.exists(), f"COPY {s}: no such file in the repository"
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                out = target / src.name if dest.endswith("/") or len(sources) > 1 else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)


def test_dockerfile_parsing():
    text = "FROM x\n# COPY not this\nCOPY a.toml b.md ./\nCOPY --chown=1:1 server \\\n    ./server\n"
    assert dockerfile_copies(text) == [(["a.toml", "b.md"], "./"), (["server"], "./server")]


def test_pip_install_from_the_docker_context(tmp_path):
    context, target = tmp_path / "context", tmp_path / "site"
    copies = dockerfile_copies((ROOT / "Dockerfile").read_text())
    assert copies, "the Dockerfile copies nothing"
    replay_copies(copies, ROOT, context)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_NO_INDEX"] = "1"  # offline: nothing may be fetched
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(context)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert res.returncode == 0, f"pip install failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    # Import from the target only (not the repository, not an editable install elsewhere).
    packages = repo_packages()
    assert {"server", "server.bench", "model", "kernels", "distributed", "configs"} <= set(packages)
    kernel_sources = sorted(p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".cu", ".cuh"))
    probe = (
        "import importlib, importlib.resources as r\n"
        f"target = {str(target)!r}\n"
        f"for name in {packages!r}:\n"
        "    mod = importlib.import_module(name)\n"
        "    assert mod.__file__.startswith(target), (name, mod.__file__)\n"
        "assert (r.files('configs') / 'arith' / 'config.json').is_file()\n"
        "assert (r.files('configs') / 'lm_eval_tasks' / 'arith_gen.yaml').is_file()\n"
        "csrc = sorted(p.name for p in (r.files('kernels') / 'csrc').iterdir())\n"
        f"assert csrc == {kernel_sources!r}, csrc\n"
        "print('ok')\n"
    )
    env["PYTHONPATH"] = str(target)
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def dockerfile_python_snippets(text: str) -> list[str]:
    """The code of each ``RUN python3 -c "..."`` instruction (line continuations joined)."""
    snippets = []
    for line in text.replace("\\\n", "").splitlines():
        words = shlex.split(line, comments=True)
        if words[:3] == ["RUN", "python3", "-c"]:
            snippets.append(words[3])
    return snippets


def test_the_image_prebuilds_every_cuda_library(monkeypatch):
    """The image builds each nvcc-built kernel library at build time (into the kernel cache the
    image's environment names), so a container never compiles on its first request: the
    Dockerfile's snippet runs here with the builders recording their calls."""
    import importlib
    import pkgutil

    import kernels
    from server import envs

    builders = sorted(name for _, name, _ in pkgutil.iter_modules(kernels.__path__)
                      if callable(getattr(importlib.import_module(f"kernels.{name}"), "build_library", None)))
    assert {"mla_decode_cuda", "mxfp8_gemm_cuda", "v4_sparse_decode_cuda"} <= set(builders)
    built = []
    for name in builders:
        monkeypatch.setattr(f"kernels.{name}.build_library",
                            lambda nvcc=None, out_dir=None, _name=name: built.append((_name, out_dir)) or _name)
    snippets = [s for s in dockerfile_python_snippets((ROOT / "Dockerfile").read_text()) if "build_library" in s]
    assert len(snippets) == 1, snippets
    exec(compile(snippets[0], "Dockerfile", "exec"), {})
    assert sorted(name for name, _ in built) == builders
    assert all(out_dir == envs.MLASERVE_KERNEL_CACHE for _, out_dir in built)
