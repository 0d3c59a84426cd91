"""priority: a small load submitted right behind a 512 MiB load, normal and ``urgent=True``.

Two kinds of big load, each on the row's path: 4 KiB pages in one contiguous run, and random
256 KiB pages. The small load (one page) uses the same path; its time runs from its
`load()` call until its ``await`` returns. A normal small load waits behind the big one (one
direction is FIFO); an urgent one runs in the direction's urgent lane. Single-tensor layouts.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np

import kvasync as kv

from ..common import KiB, MiB, Row, Section, fmt_size, pct_us
from ..context import Context

BIG = 512 * MiB
CASES = (("contiguous", 4 * KiB), ("random", 256 * KiB))
REPS, WARM = 10, 2


async def _behind(off: kv.Offloader, big: tuple[Any, Any], small: tuple[Any, Any], path: str,
                  urgent: bool) -> tuple[float, float]:
    """(seconds from the small load's call to its await returning, the big load's seconds)."""
    t0 = time.perf_counter()
    tb = off.load(cpu_chunks=big[1], gpu_blocks=big[0], path=path)
    t1 = time.perf_counter()
    ts = off.load(cpu_chunks=small[1], gpu_blocks=small[0], path=path, urgent=urgent)
    await ts
    t2 = time.perf_counter()
    await tb
    return t2 - t1, time.perf_counter() - t0


def run(ctx: Context) -> list[Row]:
    big_bytes = min(16 * MiB if ctx.quick else BIG, ctx.total // 2)
    reps = 3 if ctx.quick else REPS
    rows: list[Row] = []
    rng = np.random.default_rng(6)
    for kind, page in CASES:
        off = ctx.offloader(page, tensors=1)
        n = ctx.pool_bytes // page
        k = min(n - reps - WARM, big_bytes // page)
        if k < 1:
            continue
        for path in ctx.paths:
            for urgent in (False, True):
                ctx.progress(f"{fmt_size(page)} behind {fmt_size(k * page)} {kind}, path "
                             f"{path}, urgent={urgent}")
                lat: list[float] = []
                bigs: list[float] = []
                for rep in range(reps + WARM):
                    order = np.arange(n) if kind == "contiguous" else rng.permutation(n)
                    big = (order[:k], order[:k] if kind == "contiguous" else rng.permutation(k))
                    small = (order[k + rep: k + rep + 1], order[k + rep: k + rep + 1])
                    a, b = asyncio.run(_behind(off, big, small, path, urgent))
                    if rep >= WARM:
                        lat.append(a)
                        bigs.append(b)
                rows.append(Row(
                    "priority", path, "h2d", page,
                    values={"p50_us": pct_us(lat, 50), "max_us": round(max(lat) * 1e6, 2),
                            "big_ms": round(statistics.median(bigs) * 1e3, 3)},
                    samples=[round(x, 7) for x in lat],
                    note=f"urgent={urgent}, behind {fmt_size(k * page)} in {kind} "
                         f"{fmt_size(page)} pages",
                    extra={"urgent": urgent, "big_bytes": k * page, "big_pages": kind}))
    return rows


SECTION = Section("priority", run, (),
                  "a small load behind a 512 MiB load: FIFO vs urgent=True")
