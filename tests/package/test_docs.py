"""The API page is generated from the source, so it cannot drift: it names every export,
and the built page shows keyword-only arguments as such."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvasync

ROOT = Path(__file__).resolve().parents[2]


def directives() -> list[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    return re.findall(r"^::: ([\w.]+)$", text, flags=re.M)


def test_api_page_generates_every_exported_name() -> None:
    names = {d.removeprefix("kvasync.") for d in directives() if d.count(".") == 1}
    assert names == set(kvasync.__all__)
    assert "kvasync.compat.vllm" in directives()


def test_mkdocs_uses_mkdocstrings_and_the_docs_extra_installs_it() -> None:
    assert "- mkdocstrings:" in (ROOT / "mkdocs.yml").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    docs = next(line for line in pyproject.splitlines() if line.startswith("docs = "))
    assert "mkdocstrings[python]" in docs


@pytest.mark.timeout(300)
def test_the_built_api_page_shows_every_name_and_keyword_only_ids(tmp_path: Path) -> None:
    """Builds the site as CI does (`mkdocs build --strict`: any warning fails), into tmp."""
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    page = (tmp_path / "site" / "api" / "index.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    for name in kvasync.__all__:
        assert re.search(rf"\b{name}\b", text), f"{name} is missing from the API page"
    for method, first in (("store", "gpu_blocks"), ("load", "cpu_chunks"),
                          ("load_layerwise", "cpu_chunks")):
        assert re.search(rf"\b{method}\(\s*\*,\s*{first}:", text), f"{method} is not keyword-only"
    assert re.search(r"add_done_callback\(\s*fn: [^)]*\*,\s*context", text)
