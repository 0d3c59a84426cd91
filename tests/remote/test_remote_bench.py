"""The bench's remote section runs end to end where NIXL is installed (host backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_remote_section_writes_nixl_and_staged_rows(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(
        [sys.executable, "-m", "kvasync.bench", "--backend", "host", "--quick",
         "--sections", "remote", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    remote = [r for r in rows if r["section"] == "remote"]
    assert {(r["path"], r["direction"]) for r in remote} >= {
        ("nixl", "h2d"), ("nixl", "d2h"), ("staged", "h2d"), ("staged", "d2h")}
    assert all(r["gbps"] > 0 and r["ratio"] > 0 for r in remote)
