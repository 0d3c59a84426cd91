"""interference: each copy path beside a bf16 matmul loop, the way a server runs them.

A thread keeps `DEPTH` bf16 N x N x N matmuls queued on their own stream; transfers of
`CHUNK` bytes (random blocks of every tensor), `INFLIGHT` in flight, run on an idle side
stream (``stream=``, so they never wait for the matmuls) for a window of at least
`WINDOW_S`. On a GPU, `auto` runs a second time (row path ``auto@128MiB``) on an offloader
with `BIG_STAGING` bytes of staging per direction: the matmul's kernels hold every SM, so
a pack or unpack runs only between two of them, and the link share is bounded by the
staging bytes per matmul kernel (docs/performance.md). Each
row carries the link share as `ratio` (GB/s over the one-direction ceiling) and the matmul's
kept share as ``extra.tflops_ratio`` (its TFLOP/s in the window over the mean of its rate
alone at the start and the end). TFLOP/s counts the matmul work that overlaps the window,
timed by CUDA events on the matmul stream and aligned by events on the idle side stream.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import kvasync as kv

from ..common import DIRECTIONS, KiB, MiB, Row, Section, fmt_size
from ..context import WAIT_S, Context, submit

PAGES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB)
MATMUL_N = 8192
DEPTH = 6
WINDOW_S = 0.4
CHUNK = 64 * MiB
INFLIGHT = 4
BIG_STAGING = 128 * MiB
BIG_PAGES = (4 * KiB, 16 * KiB)


class MatmulLoop:
    """A bf16 matmul loop on its own stream, fed by a thread that keeps `depth` queued."""

    def __init__(self, torch: Any, n: int, depth: int = DEPTH) -> None:
        self.torch = torch
        self.a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty((n, n), device="cuda", dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream()
        self.flop = 2.0 * n**3
        self.depth = depth
        self.done = 0
        self.ends: list[Any] = []

    def _feed(self, stop: threading.Event) -> None:
        torch = self.torch
        pending: deque[Any] = deque()
        with torch.cuda.stream(self.stream):
            while not stop.is_set():
                torch.matmul(self.a, self.b, out=self.c)
                ev = torch.cuda.Event(enable_timing=True, blocking=True)
                ev.record(self.stream)
                self.ends.append(ev)
                pending.append(ev)
                if len(pending) >= self.depth:
                    pending.popleft().synchronize()
                    self.done += 1
        self.stream.synchronize()

    def measure(self, during: Callable[[Callable[[], bool]], Any], min_s: float,
                marker: Any) -> tuple[float, Any]:
        """TFLOP/s of the matmuls while `during(keep_going)` runs, and what it returned."""
        torch = self.torch
        self.done, self.ends = 0, []
        base = torch.cuda.Event(enable_timing=True)
        base.record(self.stream)
        stop = threading.Event()
        feeder = threading.Thread(target=self._feed, args=(stop,), daemon=True)
        feeder.start()
        t_wait = time.perf_counter()
        while self.done < 2 and time.perf_counter() - t_wait < 10:
            time.sleep(0.001)
        m0, m1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        m0.record(marker)
        snap, t0 = self.done, time.perf_counter()

        def keep_going() -> bool:
            el = time.perf_counter() - t0
            return el < min_s or (self.done - snap < 4 and el < 6 * min_s)

        try:
            result = during(keep_going)
        finally:
            m1.record(marker)
            stop.set()
            feeder.join(60)
        torch.cuda.synchronize()
        w0, w1 = base.elapsed_time(m0), base.elapsed_time(m1)
        ends = [base.elapsed_time(e) for e in self.ends]
        work = 0.0
        for s, e in zip(ends, ends[1:]):  # matmul k runs (end k-1, end k]
            if e > s:
                work += max(0.0, min(e, w1) - max(s, w0)) / (e - s)
        tflops = work * self.flop / ((w1 - w0) / 1e3) / 1e12 if w1 > w0 else 0.0
        return tflops, result


def _transfers(off: kv.Offloader, direction: str, path: str, ids: list[tuple[Any, Any]],
               side: Any, keep_going: Callable[[], bool]) -> tuple[int, float]:
    """(bytes, seconds) of transfers of `ids` (cycled), `INFLIGHT` in flight, on `side`."""
    inflight: deque[kv.Transfer] = deque()
    moved, i, t0 = 0, 0, time.perf_counter()
    while keep_going():
        gpu, cpu = ids[i % len(ids)]
        inflight.append(submit(off, direction, gpu, cpu, path=path, stream=side))
        i += 1
        if len(inflight) >= INFLIGHT:
            moved += inflight.popleft().wait(WAIT_S).bytes
    while inflight:
        moved += inflight.popleft().wait(WAIT_S).bytes
    return moved, time.perf_counter() - t0


def _idle(keep_going: Callable[[], bool]) -> tuple[int, float]:
    t0 = time.perf_counter()
    while keep_going():
        time.sleep(0.005)
    return 0, time.perf_counter() - t0


def run(ctx: Context) -> list[Row]:
    torch = ctx.torch
    window = 0.1 if ctx.quick else WINDOW_S
    chunk = min(CHUNK, ctx.total)
    pages = [p for p in ((16 * KiB,) if ctx.quick else PAGES) if ctx.tensors * p <= chunk]
    mm = MatmulLoop(torch, 4096 if ctx.quick else MATMUL_N)
    side = torch.cuda.Stream()
    rows: list[Row] = []
    alone: list[float] = []

    def alone_row(when: str) -> Row:
        ctx.progress(f"matmul alone ({when})")
        tf, _ = mm.measure(_idle, window, side)
        alone.append(tf)
        return Row("interference", "matmul-alone", "", 0, values={"tflops": round(tf, 1)},
                   note=f"matmul loop alone ({when})")

    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # the feeder thread gets the GIL promptly
    try:
        mm.measure(_idle, 0.2, side)  # warm-up: cuBLAS heuristics, clocks
        rows.append(alone_row("start"))
        for page in pages:
            rows += _page_rows(ctx, mm, side, page, chunk, window)
        rows.append(alone_row("end"))
    finally:
        sys.setswitchinterval(old_switch)
    ref = statistics.mean(alone)
    for r in rows:
        if r.path != "matmul-alone" and ref > 0:
            r.values["tflops_alone"] = round(ref, 1)
            r.extra["tflops_ratio"] = round(r.value("tflops") / ref, 3)
    return rows


def _page_rows(ctx: Context, mm: MatmulLoop, side: Any, page: int, chunk: int,
               window: float) -> list[Row]:
    off = ctx.offloader(page)
    ids = [ctx.ids(page, chunk) for _ in range(4)]
    big: kv.Offloader | None = None
    if ctx.gpu and not ctx.quick and page in BIG_PAGES and "auto" in ctx.paths:
        views = ctx.pool_views(page, ctx.tensors)
        big = ctx.make_offloader(views, len(views[0]), staging_bytes=BIG_STAGING)
    rows: list[Row] = []
    for direction in DIRECTIONS:
        ceil = ctx.ceiling(direction)
        cases: list[tuple[str, str, int | None, kv.Offloader]] = [
            (p, p, None, off) for p in ctx.paths]
        policy = ctx.vllm_policy(direction, page)
        if policy is not None:
            cases.append(("vllm-policy", *policy, off))
        if big is not None:
            cases.append((f"auto@{BIG_STAGING // MiB}MiB", "auto", None, big))
        for name, path, ctas, o in cases:
            ctx.progress(f"{fmt_size(page)} {direction} {name} beside the matmul")
            with ctx.grid(o, ctas), ctx.ran_paths(o) as ran:
                gpu, cpu = ids[0]  # warm-up outside the window (tables, first launch)
                submit(o, direction, gpu, cpu, path=path, stream=side).wait(WAIT_S)

                def during(keep_going: Callable[[], bool], direction: str = direction,
                           path: str = path, o: kv.Offloader = o) -> tuple[int, float]:
                    return _transfers(o, direction, path, ids, side, keep_going)

                tf, (moved, wall) = mm.measure(during, window, side)
            gbps = moved / wall / 1e9 if wall > 0 else 0.0
            rows.append(Row(
                "interference", name, direction, page, ratio=round(gbps / ceil, 3),
                gbps=round(gbps, 2), ceiling_gbps=round(ceil, 2),
                values={"tflops": round(tf, 1), "seconds": round(wall, 4),
                        "bytes": float(moved)},
                note=f"ran {ran.text}" + (f", {ctas} CTAs" if ctas else "")
                + (f", {o.staging_bytes // MiB} MiB staging" if o is big else ""),
                extra={"ran": ran.text, "transfer_bytes": chunk, "in_flight": INFLIGHT,
                       "staging_bytes": o.staging_bytes}))
    if big is not None:
        big.close()
    return rows


SECTION = Section("interference", run, ("gpu", "torch"),
                  "each path beside a bf16 matmul loop: matmul kept vs link share")
