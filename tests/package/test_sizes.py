"""No module of kvasync over `MAX_MODULE_LINES` lines, no class over `MAX_CLASS_LINES`.

Sizes are read from the source with `ast` (a class spans `end_lineno - lineno + 1` lines,
from its `class` line, docstring included). A module or class that must stay longer for now is named
in `KNOWN_LONG` with the reason; each entry must still be too long (else remove it), so the
list only shrinks. `python tests/package/test_sizes.py` prints the longest of each.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvasync"
#: split a longer module into a new private module
MAX_MODULE_LINES = 400
#: split a longer class into cohesive parts in their own modules
MAX_CLASS_LINES = 250
#: "module" or "module:Class" -> why it is long for now
KNOWN_LONG: dict[str, str] = {
}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def module_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def class_lines(path: Path) -> dict[str, int]:
    """Every class of the module (nested ones as `Outer.Inner`) -> its line span."""
    spans: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                assert child.end_lineno is not None
                spans[name] = child.end_lineno - child.lineno + 1
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(), str(path)), "")
    return spans


MODULES = _modules()
CLASSES = {f"{m}:{c}": n for m, p in MODULES.items() for c, n in class_lines(p).items()}


def _check(key: str, size: int, limit: int) -> None:
    if key in KNOWN_LONG:
        assert size > limit, f"{key} has {size} lines now: remove it from KNOWN_LONG"
        return
    assert size <= limit, f"{key} has {size} lines (at most {limit}): split it"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_length(module: str) -> None:
    _check(module, module_lines(MODULES[module]), MAX_MODULE_LINES)


@pytest.mark.parametrize("cls", sorted(c for c, n in CLASSES.items() if n > 100))
def test_class_length(cls: str) -> None:
    """Classes over 100 lines are listed one by one (shorter ones cannot fail)."""
    _check(cls, CLASSES[cls], MAX_CLASS_LINES)


def test_every_known_long_entry_exists() -> None:
    missing = [k for k in KNOWN_LONG if k not in MODULES and k not in CLASSES]
    assert not missing, f"KNOWN_LONG names what is not there: {missing}"


def test_the_sizes_are_read_from_the_source(tmp_path: Path) -> None:
    """The measure itself: a class spans from its `class` line to its last line; a nested
    class is counted on its own too."""
    src = tmp_path / "m.py"
    src.write_text("x = 1\n\nclass A:\n    class B:\n        y = 2\n\n    z = 3\n")
    assert module_lines(src) == 7
    assert class_lines(src) == {"A": 5, "A.B": 2}
    _check("m", 7, 7)
    with pytest.raises(AssertionError, match="at most 6"):
        _check("m", 7, 6)


def test_the_package_is_measured() -> None:
    assert "kvasync._offloader" in MODULES and "kvasync._offloader:Offloader" in CLASSES
    assert CLASSES["kvasync._offloader:Offloader"] > 100  # it is measured, not skipped


if __name__ == "__main__":
    for label, sizes in (("modules", {m: module_lines(p) for m, p in MODULES.items()}),
                         ("classes", CLASSES)):
        top = sorted(((n, k) for k, n in sizes.items()), reverse=True)[:8]
        print(f"longest {label}:", ", ".join(f"{k} {n}" for n, k in top))
