"""``python -m kvasync.bench``: what kvasync's copy paths achieve on this machine.

Runs the sections (``--sections``, default all; ``--list`` names them) in one process, so
every ratio is to ceilings measured in the same run, and prints one table per section and a
summary against the targets. ``--out DIR`` also writes ``bench.json`` (run metadata and every
row), ``bench.txt`` (what was printed) and the plots, replacing an earlier run's files there.
``--from-json FILE`` re-renders a saved run (no GPU needed, nothing measured).

Without a usable GPU (no CuPy, or CuPy sees no device) the run uses the host backend, says so
at the top, and skips, with the reason, the sections that only mean something on a GPU.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from .common import FORMAT, HOST_LABEL, MiB, Options, Row, Run, Section, parse_sizes
from .context import BenchUnavailable, Context
from .plot import PLOTS, plot
from .report import render
from .sections import SECTIONS

__all__ = ["main"]

OUTPUTS = ("bench.json", "bench.txt", *PLOTS)


class Progress:
    """One line per step on stderr: section i/n, its name, the step, seconds so far."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.index = 0
        self.t0 = time.perf_counter()

    def start(self, index: int) -> None:
        self.index = index
        self.step("start")

    def step(self, msg: str) -> None:
        print(f"[bench {self.index + 1}/{len(self.names)} {self.names[self.index]}] {msg} "
              f"({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvasync.bench",
        description="What kvasync's copy paths achieve on this machine, one table per section "
                    "and a summary against the targets.")
    ap.add_argument("--out", metavar="DIR", help="write bench.json, bench.txt and the plots here")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma separated (default: all): " + ", ".join(SECTIONS))
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: small transfers, one rep, fewer cases")
    ap.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto",
                    help="auto: CUDA where CuPy sees a GPU, else the host backend")
    ap.add_argument("--pages", help="page sizes of the bandwidth section (default "
                    "4K,16K,64K,256K,2M; quick: 4K,64K)")
    ap.add_argument("--total-mib", type=int, help="MiB per timed transfer (default 1024 on a "
                    "GPU, 128 on the host backend; quick: 32)")
    ap.add_argument("--reps", type=int, help="timed repetitions, median (default 3; quick: 1; "
                    "bidirectional: at least 7)")
    ap.add_argument("--tensors", type=int, help="KV tensors per layout (default 64; quick: 8)")
    ap.add_argument("--from-json", metavar="FILE",
                    help="re-render a saved bench.json (into --out, if given)")
    ap.add_argument("--list", action="store_true", help="list the sections and exit")
    return ap


def _options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Options:
    given = Options.quick_defaults() if args.quick else {}
    try:
        if args.pages:
            given["pages"] = parse_sizes(args.pages)
    except ValueError as exc:
        ap.error(f"--pages: {exc}")
    for flag, name, value, scale in (("--total-mib", "total_bytes", args.total_mib, MiB),
                                     ("--reps", "reps", args.reps, 1),
                                     ("--tensors", "tensors", args.tensors, 1)):
        if value is not None:
            if value < 1:
                ap.error(f"{flag} must be >= 1, got {value}")
            given[name] = value * scale
    return Options(backend=args.backend, quick=args.quick, **given)


def _unavailable(section: Section, ctx: Context) -> str | None:
    """Why `section` cannot run in this context (None: it can)."""
    if "gpu" in section.needs and not ctx.gpu:
        return f"needs a CUDA GPU ({ctx.no_gpu_reason})"
    if "torch" in section.needs and ctx.torch is None:
        return "needs torch with CUDA (its bf16 matmuls stand in for the model)"
    return section.missing() if section.missing is not None else None


def _git_commit(where: Path | None = None) -> str | None:
    """The commit of the checkout kvasync runs from, if it runs from one, with "-dirty"
    where tracked files differ from it (a copied tree whose git metadata is older)."""
    root = str(where or Path(__file__).parent)

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                                 timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head:
        return None
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _write(out: Path, run: Run, text: str) -> None:
    (out / "bench.json").write_text(run.to_json() + "\n")
    (out / "bench.txt").write_text(text + "\n")


def _rerender(src: str, out: Path | None) -> int:
    try:
        run = Run.from_json(Path(src).read_text())
    except (OSError, ValueError) as exc:
        print(f"kvasync.bench: cannot read {src}: {exc}", file=sys.stderr)
        return 2
    text = render(run)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.txt").write_text(text + "\n")
        _plots(run, out)
    return 0


def _plots(run: Run, out: Path) -> None:
    made = plot(run, out)
    if made:
        print(f"plots: {', '.join(str(p) for p in made)}", file=sys.stderr)
    else:
        print("no plots (matplotlib missing, or no plottable rows)", file=sys.stderr)


def _measure(names: list[str], ctx: Context, run: Run, out: Path | None,
             progress: Progress) -> None:
    """Run each section, keeping the rows so far (on disk too) if a later one fails."""
    for i, name in enumerate(names):
        section = SECTIONS[name]
        why = _unavailable(section, ctx)
        if why is not None:
            run.meta["skipped"][name] = why
            print(f"skipped {name}: {why}", file=sys.stderr)
            continue
        progress.start(i)
        t0 = time.perf_counter()
        try:
            run.rows += section.run(ctx)
        except Exception as exc:  # keep the other sections' results
            traceback.print_exc()
            run.rows.append(Row(name, "error", note=f"{type(exc).__name__}: {exc}"))
        run.meta["section_seconds"][name] = round(time.perf_counter() - t0, 1)
        run.meta.update(ctx.meta())
        if out is not None:
            _write(out, run, render(run))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (1 if a section failed, 2 if none could run)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    args = ap.parse_args(argv)
    if args.list:
        for s in SECTIONS.values():
            needs = f" [needs {', '.join(s.needs)}]" if s.needs else ""
            print(f"{s.name:14} {s.doc}{needs}")
        return 0
    out = Path(args.out) if args.out else None
    if args.from_json:
        return _rerender(args.from_json, out)
    names = list(dict.fromkeys(s.strip() for s in args.sections.split(",") if s.strip()))
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        ap.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    opts = _options(ap, args)
    progress = Progress(names)
    try:
        ctx = Context(opts, progress.step)
    except BenchUnavailable as exc:
        print(f"kvasync.bench: {exc}", file=sys.stderr)
        return 2
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:  # the next run writes over the last one, stale plots included
            (out / name).unlink(missing_ok=True)
    meta = {"format": FORMAT, "command": shlex.join(["python", "-m", "kvasync.bench", *argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git_commit": _git_commit(), "sections": names, "skipped": {},
            "section_seconds": {}}
    run = Run(meta, [])
    if not ctx.gpu:
        print(f"{HOST_LABEL}; {ctx.no_gpu_reason}", file=sys.stderr)
    try:
        _measure(names, ctx, run, out, progress)
        run.meta.update(ctx.meta())
    finally:
        ctx.close()
    text = render(run)
    print(text)
    if out is not None:
        _write(out, run, text)
        _plots(run, out)
    return 1 if any(r.path == "error" for r in run.rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
