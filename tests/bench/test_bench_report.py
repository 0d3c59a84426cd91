"""Rendering a saved run (no GPU, nothing measured): the tables, the target verdicts, plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvasync.bench.__main__ import main
from kvasync.bench.common import (
    HOST_LABEL,
    KiB,
    MiB,
    Row,
    Run,
    bandwidth_row,
    fmt_size,
    parse_size,
    pct_us,
)
from kvasync.bench.report import render, summary

CEIL = {"h2d": 55.0, "d2h": 55.0, "both": 100.0}


def gpu_run() -> Run:
    """A run as the H200 would save it: every section, a 'staged' path beside the others."""
    paths = ["auto", "kernel", "dma", "staged"]
    rows: list[Row] = []
    for d in ("h2d", "d2h"):
        rows.append(Row("bandwidth", "ceiling", d, 0, 1.0, CEIL[d], CEIL[d]))
        for page in (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB):
            for path, gbps in zip(paths, (53.9, 46.0, 5.0, 54.0)):
                if path == "auto" and d == "d2h" and page == 4 * KiB:
                    gbps = 46.2  # one miss: d2h auto at 4 KiB is 0.84 of the ceiling
                rows.append(bandwidth_row("bandwidth", path, d, page, [1.0 / gbps], 10**9,
                                          CEIL[d], 1.0 / (gbps + 1), "", {"ran": "staged"}))
    for mode, ratio in (("as-run", 0.898), ("held", 0.955)):
        rows.append(Row("pipeline", "staged", "h2d", 4 * KiB, ratio, ratio * 55, 55.0,
                        {"wall_ratio": 0.853} if mode == "as-run" else {},
                        extra={"mode": mode, "ran": "staged"}))
    rows.append(Row("pipeline", "ref-rows", "h2d", 4 * KiB, 0.972, 53.5, 55.0,
                    extra={"mode": "held", "ran": "rows"}))
    rows.append(Row("interference", "matmul-alone", values={"tflops": 640.0}))
    for d, (mm, link) in (("h2d", (0.99, 0.90)), ("d2h", (0.44, 0.90))):
        for page in (4 * KiB, 16 * KiB):
            rows.append(Row("interference", "auto", d, page, link, link * 55, 55.0,
                            {"tflops": 640 * mm}, extra={"tflops_ratio": mm, "ran": "kernel"}))
    rows.append(Row("bidirectional", "ceiling", "both", 0, 1.0, 100.0, 100.0))
    rows += [Row("bidirectional", "auto", "both", 64 * KiB, 0.68, 68.0, 100.0,
                 {"store_device_gbps": 40.0, "load_device_gbps": 30.0}),
             Row("bidirectional", "auto", "both", 2 * MiB, 0.94, 94.0, 100.0)]
    rows += [Row("latency", "auto", "h2d", 4 * KiB, values={"p50_us": 64.0, "p99_us": 116.0},
                 samples=[64e-6, 70e-6, 116e-6], extra={"completion": "hybrid"}),
             Row("latency", "ref-sync", "h2d", 4 * KiB, values={"p50_us": 8.9, "p99_us": 17.6},
                 samples=[8.9e-6, 17.6e-6], extra={"reference": True})]
    rows += [Row("cpu", p, "h2d", 2 * MiB, 0.95, 52.0, 55.0,
                 {"cpu_frac": frac, "seconds": 0.02}, extra={"completion": c})
             for p, c, frac in (("auto", "hybrid", 0.075), ("auto", "thread", 0.12),
                                ("dma", "hybrid", 0.5))]
    for n, us in ((64, 80.0), (512, 210.0)):
        for path in ("auto", "staged"):
            rows.append(Row("hostcost", path, "d2h", 16 * KiB,
                            values={"p50_us": us, "p99_us": 2 * us, "blocks": n,
                                    "tensors": 128}))
    for urgent, p50 in ((False, 8600.0), (True, 310.0)):
        rows.append(Row("priority", "auto", "h2d", 256 * KiB,
                        values={"p50_us": p50, "max_us": p50 * 1.2, "big_ms": 11.5},
                        extra={"urgent": urgent, "big_bytes": 512 * MiB, "big_pages": "random"}))
    for mode, total in (("serial", 46.7), ("layerwise", 33.3)):
        rows.append(Row("layerwise", "auto", "h2d", 32 * KiB,
                        values={"total_ms": total, "first_layer_ms": 3.2, "load_ms": 21.0,
                                "compute_ms": 22.0, "call_ms": 3.1}, extra={"mode": mode}))
    rows += [Row("rate", "auto", "h2d", 64 * KiB, values={"rate_per_s": 16600.0}),
             Row("rate", "auto", "h2d", 64 * KiB, values={"rate_per_s": 8800.0, "seconds": 1.1},
                 extra={"inflight": 10000, "resolved": 10000, "lost": 0,
                        "completed_in_order": True})]
    meta = {"format": 1, "backend": "cuda", "device": "NVIDIA H200", "date": "2026-12-04",
            "command": "python -m kvasync.bench --out docs/benchmarks", "paths": paths,
            "tensors": 64, "total_bytes": 1 << 30, "reps": 3, "ceilings_gbps": CEIL,
            "skipped": {}}
    return Run(meta, rows)


def verdicts(run: Run) -> dict[str, tuple[str, str]]:
    return {t: (m, ok) for t, m, ok in summary(run)}


def test_targets_are_judged_from_the_rows() -> None:
    v = verdicts(gpu_run())
    assert v["auto alone >= 0.97 of the ceiling, h2d"] == (
        "4 KiB 0.98, 16 KiB 0.98, 64 KiB 0.98, 256 KiB 0.98, 2 MiB 0.98", "yes")
    assert v["auto alone >= 0.97 of the ceiling, d2h"][0].startswith("4 KiB 0.84, 16 KiB 0.98")
    assert v["auto alone >= 0.97 of the ceiling, d2h"][1] == "NO"
    # the copy engines' own rate on the same rows is shown under the target, not judged
    assert v["(bound) copy engines alone on those host rows, event time, h2d"] == (
        "4 KiB 0.97", "-")
    assert not any(t.endswith("event time, d2h") for t in v)  # no such row in this run
    mm = "beside a matmul, auto keeps >= 97% of it at >= 85% of the link"
    assert v[f"{mm}, 4 KiB h2d"] == ("matmul 99%, link 90%", "yes")
    assert v[f"{mm}, 16 KiB d2h"] == ("matmul 44%, link 90%", "NO")
    both = "store + load at once, auto >= 0.90 of the bidirectional ceiling"
    assert v[f"{both}, 64 KiB"] == ("0.68", "NO") and v[f"{both}, 2 MiB"] == ("0.94", "yes")
    assert v["store() of 64 blocks x 128 tensors, staged, p50 <= 100 us"] == ("80.0 us", "yes")
    assert v["store() of 64 blocks x 128 tensors, auto, p50 <= 30 us"] == ("80.0 us", "NO")
    assert v["store() cost grows sub-linearly, 64 -> 512 blocks, auto"][1] == "yes"
    assert v["4 KiB await round trip p50 <= 12 us, p99 <= 40 us"] == ("64.0 / 116.0 us", "NO")
    cpu = "CPU <= 10% of a core awaiting a ~20 ms load"
    assert v[f"{cpu}, hybrid"] == ("7.5%", "yes") and v[f"{cpu}, thread"][1] == "NO"
    assert v[">= 20,000 awaited 64 KiB loads/s from 64 tasks, auto"] == ("16,600/s", "NO")
    assert v["10,000 loads in flight: all resolved, in order"][1] == "yes"
    urgent = "urgent small load behind 512 MiB (random 256 KiB pages) < 1 ms"
    assert v[urgent] == ("p50 0.310, max 0.372 ms", "yes")
    assert v["layer-wise load overlaps the per-layer compute, auto"][1] == "yes"


def test_render_shows_every_section_and_path(tmp_path: Path) -> None:
    run = gpu_run()
    text = render(run)
    assert "kvasync bench on NVIDIA H200 (cuda backend), 2026-12-04" in text
    assert "command: python -m kvasync.bench --out docs/benchmarks" in text
    for name in ("bandwidth", "pipeline", "interference", "bidirectional", "latency", "cpu",
                 "hostcost", "priority", "layerwise", "rate", "targets"):
        assert f"== {name} ==" in text
    # one line per (direction, page, path): wall and event time as run, event time held
    assert re.search(r"^h2d +4 KiB +staged +staged +0\.853 +0\.898 +0\.955$", text, re.M)
    assert re.search(r"^h2d +4 KiB +ref-rows +rows +- +- +0\.972$", text, re.M)
    header = next(line for line in text.splitlines() if line.startswith("dir  page"))
    assert header.split()[2:6] == ["auto", "kernel", "dma", "staged"]
    assert re.search(r"^d2h +4 KiB +46\.2 \(0\.84\) +46\.0 \(0\.84\)", text, re.M)
    assert "auto: layer-wise x1.40 faster than serial" in text
    assert HOST_LABEL not in text


def test_host_runs_are_labelled_and_not_judged() -> None:
    run = gpu_run()
    run.meta["backend"] = "host"
    text = render(run)
    assert HOST_LABEL in text
    verdict = {t: ok for t, _, ok in summary(run)}
    assert {ok for t, ok in verdict.items() if not t.startswith("(bound)")} == {"n/a"}
    assert {ok for t, ok in verdict.items() if t.startswith("(bound)")} == {"-"}


def test_from_json_writes_text_and_plots(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    src = tmp_path / "bench.json"
    src.write_text(gpu_run().to_json())
    out = tmp_path / "out"
    assert main(["--from-json", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "bench.txt").read_text() == printed == render(gpu_run()) + "\n"
    for name in ("bandwidth.png", "interference.png", "latency_cdf.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_round_trip_keeps_every_field() -> None:
    run = gpu_run()
    again = Run.from_json(run.to_json())
    assert again.meta == json.loads(json.dumps(run.meta))
    assert again.rows == run.rows


def test_unreadable_json_is_a_clear_message(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"section": "bandwidth", "path": "auto"}]))
    assert main(["--from-json", str(old)]) == 2
    assert "not a kvasync.bench bench.json" in capsys.readouterr().err
    assert main(["--from-json", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"meta": {"format": 99}, "rows": []}))
    assert main(["--from-json", str(newer)]) == 2
    assert "newer than this" in capsys.readouterr().err


def test_unknown_row_keys_are_kept_in_extra() -> None:
    row = Row.from_dict({"section": "s", "path": "p", "later_field": 3})
    assert row.extra == {"later_field": 3}
    with pytest.raises(ValueError, match="needs 'section' and 'path'"):
        Row.from_dict({"path": "p"})


def test_units() -> None:
    assert [parse_size(s) for s in ("4K", "4KiB", "2M", "4096", "1G")] == [
        4096, 4096, 2 * MiB, 4096, 1 << 30]
    with pytest.raises(ValueError):
        parse_size("4X")
    assert [fmt_size(n) for n in (4096, 2 * MiB, 100, 1 << 30)] == [
        "4 KiB", "2 MiB", "100 B", "1 GiB"]
    assert pct_us([1e-6, 2e-6, 3e-6, 4e-6, 100e-6], 50) == 3.0
    assert pct_us([1e-6, 2e-6, 3e-6, 4e-6, 100e-6], 99) == 100.0
