"""A Transfer wherever asyncio or anyio take an awaitable or a future.

Each test holds transfers behind a gate (a host "compute stream" blocked on an event) where
it needs them pending, so "not done yet" is a fact and not a race.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support import Gate

import kvasync as kv

pytestmark = pytest.mark.timeout(60)

#: a wait that must end "at once" (the gate stays shut for far longer)
PROMPT_S = 2.0




@pytest.fixture
def setup() -> Iterator[tuple[list[np.ndarray], kv.Offloader]]:
    gpu = [np.random.default_rng(i).integers(0, 256, (64, 256), dtype=np.uint8)
           for i in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host")
    yield gpu, off
    off.close()


def _landed(gpu: list[np.ndarray], off: kv.Offloader, block: int, chunk: int) -> bool:
    return all(bytes(off.cpu_tensors[k][chunk]) == bytes(gpu[k][block]) for k in range(2))


# -- asyncio.wait: the call that used to crash ------------------------------------------------

@pytest.mark.asyncio
async def test_asyncio_wait_with_pending_transfers_and_a_timeout(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    """asyncio.wait calls add_done_callback, then remove_done_callback (which was missing:
    AttributeError), and its callback sets a loop future (unsafe from kvasync's thread)."""
    gpu, off = setup
    held = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(4)]
    free = off.load(cpu_chunks=[10], gpu_blocks=[20])
    done, pending = await asyncio.wait([*held, free], return_when=asyncio.FIRST_COMPLETED)
    assert done == {free} and pending == set(held)
    done, pending = await asyncio.wait(held, timeout=0.05)
    assert not done and pending == set(held)
    assert all(not t._loop_callbacks for t in held)  # wait() removed what it added
    gate.open()
    done, pending = await asyncio.wait(held)
    assert done == set(held) and not pending
    assert [t.result().job_id for t in held] == [0, 1, 2, 3]
    assert all(_landed(gpu, off, i, i) for i in range(4))


@pytest.mark.asyncio
async def test_asyncio_wait_first_exception(setup: tuple[list[np.ndarray], kv.Offloader],
                                            gate: Gate) -> None:
    gpu, off = setup
    held = off.load(cpu_chunks=[0], gpu_blocks=[0], stream=gate.stream)
    off.backend.inject_fault()  # type: ignore[attr-defined]
    bad = off.store(gpu_blocks=[1], cpu_chunks=[1])
    done, pending = await asyncio.wait([held, bad], return_when=asyncio.FIRST_EXCEPTION)
    assert done == {bad} and pending == {held}
    assert isinstance(bad.exception(), kv.TransferFailedError)


# -- done-callbacks added inside a loop run on that loop --------------------------------------

@pytest.mark.asyncio
async def test_callbacks_added_in_a_loop_run_on_it_in_completion_order_before_the_awaiter(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    loop_thread = threading.get_ident()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(50)]
    seen: list[tuple[int, int, bool]] = []
    for t in ts:
        t.add_done_callback(lambda tr: seen.append(
            (tr.job_id, threading.get_ident(), asyncio.get_running_loop() is not None)))
    await asyncio.sleep(0.02)
    assert seen == []
    gate.open()
    await ts[-1]
    # like an asyncio future's: the callbacks ran before the awaiting task resumed
    assert [s[0] for s in seen] == list(range(50))
    assert all(s[1] == loop_thread and s[2] for s in seen)


@pytest.mark.asyncio
async def test_callback_context_and_already_done(
        setup: tuple[list[np.ndarray], kv.Offloader]) -> None:
    gpu, off = setup
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    t = off.store(gpu_blocks=[1], cpu_chunks=[1])
    await t
    ctx = contextvars.copy_context()
    ctx.run(var.set, "theirs")
    got: list[str] = []
    t.add_done_callback(lambda _t: got.append(var.get()), context=ctx)  # done: scheduled
    t.add_done_callback(lambda _t: got.append(var.get()))
    assert got == []  # scheduled with call_soon, as asyncio does, not run inline
    await asyncio.sleep(0)
    assert got == ["theirs", "unset"]

    def outside() -> None:  # no loop in this thread: runs now, in the given context
        t.add_done_callback(lambda _t: got.append(var.get()), context=ctx)

    th = threading.Thread(target=outside)
    th.start()
    th.join()
    assert got == ["theirs", "unset", "theirs"]


@pytest.mark.asyncio
async def test_remove_done_callback_counts_and_unregisters(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    t = off.store(gpu_blocks=[2], cpu_chunks=[2], stream=gate.stream)
    calls: list[str] = []

    def fn(_t: kv.Transfer) -> None:
        calls.append("fn")

    t.add_done_callback(fn)
    t.add_done_callback(fn)
    th = threading.Thread(target=t.add_done_callback, args=(fn,))  # a thread registration
    th.start()
    th.join()
    t.add_done_callback(lambda _t: calls.append("other"))
    assert t.remove_done_callback(fn) == 3
    assert t.remove_done_callback(fn) == 0
    gate.open()
    await t
    await asyncio.sleep(0.05)
    assert calls == ["other"]


def test_callbacks_from_two_loops_each_run_on_their_own_loop(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    t = off.store(gpu_blocks=[3], cpu_chunks=[3], stream=gate.stream)
    ran: dict[str, tuple[int, int]] = {}
    ready = threading.Barrier(3)

    def run_loop(name: str) -> None:
        async def main() -> None:
            fired = asyncio.Event()

            def cb(_t: kv.Transfer) -> None:
                ran[name] = (threading.get_ident(), id(asyncio.get_running_loop()))
                fired.set()  # only safe on this loop's own thread

            t.add_done_callback(cb)
            loop_id = id(asyncio.get_running_loop())
            ready.wait(10)
            await asyncio.wait_for(fired.wait(), 20)
            assert ran[name] == (threading.get_ident(), loop_id)

        asyncio.run(main())

    threads = [threading.Thread(target=run_loop, args=(n,)) for n in ("a", "b")]
    for th in threads:
        th.start()
    ready.wait(10)
    gate.open()
    for th in threads:
        th.join(30)
    assert set(ran) == {"a", "b"} and ran["a"][0] != ran["b"][0]
    assert t.result().success


# -- combinators ------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_as_completed(setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    held = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(3)]
    with pytest.raises(asyncio.TimeoutError):
        for f in asyncio.as_completed(held, timeout=0.05):
            await f
    gate.open()
    ids = [(await f).job_id for f in asyncio.as_completed(held)]
    assert sorted(ids) == [0, 1, 2]


@pytest.mark.asyncio
async def test_gather_results_and_exceptions(
        setup: tuple[list[np.ndarray], kv.Offloader]) -> None:
    gpu, off = setup
    results = await asyncio.gather(*[off.store(gpu_blocks=[i], cpu_chunks=[i])
                                     for i in range(8)])
    assert [r.job_id for r in results] == list(range(8))
    good = off.load(cpu_chunks=[0], gpu_blocks=[40])
    off.backend.inject_fault()  # type: ignore[attr-defined]
    bad = off.load(cpu_chunks=[1], gpu_blocks=[41])
    out = await asyncio.gather(good, bad, return_exceptions=True)
    assert isinstance(out[0], kv.TransferResult) and isinstance(out[1], kv.TransferFailedError)
    with pytest.raises(kv.TransferFailedError):
        await asyncio.gather(bad)


@pytest.mark.asyncio
async def test_cancelling_a_gather_stops_the_waiting_at_once_not_the_copy(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    a = off.store(gpu_blocks=[4], cpu_chunks=[4], stream=gate.stream)
    b = off.store(gpu_blocks=[5], cpu_chunks=[5], stream=gate.stream)
    task = asyncio.ensure_future(asyncio.gather(a, b))
    await asyncio.sleep(0.02)
    t0 = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - t0 < PROMPT_S and not a.done()
    gate.open()
    assert (await b).success and _landed(gpu, off, 4, 4) and _landed(gpu, off, 5, 5)


@pytest.mark.asyncio
async def test_wait_for(setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    assert (await asyncio.wait_for(off.store(gpu_blocks=[6], cpu_chunks=[6]), 10)).success
    held = off.store(gpu_blocks=[7], cpu_chunks=[7], stream=gate.stream)
    other = asyncio.ensure_future(_await(held))  # a second awaiter, not cancelled
    for timeout in (0.05, 0):
        t0 = time.perf_counter()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(held, timeout)
        assert time.perf_counter() - t0 < PROMPT_S
    assert not held.done() and not other.done()
    gate.open()
    assert (await other).success and _landed(gpu, off, 7, 7)


@pytest.mark.asyncio
async def test_shield(setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    held = off.store(gpu_blocks=[8], cpu_chunks=[8], stream=gate.stream)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(held), 0.05)
    assert not held.done()
    gate.open()
    assert (await asyncio.shield(held)).success and _landed(gpu, off, 8, 8)


@pytest.mark.asyncio
@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11+")
async def test_asyncio_timeout(setup: tuple[list[np.ndarray], kv.Offloader],
                               gate: Gate) -> None:
    gpu, off = setup
    held = off.store(gpu_blocks=[9], cpu_chunks=[9], stream=gate.stream)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):  # type: ignore[attr-defined]
            await held
    assert time.perf_counter() - t0 < PROMPT_S and not held.done()
    async with asyncio.timeout(10):  # type: ignore[attr-defined]
        gate.open()
        assert (await held).success


@pytest.mark.asyncio
@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is Python 3.11+")
async def test_task_group_a_failed_transfer_cancels_the_siblings_awaits_only(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    results: list[kv.TransferResult] = []
    async with asyncio.TaskGroup() as tg:  # type: ignore[attr-defined]
        for i in range(4):
            tg.create_task(_append(results, off.store(gpu_blocks=[i], cpu_chunks=[i])))
    assert sorted(r.job_id for r in results) == [0, 1, 2, 3]

    held = off.load(cpu_chunks=[0], gpu_blocks=[50], stream=gate.stream)
    off.backend.inject_fault()  # type: ignore[attr-defined]
    bad = off.store(gpu_blocks=[10], cpu_chunks=[10])
    with pytest.raises(BaseExceptionGroup) as info:  # noqa: F821 (3.11+)
        async with asyncio.TaskGroup() as tg:  # type: ignore[attr-defined]
            sibling = tg.create_task(_await(held))
            tg.create_task(_await(bad))
    assert info.group_contains(kv.TransferFailedError)  # type: ignore[attr-defined]
    assert sibling.cancelled() and not held.done()
    gate.open()
    assert (await held).success
    np.testing.assert_array_equal(gpu[0][50], off.cpu_tensors[0][0])


def test_anyio_fail_after_move_on_after_and_task_groups(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    anyio = pytest.importorskip("anyio")
    gpu, off = setup

    async def main() -> None:
        held = off.store(gpu_blocks=[11], cpu_chunks=[11], stream=gate.stream)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError), anyio.fail_after(0.05):
            await held
        with anyio.move_on_after(0.05) as scope:
            await held
        assert scope.cancelled_caught and not held.done()
        assert time.perf_counter() - t0 < 2 * PROMPT_S
        results: list[kv.TransferResult] = []
        loads = [off.load(cpu_chunks=[i], gpu_blocks=[30 + i]) for i in range(4)]
        async with anyio.create_task_group() as tg:
            for t in [*loads, held]:
                tg.start_soon(_append, results, t)
            gate.open()
        assert sorted(r.job_id for r in results) == sorted(t.job_id for t in [*loads, held])
        assert all(r.success for r in results)

    anyio.run(main, backend="asyncio")
    assert _landed(gpu, off, 11, 11)


# -- the future protocol itself --------------------------------------------------------------

@pytest.mark.asyncio
async def test_future_methods_inside_a_loop(setup: tuple[list[np.ndarray], kv.Offloader],
                                            gate: Gate) -> None:
    gpu, off = setup
    t = off.store(gpu_blocks=[12], cpu_chunks=[12], stream=gate.stream)
    assert t.get_loop() is asyncio.get_running_loop()
    assert not t.done() and not t.cancelled()
    with pytest.raises(RuntimeError, match="not done"):
        t.result()
    with pytest.raises(RuntimeError, match="not done"):
        t.exception()
    assert t.cancel() is False and t.cancel("why") is False  # a submitted copy stays
    assert not t.cancelled()
    # not an asyncio future on purpose: asyncio would cancel it to stop waiting; it wraps
    # it in a task instead, and cancelling that task stops only the waiting
    assert not asyncio.isfuture(t)
    wrapper = asyncio.ensure_future(t)
    assert isinstance(wrapper, asyncio.Task) and wrapper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wrapper
    gate.open()
    r = await t
    assert t.done() and t.result() is r and t.exception() is None and not t.cancelled()


def test_future_methods_outside_a_loop(setup: tuple[list[np.ndarray], kv.Offloader]) -> None:
    gpu, off = setup
    t = off.store(gpu_blocks=[13], cpu_chunks=[13])
    with pytest.raises(RuntimeError, match="no event loop"):
        t.get_loop()
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(t).job_id == t.job_id  # wrapped in a task
    finally:
        loop.close()
    fired = threading.Event()
    t.add_done_callback(lambda _t: fired.set())  # done, no loop: runs now
    assert fired.is_set()


@pytest.mark.asyncio
async def test_layered_transfer_has_the_same_methods(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate) -> None:
    gpu, off = setup
    lt = off.load_layerwise(cpu_chunks=[0, 1], gpu_blocks=[60, 61], stream=gate.stream)
    seen: list[Any] = []
    lt.add_done_callback(seen.append)
    lt.add_done_callback(print)
    assert lt.remove_done_callback(print) == 1
    assert lt.get_loop() is asyncio.get_running_loop() and lt.cancel() is False
    done, pending = await asyncio.wait([lt], timeout=0.05)
    assert not done and not lt.done()
    with pytest.raises(RuntimeError, match="not done"):
        lt.result()
    gate.open()
    done, _ = await asyncio.wait([lt])
    assert done == {lt} and seen == [lt]
    r = lt.result()
    assert r.bytes == 2 * 2 * 256 and lt.exception() is None
    assert (await asyncio.wait_for(lt, 5)) == r


@pytest.mark.asyncio
async def test_watched_transfers_complete_with_the_lazy_thread_and_polling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncio.wait on the lazy completion thread (the CUDA default), where the loop's
    resolver polls the watched transfers near their predicted end."""
    from kvasync._backends._host import HostBackend
    from kvasync._scheduler import DirectionQueue

    monkeypatch.setattr(HostBackend, "poll_from_await", True)
    monkeypatch.setattr(DirectionQueue, "LAZY_THREAD", True)
    gpu = [np.random.default_rng(7).integers(0, 256, (64, 1024), dtype=np.uint8)]
    async with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host") as off:
        assert off._queues[("d2h", False)].lazy
        for _ in range(5):
            ts = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(0, 64, 4)]
            done, pending = await asyncio.wait(ts, timeout=10)
            assert done == set(ts) and not pending
        np.testing.assert_array_equal(off.cpu_tensors[0][::4], gpu[0][::4])


async def _await(t: Any) -> kv.TransferResult:
    result: kv.TransferResult = await t
    return result


async def _append(out: list[kv.TransferResult], t: kv.Transfer) -> None:
    out.append(await t)


@pytest.mark.asyncio
@pytest.mark.parametrize("polled", [False, True])
async def test_a_cancelled_resolver_loses_no_callback_or_awaiter(
        setup: tuple[list[np.ndarray], kv.Offloader], gate: Gate, polled: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An app may cancel every task of its loop, kvasync's resolver too, while a transfer
    has a done-callback from that loop: the transfer completes meanwhile, and a later
    await of it still runs the callback first and then returns."""
    from kvasync._backends._host import HostBackend

    if polled:  # as on CUDA: the loop polls the direction itself
        monkeypatch.setattr(HostBackend, "poll_from_await", True)
    gpu, _ = setup
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host")
    try:
        t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
        seen: list[str] = []
        t.add_done_callback(lambda _: seen.append("callback"))
        await asyncio.sleep(0.01)
        resolvers = [task for task in asyncio.all_tasks()
                     if task.get_name() == "kvasync-completion"]
        assert resolvers
        for task in resolvers:
            task.cancel()
        await asyncio.sleep(0.01)
        gate.open()
        assert t.wait(PROMPT_S).success
        r = await asyncio.wait_for(t, PROMPT_S)  # hung before: the new resolver never heard
        seen.append("await")
        assert r.success and seen == ["callback", "await"]
    finally:
        off.close()
