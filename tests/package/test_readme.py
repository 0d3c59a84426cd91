"""The README's commands are what CI runs, verbatim; the defaults they rely on hold."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: CI appends this to a README command: `set -e` ignores a failure inside an && list
STOP = " || exit 1"


def bash_blocks() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [[line for line in b.strip().splitlines() if line.strip()] for b in blocks]


def readme_commands() -> list[str]:
    return bash_blocks()[0]


def pyproject() -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data


def ci_lines() -> list[str]:
    return (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_starts_with_the_two_commands() -> None:
    cmds = readme_commands()
    assert len(cmds) == 2
    assert "examples/quickstart.py" in cmds[0]
    assert "pytest" in cmds[1]


def test_the_test_command_installs_only_what_the_tests_need() -> None:
    """No torch (from the package index it is the CUDA build, gigabytes), no CUDA extra."""
    cmd = readme_commands()[1]
    assert "torch" not in cmd and "cuda" not in cmd and "[test]" in cmd
    test_deps = pyproject()["project"]["optional-dependencies"]["test"]
    assert not [d for d in test_deps if d.startswith(("torch", "cupy"))]


def test_ci_runs_every_readme_command_verbatim_and_in_order() -> None:
    ci = ci_lines()
    at = []
    for block in bash_blocks():
        for cmd in block:
            hits = [i for i, line in enumerate(ci) if line in (cmd, cmd + STOP)]
            assert hits, f"CI does not run the README command: {cmd}"
            at.append(hits[0])
    assert at == sorted(at), "CI runs the README's commands in another order"


def test_ci_builds_the_docs_with_exactly_the_documented_command() -> None:
    """`mkdocs build --strict -q` passed where the documented command failed: -q hides the
    warnings that --strict counts. Every mkdocs call in CI is the README's, unchanged."""
    docs = [cmd for block in bash_blocks() for cmd in block if "mkdocs" in cmd]
    assert docs == ['.venv/bin/pip install -e ".[docs]" && .venv/bin/mkdocs build --strict']
    calls = [line for line in ci_lines() if "mkdocs" in line and not line.startswith("#")]
    assert calls == [docs[0] + STOP]


def test_readme_says_how_to_open_and_how_to_run_the_notebook() -> None:
    text = (ROOT / "README.md").read_text()
    assert "jupyter lab examples/notebook.ipynb" in text
    headless = [cmd for block in bash_blocks() for cmd in block if "jupyter execute" in cmd]
    assert headless == [
        '.venv/bin/pip install -e ".[examples]" && .venv/bin/jupyter execute '
        "examples/notebook.ipynb"]
    extra = pyproject()["project"]["optional-dependencies"]["examples"]
    assert any(d.startswith("nbclient") for d in extra)  # provides `jupyter execute`
    assert any(d.startswith("ipykernel") for d in extra)  # the python3 kernel


def test_the_default_run_deselects_the_soak_and_ci_runs_it_on_its_own() -> None:
    opts = pyproject()["tool"]["pytest"]["ini_options"]
    assert '-m "not slow"' in opts["addopts"]
    assert any(m.startswith("slow:") for m in opts["markers"])
    assert ".venv/bin/python -m pytest -q -m slow" in ci_lines()
    soak = (ROOT / "tests" / "offloader" / "test_soak.py").read_text()
    assert "@pytest.mark.slow" in soak


def test_ci_runs_the_torch_tests_with_torch_installed() -> None:
    ci = ci_lines()
    install = next(i for i, line in enumerate(ci) if '"torch==2.13.0"' in line)
    assert any("KVASYNC_REQUIRE_TORCH=1" in line and "pytest" in line for line in ci[install:])
