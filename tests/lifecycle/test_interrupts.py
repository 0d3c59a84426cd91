"""Shutdown that cancels every task, and exceptions from outside kvasync (a Ctrl-C) landing
inside its completion: no awaiter, waiter or close() is left waiting forever."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from support import Gate

import kvasync as kv
from kvasync._backends._host import HostBackend
from kvasync._lane_completion import LaneCompletion


def make() -> kv.Offloader:
    gpu = [np.random.default_rng(i).integers(0, 256, (64, 1024), dtype=np.uint8)
           for i in range(2)]
    return kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host")


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_await_survives_a_shutdown_that_cancels_every_task(gate: Gate) -> None:
    """A handler cancelled mid-store awaits the store again before freeing its blocks; the
    same shutdown cancels kvasync's resolver task, which goes on until that await ends."""
    off = make()
    t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
    cleaned: list[bool] = []

    async def handler() -> None:
        try:
            await t
        except asyncio.CancelledError:
            cleaned.append((await t).success)  # the copy still reads the blocks
            raise

    h = asyncio.ensure_future(handler())
    await asyncio.sleep(0.05)
    me = asyncio.current_task()
    tasks = [x for x in asyncio.all_tasks() if x is not me]
    tasks.sort(key=lambda x: x.get_name() == "kvasync-completion")  # the handler first
    assert any(x.get_name() == "kvasync-completion" for x in tasks)
    for x in tasks:
        x.cancel()
    threading.Timer(0.2, gate.open).start()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert cleaned == [True] and h.cancelled()
    assert off._engine.num_tasks == 0  # the resolver ended once nothing awaited
    await off.aclose()


@pytest.mark.timeout(60)
def test_asyncio_run_returns_when_its_shutdown_cancels_a_pending_await() -> None:
    """main() returns while tasks await stores that land later; asyncio.run cancels every
    task, their cleanup awaits the stores again, and asyncio.run returns."""
    code = textwrap.dedent("""
        import asyncio, threading, numpy as np, kvasync as kv
        from support import Gate
        gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
        off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host")
        gate = Gate()
        threading.Timer(0.3, gate.open).start()
        async def handler(i):
            t = off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream)
            try:
                await t
            except asyncio.CancelledError:
                await t
                raise
        async def main():
            for i in range(3):
                asyncio.ensure_future(handler(i))
            await asyncio.sleep(0.05)
        asyncio.run(main())
        off.close()
        print("returned")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, cwd="tests")
    assert out.returncode == 0 and "returned" in out.stdout, out.stderr


@pytest.mark.asyncio
async def test_a_base_exception_from_a_loop_callback_is_raised_there_not_later() -> None:
    """A done-callback added inside a loop runs on it; its SystemExit leaves the loop's
    callback as from any asyncio callback, and nothing is kept to surface later from an
    unrelated call on that thread."""
    off = make()
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()
    t = off.store(gpu_blocks=[1], cpu_chunks=[1])

    def bad(tr: kv.Transfer) -> None:
        seen.append("ran")
        raise SystemExit("from a callback")

    real_run = asyncio.events.Handle._run

    def run(h: asyncio.Handle) -> None:  # what escapes a loop callback, as the loop sees it
        try:
            real_run(h)
        except SystemExit as exc:
            seen.append(f"escaped: {exc}")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(asyncio.events.Handle, "_run", run)
        t.add_done_callback(bad)
        await t
        for _ in range(3):
            await asyncio.sleep(0)
    assert seen == ["ran", "escaped: from a callback"]
    assert loop.get_exception_handler() is handler
    later = off.load(cpu_chunks=[1], gpu_blocks=[2])
    later.wait(5)
    later.add_done_callback(lambda tr: None)  # used to raise the kept SystemExit
    await off.aclose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poller", ["wait", "await"])
def test_a_ctrl_c_inside_a_polled_completion_still_completes_the_transfer(
        poller: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt landing while a waiter completes a transfer by polling (the
    CUDA default) used to leave it popped but never completed: its waiters and close()
    waited forever. The transfer completes and the interrupt still reaches the caller."""
    monkeypatch.setattr(HostBackend, "poll_from_await", True)  # waiters poll, as on CUDA
    off = make()
    real = LaneCompletion._finish
    fired: list[bool] = []

    def interrupted(self: LaneCompletion, rec: object) -> bool:
        if not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            raise KeyboardInterrupt("Ctrl-C")
        return real(self, rec)  # type: ignore[arg-type]

    monkeypatch.setattr(LaneCompletion, "_finish", interrupted)
    closed_inside: list[bool] = []

    def close_inside(tr: kv.Transfer) -> None:  # documented not to wait inside a callback
        if fired and not closed_inside:
            off.close(timeout=5)  # TimeoutError if it waited for its own transfer
            closed_inside.append(True)

    for _ in range(200):
        t = off.store(gpu_blocks=list(range(64)), cpu_chunks=list(range(64)))
        t.add_done_callback(close_inside)
        try:
            if poller == "wait":
                t.wait(10)
            else:
                asyncio.run(_await(t))
        except KeyboardInterrupt:
            assert fired  # ours, through the poll that completed the transfer
        if fired:
            break
    assert fired, "the main thread never completed a transfer itself"
    assert t.wait(5).success and t.done() and closed_inside == [True]
    assert all(q.inflight == 0 for q in off._queues.values())
    off.close(timeout=5)


async def _await(t: kv.Transfer) -> None:
    await t


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this platform")
def test_a_forked_child_gets_a_clear_error_and_can_build_its_own() -> None:
    """An offloader inherited through fork() has no threads in the child: its calls raise
    OffloaderBrokenError (they used to hang), close() and the child's exit do not wait for
    the parent's threads, a new offloader built in the child works, and the parent's own
    offloader is untouched."""
    code = textwrap.dedent("""
        import os, sys, numpy as np, kvasync as kv
        def make():
            gpu = [np.full((8, 64), 5, np.uint8) for _ in range(2)]
            return kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host")
        off = make()
        off.store(gpu_blocks=[1], cpu_chunks=[1]).wait(10)
        pid = os.fork()
        if pid == 0:
            for call in (lambda: off.store(gpu_blocks=[2], cpu_chunks=[2]),
                         lambda: off.drain_sync(1)):
                try:
                    call()
                    print("child: accepted")
                except kv.OffloaderBrokenError as exc:
                    print("child: refused", "before a fork" in str(exc))
            off.close(timeout=5)
            mine = make()
            print("child: own", mine.store(gpu_blocks=[3], cpu_chunks=[3]).wait(10).success)
            mine.close()
            sys.stdout.flush()
            sys.exit(0)  # atexit and finalizers run: nothing may wait for the parent
        _, status = os.waitpid(pid, 0)
        print("parent: child exit", os.waitstatus_to_exitcode(status))
        print("parent: own", off.store(gpu_blocks=[4], cpu_chunks=[4]).wait(10).success)
        off.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == [
        "child: refused True", "child: refused True", "child: own True",
        "parent: child exit 0", "parent: own True"], (out.stdout, out.stderr)


@pytest.mark.timeout(60)
@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11+")
@pytest.mark.parametrize(("watch", "handlers"), [(False, 4), (True, 1)],
                         ids=["alone", "watch-task-started"])
def test_asyncio_run_returns_when_the_cleanup_await_gives_up(watch: bool,
                                                             handlers: int) -> None:
    """The resolver goes on while a task awaits through it; a cleanup await that gives up
    (a timeout) wakes nobody, and the resolver used to sleep until the transfer ended (5 s
    here, forever for one that never does) with asyncio.run waiting on it. `watch`: the
    cleanup also starts a task that awaits the copy; asyncio.run never cancelled that task
    and does not wait for it, so neither may the resolver (it went on for every await)."""
    code = textwrap.dedent("""
        import asyncio, threading, time, numpy as np, kvasync as kv
        from support import Gate
        gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
        off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host",
                           completion="thread")  # no polling wakes the resolver
        gate = Gate()
        threading.Timer(5.0, gate.open).start()
        async def watch(t):
            await t
        async def handler():
            t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
            try:
                await t
            except asyncio.CancelledError:
                if WATCH:
                    asyncio.ensure_future(watch(t))  # begun after the cancellation
                try:
                    async with asyncio.timeout(0.1):  # wait a little for the copy, then go
                        await t
                except TimeoutError:
                    pass
                raise
        async def main():
            for _ in range(HANDLERS):
                asyncio.ensure_future(handler())
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        asyncio.run(main())
        print(f"returned after {time.monotonic() - t0:.2f}")
        off.close()
    """).replace("WATCH", str(watch)).replace("HANDLERS", str(handlers))
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code],
                         capture_output=True, text=True, timeout=30, cwd="tests")
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 3.0, out.stdout  # not the transfer's 5 s


@pytest.mark.timeout(60)
def test_a_ctrl_c_completing_a_closed_offloaders_last_transfer_still_releases_it(
        gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """close(timeout=0) left one transfer in flight; its waiter completes it by polling and
    a Ctrl-C lands right after the completion: the release that close could not do must
    still follow (the in-flight count fell to 0 inside the interrupted step)."""
    from kvasync._transfer import Transfer

    monkeypatch.setattr(HostBackend, "poll_from_await", True)
    real, fired = Transfer._complete, []

    def complete(self: Transfer, result: object, error: object) -> None:
        real(self, result, error)  # type: ignore[arg-type]
        if not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            raise KeyboardInterrupt("Ctrl-C")

    monkeypatch.setattr(Transfer, "_complete", complete)
    for _ in range(200):
        off = make()
        g = Gate()
        t = off.store(gpu_blocks=list(range(64)), cpu_chunks=list(range(64)), stream=g.stream)
        with pytest.raises(TimeoutError):
            off.close(timeout=0)
        g.open()
        try:
            t.wait(10)
        except KeyboardInterrupt:
            pass
        if fired:
            break
        off._life.released.wait(5)
    assert fired
    assert off._life.released.wait(5), "the closed offloader was never released"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_await_begun_after_every_task_was_cancelled_still_resolves(
        gate: Gate) -> None:
    """In a loop that goes on after cancelling every task, an await begun meanwhile
    outlives the resolver that went on for the cancelled awaits: a new one takes it."""
    off = make()
    t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
    later: list[asyncio.Task[kv.TransferResult]] = []

    async def watch() -> kv.TransferResult:
        return await t

    async def handler() -> None:
        try:
            await t
        except asyncio.CancelledError:
            later.append(asyncio.ensure_future(watch()))
            await asyncio.sleep(0)  # the new task awaits
            await asyncio.wait({asyncio.ensure_future(_await(t))}, timeout=0.1)
            raise

    h = asyncio.ensure_future(handler())
    await asyncio.sleep(0.05)
    me = asyncio.current_task()
    tasks = [x for x in asyncio.all_tasks() if x is not me]
    tasks.sort(key=lambda x: x.get_name() == "kvasync-completion")
    for x in tasks:
        x.cancel()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert h.cancelled() and len(later) == 1 and not later[0].done()
    gate.open()
    r = await asyncio.wait_for(later[0], 10)
    assert r.success and r is t.result()
    await off.aclose()


@pytest.mark.timeout(60)
def test_a_ctrl_c_inside_the_resolvers_poll_reaches_the_app_and_loses_no_await() -> None:
    """A KeyboardInterrupt landing while a loop's resolver polls a lane leaves the loop,
    as from any code the loop runs (it was swallowed); the transfer still completes, and
    an await of it afterwards returns. In a process of its own: on CPython 3.11 a
    KeyboardInterrupt that leaves a task corrupts the interpreter's recursion count, and
    every later `compile()` fails (a test's import, here)."""
    code = textwrap.dedent("""
        import asyncio, threading, numpy as np, kvasync as kv
        from support import Gate
        from kvasync import _completion
        from kvasync._backends._host import HostBackend
        from kvasync._lane_completion import LaneCompletion
        HostBackend.poll_from_await = True  # the loop polls the lane, as on CUDA
        real_all, real_poll = _completion._LoopResolver._poll_all, LaneCompletion.poll
        inside, fired = [], []
        def poll_all(queues):
            inside.append(True)
            try:
                real_all(queues)
            finally:
                inside.pop()
        def poll(self):
            if inside and not fired:
                fired.append(True)
                raise KeyboardInterrupt("Ctrl-C")
            return real_poll(self)
        _completion._LoopResolver._poll_all = staticmethod(poll_all)
        LaneCompletion.poll = poll
        gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
        off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host")
        gate, later = Gate(), Gate()
        t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
        t2 = off.load(cpu_chunks=[2], gpu_blocks=[2], stream=later.stream)
        threading.Timer(0.3, gate.open).start()
        loop = asyncio.new_event_loop()
        called = []
        async def main():
            t2.add_done_callback(lambda tr: called.append("callback"))  # on this loop
            return await t
        try:
            loop.run_until_complete(main())
            print("no interrupt")
        except KeyboardInterrupt:
            print("interrupted", bool(fired))
        later.open()
        assert t2.wait(5).success
        async def after():  # the app's loop goes on; an await of t returns
            r = await t
            await asyncio.sleep(0.05)  # t2's loop callback runs without an await of t2
            return r.success
        print("done", t.wait(5).success, loop.run_until_complete(after()), called)
        loop.close()
        off.close(timeout=5)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, cwd="tests")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["interrupted True", "done True True ['callback']"], (
        out.stdout)
    assert "never retrieved" not in out.stderr, out.stderr
