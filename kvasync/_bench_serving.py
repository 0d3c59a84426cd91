"""Serving sections of ``python -m kvasync.bench`` (issue 5), measured side by side in one run.

- ``latency``: 4 KiB load round trip through ``await`` (hybrid and thread completion) next to
  five raw-CuPy completion methods; CPU share while awaiting a ~20 ms transfer.
- ``hostcost``: how long ``store()`` holds the caller (128 tensors, 1-512 blocks).
- ``smallrate``: awaited 64 KiB transfers per second from 64 tasks; 10,000 in flight at once.
- ``overlap``: a store and a load at once vs two contiguous memcpys on two streams.
- ``interference``: a bf16 8192^3 matmul loop alone and during each path's transfers.
- ``priority``: a small load right behind a 512 MiB load (contiguous 4 KiB or random 256 KiB
  pages), normal vs ``urgent=True``.
- ``layerwise``: ``load_layerwise`` + per-layer compute vs load-everything-then-compute.

Each section takes the bench `Context` and returns its `Row`s (built with ``ctx.row``, so
this module does not import ``bench``); `serving_summary` and `plot_serving` read them back.
"""

from __future__ import annotations

import asyncio
import inspect
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .bench import Context, Row

__all__ = ["SERVING_SECTIONS", "plot_serving", "serving_summary"]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
_H2D, _D2H = 1, 2  # cudaMemcpyKind
#: the issue-5 targets
LAT_P50_US, LAT_P99_US, CPU_MAX = 12.0, 40.0, 0.10
STORE_64_US = 30.0
SMALL_RATE = 20_000.0
OVERLAP_MIN = 0.90
MM_KEEP, LINK_KEEP = 0.85, 0.90
URGENT_MS = 1.0
MATMUL_N = 8192
#: hostcost layout: layers (K and V separate tensors), blocks per tensor, block bytes (2 GiB)
HOSTCOST_LAYOUT = (64, 1024, 16 * KiB)


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q)) if samples else 0.0


def _us(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) in microseconds of samples in seconds."""
    return round(_pct(samples, 50) * 1e6, 2), round(_pct(samples, 99) * 1e6, 2)


def fmt_size(n: int) -> str:
    """Bytes as a short label: '4 KiB', '2 MiB', '100 B'."""
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def _one_ids(n_ids: int, pool_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`n_ids` single-block id arrays (shape (n, 1) int64), distinct while n <= pool."""
    k = min(n_ids, pool_blocks)
    ids = rng.permutation(pool_blocks)[:k]
    return np.resize(ids, n_ids).reshape(-1, 1).astype(np.int64)


# -- 1. latency ---------------------------------------------------------------------------------
async def _await_woken(off: Any, t: Any) -> Any:
    """`await t`, but first wake this loop's resolver so it polls at once: emulates the
    one-line core fix proposed in docs/performance.md (diagnostic only)."""
    engine = off._engine
    fut = engine.future_for(t)
    if fut is None:
        return t.result()
    engine._resolver(asyncio.get_running_loop()).notify(None)  # same thread: sets its event
    return await fut


async def _offloader_round_trips(off: Any, g: np.ndarray, c: np.ndarray, reps: int, warm: int,
                                 path: str | None, stream: Any | None = None,
                                 woken: bool = False
                                 ) -> tuple[list[float], list[float], list[float]]:
    """Wall seconds of `await off.load(...)` per rep, of the load() call alone, and the
    transfers' device seconds."""
    total: list[float] = []
    submit: list[float] = []
    device: list[float] = []
    pc = time.perf_counter
    for i in range(reps + warm):
        t0 = pc()
        t = off.load(cpu_chunks=c[i], gpu_blocks=g[i], path=path, stream=stream)
        t1 = pc()
        r = await (_await_woken(off, t) if woken else t)
        t2 = pc()
        if i >= warm:
            total.append(t2 - t0)
            submit.append(t1 - t0)
            device.append(r.seconds)
    return total, submit, device


def _sync_round_trips(off: Any, g: np.ndarray, c: np.ndarray, reps: int, warm: int,
                      spin: bool) -> list[float]:
    """No event loop: spin on the queue's poll() (the floor for any waiter) or t.wait()."""
    out: list[float] = []
    pc = time.perf_counter
    for i in range(reps + warm):
        t0 = pc()
        t = off.load(cpu_chunks=c[i], gpu_blocks=g[i])
        if spin:
            q = t._queue
            while not t.done():
                q.poll()
        else:
            t.wait(10)
        if i >= warm:
            out.append(pc() - t0)
    return out


def _profile(ctx: Context, title: str, fn: Callable[[int], Any], calls: int,
             top: int = 25) -> dict[str, float]:
    """cProfile `fn(i)` for i < calls; append the top functions (tottime) to profile.txt and
    return {function: us per call} of the top 12."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for i in range(calls):
        prof.enable()
        t = fn(i)
        prof.disable()
        t.wait(60)
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    out = Path(getattr(ctx.args, "out", "."))
    with open(out / "profile.txt", "a") as fh:
        fh.write(f"==== {title} ({calls} calls, cProfile, sorted by tottime) ====\n")
        fh.write(buf.getvalue())
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:12]  # type: ignore[attr-defined]
    return {f"{Path(k[0]).name}:{k[1]}({k[2]})": round(v[2] / calls * 1e6, 2) for k, v in rows}


class _RawCopy:
    """A raw CuPy copy (pinned host -> device) and the five reference ways to wait for it."""

    def __init__(self, cp: Any, dst: int, src: int, nbytes: int) -> None:
        self.cp = cp
        self.dst, self.src, self.nbytes = dst, src, nbytes
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.ev = cp.cuda.Event(disable_timing=True)  # spin-sync (CuPy's default)

    def launch(self) -> None:
        self.cp.cuda.runtime.memcpyAsync(self.dst, self.src, self.nbytes, _H2D, self.stream.ptr)

    def sync(self) -> None:
        self.launch()
        self.stream.synchronize()

    async def poll0(self) -> None:
        self.launch()
        self.ev.record(self.stream)
        while not self.ev.done:
            await asyncio.sleep(0)

    async def poll1ms(self) -> None:
        self.launch()
        self.ev.record(self.stream)
        while not self.ev.done:
            await asyncio.sleep(0.001)

    async def host_func(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def _set(f: asyncio.Future[None]) -> None:
            if not f.done():
                f.set_result(None)

        def _cb(f: asyncio.Future[None]) -> None:  # on CUDA's callback thread
            loop.call_soon_threadsafe(_set, f)

        self.launch()
        self.stream.launch_host_func(_cb, fut)
        await fut

    async def to_thread(self) -> None:
        self.launch()
        self.ev.record(self.stream)
        await asyncio.to_thread(self.ev.synchronize)


_RAW_METHODS: list[tuple[str, str]] = [
    ("sync", "stream.synchronize() (blocking, no asyncio)"),
    ("poll0", "poll Event.done with asyncio.sleep(0)"),
    ("poll1ms", "poll with asyncio.sleep(0.001)"),
    ("host_func", "Stream.launch_host_func -> loop.call_soon_threadsafe"),
    ("to_thread", "asyncio.to_thread(event.synchronize) (spin-sync event)"),
]


async def _raw_round_trips(raw: _RawCopy, method: str, reps: int, warm: int) -> list[float]:
    pc = time.perf_counter
    out: list[float] = []
    fn: Callable[[], Any] = getattr(raw, method)
    for i in range(reps + warm):
        t0 = pc()
        if method == "sync":
            fn()
        else:
            await fn()
        if i >= warm:
            out.append(pc() - t0)
    return out


async def _cpu_share(wait: Callable[[], Any], reps: int, warm: int) -> tuple[float, float]:
    """Median (CPU seconds / wall seconds, wall seconds) of `await wait()`."""
    fracs, walls = [], []
    for i in range(reps + warm):
        p0, w0 = time.process_time(), time.perf_counter()
        r = wait()
        if inspect.isawaitable(r):  # a coroutine, or a kvasync Transfer
            await r
        wall = time.perf_counter() - w0
        if i >= warm:
            fracs.append((time.process_time() - p0) / wall)
            walls.append(wall)
    return statistics.median(fracs), statistics.median(walls)


def section_latency(ctx: Context) -> list[Row]:
    """4 KiB h2d round trip through await vs five raw completion methods; CPU while waiting."""
    cp, torch = ctx.cp, ctx.torch
    rows: list[Row] = []
    reps, warm = 2000, 200
    page, nblocks = 4 * KiB, 4096
    rng = np.random.default_rng(1)
    # ours: a 16 MiB tensor of 4 KiB blocks per completion mode
    for completion in ("hybrid", "thread"):
        ctx.progress(f"await load 4 KiB, completion={completion}")
        dev = torch.zeros((nblocks, page), dtype=torch.uint8, device="cuda")
        off = ctx.make_offloader([dev], nblocks, completion=completion)
        g = _one_ids(reps + warm, nblocks, rng)
        c = _one_ids(reps + warm, nblocks, rng)
        side = cp.cuda.Stream(non_blocking=True)
        variants: list[tuple[str, str, Any, bool]] = [("", "auto", None, False)]
        if completion == "hybrid":
            variants += [("-kernel", "kernel", None, False), ("-dma", "dma", None, False),
                         ("-sidestream", "auto", side, False),
                         ("+wakefix", "auto", None, True), ("+wakefix-dma", "dma", None, True)]
        for suffix, path, stream, woken in variants:
            name = f"kvasync-{completion}{suffix}"
            ctx.progress(f"await load 4 KiB, {name}")
            before = dict(off.backend.counts)
            total, submit, device = asyncio.run(
                _offloader_round_trips(off, g, c, reps, warm, path, stream, woken))
            ran = [p for p in ("kernel", "dma") if off.backend.counts[p] > before.get(p, 0)]
            p50, p99 = _us(total)
            s50, s99 = _us(submit)
            what = ("await off.load()" + (", stream= idle side stream" if stream else "")
                    + (", resolver woken at await (diagnostic)" if woken else ""))
            rows.append(ctx.row("latency", name, "h2d", page,
                                p50_us=p50, p99_us=p99, reps=reps, blocks=1, bytes=page,
                                samples=[round(x, 8) for x in total],
                                note=f"{what}, path {path} (ran {'+'.join(ran)})",
                                extra={"completion": completion, "path": path,
                                       "submit_p50_us": s50, "submit_p99_us": s99,
                                       "device_p50_us": _us(device)[0],
                                       "diagnostic": bool(stream or woken)}))
        if completion == "hybrid":
            for name, spin in (("diag-spin-poll", True), ("diag-wait", False)):
                ctx.progress(f"4 KiB load, {name}")
                samples = _sync_round_trips(off, g, c, reps, warm, spin)
                p50, p99 = _us(samples)
                rows.append(ctx.row(
                    "latency", name, "h2d", page, p50_us=p50, p99_us=p99, reps=reps,
                    blocks=1, bytes=page, samples=[round(x, 8) for x in samples],
                    note=("load() then spin on the queue's poll() (no loop, no thread hop)"
                          if spin else "load() then t.wait() (completion thread)"),
                    extra={"diagnostic": True}))
            ctx.progress("cProfile of load() 4 KiB")
            prof = _profile(ctx, "load() of one 4 KiB block, 1 tensor",
                            lambda i, off=off, c=c, g=g:  # type: ignore[misc]
                            off.load(cpu_chunks=c[i], gpu_blocks=g[i]), reps)
            rows.append(ctx.row("latency-profile", "load-4KiB", "h2d", page, reps=reps,
                                note="cProfile tottime per call (us), top 12",
                                extra={"profile_top": prof}))
        off.close()
    # the five reference methods, raw CuPy on one 4 KiB copy
    hbuf = cp.cuda.alloc_pinned_memory(page)
    dbuf = cp.cuda.alloc(page)
    raw = _RawCopy(cp, int(dbuf.ptr), int(hbuf.ptr), page)
    for method, label in _RAW_METHODS:
        ctx.progress(f"reference {method}")
        samples = asyncio.run(_raw_round_trips(raw, method, reps, warm))
        p50, p99 = _us(samples)
        rows.append(ctx.row("latency", f"ref-{method}", "h2d", page, p50_us=p50, p99_us=p99,
                            reps=reps, blocks=1, bytes=page,
                            samples=[round(x, 8) for x in samples], note=label))
    rows += _latency_cpu(ctx)
    return rows


def _latency_cpu(ctx: Context) -> list[Row]:
    """CPU share while awaiting one ~1 GiB (~20 ms) load: ours (hybrid, thread) and raw."""
    cp = ctx.cp
    rows: list[Row] = []
    page = 2 * MiB
    nbytes = min(ctx.total, 1 * GiB)
    n = nbytes // page
    view = ctx.pool[: n * page].view(n, page)
    rng = np.random.default_rng(2)
    g, c = rng.permutation(n), rng.permutation(n)
    for completion, woken in (("hybrid", False), ("thread", False), ("hybrid", True)):
        name = f"kvasync-{completion}" + ("+wakefix" if woken else "")
        ctx.progress(f"CPU while awaiting {fmt_size(nbytes)}, {name}")
        off = ctx.make_offloader([view], n, completion=completion)

        async def run(off: Any = off, woken: bool = woken) -> tuple[float, float]:
            # 10 warm-ups: the hybrid predictor learns the link's bandwidth from them
            if woken:
                return await _cpu_share(
                    lambda: _await_woken(off, off.load(cpu_chunks=c, gpu_blocks=g)), 5, 10)
            return await _cpu_share(lambda: off.load(cpu_chunks=c, gpu_blocks=g), 5, 10)

        frac, wall = asyncio.run(run())
        rows.append(ctx.row("latency-cpu", name, "h2d", page,
                            cpu_frac=round(frac, 4), seconds=wall, bytes=n * page, blocks=n,
                            reps=5, gbps=round(n * page / wall / 1e9, 2),
                            note=f"await off.load() of {fmt_size(n * page)} in "
                                 f"{fmt_size(page)} pages"))
        off.close()
    # reference methods on one contiguous copy of the same bytes
    host = ctx.offloader(page).cpu_tensors[0]
    raw = _RawCopy(cp, ctx.pool_ptr, int(host.ctypes.data), nbytes)
    for method, label in _RAW_METHODS:
        ctx.progress(f"CPU while awaiting {fmt_size(nbytes)}, ref {method}")
        fn = getattr(raw, method)
        frac, wall = asyncio.run(_cpu_share(fn, 3, 1))
        rows.append(ctx.row("latency-cpu", f"ref-{method}", "h2d", nbytes,
                            cpu_frac=round(frac, 4), seconds=wall, bytes=nbytes, reps=3,
                            gbps=round(nbytes / wall / 1e9, 2), note=label))
    return rows


# -- 2. host cost of store() --------------------------------------------------------------------
def section_hostcost(ctx: Context) -> list[Row]:
    """us per store() call for 1/8/64/512 blocks of a 64-layer (K, V separate) layout."""
    torch = ctx.torch
    rows: list[Row] = []
    layers, blocks, page = HOSTCOST_LAYOUT
    tensors = [torch.zeros((blocks, page), dtype=torch.uint8, device="cuda")
               for _ in range(2 * layers)]
    off = ctx.make_offloader(tensors, blocks)
    rng = np.random.default_rng(3)
    plan = [(n, path, reps) for n in (1, 8, 64, 512) for path, reps in
            (("auto", 300 if n < 512 else 100), ("kernel", 300 if n < 512 else 100),
             ("dma", 100 if n < 512 else 10))]
    for n, path, reps in plan:
        ctx.progress(f"store() of {n} blocks x {2 * layers} tensors, path {path}")
        warm = 5
        ids = [(rng.permutation(blocks)[:n], rng.permutation(blocks)[:n])
               for _ in range(16)]
        before = dict(off.backend.counts)
        calls: list[float] = []
        walls: list[float] = []
        for i in range(reps + warm):
            g, c = ids[i % len(ids)]
            t0 = time.perf_counter()
            t = off.store(gpu_blocks=g, cpu_chunks=c, path=path)
            t1 = time.perf_counter()
            t.wait(60)
            t2 = time.perf_counter()
            if i >= warm:
                calls.append(t1 - t0)
                walls.append(t2 - t0)
        ran = [p for p in ("kernel", "dma") if off.backend.counts[p] > before.get(p, 0)]
        p50, p99 = _us(calls)
        nbytes = n * 2 * layers * page
        extra: dict[str, Any] = {"descriptors": n * 2 * layers, "tensors": 2 * layers}
        if path == "auto":  # where the time goes: request validation + plan alone
            extra["build_plan_p50_us"] = _build_plan_us(off, ids, 200)
            if n == 64:
                ctx.progress("cProfile of store() 64 blocks")
                extra["profile_top"] = _profile(
                    ctx, f"store() of 64 blocks x {2 * layers} tensors, path auto",
                    lambda i, ids=ids: off.store(gpu_blocks=ids[i % len(ids)][0],  # type: ignore[misc]
                                                 cpu_chunks=ids[i % len(ids)][1]), 300)
        rows.append(ctx.row("hostcost", path, "d2h", page, p50_us=p50, p99_us=p99, blocks=n,
                            reps=reps, bytes=nbytes, seconds=statistics.median(walls),
                            gbps=round(nbytes / statistics.median(walls) / 1e9, 2),
                            note=f"ran {'+'.join(ran)}", extra=extra))
    off.close()
    return rows


def _build_plan_us(off: Any, ids: list[tuple[Any, Any]], reps: int) -> float:
    """p50 us of `build_plan` alone for a store of `ids` (no submission)."""
    from ._descriptors import build_plan

    table = off._tables["d2h"]
    out = []
    for i in range(reps):
        g, c = ids[i % len(ids)]
        t0 = time.perf_counter()
        build_plan(table, g, c, None, None, True, off.num_cpu_chunks)
        out.append(time.perf_counter() - t0)
    return _us(out)[0]


# -- 3. small-transfer rate ---------------------------------------------------------------------
async def _task_rate(off: Any, direction: str, path: str, tasks: int, seconds: float,
                     ids: np.ndarray) -> tuple[int, float]:
    """(transfers done, wall seconds) of `tasks` tasks each awaiting one transfer at a time."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal count
        mine = ids[k]
        i = 0
        while time.perf_counter() < deadline:
            g = mine[i % len(mine)]
            if direction == "h2d":
                await off.load(cpu_chunks=g, gpu_blocks=g, path=path)
            else:
                await off.store(gpu_blocks=g, cpu_chunks=g, path=path)
            count += 1
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(tasks)))
    return count, time.perf_counter() - t0


async def _inflight(off: Any, n: int, g: np.ndarray, c: np.ndarray) -> dict[str, Any]:
    """Submit `n` loads without awaiting, then await them all; check order and count."""
    order: list[int] = []
    t0 = time.perf_counter()
    trs = [off.load(cpu_chunks=c[i], gpu_blocks=g[i]) for i in range(n)]
    t1 = time.perf_counter()
    for t in trs:
        t.add_done_callback(lambda tr: order.append(tr.job_id))
    results = await asyncio.gather(*trs, return_exceptions=True)
    t2 = time.perf_counter()
    ids = [t.job_id for t in trs]
    ok = [r for r in results if not isinstance(r, BaseException) and r.success]
    return {
        "n": n, "submit_s": t1 - t0, "total_s": t2 - t0,
        "resolved": len(ok), "lost": n - len(ok),
        "results_match_ids": [getattr(r, "job_id", None) for r in results] == ids,
        "ids_increasing": all(a < b for a, b in zip(ids, ids[1:])),
        "completed_in_order": order == ids,
        "callbacks": len(order),
    }


def section_smallrate(ctx: Context) -> list[Row]:
    """Awaited 64 KiB transfers/s from 64 tasks; 10,000 in flight, in order, none lost."""
    rows: list[Row] = []
    page, tasks, seconds = 64 * KiB, 64, 1.0
    off = ctx.offloader(page)
    n = ctx.pool_bytes // page
    rng = np.random.default_rng(4)
    per = max(1, min(64, n // tasks))
    ids = rng.permutation(n)[: tasks * per].reshape(tasks, per, 1).astype(np.int64)
    for direction, path in (("h2d", "auto"), ("h2d", "kernel"), ("h2d", "dma"),
                            ("d2h", "auto")):
        ctx.progress(f"{tasks} tasks x awaited {fmt_size(page)} {direction}, path {path}")
        asyncio.run(_task_rate(off, direction, path, tasks, 0.2, ids))  # warm-up
        before = dict(off.backend.counts)
        count, wall = asyncio.run(_task_rate(off, direction, path, tasks, seconds, ids))
        ran = [p for p in ("kernel", "dma") if off.backend.counts[p] > before.get(p, 0)]
        rows.append(ctx.row("smallrate", path, direction, page, rate=round(count / wall, 1),
                            reps=count, seconds=wall, bytes=count * page,
                            gbps=round(count * page / wall / 1e9, 2),
                            note=f"{tasks} tasks, ran {'+'.join(ran)}"))
    ctx.progress("10,000 loads in flight")
    k = 10_000
    g = _one_ids(k, n, rng)
    c = _one_ids(k, n, rng)
    res = asyncio.run(_inflight(off, k, g, c))
    rows.append(ctx.row("smallrate", "inflight", "h2d", page, rate=round(k / res["total_s"], 1),
                        reps=k, seconds=res["total_s"], bytes=k * page, extra=res,
                        note="10,000 loads submitted, then all awaited"))
    return rows


# -- 4. overlap of both directions ------------------------------------------------------------
def _bidir_ceiling(ctx: Context, reps: int) -> tuple[float, float, float]:
    """(both-at-once GB/s, h2d alone, d2h alone) of contiguous memcpys on two streams."""
    cp = ctx.cp
    nbytes = min(ctx.total, ctx.pool_bytes // 2)
    host = ctx.offloader(2 * MiB).cpu_tensors[0]
    hptr, dptr = int(host.ctypes.data), ctx.pool_ptr
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime
    both: list[float] = []
    alone: dict[str, list[float]] = {"h2d": [], "d2h": []}
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        rt.memcpyAsync(dptr, hptr, nbytes, _H2D, s1.ptr)
        rt.memcpyAsync(hptr + nbytes, dptr + nbytes, nbytes, _D2H, s2.ptr)
        s1.synchronize()
        s2.synchronize()
        if rep:
            both.append(time.perf_counter() - t0)
        for d, (dst, src, kind, s) in {"h2d": (dptr, hptr, _H2D, s1),
                                        "d2h": (hptr + nbytes, dptr + nbytes, _D2H, s2)}.items():
            t0 = time.perf_counter()
            rt.memcpyAsync(dst, src, nbytes, kind, s.ptr)
            s.synchronize()
            if rep:
                alone[d].append(time.perf_counter() - t0)
    return (2 * nbytes / statistics.median(both) / 1e9,
            nbytes / statistics.median(alone["h2d"]) / 1e9,
            nbytes / statistics.median(alone["d2h"]) / 1e9)


def section_overlap(ctx: Context) -> list[Row]:
    """A store and a load at once vs the bidirectional ceiling measured in the same run."""
    rows: list[Row] = []
    reps = max(ctx.reps, 3)
    ctx.progress("bidirectional ceiling")
    both, h2d, d2h = _bidir_ceiling(ctx, reps)
    rows.append(ctx.row("overlap", "ceiling", "both", 0, gbps=round(both, 2),
                        ceiling_gbps=round(both, 2), ratio=1.0, reps=reps,
                        note="two contiguous cudaMemcpyAsync on two streams at once",
                        extra={"h2d_alone": round(h2d, 2), "d2h_alone": round(d2h, 2)}))
    rng = np.random.default_rng(5)
    for page in (64 * KiB, 2 * MiB):
        off = ctx.offloader(page)
        n = ctx.pool_bytes // page
        half = min(n // 2, max(1, ctx.total // page))
        gp, cpm = rng.permutation(n), rng.permutation(n)
        gs, gl = gp[:half], gp[half: 2 * half]
        cs, cl = cpm[:half], cpm[half: 2 * half]
        for sp, lp in (("auto", "auto"), ("kernel", "kernel"), ("dma", "dma"),
                       ("dma", "kernel"), ("kernel", "dma")):
            for threads in (1, 2):
                ctx.progress(f"store {sp} + load {lp}, {fmt_size(page)} pages, {threads} thread(s)")
                walls, dev_s, dev_l = [], [], []
                moved = 0
                for rep in range(reps + 1):
                    t0 = time.perf_counter()
                    if threads == 1:
                        ts = off.store(gpu_blocks=gs, cpu_chunks=cs, path=sp)
                        tl = off.load(cpu_chunks=cl, gpu_blocks=gl, path=lp)
                    else:  # the store submitted from a second thread at the same time
                        box: list[Any] = []
                        def store(off: Any = off, g: Any = gs, c: Any = cs, sp: str = sp,
                                  box: list[Any] = box) -> None:
                            box.append(off.store(gpu_blocks=g, cpu_chunks=c, path=sp))

                        th = threading.Thread(target=store)
                        th.start()
                        tl = off.load(cpu_chunks=cl, gpu_blocks=gl, path=lp)
                        th.join()
                        ts = box[0]
                    rs, rl = ts.wait(120), tl.wait(120)
                    dt = time.perf_counter() - t0
                    moved = rs.bytes + rl.bytes
                    if rep:
                        walls.append(dt)
                        dev_s.append(rs.seconds)
                        dev_l.append(rl.seconds)
                wall = statistics.median(walls)
                gbps = moved / wall / 1e9
                name = f"{sp}/{lp}" + (" 2 threads" if threads == 2 else "")
                rows.append(ctx.row(
                    "overlap", name, "both", page, gbps=round(gbps, 2),
                    ceiling_gbps=round(both, 2), ratio=round(gbps / both, 3), bytes=moved,
                    seconds=wall, blocks=2 * half, reps=reps,
                    samples=[round(w, 6) for w in walls],
                    note=("store and load submitted back to back from one thread" if threads == 1
                          else "store submitted from a second thread while the load is"),
                    extra={"store_path": sp, "load_path": lp, "threads": threads,
                           "store_device_gbps": round(moved / 2 / statistics.median(dev_s) / 1e9,
                                                      2),
                           "load_device_gbps": round(moved / 2 / statistics.median(dev_l) / 1e9,
                                                     2),
                           "vllm_policy": sp == lp == "dma"}))
    return rows


# -- 5. interference with a matmul --------------------------------------------------------------
class _MatmulLoop:
    """A bf16 N^3 matmul loop on its own stream, fed by a thread, `depth` matmuls queued."""

    def __init__(self, torch: Any, n: int = MATMUL_N, depth: int = 6) -> None:
        self.torch = torch
        self.a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty((n, n), device="cuda", dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream()
        self.flop = 2.0 * n**3
        self.depth = depth
        self.done = 0
        self.ends: list[Any] = []
        self.base: Any = None

    def _run(self, stop: threading.Event) -> None:
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
                marker_stream: Any) -> tuple[float, Any]:
        """TFLOP/s of the matmuls while `during(keep_going)` runs, and what it returned.

        The window is marked by timing events on an idle stream (they complete at once);
        every matmul's share of the window counts (the queue never runs dry)."""
        torch = self.torch
        self.done = 0
        self.ends = []
        self.base = torch.cuda.Event(enable_timing=True)
        self.base.record(self.stream)
        stop = threading.Event()
        th = threading.Thread(target=self._run, args=(stop,), daemon=True)
        th.start()
        t_wait = time.perf_counter()
        while self.done < 2 and time.perf_counter() - t_wait < 10:
            time.sleep(0.001)
        m0 = torch.cuda.Event(enable_timing=True)
        m1 = torch.cuda.Event(enable_timing=True)
        m0.record(marker_stream)
        snap = self.done
        t0 = time.perf_counter()

        def keep_going() -> bool:
            el = time.perf_counter() - t0
            return el < min_s or (self.done - snap < 4 and el < 6 * min_s)

        try:
            result = during(keep_going)
        finally:
            m1.record(marker_stream)
            stop.set()
            th.join(60)
        torch.cuda.synchronize()
        w0, w1 = self.base.elapsed_time(m0), self.base.elapsed_time(m1)
        ends = [self.base.elapsed_time(e) for e in self.ends]
        work = 0.0
        for s, e in zip(ends, ends[1:]):  # matmul k runs (end k-1, end k]
            if e <= s:
                continue
            ov = max(0.0, min(e, w1) - max(s, w0))
            work += ov / (e - s)
        tflops = work * self.flop / ((w1 - w0) / 1e3) / 1e12 if w1 > w0 else 0.0
        return tflops, result


def _transfer_loop(off: Any, direction: str, path: str, ids: list[tuple[Any, Any]],
                   side: Any, keep_going: Callable[[], bool]) -> tuple[int, float]:
    """Transfers of `ids` (cycled), two in flight, on the idle `side` stream."""
    inflight: deque[Any] = deque()
    moved = 0
    i = 0
    t0 = time.perf_counter()
    while keep_going():
        g, c = ids[i % len(ids)]
        if direction == "d2h":
            t = off.store(gpu_blocks=g, cpu_chunks=c, path=path, stream=side)
        else:
            t = off.load(cpu_chunks=c, gpu_blocks=g, path=path, stream=side)
        inflight.append(t)
        i += 1
        if len(inflight) >= 2:
            moved += inflight.popleft().wait(120).bytes
    while inflight:
        moved += inflight.popleft().wait(120).bytes
    return moved, time.perf_counter() - t0


def _staged_store_loop(ctx: Context, off: Any, page: int, ids: list[tuple[Any, Any]],
                       side: Any, keep_going: Callable[[], bool]) -> tuple[int, float]:
    """Prototype of staged stores: gather blocks into a contiguous device buffer
    (index_select), then one cudaMemcpyAsync D2H to a contiguous host run."""
    torch, cp = ctx.torch, ctx.cp
    n = ctx.pool_bytes // page
    view = ctx.pool[: n * page].view(n, page)
    k = len(ids[0][0])
    idx = [torch.as_tensor(np.asarray(g, dtype=np.int64), device="cuda") for g, _ in ids]
    bufs = [torch.empty((k, page), dtype=torch.uint8, device="cuda") for _ in range(2)]
    host = off.cpu_tensors[0]
    hptrs = [int(host[j * k].ctypes.data) for j in range(2)]
    moved = 0
    i = 0
    done_ev: deque[Any] = deque()
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        while keep_going():
            j = i % 2
            if len(done_ev) >= 2:
                done_ev.popleft().synchronize()
            torch.index_select(view, 0, idx[i % len(idx)], out=bufs[j])
            cp.cuda.runtime.memcpyAsync(hptrs[j], int(bufs[j].data_ptr()), k * page, _D2H,
                                        side.cuda_stream)
            ev = torch.cuda.Event(blocking=True)
            ev.record(side)
            done_ev.append(ev)
            moved += k * page
            i += 1
        side.synchronize()
    return moved, time.perf_counter() - t0


def _hiprio_offloader(ctx: Context, page: int) -> Any:
    """An offloader over the pool whose copy streams have the highest stream priority
    (an experiment: the backend's new_stream is replaced on this instance only)."""
    from ._backends._cuda import CudaBackend, CudaStream

    cp = ctx.cp
    backend = CudaBackend(0, "torch")
    try:
        _, greatest = cp.cuda.runtime.deviceGetStreamPriorityRange()
    except Exception:
        greatest = -1

    def new_stream() -> CudaStream:
        backend.warm_up()
        with cp.cuda.Device(0):
            raw = cp.cuda.Stream(non_blocking=True, priority=int(greatest))
        return CudaStream(raw.ptr, raw, 0)

    backend.new_stream = new_stream  # type: ignore[method-assign]
    n = ctx.pool_bytes // page
    return ctx.make_offloader([ctx.pool[: n * page].view(n, page)], n, backend=backend)


def section_interference(ctx: Context) -> list[Row]:
    """bf16 8192^3 matmul TFLOP/s alone and during each path's 16/256 KiB transfers."""
    torch = ctx.torch
    rows: list[Row] = []
    window = 0.4
    chunk = 64 * MiB
    mm = _MatmulLoop(torch)
    side = torch.cuda.Stream()  # idle: transfers must not wait for the matmuls
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # the feeder thread gets the GIL promptly

    def idle(keep_going: Callable[[], bool]) -> tuple[int, float]:
        t0 = time.perf_counter()
        while keep_going():
            time.sleep(0.005)
        return 0, time.perf_counter() - t0

    alone: list[float] = []
    try:
        ctx.progress("matmul alone")
        mm.measure(idle, 0.2, side)  # warm-up (cuBLAS heuristics, clocks)
        tf, _ = mm.measure(idle, window, side)
        alone.append(tf)
        rows.append(ctx.row("interference", "alone", "", 0, tflops=round(tf, 1),
                            note="matmul loop alone (start)"))
        rng = np.random.default_rng(6)
        for page in (16 * KiB, 256 * KiB):
            base_off = ctx.offloader(page)
            hi_off = _hiprio_offloader(ctx, page)
            n = ctx.pool_bytes // page
            k = chunk // page
            ids = [(rng.permutation(n)[:k], rng.permutation(n)[:k]) for _ in range(4)]
            for direction in ("h2d", "d2h"):
                ceil = ctx.ceiling(direction)
                vllm = ("kernel", 12) if direction == "h2d" and page < 28 * KiB else ("dma", 0)
                cases: list[tuple[str, str, int]] = [
                    ("kernel@16", "kernel", 16), ("kernel@8", "kernel", 8),
                    ("kernel@4", "kernel", 4), ("dma", "dma", 0), ("auto", "auto", 0),
                    ("vllm-policy", vllm[0], vllm[1]), ("kernel@16-hiprio", "kernel", 16),
                    ("kernel@4-hiprio", "kernel", 4), ("dma-hiprio", "dma", 0)]
                if direction == "d2h":
                    cases.append(("staged-proto", "staged", 0))
                for name, path, grid in cases:
                    ctx.progress(f"{fmt_size(page)} {direction} {name}")
                    off = hi_off if name.endswith("-hiprio") else base_off
                    old_grid = off.backend.grid
                    if grid:
                        off.backend.grid = grid
                    before = dict(off.backend.counts)
                    try:
                        if path == "staged":
                            def during(kg: Callable[[], bool], off: Any = off, page: int = page,
                                       ids: list[tuple[Any, Any]] = ids) -> tuple[int, float]:
                                return _staged_store_loop(ctx, off, page, ids, side, kg)
                        else:
                            # warm-up (table upload, first launch) outside the window
                            g0, c0 = ids[0]
                            w = (off.store(gpu_blocks=g0, cpu_chunks=c0, path=path, stream=side)
                                 if direction == "d2h" else
                                 off.load(cpu_chunks=c0, gpu_blocks=g0, path=path, stream=side))
                            w.wait(120)

                            def during(  # type: ignore[misc]
                                       kg: Callable[[], bool], off: Any = off,
                                       direction: str = direction, path: str = path,
                                       ids: list[tuple[Any, Any]] = ids) -> tuple[int, float]:
                                return _transfer_loop(off, direction, path, ids, side, kg)
                        tf, (moved, wall) = mm.measure(during, window, side)
                    finally:
                        off.backend.grid = old_grid
                    ran = [p for p in ("kernel", "dma") if off.backend.counts[p] > before.get(p, 0)]
                    gbps = moved / wall / 1e9 if wall > 0 else 0.0
                    label = "+".join(ran) if path != "staged" else "index_select + 1 memcpy"
                    rows.append(ctx.row(
                        "interference", name, direction, page, tflops=round(tf, 1),
                        gbps=round(gbps, 2), ceiling_gbps=round(ceil, 2),
                        ratio=round(gbps / ceil, 3), bytes=moved, seconds=wall,
                        note=f"ran {label}" + (f", {grid} CTAs" if grid else ""),
                        extra={"grid": grid or (old_grid if path in ("kernel", "auto") else 0)}))
        ctx.progress("matmul alone (end)")
        tf, _ = mm.measure(idle, window, side)
        alone.append(tf)
        rows.append(ctx.row("interference", "alone", "", 0, tflops=round(tf, 1),
                            note="matmul loop alone (end)"))
    finally:
        sys.setswitchinterval(old_switch)
    ref = statistics.mean(alone) if alone else 0.0
    for r in rows:
        if r.path != "alone" and ref > 0:
            r.extra["tflops_ratio"] = round(r.tflops / ref, 3)
    return rows


# -- 6. priority --------------------------------------------------------------------------------
async def _behind(off: Any, big: tuple[Any, Any], small: tuple[Any, Any], big_path: str,
                  small_path: str, urgent: bool) -> tuple[float, float]:
    """(seconds from submitting the small load to its await returning, big load seconds)."""
    bg, bc = big
    sg, sc = small
    t0 = time.perf_counter()
    tb = off.load(cpu_chunks=bc, gpu_blocks=bg, path=big_path)
    t1 = time.perf_counter()
    ts = off.load(cpu_chunks=sc, gpu_blocks=sg, path=small_path, urgent=urgent)
    await ts
    t2 = time.perf_counter()
    await tb
    t3 = time.perf_counter()
    return t2 - t1, t3 - t0


def section_priority(ctx: Context) -> list[Row]:
    """A small load right behind a 512 MiB load: FIFO (urgent=False) vs urgent=True.

    Two kinds of big load: 4 KiB pages in contiguous runs (one copy per piece) on the DMA and
    the kernel path, and random 256 KiB pages on DMA (batched, fanned out over the helper
    streams: what the copy engines do not let a later copy pass), with the small load on
    "auto" (which sends an urgent one to the kernel) and on DMA.
    """
    rows: list[Row] = []
    big_bytes = min(512 * MiB, ctx.pool_bytes // 2)
    reps = 10
    rng = np.random.default_rng(6)
    cases = [(4 * KiB, False, "dma", "dma"), (4 * KiB, False, "kernel", "kernel"),
             (256 * KiB, True, "dma", "auto"), (256 * KiB, True, "dma", "dma")]
    for page, scattered, big_path, small_path in cases:
        off = ctx.offloader(page)
        n = ctx.pool_bytes // page
        k = big_bytes // page
        kind = "random" if scattered else "contiguous"
        for urgent in (False, True):
            if scattered and not urgent and small_path == "auto":
                continue  # FIFO behind is FIFO whatever the path
            ctx.progress(f"{fmt_size(page)} behind {fmt_size(big_bytes)} {kind}, path "
                         f"{big_path}/{small_path}, urgent={urgent}")
            lat, bigs = [], []
            for rep in range(reps + 2):
                if scattered:
                    big = (rng.permutation(k), rng.permutation(k))
                else:
                    big = (np.arange(k, dtype=np.int64), np.arange(k, dtype=np.int64))
                j = k + 1 + rep % max(1, n - k - 1)
                small = (np.asarray([j]), np.asarray([j]))
                a, b = asyncio.run(_behind(off, big, small, big_path, small_path, urgent))
                if rep >= 2:
                    lat.append(a)
                    bigs.append(b)
            p50, _ = _us(lat)
            label = big_path if big_path == small_path else f"{big_path}/{small_path}"
            rows.append(ctx.row("priority", label, "h2d", page, p50_us=p50,
                                p99_us=round(max(lat) * 1e6, 2), reps=reps, bytes=page,
                                samples=[round(x, 7) for x in lat],
                                seconds=statistics.median(bigs),
                                note=f"urgent={urgent}; big load {fmt_size(big_bytes)} in "
                                     f"{kind} {fmt_size(page)} pages on {big_path} took "
                                     f"{statistics.median(bigs)*1e3:.1f} ms",
                                extra={"urgent": urgent, "big_bytes": big_bytes,
                                       "big_pages": kind, "small_path": small_path}))
    return rows


# -- 7. layer-wise loads ------------------------------------------------------------------------
def section_layerwise(ctx: Context) -> list[Row]:
    """load_layerwise + per-layer compute vs load-everything-then-compute (32 layers)."""
    torch = ctx.torch
    rows: list[Row] = []
    layers, blocks, page = 32, 512, 32 * KiB
    tensors = [torch.zeros((blocks, page), dtype=torch.uint8, device="cuda")
               for _ in range(2 * layers)]
    off = ctx.make_offloader(tensors, blocks)
    spec = [[2 * i, 2 * i + 1] for i in range(layers)]
    rng = np.random.default_rng(7)
    g, c = rng.permutation(blocks), rng.permutation(blocks)
    comp = torch.cuda.Stream()
    m = 4096
    a = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((m, m), device="cuda", dtype=torch.bfloat16)
    out = torch.empty((m, m), device="cuda", dtype=torch.bfloat16)

    def ev() -> Any:
        return torch.cuda.Event(enable_timing=True)

    def compute(reps: int) -> None:
        with torch.cuda.stream(comp):
            for _ in range(reps):
                torch.matmul(a, b, out=out)

    nreps = 5
    for path in ("auto", "dma"):
        ctx.progress(f"calibrate per-layer compute, path {path}")
        load_dev, load_wall = [], []
        for rep in range(3):
            t0 = time.perf_counter()
            r = off.load(cpu_chunks=c, gpu_blocks=g, path=path, stream=comp).wait(60)
            if rep:
                load_wall.append(time.perf_counter() - t0)
                load_dev.append(r.seconds)
        load_s = statistics.median(load_dev)
        e0, e1 = ev(), ev()
        compute(3)
        e0.record(comp)
        compute(20)
        e1.record(comp)
        e1.synchronize()
        t_mm = e0.elapsed_time(e1) / 1e3 / 20
        per_layer = max(1, round(load_s / layers / t_mm))
        e0.record(comp)
        for _ in range(layers):
            compute(per_layer)
        e1.record(comp)
        e1.synchronize()
        compute_s = e0.elapsed_time(e1) / 1e3

        submit_s: list[float] = []

        async def one(mode: str, path: str = path, per_layer: int = per_layer,
                      submit_s: list[float] = submit_s) -> tuple[float, float]:
            """(total, time to first layer) in device seconds from before the load."""
            base, first, end = ev(), ev(), ev()
            base.record(comp)
            if mode == "serial-await":  # host waits for the whole load, then computes
                await off.load(cpu_chunks=c, gpu_blocks=g, path=path, stream=comp)
                first.record(comp)
                for _ in range(layers):
                    compute(per_layer)
                end.record(comp)
            else:
                s0 = time.perf_counter()
                lt = off.load_layerwise(cpu_chunks=c, gpu_blocks=g, layers=spec, path=path,
                                        stream=comp)
                submit_s.append(time.perf_counter() - s0)
                for i in range(layers):
                    if mode == "layerwise":
                        lt.wait_layer(i, comp)
                    elif i == 0:  # serial: the device waits for the last layer first
                        lt.wait_layer(layers - 1, comp)
                    if i == 0:
                        first.record(comp)
                    compute(per_layer)
                end.record(comp)
                await lt
            end.synchronize()
            return base.elapsed_time(end) / 1e3, base.elapsed_time(first) / 1e3

        async def all_reps(path: str = path) -> dict[str, list[tuple[float, float]]]:
            res: dict[str, list[tuple[float, float]]] = {
                "serial": [], "serial-await": [], "layerwise": []}
            for rep in range(nreps + 1):
                for mode, vals in res.items():
                    ctx.progress(f"{mode} rep {rep}, path {path}")
                    v = await one(mode)
                    if rep:
                        vals.append(v)
            return res

        results = asyncio.run(all_reps())
        for mode, vals in results.items():
            total = statistics.median(v[0] for v in vals)
            ttfl = statistics.median(v[1] for v in vals)
            nbytes = 2 * layers * blocks * page
            rows.append(ctx.row(
                "layerwise", mode, "h2d", page, seconds=total, reps=nreps, bytes=nbytes,
                blocks=blocks, gbps=round(nbytes / total / 1e9, 2), note=f"path {path}",
                samples=[round(v[0], 6) for v in vals],
                extra={"path": path, "ttfl_s": ttfl, "load_s": load_s,
                       "load_wall_s": statistics.median(load_wall), "compute_s": compute_s,
                       "matmuls_per_layer": per_layer, "matmul_s": t_mm,
                       "load_layerwise_call_s": statistics.median(submit_s) if submit_s else 0,
                       "layers": layers, "layer_bytes": 2 * blocks * page}))
    off.close()
    return rows


SERVING_SECTIONS: dict[str, Callable[[Context], list[Row]]] = {
    "latency": section_latency,
    "hostcost": section_hostcost,
    "smallrate": section_smallrate,
    "overlap": section_overlap,
    "interference": section_interference,
    "priority": section_priority,
    "layerwise": section_layerwise,
}


# -- summary ------------------------------------------------------------------------------------
def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


def serving_summary(rows: list[Row]) -> str:
    """One table: each measurement, its reference or ceiling, the ratio, target, met."""
    mine = [r for r in rows if r.section in {*SERVING_SECTIONS, "latency-cpu"}
            and r.path != "error"]
    if not mine:
        return ""
    lines: list[tuple[str, str, str, str, str, str]] = []

    def add(what: str, value: str, ref: str = "", ratio: str = "", target: str = "",
            ok: bool | None = None) -> None:
        lines.append((what, value, ref, ratio, target, _met(ok)))

    lat = [r for r in mine if r.section == "latency"]
    sync = next((r for r in lat if r.path == "ref-sync"), None)
    for r in lat:
        ours = r.path.startswith("kvasync")
        ref = f"sync {sync.p50_us:.1f} / {sync.p99_us:.1f}" if sync and ours else ""
        ratio = f"{r.p50_us / sync.p50_us:.2f}x sync" if sync and ours else ""
        extra = f" (call {r.extra['submit_p50_us']:.1f}" if "submit_p50_us" in r.extra else ""
        if "device_p50_us" in r.extra:
            extra += f", device {r.extra['device_p50_us']:.1f}"
        extra += ")" if extra else ""
        ok = (r.p50_us <= LAT_P50_US and r.p99_us <= LAT_P99_US) if r.path in (
            "kvasync-hybrid",) else None
        add(f"latency 4 KiB {r.path}", f"p50 {r.p50_us:.1f} p99 {r.p99_us:.1f} us{extra}",
            ref, ratio, f"p50<={LAT_P50_US:g} p99<={LAT_P99_US:g}" if ok is not None else "",
            ok)
    for r in (r for r in mine if r.section == "latency-cpu"):
        ours = r.path in ("kvasync-hybrid", "kvasync-thread")
        add(f"CPU awaiting {fmt_size(r.bytes)} {r.path}",
            f"{r.cpu_frac:.1%} of a core ({r.seconds * 1e3:.1f} ms)", "", "",
            f"<={CPU_MAX:.0%}" if ours else "", (r.cpu_frac <= CPU_MAX) if ours else None)
    hc = sorted((r for r in mine if r.section == "hostcost"), key=lambda r: (r.path, r.blocks))
    for r in hc:
        ok = (r.p50_us <= STORE_64_US) if r.blocks == 64 and r.path == "auto" else None
        bp = r.extra.get("build_plan_p50_us")
        add(f"store() {r.blocks} blk x {r.extra.get('tensors', 0)} tensors {r.path}",
            f"p50 {r.p50_us:.1f} p99 {r.p99_us:.1f} us",
            r.note + (f"; build_plan alone {bp:.1f} us" if bp is not None else ""), "",
            f"<={STORE_64_US:g} us" if ok is not None else "", ok)
    for path in ("auto", "kernel", "dma"):
        pts = {r.blocks: r.p50_us for r in hc if r.path == path}
        if 64 in pts and 512 in pts and pts[64] > 0:
            growth = pts[512] / pts[64]
            add(f"store() growth 64->512 blocks {path}", f"{growth:.2f}x (linear: 8x)", "", "",
                "sub-linear" if path == "auto" else "", (growth < 8) if path == "auto" else None)
    for r in (r for r in mine if r.section == "smallrate"):
        if r.path == "inflight":
            x = r.extra
            ok = x["lost"] == 0 and x["completed_in_order"] and x["results_match_ids"]
            add("10,000 loads in flight", f"{x['resolved']} resolved, {x['lost']} lost, "
                f"in order {x['completed_in_order']}, {r.seconds * 1e3:.0f} ms", "", "",
                "all, in order", ok)
        else:
            ok = r.rate >= SMALL_RATE if r.path == "auto" and r.direction == "h2d" else None
            add(f"awaited 64 KiB {r.direction} {r.path}, 64 tasks", f"{r.rate:,.0f}/s",
                r.note, "", f">={SMALL_RATE:,.0f}/s" if ok is not None else "", ok)
    for r in (r for r in mine if r.section == "overlap"):
        if r.path == "ceiling":
            add("bidirectional ceiling", f"{r.gbps:.1f} GB/s",
                f"h2d {r.extra['h2d_alone']:.1f} + d2h {r.extra['d2h_alone']:.1f} alone")
            continue
        name = r.path + (" (= vLLM policy)" if r.extra.get("vllm_policy") else "")
        ok = r.ratio >= OVERLAP_MIN if r.path == "auto/auto" else None
        add(f"store+load {fmt_size(r.page_bytes)} {name}", f"{r.gbps:.1f} GB/s",
            f"ceiling {r.ceiling_gbps:.1f}; device st {r.extra.get('store_device_gbps', 0):.1f}"
            f" ld {r.extra.get('load_device_gbps', 0):.1f}", f"{r.ratio:.0%}",
            f">={OVERLAP_MIN:.0%}" if ok is not None else "", ok)
    inter = [r for r in mine if r.section == "interference"]
    for r in inter:
        if r.path == "alone":
            add(f"matmul alone ({r.note.split('(')[-1].rstrip(')')})", f"{r.tflops:.0f} TFLOP/s")
            continue
        tr = r.extra.get("tflops_ratio", 0.0)
        ok = (tr >= MM_KEEP and r.ratio >= LINK_KEEP) if r.path == "auto" else None
        add(f"interf. {fmt_size(r.page_bytes)} {r.direction} {r.path}",
            f"{r.tflops:.0f} TFLOP/s, {r.gbps:.1f} GB/s", f"link {r.ceiling_gbps:.1f}",
            f"mm {tr:.0%} link {r.ratio:.0%}",
            f"mm>={MM_KEEP:.0%} & link>={LINK_KEEP:.0%}" if ok is not None else "", ok)
    best = _best_tradeoffs(inter)
    for key, r in best.items():
        add(f"best trade-off {key}", f"{r.path}: mm {r.extra.get('tflops_ratio', 0):.0%}, "
            f"link {r.ratio:.0%}", "", "", "")
    prio = [r for r in mine if r.section == "priority"]
    for r in prio:
        urgent = bool(r.extra.get("urgent"))
        ok = (r.p50_us / 1e3 < URGENT_MS and r.p99_us / 1e3 < URGENT_MS) if urgent else None
        add(f"{fmt_size(r.page_bytes)} behind {fmt_size(r.extra.get('big_bytes', 0))} "
            f"{r.extra.get('big_pages', 'contiguous')[:6]} {r.path} urgent={urgent}",
            f"p50 {r.p50_us / 1e3:.3f} max {r.p99_us / 1e3:.3f} ms",
            f"big load {r.seconds * 1e3:.1f} ms", "",
            f"<{URGENT_MS:g} ms" if urgent else "", ok)
    lw = [r for r in mine if r.section == "layerwise"]
    for path in sorted({r.extra.get("path", "") for r in lw}):
        group = {r.path: r for r in lw if r.extra.get("path") == path}
        ser, lay = group.get("serial"), group.get("layerwise")
        for r in group.values():
            x = r.extra
            call = x.get("load_layerwise_call_s", 0.0)
            add(f"32 layers {r.path} ({path})",
                f"{r.seconds * 1e3:.2f} ms, first layer {x['ttfl_s'] * 1e3:.2f} ms",
                f"load {x['load_s'] * 1e3:.2f} + compute {x['compute_s'] * 1e3:.2f} ms"
                + (f"; load_layerwise() call {call * 1e3:.2f} ms" if call else ""), "", "")
        if ser and lay:
            ideal = max(lay.extra["load_s"], lay.extra["compute_s"])
            add(f"layer-wise speed-up ({path})", f"{ser.seconds / lay.seconds:.2f}x",
                f"ideal total >= {ideal * 1e3:.2f} ms", f"{ideal / lay.seconds:.0%} of ideal",
                "overlap shown", lay.seconds < ser.seconds)
    heads = ("measurement", "ours", "reference / ceiling", "ratio", "target", "met")
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(heads)]
    out = ["serving summary (issue 5):",
           "  ".join(h.ljust(w) for h, w in zip(heads, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def _best_tradeoffs(inter: list[Row]) -> dict[str, Row]:
    """Per (page, direction): the case with the best matmul share among those moving >= 90%
    of the link (else the fastest transfer)."""
    best: dict[str, Row] = {}
    for r in inter:
        if r.path == "alone":
            continue
        key = f"{fmt_size(r.page_bytes)} {r.direction}"
        cur = best.get(key)

        def score(x: Row) -> tuple[int, float]:
            ok = x.ratio >= LINK_KEEP
            return (1, x.extra.get("tflops_ratio", 0.0)) if ok else (0, x.ratio)

        if cur is None or score(r) > score(cur):
            best[key] = r
    return best


# -- plots --------------------------------------------------------------------------------------
def plot_serving(rows: list[Row], out: Path) -> list[Path]:
    """latency_cdf.png and interference.png under `out` (what the rows allow)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []

    made: list[Path] = []
    shown = ("kvasync-hybrid", "kvasync-thread", "kvasync-hybrid+wakefix", "diag-spin-poll")
    lat = [r for r in rows if r.section == "latency" and r.samples
           and (r.path in shown or r.path.startswith("ref-"))]
    if lat:
        fig, ax = plt.subplots(figsize=(9, 5))
        for r in lat:
            xs = np.sort(np.asarray(r.samples) * 1e6)
            ys = np.arange(1, len(xs) + 1) / len(xs)
            style = "-" if r.path.startswith("kvasync") else "--"
            ax.plot(xs, ys, style, lw=2 if r.path.startswith("kvasync") else 1.2,
                    label=f"{r.path} (p50 {r.p50_us:.1f}, p99 {r.p99_us:.1f} us)")
        ax.axvline(LAT_P50_US, color="gray", ls=":", lw=1)
        ax.axvline(LAT_P99_US, color="gray", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("round trip of a 4 KiB H2D copy (us, log)")
        ax.set_ylabel("fraction of 2000 reps")
        ax.set_title("completion latency: submit -> await returns")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out / "latency_cdf.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    inter = [r for r in rows if r.section == "interference" and r.path != "alone"]
    alone = [r.tflops for r in rows if r.section == "interference" and r.path == "alone"]
    if inter:
        groups = sorted({(r.page_bytes, r.direction) for r in inter},
                        key=lambda x: (x[1], x[0]))
        fig, axes = plt.subplots(2, len(groups), figsize=(5 * len(groups), 7.5), squeeze=False)
        for j, (page, direction) in enumerate(groups):
            sub = [r for r in inter if r.page_bytes == page and r.direction == direction]
            names = [r.path for r in sub]
            x = np.arange(len(sub))
            ax = axes[0][j]
            ax.bar(x, [r.tflops for r in sub], color="tab:blue")
            if alone:
                ax.axhline(statistics.mean(alone), color="k", ls=":", lw=1, label="alone")
                ax.axhline(MM_KEEP * statistics.mean(alone), color="r", ls=":", lw=1,
                           label=f"{MM_KEEP:.0%} of alone")
            ax.set_title(f"{fmt_size(page)} {direction}")
            ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            ax2 = axes[1][j]
            ax2.bar(x, [r.gbps for r in sub], color="tab:orange")
            if sub:
                ax2.axhline(sub[0].ceiling_gbps, color="k", ls=":", lw=1, label="link")
                ax2.axhline(LINK_KEEP * sub[0].ceiling_gbps, color="r", ls=":", lw=1,
                            label=f"{LINK_KEEP:.0%} of link")
            ax2.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
            ax2.grid(alpha=0.3, axis="y")
            if j == 0:
                ax.set_ylabel("matmul TFLOP/s")
                ax2.set_ylabel("transfer GB/s")
                ax.legend(fontsize=7)
                ax2.legend(fontsize=7)
        fig.suptitle("bf16 8192^3 matmul loop during transfers (transfers on an idle side "
                     "stream)")
        fig.tight_layout()
        path = out / "interference.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made
