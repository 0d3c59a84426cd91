"""Closing, dropping and interrupting an offloader from every thread and callback.

What must hold whatever the order: no copy runs into released memory, no thread or host
memory outlives the offloader, and a close that could not finish is finished by the next
close, by the last transfer in flight, or by garbage collection. Cases that used to crash
the interpreter run in a subprocess; every test has a timeout, so a deadlock fails.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support import Gate

import kvasync as kv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




@pytest.fixture(params=["eager", "lazy"])
def thread_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The host backend's eager completion thread, or CUDA's lazy one (polled by callers,
    parks when idle): closing and collection must stop either."""
    if request.param == "lazy":
        from kvasync._backends._host import HostBackend
        from kvasync._scheduler import DirectionQueue

        monkeypatch.setattr(HostBackend, "poll_from_await", True)
        monkeypatch.setattr(DirectionQueue, "LAZY_THREAD", True)
        monkeypatch.setattr(DirectionQueue, "PARK_AFTER", 0.02)
    kind: str = request.param
    return kind


def make(blocks: int = 64, page: int = 1024, chunks: int = 64, **kw: Any) -> tuple[
    list[np.ndarray], kv.Offloader
]:
    gpu = [np.random.default_rng(i).integers(0, 256, (blocks, page), dtype=np.uint8)
           for i in range(2)]
    return gpu, kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), chunks, backend="host", **kw)


def kvasync_threads() -> list[threading.Thread]:
    """Threads kvasync started (completion and host stream threads), not the test's gate."""
    return [t for t in threading.enumerate()
            if t.name.startswith("kvasync-") and t.name != "kvasync-host"]


def until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


RELEASED = {"completion_threads": 0, "resolver_tasks": 0, "stream_threads": 0,
            "host_bytes": 0, "inflight": 0}


def released(off: kv.Offloader) -> bool:
    return off._resources() == RELEASED


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `body` in a fresh interpreter (a crash there is a return code, not a dead run).
    A script still running 5 s before `timeout` prints every thread's stack to its stderr
    and exits 1, so a hang fails the test with where it hung."""
    prelude = textwrap.dedent(f"""
        import faulthandler
        faulthandler.dump_traceback_later({max(timeout - 5, 1)}, exit=True)
        import gc, os, signal, sys, threading, time, warnings
        import numpy as np
        import kvasync as kv
        from kvasync._backends._host import HostStream

        def gate():
            ev = threading.Event()
            s = HostStream(name="test-gate")
            s.enqueue(ev.wait)
            return ev, s

        def make(blocks=64, page=4096, chunks=64):
            gpu = [np.full((blocks, page), 7, np.uint8) for _ in range(2)]
            return gpu, kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), chunks, backend="host")
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# -- close(timeout) with copies queued ----------------------------------------------------------


@pytest.mark.timeout(90)
def test_close_with_timeout_never_unmaps_under_a_queued_copy() -> None:
    """The copies run after close(timeout) gave up: they must find their memory mapped."""
    proc = run_script("""
        ev, g = gate()
        gpu, off = make()
        st = off.store(gpu_blocks=list(range(32)), cpu_chunks=list(range(32)), stream=g)
        ld = off.load(cpu_chunks=list(range(32, 64)), gpu_blocks=list(range(32, 64)), stream=g)
        try:
            off.close(timeout=0.2)
            raise SystemExit("close(timeout) returned with copies queued")
        except TimeoutError:
            pass
        ev.set()
        assert st.wait(10).success and ld.wait(10).success
        assert (gpu[0][32:] == 0).all()  # the load read chunks nothing stored to (zeros)
        off.close()
        g.close()
        print("ok")
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "ok"


@pytest.mark.timeout(60)
def test_close_timeout_raises_refuses_work_and_the_last_copy_releases(gate: Gate, thread_kind: str) -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[1, 2], cpu_chunks=[3, 4], stream=gate.stream)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="in flight"):
        off.close(timeout=0.2)
    assert time.monotonic() - start < 5
    assert off.closed
    with pytest.raises(kv.OffloaderClosedError):
        off.store(gpu_blocks=[0], cpu_chunks=[0])
    res = off._resources()
    assert res["host_bytes"] > 0 and res["inflight"] == 1 and res["completion_threads"] == 1
    gate.open()
    assert t.wait(10).success
    # nobody calls close() again: the completion of the last transfer released everything
    assert until(lambda: released(off) and not kvasync_threads())
    off.close()  # and a later close is a no-op
    assert released(off)


@pytest.mark.timeout(60)
def test_close_timeout_then_blocking_close_finishes(gate: Gate) -> None:
    gpu, off = make()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(8)]
    with pytest.raises(TimeoutError):
        off.close(timeout=0.05)
    threading.Timer(0.2, gate.open).start()
    off.close()  # waits for the drain this time
    assert all(t.result().success for t in ts)
    assert released(off) and not kvasync_threads()


def test_close_with_timeout_when_idle_releases_at_once() -> None:
    for timeout in (0, 0.0, -1):
        gpu, off = make()
        assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10).success
        off.close(timeout=timeout)
        assert released(off) and not kvasync_threads()


# -- done-callbacks: exceptions and lifecycle calls --------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_base_exception_in_callback_keeps_the_completion_thread(
        exc: type[BaseException], caplog: pytest.LogCaptureFixture) -> None:
    gpu, off = make()
    seen: list[int] = []

    def bad(tr: kv.Transfer) -> None:
        raise exc

    with caplog.at_level(logging.ERROR, logger="kvasync"):
        t = off.store(gpu_blocks=[0], cpu_chunks=[0])
        t.add_done_callback(bad)
        t.add_done_callback(lambda tr: seen.append(tr.job_id))  # still runs
        assert t.wait(10).success
        for i in range(1, 5):  # the thread lives on: later transfers complete
            assert off.store(gpu_blocks=[i], cpu_chunks=[i]).wait(10).success
        assert off.drain_sync(10)
    assert seen == [0]
    assert exc.__name__ in caplog.text
    off.close()
    assert released(off) and not kvasync_threads()


@pytest.mark.timeout(60)
def test_base_exception_in_callback_is_reraised_on_the_callers_thread() -> None:
    """On the caller's own thread it belongs to the caller: raised after the bookkeeping."""
    gpu, off = make()
    t = off.store(gpu_blocks=[0], cpu_chunks=[0])
    t.wait(10)
    ran: list[str] = []

    def stop(tr: kv.Transfer) -> None:
        ran.append("stop")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        t.add_done_callback(stop)
    assert ran == ["stop"]
    assert off.store(gpu_blocks=[1], cpu_chunks=[1]).wait(10).success
    off.close()
    assert released(off)


def _lazy_offloader(monkeypatch: pytest.MonkeyPatch) -> tuple[list[np.ndarray], kv.Offloader]:
    """A host offloader with the CUDA backend's lazy thread: callers' wait() polls, so
    callbacks run on the caller's thread."""
    from kvasync._backends._host import HostBackend
    from kvasync._scheduler import DirectionQueue

    monkeypatch.setattr(HostBackend, "poll_from_await", True)
    monkeypatch.setattr(DirectionQueue, "LAZY_THREAD", True)
    gpu, off = make()
    assert all(q.lazy for q in off._queues.values())
    return gpu, off


@pytest.mark.timeout(60)
def test_system_exit_from_a_callback_run_by_a_polling_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiter that completed the transfer itself gets the SystemExit; the lane's
    bookkeeping is done first, so nothing hangs afterwards."""
    gpu, off = _lazy_offloader(monkeypatch)
    q = off._queues[("d2h", False)]
    hits: list[bool] = []
    for i in range(20):  # until the caller's own poll completes one
        t = off.store(gpu_blocks=[i], cpu_chunks=[i])

        def bye(tr: kv.Transfer) -> None:
            if threading.current_thread() is threading.main_thread():
                hits.append(True)
                raise SystemExit(3)

        t.add_done_callback(bye)
        try:
            t.wait(10)
        except SystemExit as e:
            assert e.code == 3
        if hits:
            break
    assert hits, "no callback ran on the waiting thread"
    assert q.inflight == 0 and off.drain_sync(10)
    assert off.store(gpu_blocks=[40], cpu_chunks=[40]).wait(10).success
    off.close()
    assert released(off)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [None, 1.0])
def test_close_inside_a_done_callback(gate: Gate, timeout: float | None,
                                      thread_kind: str) -> None:
    gpu, off = make()
    outcome: list[object] = []
    first_gate = Gate()  # holds the first store until its callback is registered
    first = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=first_gate.stream)
    later = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(1, 4)]

    def closer(tr: kv.Transfer) -> None:
        start = time.monotonic()
        try:
            off.close(timeout)
            outcome.append(time.monotonic() - start)
        except BaseException as exc:
            outcome.append(exc)

    first.add_done_callback(closer)
    first_gate.open()
    assert first.wait(10).success
    first_gate.stream.close()
    assert until(lambda: bool(outcome))
    assert isinstance(outcome[0], float) and outcome[0] < 0.5  # returned at once
    assert off.closed
    with pytest.raises(kv.OffloaderClosedError):
        off.store(gpu_blocks=[9], cpu_chunks=[9])
    assert off._resources()["host_bytes"] > 0  # three copies still queued
    gate.open()
    assert all(t.wait(10).success for t in later)  # accepted work still completes
    assert until(lambda: released(off) and not kvasync_threads())
    off.close()


@pytest.mark.timeout(60)
def test_close_in_callback_then_later_close_releases(gate: Gate) -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=gate.stream)
    t.add_done_callback(lambda tr: off.close())
    threading.Timer(0.1, gate.open).start()
    off.close()  # a blocking close racing the callback's close: both finish
    assert t.result().success
    assert released(off) and not kvasync_threads()


@pytest.mark.timeout(60)
def test_lifecycle_calls_inside_a_done_callback() -> None:
    """What each call does while kvasync completes a transfer (docs/errors.md)."""
    gpu, off = make()
    early = off.store(gpu_blocks=[0], cpu_chunks=[0])
    early.wait(10)
    report: dict[str, object] = {}
    done = threading.Event()

    def cb(tr: kv.Transfer) -> None:
        try:
            report["result"] = tr.wait(0).success  # itself: already done
            report["early"] = early.wait().job_id  # finished earlier: returns
            nxt = off.load(cpu_chunks=[0], gpu_blocks=[5])  # submitting works
            report["load"] = nxt
            for name, call in (("wait", lambda: nxt.wait(5)),
                               ("drain_sync", lambda: off.drain_sync(5))):
                try:
                    call()
                    report[name] = "returned"
                except RuntimeError as exc:
                    report[name] = str(exc)
        finally:
            done.set()

    t = off.store(gpu_blocks=[1], cpu_chunks=[1])
    t.add_done_callback(cb)
    assert done.wait(10)
    assert report["result"] is True and report["early"] == early.job_id
    assert "deadlock" in str(report["wait"]) and "done-callback" in str(report["wait"])
    assert "drain_sync" in str(report["drain_sync"])
    load = report["load"]
    assert isinstance(load, kv.Transfer) and load.wait(10).success
    assert (gpu[0][5] == off.cpu_tensors[0][0]).all()
    # outside a callback the same calls block as usual
    assert off.drain_sync(10)
    off.close()


@pytest.mark.timeout(60)
def test_event_loops_run_inside_a_done_callback(gate: Gate) -> None:
    """asyncio.run() inside a callback: awaiting an unfinished transfer raises instead of
    hanging the completion thread; aclose() there does not wait."""
    gpu, off = make()
    first_gate = Gate()
    first = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=first_gate.stream)
    held = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
    report: dict[str, object] = {}
    done = threading.Event()

    def cb(tr: kv.Transfer) -> None:
        try:
            report["self"] = asyncio.run(_await(tr)).success
            try:
                asyncio.run(_await(held))
                report["held"] = "returned"
            except RuntimeError as exc:
                report["held"] = str(exc)
            asyncio.run(off.aclose())
            report["aclose"] = off.closed
        finally:
            done.set()

    first.add_done_callback(cb)
    first_gate.open()
    assert done.wait(10)
    first_gate.stream.close()
    assert report["self"] is True and report["aclose"] is True
    assert "inside a done-callback would deadlock" in str(report["held"])
    gate.open()
    assert held.wait(10).success
    assert until(lambda: released(off) and not kvasync_threads())


# -- Ctrl-C during close -----------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_ctrl_c_during_close_then_close_again() -> None:
    proc = run_script("""
        # a runner that starts us in the background (`cmd &` without job control) hands
        # us SIGINT ignored, and Python then never raises KeyboardInterrupt: install it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        ev, g = gate()
        gpu, off = make()
        t = off.store(gpu_blocks=[1, 2], cpu_chunks=[1, 2], stream=g)
        main = threading.main_thread().ident
        threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        try:
            off.close()
            raise SystemExit("close() returned with a copy held")
        except KeyboardInterrupt:
            pass
        assert off.closed and not t.done()
        try:
            off.store(gpu_blocks=[0], cpu_chunks=[0])
            raise SystemExit("accepted work after an interrupted close")
        except kv.OffloaderClosedError:
            pass
        assert off._resources()["host_bytes"] > 0
        threading.Timer(0.2, ev.set).start()
        off.close()  # resumes: drains, then releases
        assert t.result().success
        res = off._resources()
        assert set(res.values()) == {0}, res
        g.close()
        time.sleep(0.05)
        assert threading.active_count() == 1, threading.enumerate()
        print("ok")
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "ok"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("step", ["join", "engine", "backend", "memory"])
def test_interrupted_release_step_is_finished_by_the_next_close(
        step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C may land in any release step: the next close() runs the rest."""
    from kvasync._backends._base import HostMemory
    from kvasync._completion import CompletionEngine
    from kvasync._scheduler import DirectionQueue

    gpu, off = make()
    assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10).success and off.load(cpu_chunks=[0], gpu_blocks=[1]).wait(10).success
    target: Any = {"join": DirectionQueue.join_thread, "engine": CompletionEngine.close,
                   "backend": type(off.backend).close, "memory": HostMemory.release}[step]
    owner: Any = {"join": DirectionQueue, "engine": CompletionEngine,
                  "backend": type(off.backend), "memory": HostMemory}[step]
    fired: list[bool] = []

    def interrupted(self: Any, *a: Any, **k: Any) -> None:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        target(self, *a, **k)

    monkeypatch.setattr(owner, target.__name__, interrupted)
    with pytest.raises(KeyboardInterrupt):
        off.close()
    assert fired and off.closed
    off.close()
    assert released(off) and not kvasync_threads()


# -- concurrent lifecycle calls ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_concurrent_closes_all_return_after_the_release(gate: Gate, thread_kind: str) -> None:
    gpu, off = make()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(16)]
    errors: list[BaseException] = []

    def close() -> None:
        try:
            off.close()
            assert released(off)
        except BaseException as exc:
            errors.append(exc)

    closers = [threading.Thread(target=close) for _ in range(4)]
    for c in closers:
        c.start()
    time.sleep(0.1)
    assert all(c.is_alive() for c in closers)  # they drain
    gate.open()
    for c in closers:
        c.join(20)
    assert not errors and not any(c.is_alive() for c in closers)
    assert all(t.result().success for t in ts)
    assert released(off) and not kvasync_threads()


@pytest.mark.timeout(60)
def test_submitters_racing_close_lose_nothing() -> None:
    """Each store either is accepted and completes before close() returns, or raises
    OffloaderClosedError; nothing is accepted and then dropped."""
    gpu, off = make()
    accepted: list[kv.Transfer] = []
    refused: list[int] = []
    go = threading.Event()

    def submit(k: int) -> None:
        go.wait()
        for i in range(200):
            try:
                accepted.append(off.store(gpu_blocks=[(k * 7 + i) % 64], cpu_chunks=[(k * 13 + i) % 64]))
            except kv.OffloaderClosedError:
                refused.append(i)

    workers = [threading.Thread(target=submit, args=(k,)) for k in range(3)]
    for w in workers:
        w.start()
    go.set()
    time.sleep(0.01)
    off.close()
    done_at_close = [t.done() for t in accepted]
    for w in workers:
        w.join(20)
    assert all(done_at_close)
    assert len(accepted) + len(refused) == 600
    assert all(t.result().success for t in accepted)
    assert released(off) and not kvasync_threads()


@pytest.mark.timeout(60)
def test_wait_in_one_thread_while_another_closes(gate: Gate) -> None:
    gpu, off = make()
    t = off.load(cpu_chunks=[0], gpu_blocks=[9], stream=gate.stream)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(t.wait(20)))
    waiter.start()
    closer = threading.Thread(target=off.close)
    closer.start()
    time.sleep(0.05)
    gate.open()
    waiter.join(20)
    closer.join(20)
    assert isinstance(got[0], kv.TransferResult) and got[0].success
    assert released(off)
    assert t.wait(0).success  # a finished transfer still answers after close


# -- asyncio -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_async_with_exit_cancelled_still_releases(gate: Gate) -> None:
    gpu, off = make()
    entered = asyncio.Event()
    held: list[kv.Transfer] = []

    async def body() -> None:
        async with off:
            held.append(off.store(gpu_blocks=[0], cpu_chunks=[0], stream=gate.stream))
            entered.set()
        # __aexit__ awaits the held store: cancelled there

    task = asyncio.create_task(body())
    await entered.wait()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert off.closed
    with pytest.raises(kv.OffloaderClosedError):
        off.store(gpu_blocks=[1], cpu_chunks=[1])
    gate.open()
    assert (await held[0]).success
    assert await asyncio.to_thread(until, lambda: released(off) and not kvasync_threads())


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_async_with_exit_while_another_loop_awaits(gate: Gate) -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[3], cpu_chunks=[3], stream=gate.stream)
    other: list[object] = []
    th = threading.Thread(target=lambda: other.append(asyncio.run(_await(t))))
    th.start()
    threading.Timer(0.1, gate.open).start()
    async with off:
        pass  # exit drains (awaiting in this loop) then closes
    th.join(20)
    assert isinstance(other[0], kv.TransferResult) and other[0].success
    for _ in range(3):
        await asyncio.sleep(0)  # this loop's resolver task sees the close and ends
    assert released(off)


async def _await(t: kv.Transfer) -> kv.TransferResult:
    return await t


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_close_on_the_loop_thread_with_awaiters(gate: Gate) -> None:
    gpu, off = make()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(4)]
    tasks = [asyncio.create_task(_await(t)) for t in ts]
    await asyncio.sleep(0.02)
    threading.Timer(0.1, gate.open).start()
    off.close()  # blocks this loop while it drains: completion does not need the loop
    results = await asyncio.gather(*tasks)
    assert [r.job_id for r in results] == [t.job_id for t in ts]
    assert await asyncio.to_thread(until, lambda: released(off))


# -- after close -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_every_call_after_close() -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[0], cpu_chunks=[0])
    off.close()
    for call in (lambda: off.store(gpu_blocks=[1], cpu_chunks=[1]), lambda: off.load(cpu_chunks=[1], gpu_blocks=[1]),
                 lambda: off.load_layerwise(cpu_chunks=[1], gpu_blocks=[1]), lambda: off.cpu_tensors):
        with pytest.raises(kv.OffloaderClosedError):
            call()
    assert t.wait(0).success and (await t).success
    assert off.drain_sync(0)
    await off.drain()
    off.close()
    await off.aclose()
    async with off:
        pass
    assert released(off)


# -- offloaders dropped without close() --------------------------------------------------------


@pytest.mark.timeout(60)
def test_dropped_offloaders_are_released_with_a_resource_warning(thread_kind: str) -> None:
    base = len(kvasync_threads())
    mems = []
    refs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):
            gpu, off = make(page=4096)
            assert off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1]).wait(10).success
            assert off.load(cpu_chunks=[0], gpu_blocks=[2]).wait(10).success
            mems += off._host_mem
            refs.append(weakref.ref(off))
            del off
        gc.collect()
    assert all(r() is None for r in refs)  # nothing of kvasync keeps an offloader alive
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(unclosed) == 30 and "unclosed kvasync.Offloader" in str(unclosed[0].message)
    assert all(m._release is None for m in mems)  # the host memory's finalizer ran
    assert until(lambda: len(kvasync_threads()) == base), kvasync_threads()


@pytest.mark.timeout(60)
def test_dropped_with_a_copy_in_flight_releases_after_it(gate: Gate, thread_kind: str) -> None:
    gpu, off = make()
    t = off.load(cpu_chunks=[0, 1], gpu_blocks=[5, 6], stream=gate.stream)
    mems = list(off._host_mem)
    ref = weakref.ref(off)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del off
        gc.collect()
    assert ref() is None and any(issubclass(w.category, ResourceWarning) for w in caught)
    assert all(m._release is not None for m in mems)  # held: the load still reads it
    gate.open()
    assert t.wait(10).success and (gpu[0][5] == 0).all()
    assert until(lambda: all(m._release is None for m in mems) and not kvasync_threads())


def test_closed_offloaders_give_no_resource_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpu, off = make()
        off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10)
        off.close()
        del off
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.timeout(120)
def test_dropped_offloaders_return_their_memory_and_threads() -> None:
    """30 offloaders with 8 MiB of written host memory each, dropped: RSS and the thread
    count come back (they grew by ~240 MB and 120 threads before)."""
    proc = run_script("""
        def rss():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        warnings.simplefilter("ignore", ResourceWarning)
        gpu, off = make(blocks=16, page=1 << 16, chunks=64)  # warm-up, then the baseline
        off.store(gpu_blocks=list(range(16)), cpu_chunks=list(range(16))).wait(10)
        off.close()
        del off
        gc.collect()
        base_rss, base_threads = rss(), threading.active_count()
        for _ in range(30):
            gpu, off = make(blocks=16, page=1 << 16, chunks=64)
            for c in range(0, 64, 16):  # write every host page (2 x 4 MiB)
                off.store(gpu_blocks=list(range(16)), cpu_chunks=list(range(c, c + 16))).wait(10)
            off.load(cpu_chunks=[0], gpu_blocks=[1]).wait(10)
            del off
            gc.collect()
        deadline = time.monotonic() + 20
        while threading.active_count() > base_threads and time.monotonic() < deadline:
            time.sleep(0.01)
        grown = rss() - base_rss
        print(threading.active_count() - base_threads, grown)
        assert threading.active_count() == base_threads, threading.enumerate()
        assert grown < 64 << 20, grown
        print("ok")
    """, timeout=110)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.strip().endswith("ok")


@pytest.mark.timeout(90)
def test_process_exit_with_copies_queued_and_nothing_closed() -> None:
    """Interpreter exit while a dropped offloader's copies are held: a clean exit."""
    proc = run_script("""
        ev, g = gate()
        gpu, off = make()
        ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=g) for i in range(8)]
        try:
            off.close(timeout=0.05)
        except TimeoutError:
            pass
        gpu2, off2 = make()
        off2.load(cpu_chunks=[0], gpu_blocks=[1], stream=g)
        del off2
        threading.Timer(0.05, ev.set).start()
        print("exiting")
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "exiting"


@pytest.mark.parametrize("timeout", ["5", float("nan"), True, [1]])
def test_a_bad_close_timeout_is_refused_before_anything_is_shut(timeout: object) -> None:
    gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host")
    with pytest.raises(kv.InvalidTransferError, match="timeout must be"):
        off.close(timeout=timeout)  # type: ignore[arg-type]
    assert not off.closed
    assert off.store(gpu_blocks=[1], cpu_chunks=[1]).wait(5).success
    off.close(timeout=np.float64(5))
    assert off.closed and off._resources()["inflight"] == 0


@pytest.mark.parametrize("timeout", [float("inf"), 1e300])
def test_a_timeout_beyond_any_lock_wait_means_no_limit(timeout: float) -> None:
    """inf or 1e300 used to shut the offloader and then raise OverflowError from the
    lock wait, with a transfer in flight: they mean no limit."""
    from support import Gate

    gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host")
    gate = Gate()
    t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
    import threading

    threading.Timer(0.1, gate.open).start()
    off.close(timeout=timeout)
    assert t.done() and off.closed and off._resources()["inflight"] == 0
