"""The package's layering: no import cycle, `_program` below the rest (sizes: test_sizes.py).

Imports are read from the source (module level, inside functions and under
`TYPE_CHECKING` alike: each is a dependency a reader must follow), so a cycle cannot hide
behind a lazy import. `python tests/package/test_layering.py` prints the cycles and the longest
modules without running pytest.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kvasync"
#: cycles being taken apart elsewhere; each entry must still be a cycle (else remove it)
KNOWN_CYCLES: list[frozenset[str]] = []
#: modules of the package each module of `_program` must not import (the copy program is
#: pure NumPy: it knows no device, scheduler, completion, future or offloader)
PROGRAM_MUST_NOT_IMPORT = (
    "kvasync._backends",
    "kvasync._scheduler",
    "kvasync._lane_completion",
    "kvasync._completion",
    "kvasync._transfer",
    "kvasync._offloader",
)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for f in sorted((root / PACKAGE).rglob("*.py")):
        name = ".".join(f.relative_to(root).with_suffix("").parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        mods[name] = f
    return mods


def _targets(mods: dict[str, Path], cur: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules one import statement of `cur` depends on (a package's
    `__init__` included, when a module of it is imported from outside that package)."""
    names: list[str] = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = cur.split(".")
            is_pkg = mods[cur].name == "__init__.py"
            base = base[: len(base) - node.level + (1 if is_pkg else 0)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names.append(target)
        names += [f"{target}.{a.name}" for a in node.names]
    else:
        names += [a.name for a in node.names]
    out: set[str] = set()
    for name in names:
        if name not in mods:
            continue
        out.add(name)
        parts = name.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if parent in mods and not cur.startswith(parent + "."):
                out.add(parent)
    out.discard(cur)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any level of its source."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _targets(mods, name, node)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(frozenset(comp))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_read_at_every_level(tmp_path: Path) -> None:
    """A function-level or TYPE_CHECKING import closes a cycle as much as a top one."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.py").write_text("def f():\n    from ._b import x\n")
    (pkg / "_b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import _a\nx = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from .m import y\n")
    (pkg / "sub" / "m.py").write_text("from .._a import f\ny = 2\n")
    graph = import_graph(tmp_path)
    assert graph["kvasync._a"] == {"kvasync._b"}
    assert graph["kvasync._b"] == {"kvasync", "kvasync._a"}  # `from . import` reads __init__
    assert graph["kvasync.sub"] == {"kvasync.sub.m"}
    assert graph["kvasync.sub.m"] == {"kvasync._a"}
    assert cycles(graph) == [frozenset({"kvasync._a", "kvasync._b"})]


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"no longer cycles, remove them from KNOWN_CYCLES: {stale}"


def test_program_imports_nothing_above_it() -> None:
    graph = import_graph()
    program = [m for m in graph if m == "kvasync._program" or m.startswith("kvasync._program.")]
    assert len(program) > 1
    bad = {
        m: sorted(d for d in graph[m]
                  if any(d == f or d.startswith(f + ".") for f in PROGRAM_MUST_NOT_IMPORT))
        for m in program
    }
    assert not any(bad.values()), f"_program imports the layers above it: {bad}"


def test_program_needs_only_errors_and_layout() -> None:
    graph = import_graph()
    outside = {d for m, deps in graph.items() if m.startswith("kvasync._program")
               for d in deps if not d.startswith("kvasync._program")}
    assert outside <= {"kvasync._errors", "kvasync._layout"}, outside


@pytest.mark.parametrize("leaf", ["kvasync._errors", "kvasync._polling", "kvasync._threadstate"])
def test_leaf_modules_import_nothing_of_kvasync(leaf: str) -> None:
    assert import_graph()[leaf] == set()


def test_readme_names_every_module() -> None:
    """Every module is in the README's module table, as a file or under a folder named."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| module | holds |"):].split("\n\n", 1)[0]
    named = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    missing = [
        str(p.relative_to(ROOT)) for p in sorted((ROOT / PACKAGE).rglob("*.py"))
        if not any(str(p.relative_to(ROOT)) == n or
                   (n.endswith("/") and str(p.relative_to(ROOT)).startswith(n)) for n in named)
    ]
    assert not missing, f"modules missing from the README's module table: {missing}"


if __name__ == "__main__":
    print("cycles:", [sorted(c) for c in cycles(import_graph())])
