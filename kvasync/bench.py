"""``python -m kvasync.bench``: what each copy path moves per second, on this GPU.

Per page size and direction it times each of kvasync's copy paths (``kernel``, ``dma``,
``auto``) on scattered random block ids through the public `Offloader` API, plus vLLM's
shipped policy re-created with kvasync's own paths (stores: DMA; loads: a 12-CTA kernel
below 28 KiB, DMA above), and the ceiling: one contiguous pinned ``cudaMemcpyAsync`` of
the same bytes, measured in the same run. Bandwidth is bytes over wall time from the first
host call (`store()`/`load()`) until the transfer is reported done, so host-side
submission cost counts: that is what an ``await`` sees.

Output: a table on stdout, and under ``--out``: ``bench.json`` (a list of rows, each with
``section``, ``path``, ``direction`` ("h2d"/"d2h"), ``page_bytes``, ``gbps``,
``ceiling_gbps``, ``ratio``...), ``calibration.json`` (what ``auto`` measured) and
``bench.png`` (needs matplotlib; skipped without it).

Sections are functions registered in `SECTIONS` (``bandwidth``, ``grid``, ``raw``); the
serving sections of `_bench_serving` (``latency``, ``hostcost``, ``smallrate``, ``overlap``,
``interference``, ``priority``, ``layerwise``) plug in the same way and add a summary table,
``latency_cdf.png`` and ``interference.png``. ``--from-json bench.json`` redraws the tables
and plots of an earlier run without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._bench_serving import SERVING_SECTIONS, fmt_size, plot_serving, serving_summary

__all__ = ["SECTIONS", "Context", "Row", "main"]

KiB = 1024
MiB = 1024 * KiB
#: vLLM's Triton-load threshold and program count (vllm/v1/kv_offload/cpu, notes 2.4)
VLLM_THRESHOLD = 28 * KiB
VLLM_CTAS = 12


@dataclass
class Row:
    """One measurement."""

    section: str
    path: str
    direction: str
    page_bytes: int
    gbps: float
    ceiling_gbps: float
    ratio: float
    bytes: int
    seconds: float
    blocks: int
    reps: int
    note: str = ""
    samples: list[float] = field(default_factory=list)
    #: GB/s over device time (TransferResult.seconds / event time): the copy alone
    gpu_gbps: float = 0.0
    #: latency percentiles (microseconds), where the section measures latency
    p50_us: float = 0.0
    p99_us: float = 0.0
    #: CPU time / wall time of the process while waiting (1.0 = one core busy)
    cpu_frac: float = 0.0
    #: TFLOP/s of a concurrent matmul (interference section)
    tflops: float = 0.0
    #: events per second (transfers/s)
    rate: float = 0.0
    #: anything else a section reports (JSON-serialisable)
    extra: dict[str, Any] = field(default_factory=dict)


def parse_size(text: str) -> int:
    """'4K' / '2M' / '4096' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": 1024 * MiB}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


class Context:
    """Shared state of one run: the GPU pool, one Offloader per page size, the ceilings."""

    def __init__(self, args: argparse.Namespace) -> None:
        import cupy

        self.args = args
        self.cp = cupy
        self.total = int(args.total_mib) * MiB
        self.pool_bytes = 2 * self.total
        self.reps = int(args.reps)
        try:
            import torch

            self.torch: Any = torch
            self.pool: Any = torch.empty(self.pool_bytes, dtype=torch.uint8, device="cuda")
            self.pool.random_(0, 256)
        except ImportError:
            self.torch = None
            self.pool = cupy.random.randint(0, 256, self.pool_bytes, dtype=cupy.uint8)
        self._offloaders: dict[int, Any] = {}
        self._extra_offloaders: list[Any] = []
        self.ceilings: dict[str, float] = {}
        self.rng = np.random.default_rng(0)
        #: progress callback of the running section (`main` installs a stderr indicator)
        self.progress: Callable[[str], None] = lambda msg: None

    @property
    def pool_ptr(self) -> int:
        """Device address of the GPU pool."""
        return int(self.pool.data_ptr()) if self.torch is not None else int(self.pool.data.ptr)

    def make_offloader(self, tensors: list[Any], num_cpu_chunks: int, **kwargs: Any) -> Any:
        """An Offloader over `tensors` (one group; CUDA unless `backend=` says otherwise),
        closed with the context."""
        import kvasync as kv

        kwargs.setdefault("backend", "cuda")
        off = kv.Offloader(kv.KVCacheLayout.from_tensors(tensors), num_cpu_chunks, **kwargs)
        self._extra_offloaders.append(off)
        return off

    def row(self, section: str, path: str, direction: str = "", page_bytes: int = 0,
            **fields: Any) -> Row:
        """A Row with the bandwidth fields defaulted (for sections that report other things)."""
        base: dict[str, Any] = {"gbps": 0.0, "ceiling_gbps": 0.0, "ratio": 0.0, "bytes": 0,
                                "seconds": 0.0, "blocks": 0, "reps": 0}
        base.update(fields)
        return Row(section, path, direction, page_bytes, **base)

    def offloader(self, page: int) -> Any:
        """An Offloader over the pool viewed as blocks of `page` bytes (cached per page)."""
        import kvasync as kv

        off = self._offloaders.get(page)
        if off is None:
            n = self.pool_bytes // page
            view = self.pool[: n * page].view(n, page)
            off = kv.Offloader(kv.KVCacheLayout.from_tensors([view]), n, backend="cuda")
            if not off.host_pinned:
                print("WARNING: host memory is not pinned; numbers are pageable DMA",
                      file=sys.stderr)
            self._offloaders[page] = off
        return off

    def ids(self, page: int, nbytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Random distinct GPU block ids and CPU chunk ids moving `nbytes` (default total),
        as int64 arrays (what an engine passes; a Python list costs ~0.3 us per id)."""
        n = self.pool_bytes // page
        k = max(1, (nbytes or self.total) // page)
        return self.rng.permutation(n)[:k], self.rng.permutation(n)[:k]

    def time_transfer(self, page: int, direction: str, path: str, nbytes: int | None = None,
                      grid: int | None = None) -> tuple[list[float], int, str, float]:
        """Wall seconds of `reps` transfers after one warm-up; bytes; which path ran;
        median device seconds."""
        off = self.offloader(page)
        backend = off.backend
        g, c = self.ids(page, nbytes)
        old_grid = backend.grid
        if grid is not None:
            backend.grid = grid
        before = dict(backend.counts)
        samples: list[float] = []
        gpu: list[float] = []
        moved = 0
        try:
            for rep in range(self.reps + 1):
                t0 = time.perf_counter()
                t = (off.store(gpu_blocks=g, cpu_chunks=c, path=path) if direction == "d2h"
                     else off.load(cpu_chunks=c, gpu_blocks=g, path=path))
                r = t.wait(120)
                dt = time.perf_counter() - t0
                moved = r.bytes
                if rep:
                    samples.append(dt)
                    gpu.append(r.seconds)
        finally:
            backend.grid = old_grid
        ran = [p for p in ("kernel", "dma") if backend.counts[p] > before.get(p, 0)]
        return samples, moved, "+".join(ran), statistics.median(gpu)

    def ceiling(self, direction: str) -> float:
        """GB/s of one contiguous pinned cudaMemcpyAsync of `total` bytes (wall time)."""
        if direction in self.ceilings:
            return self.ceilings[direction]
        cp = self.cp
        off = self.offloader(2 * MiB)
        host = off.cpu_tensors[0]
        hptr = int(host.ctypes.data)
        dptr = int(self.pool.data_ptr()) if self.torch is not None else int(self.pool.data.ptr)
        src, dst = (hptr, dptr) if direction == "h2d" else (dptr, hptr)
        stream = cp.cuda.Stream(non_blocking=True)
        times = []
        for rep in range(self.reps + 1):
            t0 = time.perf_counter()
            cp.cuda.runtime.memcpyAsync(dst, src, self.total, 4, stream.ptr)
            stream.synchronize()
            if rep:
                times.append(time.perf_counter() - t0)
        gbps = self.total / statistics.median(times) / 1e9
        self.ceilings[direction] = gbps
        return gbps

    def close(self) -> None:
        for off in [*self._offloaders.values(), *self._extra_offloaders]:
            off.close()
        self._offloaders.clear()
        self._extra_offloaders.clear()


def _row(ctx: Context, section: str, path: str, direction: str, page: int,
         samples: list[float], moved: int, note: str = "", gpu_seconds: float = 0.0) -> Row:
    sec = statistics.median(samples)
    gbps = moved / sec / 1e9
    ceil = ctx.ceiling(direction)
    return Row(section, path, direction, page, round(gbps, 2), round(ceil, 2),
               round(gbps / ceil, 3), moved, sec, moved // page, len(samples), note,
               [round(s, 6) for s in samples],
               round(moved / gpu_seconds / 1e9, 2) if gpu_seconds > 0 else 0.0)


# -- sections ----------------------------------------------------------------------------------
def section_bandwidth(ctx: Context) -> list[Row]:
    """Scattered random blocks, ~`total` bytes per transfer, every path and vLLM's policy."""
    rows: list[Row] = []
    for direction in ("h2d", "d2h"):
        ceil = ctx.ceiling(direction)
        rows.append(Row("bandwidth", "ceiling", direction, 0, round(ceil, 2), round(ceil, 2),
                        1.0, ctx.total, ctx.total / ceil / 1e9, 1, ctx.reps,
                        "one contiguous pinned cudaMemcpyAsync"))
    for page in ctx.args.pages:
        for direction in ("h2d", "d2h"):
            for path in ("kernel", "dma", "auto"):
                samples, moved, ran, gs = ctx.time_transfer(page, direction, path)
                rows.append(_row(ctx, "bandwidth", path, direction, page, samples, moved,
                                 f"ran {ran}", gs))
            if direction == "d2h" or page >= VLLM_THRESHOLD:
                samples, moved, ran, gs = ctx.time_transfer(page, direction, "dma")
                note = "DMA"
            else:
                samples, moved, ran, gs = ctx.time_transfer(page, direction, "kernel",
                                                            grid=VLLM_CTAS)
                note = f"{VLLM_CTAS}-CTA kernel"
            rows.append(_row(ctx, "bandwidth", "vllm-policy", direction, page, samples, moved,
                             note, gs))
    return rows


def section_grid(ctx: Context) -> list[Row]:
    """Kernel CTA count sweep (how the default grid was chosen), smaller transfers."""
    rows: list[Row] = []
    nbytes = min(ctx.total, 256 * MiB)
    for page in (4 * KiB, 64 * KiB):
        for direction in ("h2d", "d2h"):
            for grid in (4, 8, 12, 16, 24, 32, 64, 132):
                samples, moved, _, gs = ctx.time_transfer(page, direction, "kernel", nbytes,
                                                          grid)
                rows.append(_row(ctx, "grid", f"kernel@{grid}", direction, page, samples,
                                 moved, f"{grid} CTAs x 512 threads", gs))
    return rows


def section_raw(ctx: Context) -> list[Row]:
    """The copy paths on raw flat descriptors, no Offloader: device-time GB/s (events)
    and wall GB/s, blocking-sync event vs spinning stream sync; isolates the GPU side."""
    from kvasync._backends._cuda import CudaEvent, CudaStream
    from kvasync._descriptors import TransferPlan

    rows: list[Row] = []
    cp = ctx.cp
    for page in ctx.args.pages:
        off = ctx.offloader(page)
        backend = off.backend
        host = off.cpu_tensors[0]
        hbase = int(host.ctypes.data)
        dbase = int(ctx.pool.data_ptr()) if ctx.torch is not None else int(ctx.pool.data.ptr)
        g, c = ctx.ids(page)
        gp = g.astype(np.uint64) * np.uint64(page) + np.uint64(dbase)
        hp = c.astype(np.uint64) * np.uint64(page) + np.uint64(hbase)
        sizes = np.full(len(g), page, np.uint64)
        for direction in ("h2d", "d2h"):
            src, dst = (hp, gp) if direction == "h2d" else (gp, hp)
            for path, grid, sync in (("kernel", 16, "event"), ("kernel", 16, "spin"),
                                     ("kernel", 32, "event"), ("kernel", 64, "event"),
                                     ("dma", 0, "event"), ("dma", 0, "spin")):
                stream = backend.new_stream()
                assert isinstance(stream, CudaStream)
                a, b = backend.new_event(), backend.new_event()
                assert isinstance(a, CudaEvent) and isinstance(b, CudaEvent)
                old = backend.grid
                backend.grid = grid or old
                walls, gpus = [], []
                for rep in range(ctx.reps + 1):
                    t0 = time.perf_counter()
                    plan = TransferPlan.raw(None, src, dst, sizes)  # type: ignore[arg-type]
                    stream.record(a)
                    backend.enqueue_copy(stream, plan, direction, path)  # type: ignore[arg-type]
                    stream.record(b)
                    if sync == "spin":
                        cp.cuda.runtime.streamSynchronize(stream.ptr)
                    else:
                        b.synchronize()
                    if rep:
                        walls.append(time.perf_counter() - t0)
                        gpus.append(a.elapsed_seconds(b))
                backend.grid = old
                moved = int(sizes.sum())
                name = f"raw-{path}" + (f"@{grid}" if grid else "") + f"-{sync}"
                rows.append(_row(ctx, "raw", name, direction, page, walls, moved,
                                 "flat descriptors, backend calls", statistics.median(gpus)))
    return rows


SECTIONS: dict[str, Callable[[Context], list[Row]]] = {
    "bandwidth": section_bandwidth,
    "grid": section_grid,
    "raw": section_raw,
    **SERVING_SECTIONS,
}


# -- output ------------------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    """The bandwidth section as one line per (direction, page): GB/s per path; then the
    other sections, then the serving summary."""
    out: list[str] = []
    if any(r.section in ("bandwidth", "raw", "grid") for r in rows):
        out += _bandwidth_table(rows)
    serving = serving_summary(rows)
    if serving:
        if out:
            out.append("")
        out.append(serving)
    errors = [r for r in rows if r.path == "error"]
    for r in errors:
        out.append(f"ERROR in section {r.section}: {r.note}")
    return "\n".join(out)


def _bandwidth_table(rows: list[Row]) -> list[str]:
    out = []
    paths = ["kernel", "dma", "auto", "vllm-policy"]
    head = f"{'dir':4} {'page':>8} " + " ".join(f"{p:>11}" for p in paths)
    head += f" {'ceiling':>8} {'auto/ceil':>9}  auto ran"
    out.append(head)
    by = {(r.direction, r.page_bytes, r.path): r for r in rows if r.section == "bandwidth"}
    for direction in ("h2d", "d2h"):
        for page in sorted({r.page_bytes for r in rows if r.section == "bandwidth" and
                            r.page_bytes}):
            cells = [by.get((direction, page, p)) for p in paths]
            auto = by.get((direction, page, "auto"))
            line = f"{direction:4} {fmt_size(page):>8} " + " ".join(
                f"{c.gbps:>11.1f}" if c else f"{'-':>11}" for c in cells)
            if auto is not None:
                line += (f" {auto.ceiling_gbps:>8.1f} {auto.ratio:>8.0%}  {auto.note}"
                         f" (device {auto.gpu_gbps:.1f})")
            out.append(line)
    raw = [r for r in rows if r.section == "raw"]
    if raw:
        out.append("")
        out.append("raw flat descriptors, wall GB/s (device-time GB/s):")
        for r in raw:
            out.append(f"{r.direction:4} {fmt_size(r.page_bytes):>8} {r.path:24} "
                       f"{r.gbps:6.1f} ({r.gpu_gbps:.1f})")
    grid = [r for r in rows if r.section == "grid"]
    if grid:
        out.append("")
        out.append("kernel CTA sweep (GB/s):")
        for direction in ("h2d", "d2h"):
            for page in sorted({r.page_bytes for r in grid}):
                sweep = [r for r in grid if r.direction == direction and r.page_bytes == page]
                out.append(f"{direction:4} {fmt_size(page):>8} " + " ".join(
                    f"{r.path.split('@')[1]}:{r.gbps:.1f}" for r in sweep))
    return out


def plot(rows: list[Row], path: Path) -> bool:
    """bench.png (GB/s vs page size per direction and path, if the bandwidth section ran)
    and the serving plots beside it; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    plot_serving(rows, path.parent)
    if not any(r.section == "bandwidth" for r in rows):
        return True
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    bw = [r for r in rows if r.section == "bandwidth"]
    for ax, direction in zip(axes, ("h2d", "d2h")):
        for p, style in (("kernel", "o-"), ("dma", "s-"), ("auto", "^-"), ("vllm-policy", "x--")):
            pts = sorted((r.page_bytes, r.gbps) for r in bw
                         if r.direction == direction and r.path == p)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=p)
        ceil = [r.gbps for r in bw if r.direction == direction and r.path == "ceiling"]
        if ceil:
            ax.axhline(ceil[0], color="gray", ls=":", label="contiguous memcpy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (bytes)")
        ax.set_title("loads (h2d)" if direction == "h2d" else "stores (d2h)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (wall time, submission included)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


class Progress:
    """A one-line progress indicator on stderr: section i/n, its name, the current step."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.index = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def start(self, index: int) -> None:
        self.index = index
        self.step("start")

    def step(self, msg: str) -> None:
        n = len(self.names)
        done = int(20 * self.index / max(n, 1))
        bar = "#" * done + "." * (20 - done)
        line = (f"[{bar}] {self.index + 1}/{n} {self.names[self.index]}: {msg} "
                f"({time.perf_counter() - self.t0:.0f} s)")
        if self.tty:
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def finish(self, seconds: float) -> None:
        name = self.names[self.index]
        end = "\n" if self.tty else ""
        print(f"{end}[section {name}: {seconds:.1f} s]", file=sys.stderr, flush=True)


def _write(out: Path, rows: list[Row]) -> None:
    text = table(rows)
    (out / "bench.txt").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))


def _replot(src: Path, out: Path) -> int:
    """Tables and plots from an earlier run's bench.json (no GPU needed)."""
    known = {f.name for f in Row.__dataclass_fields__.values()}
    rows = [Row(**{k: v for k, v in d.items() if k in known})
            for d in json.loads(src.read_text())]
    print(table(rows))
    out.mkdir(parents=True, exist_ok=True)
    if not plot(rows, out / "bench.png"):
        print("(matplotlib missing: no plot)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvasync.bench", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--out", default="bench-out", help="folder for bench.json / bench.png")
    ap.add_argument("--pages", default="4K,16K,64K,256K,2M",
                    help="page sizes, comma separated (default %(default)s)")
    ap.add_argument("--total-mib", type=int, default=1024, help="MiB per timed transfer")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    ap.add_argument("--sections", default="bandwidth,grid,raw",
                    help=f"comma separated, of {sorted(SECTIONS)}")
    ap.add_argument("--from-json", default=None, metavar="BENCH_JSON",
                    help="redraw table and plots of an earlier run into --out (no GPU)")
    args = ap.parse_args(argv)
    if args.from_json:
        return _replot(Path(args.from_json), Path(args.out))
    args.pages = [parse_size(p) for p in args.pages.split(",") if p]
    names = [s for s in args.sections.split(",") if s]
    for s in names:
        if s not in SECTIONS:
            ap.error(f"unknown section {s!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx = Context(args)
    rows: list[Row] = []
    cal: Any = None
    try:
        from kvasync._backends._cuda import CudaBackend

        cal = CudaBackend(0).calibration()
        (out / "calibration.json").write_text(json.dumps(cal.as_dict(), indent=1))
        progress = Progress(names)
        ctx.progress = progress.step
        for i, name in enumerate(names):
            ts = time.perf_counter()
            progress.start(i)
            try:
                rows += SECTIONS[name](ctx)
            except Exception as exc:  # keep the other sections' results
                traceback.print_exc()
                rows.append(ctx.row(name, "error", note=f"{type(exc).__name__}: {exc}"))
            progress.finish(time.perf_counter() - ts)
            _write(out, rows)  # partial results survive a later crash or timeout
    finally:
        ctx.close()
    text = table(rows)
    print(text)
    _write(out, rows)
    if not plot(rows, out / "bench.png"):
        print("(matplotlib missing: no plot)", file=sys.stderr)
    print(f"[total {time.perf_counter() - t0:.1f} s; calibration {cal.seconds:.2f} s, "
          f"measured={cal.measured}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
