"""latency and cpu: how soon an ``await`` returns, and what waiting costs the host.

latency: one 4 KiB block loaded and awaited, again and again (random blocks of a 16 MiB
tensor), timed from before `load()` until ``await`` returns; per path with the default
completion ("hybrid"), and ``auto`` with ``completion="thread"``. On a GPU, ``ref-sync`` is the
floor under any awaited round trip: `cudaMemcpyAsync` of 4 KiB + `cudaStreamSynchronize`, no
asyncio.

cpu: the process's CPU time over wall time (all threads) while awaiting one load of about
1 GiB in 2 MiB pages (~20 ms on a PCIe Gen5 link), median of 5 after 10 warm-ups (which let
the completion predictor learn the link's rate); per path, and ``auto`` with the thread.
GPU only: on the host backend the copy itself runs on the CPU, so the share would measure
the copy.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np

import kvasync as kv

from ..common import GiB, KiB, MiB, Row, Section, fmt_size, pct_us
from ..context import Context

PAGE = 4 * KiB
BLOCKS = 4096
REPS, WARM = 2000, 200
CPU_PAGE = 2 * MiB


async def _round_trips(off: kv.Offloader, ids: np.ndarray, path: str, reps: int,
                       warm: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds of each `await off.load(...)`, of the `load()` call alone, and device seconds."""
    total: list[float] = []
    call: list[float] = []
    device: list[float] = []
    pc = time.perf_counter
    for i in range(reps + warm):
        t0 = pc()
        t = off.load(cpu_chunks=ids[i, 1:], gpu_blocks=ids[i, :1], path=path)
        t1 = pc()
        r = await t
        t2 = pc()
        if i >= warm:
            total.append(t2 - t0)
            call.append(t1 - t0)
            device.append(r.seconds)
    return total, call, device


def run_latency(ctx: Context) -> list[Row]:
    reps, warm = (100, 20) if ctx.quick else (REPS, WARM)
    ids = np.random.default_rng(1).integers(0, BLOCKS, (reps + warm, 2))
    tensor = ctx.device_array((BLOCKS, PAGE))
    rows: list[Row] = []
    for completion in ("hybrid", "thread"):
        off = ctx.make_offloader([tensor], BLOCKS, completion=completion)
        for path in ctx.paths if completion == "hybrid" else ("auto",):
            ctx.progress(f"await load of 4 KiB, path {path}, completion {completion}")
            with ctx.ran_paths(off) as ran:
                total, call, device = asyncio.run(_round_trips(off, ids, path, reps, warm))
            rows.append(Row(
                "latency", path, "h2d", PAGE,
                values={"p50_us": pct_us(total, 50), "p99_us": pct_us(total, 99),
                        "call_p50_us": pct_us(call, 50), "device_p50_us": pct_us(device, 50),
                        "reps": float(reps)},
                samples=[round(x, 8) for x in total],
                note=f"await off.load() of one 4 KiB block, completion={completion}, "
                     f"ran {ran.text}",
                extra={"completion": completion, "ran": ran.text}))
        off.close()
    if ctx.gpu:
        ctx.progress("reference: cudaMemcpyAsync + cudaStreamSynchronize")
        sync = ctx.sync_round_trips(PAGE, reps, warm)
        rows.append(Row("latency", "ref-sync", "h2d", PAGE,
                        values={"p50_us": pct_us(sync, 50), "p99_us": pct_us(sync, 99),
                                "reps": float(reps)},
                        samples=[round(x, 8) for x in sync],
                        note="cudaMemcpyAsync + cudaStreamSynchronize, no asyncio: the floor",
                        extra={"reference": True}))
    return rows


async def _cpu_share(off: kv.Offloader, gpu: Any, cpu: Any, path: str, reps: int,
                     warm: int) -> tuple[float, float]:
    """Median (CPU seconds / wall seconds, wall seconds) of `await off.load(...)`."""
    fracs: list[float] = []
    walls: list[float] = []
    for i in range(reps + warm):
        p0, w0 = time.process_time(), time.perf_counter()
        await off.load(cpu_chunks=cpu, gpu_blocks=gpu, path=path)
        wall = time.perf_counter() - w0
        if i >= warm:
            fracs.append((time.process_time() - p0) / wall)
            walls.append(wall)
    return statistics.median(fracs), statistics.median(walls)


def run_cpu(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    if not ctx.fits(CPU_PAGE, 1):
        return rows
    views = ctx.pool_views(CPU_PAGE, 1)
    n = min(ctx.total, GiB) // CPU_PAGE
    gpu, cpu = ctx.rng.permutation(n), ctx.rng.permutation(n)
    ceil = ctx.ceiling("h2d")
    for completion in ("hybrid", "thread"):
        off = ctx.make_offloader(views, int(views[0].shape[0]), completion=completion)
        for path in ctx.paths if completion == "hybrid" else ("auto",):
            ctx.progress(f"CPU while awaiting {fmt_size(n * CPU_PAGE)}, path {path}, "
                         f"completion {completion}")
            with ctx.ran_paths(off) as ran:
                frac, wall = asyncio.run(_cpu_share(off, gpu, cpu, path,
                                                    3 if ctx.quick else 5, 10))
            gbps = n * CPU_PAGE / wall / 1e9
            rows.append(Row("cpu", path, "h2d", CPU_PAGE, ratio=round(gbps / ceil, 3),
                            gbps=round(gbps, 2), ceiling_gbps=round(ceil, 2),
                            values={"cpu_frac": round(frac, 4), "seconds": round(wall, 6),
                                    "bytes": float(n * CPU_PAGE)},
                            note=f"await off.load() of {fmt_size(n * CPU_PAGE)}, "
                                 f"completion={completion}, ran {ran.text}",
                            extra={"completion": completion, "ran": ran.text}))
        off.close()
    return rows


LATENCY = Section("latency", run_latency, (),
                  "4 KiB load round trip through await, per path; the blocking-sync floor")
CPU = Section("cpu", run_cpu, ("gpu",), "CPU share while awaiting a ~20 ms load")
