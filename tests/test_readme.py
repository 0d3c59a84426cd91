"""The README's first commands are what CI runs, verbatim."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line.strip()]


def test_readme_starts_with_the_two_commands() -> None:
    cmds = readme_commands()
    assert len(cmds) == 2
    assert "examples/quickstart.py" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_commands_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd in readme_commands():
        assert cmd in ci, f"CI does not run the README command: {cmd}"
