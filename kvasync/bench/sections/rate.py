"""rate: awaited small transfers per second from many tasks, and 10,000 in flight at once.

64 asyncio tasks each await one 64 KiB transfer (one block of a single-tensor layout) after
another for a second, per direction and path; ``rate_per_s`` counts completed transfers.
Then 10,000 loads are submitted without awaiting and awaited all together: the row's
``extra`` says whether every one resolved, none was lost, and they completed in order.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

import kvasync as kv

from ..common import DIRECTIONS, INFLIGHT, KiB, Row, Section, fmt_size
from ..context import Context, submit

PAGE = 64 * KiB
TASKS = 64
SECONDS = 1.0


async def _task_rate(off: kv.Offloader, direction: str, path: str, ids: np.ndarray,
                     seconds: float) -> tuple[int, float]:
    """(transfers done, wall seconds) of one task per row of `ids`, each awaiting in turn."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker(mine: np.ndarray) -> None:
        nonlocal count
        i = 0
        while time.perf_counter() < deadline:
            block = mine[i % len(mine)]
            await submit(off, direction, block, block, path=path)
            count += 1
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(mine) for mine in ids))
    return count, time.perf_counter() - t0


async def _inflight(off: kv.Offloader, ids: np.ndarray) -> dict[str, Any]:
    """Submit one load per row of `ids` without awaiting, then await them all."""
    order: list[int] = []
    t0 = time.perf_counter()
    transfers = [off.load(cpu_chunks=row, gpu_blocks=row) for row in ids]
    t1 = time.perf_counter()
    for t in transfers:
        t.add_done_callback(lambda tr: order.append(tr.job_id))
    results = await asyncio.gather(*transfers, return_exceptions=True)
    t2 = time.perf_counter()
    job_ids = [t.job_id for t in transfers]
    ok = [r for r in results if isinstance(r, kv.TransferResult) and r.success]
    return {"n": len(ids), "submit_s": round(t1 - t0, 4), "total_s": round(t2 - t0, 4),
            "resolved": len(ok), "lost": len(ids) - len(ok),
            "results_match_ids": [getattr(r, "job_id", None) for r in results] == job_ids,
            "completed_in_order": order == job_ids}


def run(ctx: Context) -> list[Row]:
    tasks, seconds, inflight = (8, 0.2, 500) if ctx.quick else (TASKS, SECONDS, INFLIGHT)
    blocks = min(4096, max(tasks, ctx.pool_bytes // PAGE))
    off = ctx.make_offloader([ctx.device_array((blocks, PAGE))], blocks)
    rng = np.random.default_rng(4)
    per = blocks // tasks
    ids = rng.permutation(blocks)[: tasks * per].reshape(tasks, per, 1)
    rows: list[Row] = []
    for direction in DIRECTIONS:
        for path in ctx.paths:
            ctx.progress(f"{tasks} tasks awaiting {fmt_size(PAGE)} {direction}, path {path}")
            asyncio.run(_task_rate(off, direction, path, ids, seconds / 5))  # warm-up
            with ctx.ran_paths(off) as ran:
                count, wall = asyncio.run(_task_rate(off, direction, path, ids, seconds))
            rows.append(Row(
                "rate", path, direction, PAGE, gbps=round(count * PAGE / wall / 1e9, 2),
                values={"rate_per_s": round(count / wall, 1), "transfers": float(count),
                        "seconds": round(wall, 4), "tasks": float(tasks)},
                note=f"{tasks} tasks, each awaiting one {fmt_size(PAGE)} transfer at a time; "
                     f"ran {ran.text}",
                extra={"ran": ran.text}))
    ctx.progress(f"{inflight:,} loads in flight")
    one = rng.integers(0, blocks, (inflight, 1))
    res = asyncio.run(_inflight(off, one))
    rows.append(Row("rate", "auto", "h2d", PAGE,
                    values={"rate_per_s": round(inflight / res["total_s"], 1),
                            "transfers": float(inflight), "seconds": res["total_s"]},
                    note=f"{inflight:,} loads submitted at once, then all awaited",
                    extra={"inflight": inflight, **res}))
    off.close()
    return rows


SECTION = Section("rate", run, (), "awaited 64 KiB transfers/s from 64 tasks; 10,000 in flight")
