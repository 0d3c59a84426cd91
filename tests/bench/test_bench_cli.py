"""`python -m kvasync.bench` on a machine without a GPU: it runs on the host backend, labels
the run as such, skips the GPU-only sections with the reason, and writes a valid bench.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvasync.bench.__main__ import main
from kvasync.bench.common import HOST_LABEL, KiB, Run
from kvasync.bench.context import cuda_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
#: runs the bench as `python -m kvasync.bench ARGS` with `import cupy` failing, as on a CPU
#: machine where CuPy is not installed at all
NO_CUPY = ("import runpy, sys; sys.modules['cupy'] = None; "
           "sys.argv = ['kvasync.bench', *sys.argv[1:]]; "
           "runpy.run_module('kvasync.bench', run_name='__main__', alter_sys=True)")
REQUIRED = ("section", "path", "direction", "page_bytes", "ratio", "gbps", "values", "extra")


def bench(cwd: Path, *args: str, no_cupy: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-c", NO_CUPY] if no_cupy else [sys.executable, "-m", "kvasync.bench"]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """One `--quick --out DIR` run without CuPy, shared by the tests below."""
    out = tmp_path_factory.mktemp("bench")
    res = bench(out, "--quick", "--out", str(out / "run"))
    return out / "run", res


@pytest.mark.timeout(600)
def test_quick_run_without_cupy_runs_on_the_host_backend(quick_run: tuple[Path, Any]) -> None:
    out, res = quick_run
    assert res.returncode == 0, res.stderr[-3000:]
    both = res.stdout + res.stderr
    assert "Traceback" not in both and "ModuleNotFoundError" not in both, both[-3000:]
    assert HOST_LABEL in res.stdout
    for section in ("pipeline", "interference", "cpu", "layerwise"):
        assert f"skipped {section}: needs a CUDA GPU (CuPy is not installed" in res.stdout
    assert (out / "bench.txt").read_text() == res.stdout


@pytest.mark.timeout(600)
def test_quick_run_writes_a_valid_bench_json(quick_run: tuple[Path, Any]) -> None:
    out, res = quick_run
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    meta = data["meta"]
    assert meta["backend"] == "host" and meta["format"] == 1
    assert meta["command"] == f"python -m kvasync.bench --quick --out {out}"
    assert meta["date"] and meta["device"].startswith("host CPU")
    assert meta["paths"][0] == "auto" and "memmove" in meta["paths"]
    # the remote section says it was skipped where NIXL is missing, as the GPU ones do
    from kvasync.bench.sections.remote import _nixl_missing

    gpu_only = {"pipeline", "interference", "cpu", "layerwise"}
    assert set(meta["skipped"]) == gpu_only | ({"remote"} if _nixl_missing() else set())
    if _nixl_missing():
        assert "skipped remote: NIXL is not available" in (out / "bench.txt").read_text()
    assert {"h2d", "d2h", "both"} <= set(meta["ceilings_gbps"])
    rows = data["rows"]
    for row in rows:
        assert all(k in row for k in REQUIRED), row
        assert isinstance(row["extra"], dict) and isinstance(row["values"], dict)
        assert row["path"] != "error", row
    sections = {r["section"] for r in rows}
    # (+ "remote" where NIXL is installed)
    assert sections - {"remote"} == {"bandwidth", "calibrate", "bidirectional", "latency",
                                     "hostcost", "priority", "rate"}
    cal = [r for r in rows if r["section"] == "calibrate"]
    assert {(r["direction"], r["path"]) for r in cal} == {
        (d, p) for d in ("d2h", "h2d") for p in ("memmove", "staged")}
    for d in ("d2h", "h2d"):  # one path chosen per direction, each row measured
        assert sum(r["extra"]["chosen"] for r in cal if r["direction"] == d) == 1
    assert all(r["ratio"] > 0 and 0 < r["extra"]["tflops_ratio"] < 3 for r in cal)
    assert all(r["extra"]["auto_before"] == "memmove" for r in cal)  # the host's fixed rule
    assert all(r["extra"]["incumbent"] == (r["path"] == "memmove") for r in cal)
    bw = {(r["direction"], r["page_bytes"], r["path"]): r for r in rows
          if r["section"] == "bandwidth"}
    for d in ("h2d", "d2h"):
        assert bw[(d, 0, "ceiling")]["ratio"] == 1.0
        for page in (4 * KiB, 64 * KiB):
            for path in meta["paths"]:  # every path the backend offers, in every row family
                r = bw[(d, page, path)]
                assert r["ratio"] > 0 and r["gbps"] > 0 and r["ceiling_gbps"] > 0
                assert r["ratio"] == pytest.approx(r["gbps"] / r["ceiling_gbps"], abs=0.01)
                assert r["extra"]["ran"] == ("memmove" if path == "auto" else path)
    for section in ("bidirectional", "latency", "hostcost", "priority", "rate"):
        assert {r["path"] for r in rows if r["section"] == section} >= set(meta["paths"])
    assert all(len(r["samples"]) >= 7 for r in rows  # a median of a few reps at least
               if r["section"] == "bidirectional" and r["path"] != "ceiling")
    inflight = [r for r in rows if r["section"] == "rate" and "inflight" in r["extra"]]
    assert inflight and inflight[0]["extra"]["lost"] == 0
    assert inflight[0]["extra"]["completed_in_order"] is True
    Run.from_json((out / "bench.json").read_text())  # the reader accepts what the run wrote


@pytest.mark.timeout(600)
def test_saved_run_re_renders_without_measuring(quick_run: tuple[Path, Any], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out, res = quick_run
    assert res.returncode == 0, res.stderr[-3000:]
    assert main(["--from-json", str(out / "bench.json"), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out == res.stdout
    assert (tmp_path / "bench.txt").read_text() == res.stdout


@pytest.mark.timeout(120)
def test_cuda_backend_without_a_gpu_is_a_clear_message(tmp_path: Path) -> None:
    res = bench(tmp_path, "--backend", "cuda", "--quick", "--out", str(tmp_path / "o"))
    assert res.returncode == 2
    assert "--backend cuda cannot run here: CuPy is not installed" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "o" / "bench.json").exists()


@pytest.mark.timeout(120)
def test_cupy_without_a_device_is_a_clear_message(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is present")
    res = bench(tmp_path, "--backend", "cuda", "--quick", no_cupy=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "cannot run here: CuPy sees no usable CUDA GPU" in res.stderr


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for args, words in ((["--sections", "bandwidth,nope"], "unknown section(s) ['nope']"),
                        (["--pages", "4X"], "--pages"), (["--reps", "0"], "--reps must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2
        assert words in capsys.readouterr().err


def test_too_small_a_transfer_for_the_layout_is_refused(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["--backend", "host", "--total-mib", "1", "--tensors", "64", "--pages", "64K",
                 "--sections", "bandwidth"]) == 2
    assert "cannot hold one block of 64 tensors x 64 KiB" in capsys.readouterr().err


def test_list_names_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    for name in ("bandwidth", "interference", "bidirectional", "latency", "cpu", "hostcost",
                 "priority", "layerwise", "rate"):
        assert name in text


def test_the_recorded_commit_says_when_the_tree_differs_from_it(tmp_path: Path) -> None:
    import shutil

    from kvasync.bench.__main__ import _git_commit

    if shutil.which("git") is None:
        pytest.skip("git is not installed")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c",
                               "user.email=t@t", *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    assert _git_commit(tmp_path) == head
    (tmp_path / "b.txt").write_text("untracked")  # untracked files do not count
    assert _git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two")
    assert _git_commit(tmp_path) == head + "-dirty"
    assert _git_commit(tmp_path / "nowhere") is None
