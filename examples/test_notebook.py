"""Runs examples/notebook.ipynb headless, top to bottom, on the host backend.

A notebook nobody executes rots silently; this keeps it working. Needs the examples extra
(nbclient, ipykernel, nbformat, matplotlib, tqdm); skipped without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("nbclient")  # the examples extra
pytest.importorskip("ipykernel")
pytest.importorskip("nbformat")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).with_name("notebook.ipynb")


def test_notebook_executes_headless_on_the_host_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASYNC_BACKEND", "host")  # the kernel inherits this environment
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # silences jupyter_core's deprecation
    nb = nbformat.read(NOTEBOOK, as_version=4)  # type: ignore[no-untyped-call]
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook with its outputs cleared"
    )

    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError, with the cell's traceback, if a cell fails

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "backend host" in text
    assert "offload: 100%" in text and "restore: 100%" in text  # both progress bars finished
    assert "layer-wise load: 100%" in text  # the bar driven by progress()
    assert "8 layers landed, 64 MiB" in text
    assert "d2h normal: 33 transfers, 65 MiB, by path {'memmove': 33}, 0 failed" in text
    assert "h2d normal:" in text and "queue wait p50" in text  # off.stats()
    assert "verified: every restored block equals the original" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not drawn"
