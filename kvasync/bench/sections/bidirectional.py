"""bidirectional: a store and a load at once, against the bidirectional ceiling.

Per page size and path, a store and a load of about `total` bytes each, over disjoint random
blocks, are submitted back to back from one thread; GB/s is both directions' bytes over the
median wall time until both are done, over at least `MIN_REPS` reps (`--reps` if more). The
ceiling is two contiguous copies of `total` bytes at once, one each way on two streams,
measured in the same run: the best of whole copies and 64 MiB calls, with the load in either
half of the buffers. Both transfers use the row's path.
"""

from __future__ import annotations

import statistics
import sys
import time

import kvasync as kv

from ..common import KiB, MiB, Row, Section, fmt_size
from ..context import WAIT_S, Context, submit

PAGES = (64 * KiB, 2 * MiB)
#: timed reps at least: a rep takes ~25 ms at 1 GiB, and with two a single slow rep (the
#: first, on a lent H100: 30 ms where the others took 24) moved a row's median 10 points
MIN_REPS = 7


def run(ctx: Context) -> list[Row]:
    both, variants = ctx.bidirectional_ceiling()
    tried = "; ".join(f"{name}: {gbps:.1f}" for name, gbps in variants.items())
    rows = [Row("bidirectional", "ceiling", "both", 0, ratio=1.0, gbps=round(both, 2),
                ceiling_gbps=round(both, 2), values={"bytes": float(2 * ctx.total)},
                note="two contiguous copies at once, one each way, on two streams; the best "
                     f"of ({tried}) GB/s")]
    pages = (64 * KiB,) if ctx.quick else PAGES
    for page in (p for p in pages if ctx.fits(p, ctx.tensors)):
        off = ctx.offloader(page)
        n = ctx.pool_bytes // (ctx.tensors * page)
        half = n // 2
        gpu, cpu = ctx.rng.permutation(n), ctx.rng.permutation(n)
        store_ids, load_ids = (gpu[:half], cpu[:half]), (gpu[half:2 * half], cpu[half:2 * half])
        for path in ctx.paths:
            ctx.progress(f"store + load {fmt_size(page)} {path}")
            walls: list[float] = []
            dev_store: list[float] = []
            dev_load: list[float] = []
            moved = 0
            try:
                submit(off, "d2h", store_ids[0][:1], store_ids[1][:1], path=path).wait(WAIT_S)
            except kv.InvalidTransferError as exc:  # e.g. a row beyond a staging buffer
                print(f"bidirectional: {fmt_size(page)} {path} not run: {exc}", file=sys.stderr)
                continue
            with ctx.ran_paths(off) as ran:
                for rep in range(max(ctx.reps, MIN_REPS) + 1):
                    t0 = time.perf_counter()
                    ts = submit(off, "d2h", *store_ids, path=path)
                    tl = submit(off, "h2d", *load_ids, path=path)
                    rs, rl = ts.wait(WAIT_S), tl.wait(WAIT_S)
                    dt = time.perf_counter() - t0
                    moved = rs.bytes + rl.bytes
                    if rep:
                        walls.append(dt)
                        dev_store.append(rs.seconds)
                        dev_load.append(rl.seconds)
            wall = statistics.median(walls)
            gbps = moved / wall / 1e9
            rows.append(Row(
                "bidirectional", path, "both", page, ratio=round(gbps / both, 3),
                gbps=round(gbps, 2), ceiling_gbps=round(both, 2),
                values={"seconds": round(wall, 6), "bytes": float(moved),
                        "store_device_gbps": _rate(moved / 2, dev_store),
                        "load_device_gbps": _rate(moved / 2, dev_load)},
                samples=[round(w, 6) for w in walls],
                note=f"store and load on {path}, back to back from one thread; ran {ran.text}",
                extra={"ran": ran.text, "store_path": path, "load_path": path}))
    return rows


def _rate(nbytes: float, seconds: list[float]) -> float:
    sec = statistics.median(seconds)
    return round(nbytes / sec / 1e9, 2) if sec > 0 else 0.0


SECTION = Section("bidirectional", run, (),
                  "a store and a load at once vs the bidirectional ceiling")
