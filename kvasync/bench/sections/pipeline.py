"""pipeline: each path alone as a caller runs it, against the same transfer enqueued ahead.

The bandwidth section times a transfer from its call, while the host is still enqueueing
it (a big staged transfer's launcher thread enqueues its slabs as the copy runs). Here each
transfer also runs a second time behind a `HOLD_CYCLES` spin kernel on its compute stream
(``stream=``). The host has then enqueued every slab before the device starts, and the
transfer's event time (`TransferResult.seconds`, from its start event after the stream's
wait) is the device pipeline alone. A row's `ratio` is over event time. Row ``mode``
"as-run" is a plain transfer, with its wall-time ratio in ``wall_ratio``; "held" is the
transfer enqueued ahead. The gap between the two is what the host's enqueue costs.

Path ``ref-rows`` (mode "held") moves the same transfer's host rows (ranked and merged as
the staged program does) by bare copy-engine DMA to or from one contiguous device buffer
(`rows.py`): no pack, no program, no slab events.
It is the copy engines' own rate on these rows, the bound under the staged path.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..common import KiB, Row, Section, fmt_size
from ..context import WAIT_S, Context, bare_rows, submit

PAGES = (4 * KiB, 16 * KiB, 64 * KiB)
#: GPU clock cycles the compute stream spins before a held transfer (~0.1 s at 2 GHz), far
#: longer than a 1 GiB transfer's host enqueue
HOLD_CYCLES = 200_000_000
#: the paths this section measures, where the backend offers them
PATHS = ("auto", "staged")


def run(ctx: Context) -> list[Row]:
    torch = ctx.torch
    hold = torch.cuda.Stream()
    rows: list[Row] = []
    for page in ctx.opts.pages if ctx.quick else PAGES:
        off = ctx.offloader(page)
        gpu, cpu = ctx.ids(page)
        for direction in ("h2d", "d2h"):
            ceil = ctx.ceiling(direction)
            for path in (p for p in PATHS if p in ctx.paths):
                for mode in ("as-run", "held"):
                    ctx.progress(f"{fmt_size(page)} {direction} {path} {mode}")
                    with ctx.ran_paths(off) as ran:
                        walls, devs, nbytes = _timed(ctx, torch, off, direction, gpu, cpu,
                                                     path, hold if mode == "held" else None)
                    dev = statistics.median(devs)
                    gbps = nbytes / dev / 1e9 if dev > 0 else 0.0
                    values = {"device_seconds": round(dev, 6), "bytes": float(nbytes)}
                    if mode == "as-run":
                        wall = statistics.median(walls)
                        values["wall_ratio"] = round(nbytes / wall / 1e9 / ceil, 3)
                    rows.append(Row(
                        "pipeline", path, direction, page, ratio=round(gbps / ceil, 3),
                        gbps=round(gbps, 2), ceiling_gbps=round(ceil, 2), values=values,
                        samples=[round(s, 6) for s in devs],
                        note=f"{mode}, ran {ran.text}",
                        extra={"mode": mode, "ran": ran.text}))
            rows.extend(_bare_rows(ctx, off, cpu, direction, page, ceil, hold))
    return rows


def _bare_rows(ctx: Context, off: Any, cpu: Any, direction: str, page: int, ceil: float,
               hold: Any) -> list[Row]:
    """The ``ref-rows`` row: the same transfer's host rows moved by the copy engines alone
    (`rows.py`), enqueued behind the spin like a held transfer; none where the layout's
    rows are not contiguous."""
    torch = ctx.torch
    ctx.progress(f"{fmt_size(page)} {direction} bare rows")
    torch.cuda.synchronize()
    devs = bare_rows(ctx, off, cpu, direction, hold.cuda_stream, lambda: _hold(torch, hold))
    dev = statistics.median(devs) if devs else 0.0
    if not devs or dev <= 0:
        return []
    nbytes = off.cpu_tensors[0].shape[1] * len(off.cpu_tensors) * len(cpu)
    gbps = nbytes / dev / 1e9
    return [Row("pipeline", "ref-rows", direction, page, ratio=round(gbps / ceil, 3),
                gbps=round(gbps, 2), ceiling_gbps=round(ceil, 2),
                values={"device_seconds": round(dev, 6), "bytes": float(nbytes)},
                samples=[round(s, 6) for s in devs],
                note="held, the transfer's host rows by bare copy-engine DMA (no pack, no "
                     "program)",
                extra={"mode": "held", "ran": "rows"})]


def _hold(torch: Any, hold: Any) -> None:
    """Enqueue the `HOLD_CYCLES` spin kernel on the stream `hold`."""
    with torch.cuda.stream(hold):
        torch.cuda._sleep(HOLD_CYCLES)


def _timed(ctx: Context, torch: Any, off: Any, direction: str, gpu: Any, cpu: Any,
           path: str, hold: Any | None) -> tuple[list[float], list[float], int]:
    """Wall and event seconds of `ctx.reps` transfers after one warm-up, and the bytes each
    moved; with `hold`, each behind a spin kernel on that stream (its compute stream)."""
    walls: list[float] = []
    devs: list[float] = []
    nbytes = 0
    for rep in range(ctx.reps + 1):
        torch.cuda.synchronize()
        kw: dict[str, Any] = {}
        if hold is not None:
            _hold(torch, hold)
            kw["stream"] = hold
        t0 = time.perf_counter()
        r = submit(off, direction, gpu, cpu, path=path, **kw).wait(WAIT_S)
        if rep:
            walls.append(time.perf_counter() - t0)
            devs.append(r.seconds)
        nbytes = r.bytes
    return walls, devs, nbytes


SECTION = Section("pipeline", run, ("gpu", "torch"),
                  "each path alone as a caller runs it and enqueued ahead of the device")
