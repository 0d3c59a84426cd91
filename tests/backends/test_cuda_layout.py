"""The layout of `kvasync._backends`, checked without a GPU (runs in CI).

Small modules and classes, one door to CuPy and libcuda (`_cudart`), no import cycle
among the backend modules (TYPE_CHECKING and function-level imports included), and the
CUDA backend importable where no driver is.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvasync._backends as backends

PACKAGE = Path(backends.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 275
#: the only module that imports CuPy or opens a library (libcuda); the others call
#: `_cudart.cupy()` (the host backend's ctypes.memmove opens nothing)
BINDING = "_cudart.py"
#: modules that must not reach CUDA at all (the seam and the host backend)
NO_CUDA = ("__init__.py", "_base.py", "_host.py")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported(node: ast.AST) -> list[str]:
    """Absolute-or-relative names an import node brings in (module and module.name)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = "." * node.level + (node.module or "")
        return [base] + [f"{base}.{a.name}" if node.module else f"{base}{a.name}"
                         for a in node.names]
    return []


def _sibling_imports(path: Path) -> set[str]:
    """Backend modules (file stems) that `path` imports, at any level."""
    stems = {p.stem for p in MODULES}
    out: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out.update(n.split(".")[0] for n in names if n and n.split(".")[0] in stems)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for name in _imported(node):
                parts = name.split(".")
                if parts[:2] == ["kvasync", "_backends"] and len(parts) > 2 \
                        and parts[2] in stems:
                    out.add(parts[2])
    out.discard(path.stem)
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_modules_and_classes_are_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name}: {lines} lines"
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{path.name}: class {node.name} is {size} lines"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_only_the_binding_layer_imports_cupy_or_opens_libcuda(path: Path) -> None:
    for node in ast.walk(_tree(path)):
        for name in _imported(node):
            top = name.lstrip(".").split(".")[0]
            if top in ("cupy", "cupy_backends", "cuda"):
                assert path.name == BINDING, f"{path.name} imports {name}"
        if isinstance(node, ast.Attribute) and node.attr in ("CDLL", "cdll", "LoadLibrary"):
            assert path.name == BINDING, f"{path.name} opens a library ({node.attr})"


def test_nothing_imports_cupy_or_torch_at_module_level() -> None:
    """Module-level imports only (function bodies may import torch for the compute
    stream); covers statements nested in module-level if/try blocks."""
    for path in MODULES:
        stack: list[ast.stmt] = list(_tree(path).body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            for name in _imported(node):
                assert name.lstrip(".").split(".")[0] not in ("cupy", "torch"), (
                    f"{path.name} imports {name} at module level")
            for field in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, field, []))


@pytest.mark.parametrize("name", NO_CUDA)
def test_the_seam_and_the_host_backend_never_reach_cuda(name: str) -> None:
    cuda = {p.stem for p in MODULES if p.stem.startswith("_cud")}
    assert not _sibling_imports(PACKAGE / name) & cuda


def test_no_import_cycle_among_backend_modules() -> None:
    graph = {p.stem: _sibling_imports(p) for p in MODULES}
    assert graph["_cuda_staged"] and "_cuda" not in graph["_cuda_staged"]

    def visit(node: str, path: tuple[str, ...]) -> None:
        for nxt in graph.get(node, ()):
            assert nxt not in path, f"import cycle: {' -> '.join((*path, nxt))}"
            visit(nxt, (*path, nxt))

    for start in graph:
        visit(start, (start,))


def test_cuda_backend_imports_without_a_driver_and_without_cupy() -> None:
    """Importing every CUDA module touches neither CuPy nor libcuda (both load at first
    use), so it works on a machine without a driver."""
    mods = [p.stem for p in MODULES if p.stem.startswith("_cud")]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module('kvasync._backends.' + m)\n"
        "from kvasync._backends import _cudart\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "assert _cudart._libcuda is None, 'libcuda opened'\n"
        "from kvasync._backends._cuda import CudaBackend\n"
        "for knob in ('URGENT_KERNEL', 'CONTENDED_DMA_BYTES', 'FAN_OUT', 'FAN_MIN_BYTES',\n"
        "             'FAN_JOIN_PIECES', 'EACH_RUNS', 'STAGED_MIN_BYTES', 'STAGING_BYTES',\n"
        "             'STAGING_BUFFERS'):\n"
        "    getattr(CudaBackend, knob)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
