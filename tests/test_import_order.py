"""The repository's import order: ``server → model → kernels → distributed → configs``.

A package may import only packages to its right (``configs`` holds data and imports none of
them); ``benchmarks/`` and ``scripts/`` sit at the edge: they may import every package, and
nothing imports them (nor does one of them import the other). Between modules there is no
import cycle at all, inside a package or across packages.

Imports are read with ``ast`` from the source (module-level and function-level alike,
``__import__``/``importlib.import_module`` with a literal name included), so an import that
runs only on a GPU or in a subprocess is checked too. The checker itself is tested on
synthetic graphs below, so a violation really fails.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Higher imports lower; ``None``: at the edge (imports anything, imported by nothing).
LAYERS: dict[str, int | None] = {
    "server": 4,
    "model": 3,
    "kernels": 2,
    "distributed": 1,
    "configs": 0,
    "benchmarks": None,
    "scripts": None,
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages) -> dict[str, Path]:
    """Every ``.py`` file under the given top-level directories, by dotted module name."""
    modules = {}
    for pkg in packages:
        for dirpath, dirnames, filenames in os.walk(root / pkg):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    path = Path(dirpath) / f
                    modules[module_name(root, path)] = path
    return modules


def imported_names(source: str, modname: str, is_package: bool) -> set[str]:
    """Dotted names a module's source imports (relative imports resolved)."""
    names: set[str] = set()
    base = modname.split(".") if is_package else modname.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from a.b import c`` names a.b.c: resolve() keeps a.b when c is not a module.
            names.update(mod if a.name == "*" else f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if fname in ("__import__", "import_module"):
                names.add(node.args[0].value)
    return names


def resolve(name: str, modules) -> str | None:
    """The most specific project module a dotted name refers to (``a.b.func`` → ``a.b``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path, packages) -> dict[str, set[str]]:
    modules = find_modules(root, packages)
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps = set()
        for name in imported_names(path.read_text(), mod, path.name == "__init__.py"):
            target = resolve(name, modules)
            if target is not None and target != mod:
                deps.add(target)
        graph[mod] = deps
    return graph


def layer_violations(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Imports against the order, one line each."""
    out = []
    ordered = [p for p, r in sorted(layers.items(), key=lambda kv: -(kv[1] or 0)) if r is not None]
    for mod, deps in sorted(graph.items()):
        src = mod.split(".")[0]
        for dep in sorted(deps):
            dst = dep.split(".")[0]
            if src == dst:
                continue
            if dst not in layers:
                continue
            if layers[dst] is None:
                out.append(f"{mod} imports {dep}: nothing may import {dst}/ (it is at the edge)")
            elif layers.get(src) is not None and layers[dst] >= layers[src]:
                below = [p for p in ordered if layers[p] < layers[src]]
                out.append(f"{mod} imports {dep}: {src} may import only {', '.join(below) or 'no package'}")
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        cycles.append(sorted(comp))
    return cycles


# ---- the repository ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo_graph():
    return import_graph(ROOT, LAYERS)


def test_imports_follow_the_layer_order(repo_graph):
    bad = layer_violations(repo_graph)
    assert not bad, "imports against server → model → kernels → distributed → configs:\n" + "\n".join(bad)


def test_no_import_cycles(repo_graph):
    cycles = import_cycles(repo_graph)
    assert not cycles, "import cycles:\n" + "\n".join(" ↔ ".join(c) for c in cycles)


def test_graph_sees_the_whole_repository(repo_graph):
    """A checker that silently found no modules (or no edges) would pass anything."""
    for pkg in ("server", "model", "kernels", "distributed", "configs", "benchmarks", "scripts"):
        assert any(m == pkg or m.startswith(pkg + ".") for m in repo_graph), pkg
    assert "model.deepseek" in repo_graph["server.runner"]
    assert "distributed.comm" in repo_graph["server.engine_parallel"]


# ---- the checker itself, on synthetic graphs ---------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checker_reads_every_kind_of_import(tmp_path):
    _write(tmp_path, {
        "server/__init__.py": "",
        "server/a.py": "import os\nfrom server import b\n",
        "server/b.py": "def f():\n    from . import c\n",
        "server/c.py": "import importlib\nm = importlib.import_module('model.x')\n",
        "server/d.py": "from model.x import thing\n__import__('kernels')\n",
        "model/__init__.py": "",
        "model/x.py": "thing = 1\n",
        "kernels/__init__.py": "",
    })
    g = import_graph(tmp_path, ["server", "model", "kernels"])
    assert g["server.a"] == {"server.b"}
    assert g["server.b"] == {"server.c"}          # relative, inside a function
    assert g["server.c"] == {"model.x"}           # importlib.import_module
    assert g["server.d"] == {"model.x", "kernels"}  # from-import of a name; __import__
    assert not layer_violations(g) and not import_cycles(g)


def test_checker_fails_on_an_upward_import(tmp_path):
    _write(tmp_path, {
        "server/__init__.py": "", "server/engine.py": "from model import net\n",
        "model/__init__.py": "", "model/net.py": "def f():\n    from distributed import comm\n",
        "distributed/__init__.py": "", "distributed/comm.py": "def g():\n    import model.net\n",
    })
    g = import_graph(tmp_path, ["server", "model", "distributed"])
    bad = layer_violations(g)
    assert len(bad) == 1 and bad[0].startswith("distributed.comm imports model.net")


def test_checker_fails_on_importing_the_edge(tmp_path):
    _write(tmp_path, {
        "server/__init__.py": "", "server/cli.py": "from benchmarks.tool import run\n",
        "benchmarks/__init__.py": "", "benchmarks/tool.py": "from server import cli\n",
        "scripts/x.py": "import benchmarks.tool\n",
    })
    g = import_graph(tmp_path, ["server", "benchmarks", "scripts"])
    bad = layer_violations(g)
    assert any(b.startswith("server.cli imports benchmarks.tool") for b in bad)
    assert any(b.startswith("scripts.x imports benchmarks.tool") for b in bad)
    assert not any(b.startswith("benchmarks.tool") for b in bad)  # the edge may import server


def test_checker_finds_cycles_inside_and_across_packages(tmp_path):
    _write(tmp_path, {
        "server/__init__.py": "",
        "server/a.py": "from server.b import x\n",
        "server/b.py": "def f():\n    import server.c\n",
        "server/c.py": "from .a import y\n",
        "server/d.py": "import server.a\n",
        "kernels/__init__.py": "", "kernels/k.py": "from distributed.w import z\n",
        "distributed/__init__.py": "", "distributed/w.py": "def f():\n    from kernels import k\n",
    })
    g = import_graph(tmp_path, ["server", "kernels", "distributed"])
    cycles = import_cycles(g)
    assert ["server.a", "server.b", "server.c"] in cycles
    assert ["distributed.w", "kernels.k"] in cycles
    assert len(cycles) == 2  # server.d only imports into the cycle
