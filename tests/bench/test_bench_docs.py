"""What the docs and CI say about the bench matches the bench."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvasync.bench.__main__ import OUTPUTS, _parser
from kvasync.bench.sections import SECTIONS

ROOT = Path(__file__).resolve().parents[2]


def bench_command(env: dict[str, str]) -> list[str]:
    """The arguments .ci/gpu-run.sh passes to `python3 -m kvasync.bench`, with `env` set."""
    text = (ROOT / ".ci" / "gpu-run.sh").read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if "-m kvasync.bench" in x)
    line = line.split("-m kvasync.bench", 1)[1].split("2>&1")[0]

    def expand(m: re.Match[str]) -> str:
        name, op, word = m.group(1), m.group(2), m.group(3)
        if op == ":+":
            return word if name in env else ""
        return env.get(name, word)

    line = re.sub(r"\$\{(\w+)(:[-+])([^}]*)\}", expand, line)
    return shlex.split(re.sub(r"\$(\w+)", lambda m: {"OUT": "gpu-out", **env}[m.group(1)], line))


@pytest.mark.parametrize("env", [{}, {"BENCH_SECTIONS": "bandwidth,rate", "BENCH_REPS": "3"}])
def test_ci_calls_the_bench_with_options_it_accepts(env: dict[str, str]) -> None:
    args = _parser().parse_args(bench_command(env))
    assert args.out == "gpu-out/bench" and args.total_mib == 1024
    assert args.sections == env.get("BENCH_SECTIONS", ",".join(SECTIONS))
    assert set(args.sections.split(",")) <= set(SECTIONS)
    assert args.reps == int(env.get("BENCH_REPS", "2"))


def test_the_benchmarks_folder_holds_one_run_and_its_command() -> None:
    folder = ROOT / "docs" / "benchmarks"
    assert {p.name for p in folder.iterdir()} <= {"README.md", *OUTPUTS}
    text = (folder / "README.md").read_text()
    assert "python -m kvasync.bench --out docs/benchmarks" in text
    for name in OUTPUTS:
        assert f"`{name}`" in text


def test_the_performance_page_lists_the_sections_and_no_history() -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", text, re.M)
    assert listed == list(SECTIONS)
    for stale in ("session", "latest run", "Latest", "Final run", "issue"):
        assert stale not in text, stale


def test_readme_module_table_is_one_table_of_real_paths() -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("| module | holds |")
    table = text[start:].split("\n\n", 1)[0].splitlines()
    paths = [re.match(r"\| `([^`]+)` \|", row) for row in table[2:]]
    assert all(paths), table
    names = [m.group(1) for m in paths if m]
    assert "kvasync/bench/" in names and "kvasync/_region.py" in names
    for name in names:
        assert (ROOT / name).exists(), name
