"""The bench package's shape: no import cycle, data and rendering free of GPU imports, small
modules. Imports are read from the source (function-level ones included), not executed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "kvasync" / "bench"
MAX_LINES = 400


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (a `from X import y` counts X.y too, so
    `from . import bandwidth` names the submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if node.module:
                found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def bench_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in imports_of(p) if i in modules and i != m} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_the_bench() -> None:
    graph = bench_graph()
    assert "kvasync.bench.sections.bandwidth" in graph["kvasync.bench.sections"]
    assert find_cycle(graph) is None


def test_data_and_rendering_import_nothing_of_the_device() -> None:
    """common, report and plot read a saved run on any machine: no kvasync core, CUDA or
    torch import; report and plot import nothing of the bench but common."""
    for name in ("common", "report", "plot"):
        mods = imports_of(PKG / f"{name}.py")
        assert not {m for m in mods if m.split(".")[0] in ("cupy", "torch", "numba")}, name
        assert not {m for m in mods if m.startswith("kvasync") and
                    not m.startswith("kvasync.bench")}, name
        allowed = set() if name == "common" else {"kvasync.bench.common"}
        assert {m for m in mods if m in bench_graph()} <= allowed, (name, mods)


@pytest.mark.timeout(60)
def test_reading_a_run_loads_no_gpu_module() -> None:
    code = ("import sys, kvasync.bench.common, kvasync.bench.report, kvasync.bench.plot\n"
            "bad = [m for m in ('cupy', 'torch', 'kvasync._backends._cuda', "
            "'kvasync._backends._cudart', 'kvasync.bench.context') if m in sys.modules]\n"
            "print(bad)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, cwd=PKG.parent.parent)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


def test_only_context_reaches_kvasync_internals() -> None:
    """Sections use the public API; what is private is read in context.py alone."""
    for path in PKG.rglob("*.py"):
        private = {m for m in imports_of(path) if m.startswith("kvasync._")}
        assert not private, (path.name, private)
        if path.name != "context.py":
            text = path.read_text()
            for attr in (".counts", ".grid", "calibration(", "alloc_host", "._"):
                assert f"backend{attr}" not in text, (path.name, attr)


def test_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert max(sizes.values()) <= MAX_LINES, sizes
