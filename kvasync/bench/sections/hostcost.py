"""hostcost: how long `store()` holds the caller, for 1 to 512 blocks of a model's layout.

The layout has 128 KV tensors (64 layers, K and V separate) of 1024 blocks x 16 KiB (quick,
or on the host backend: 128 blocks x 4 KiB). A row's ``p50_us`` / ``p99_us`` are the time
from the `store()` call until it returns (the copy itself is not inside the timing); each
call's transfer is waited for before the next call. Calls per case: up to 300, within about
a second per case.
"""

from __future__ import annotations

import time

import numpy as np

from ..common import KiB, Row, Section, pct_us
from ..context import WAIT_S, Context

LAYERS = 64
BLOCKS, PAGE = 1024, 16 * KiB
COUNTS = (1, 8, 64, 512)
MAX_CALLS, MIN_CALLS, WARM = 300, 10, 5
BUDGET_S = 1.0


def run(ctx: Context) -> list[Row]:
    small = ctx.quick or not ctx.gpu  # 4 GiB of host memory is no smoke test
    blocks, page = (128, 4 * KiB) if small else (BLOCKS, PAGE)
    budget = 0.2 if ctx.quick else BUDGET_S
    tensors = [ctx.device_array((blocks, page)) for _ in range(2 * LAYERS)]
    off = ctx.make_offloader(tensors, blocks)
    rng = np.random.default_rng(3)
    rows: list[Row] = []
    for n in (c for c in COUNTS if c <= blocks // 2):
        ids = [(rng.permutation(blocks)[:n], rng.permutation(blocks)[:n]) for _ in range(16)]
        for path in ctx.paths:
            ctx.progress(f"store() of {n} blocks x {len(tensors)} tensors, path {path}")
            calls: list[float] = []
            walls: list[float] = []
            start = time.perf_counter()
            with ctx.ran_paths(off) as ran:
                i = 0
                while len(calls) < MAX_CALLS and (
                        len(calls) < MIN_CALLS or time.perf_counter() - start < budget):
                    gpu, cpu = ids[i % len(ids)]
                    t0 = time.perf_counter()
                    t = off.store(gpu_blocks=gpu, cpu_chunks=cpu, path=path)
                    t1 = time.perf_counter()
                    t.wait(WAIT_S)
                    if i >= WARM:
                        calls.append(t1 - t0)
                        walls.append(time.perf_counter() - t0)
                    i += 1
            rows.append(Row(
                "hostcost", path, "d2h", page,
                values={"p50_us": pct_us(calls, 50), "p99_us": pct_us(calls, 99),
                        "done_p50_us": pct_us(walls, 50), "blocks": float(n),
                        "tensors": float(len(tensors)), "descriptors": float(n * len(tensors)),
                        "calls": float(len(calls))},
                samples=[round(x, 8) for x in calls],
                note=f"store() of {n} blocks x {len(tensors)} tensors, ran {ran.text}",
                extra={"ran": ran.text}))
    off.close()
    return rows


SECTION = Section("hostcost", run, (),
                  "how long store() holds the caller: 1-512 blocks x 128 tensors")
