"""The completion engine: ordering, many awaiters, cancellation, loops, no spinning."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
import pytest
from support import Gate

import kvasync as kv


def make(blocks: int = 64, page: int = 1024, chunks: int = 64, **kw: object) -> tuple[
    list[np.ndarray], kv.Offloader
]:
    gpu = [np.random.default_rng(i).integers(0, 256, (blocks, page), dtype=np.uint8)
           for i in range(2)]
    return gpu, kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), chunks, backend="host", **kw)


@pytest.mark.asyncio
async def test_many_awaiters_resolve_in_submission_order(gate: Gate) -> None:
    gpu, off = make()
    n = 200
    order: list[int] = []
    # held behind the gate until every waiter awaits (else a waiter that starts after its
    # transfer finished returns at once, ahead of earlier ones still waking up)
    transfers = [off.store(gpu_blocks=[i % 64], cpu_chunks=[i % 64], stream=gate.stream) for i in range(n)]
    for t in transfers:
        t.add_done_callback(lambda tr: order.append(tr.job_id))
    awaited: list[int] = []

    async def waiter(t: kv.Transfer) -> None:
        r = await t
        awaited.append(r.job_id)

    async def release() -> None:
        await asyncio.sleep(0.05)
        gate.open()

    await asyncio.gather(*(waiter(t) for t in transfers for _ in range(3)), release())
    # awaiters are told before callbacks run (both from the completion thread), so the
    # last callbacks may still be on their way when gather() returns
    deadline = time.monotonic() + 10
    while len(order) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert order == list(range(n))
    assert len(awaited) == 3 * n and sorted(awaited) == sorted(list(range(n)) * 3)
    # awaiters were resolved by one task in completion order
    assert awaited[::3] == sorted(awaited[::3]) or awaited == sorted(awaited)
    loads = [off.load(cpu_chunks=[i], gpu_blocks=[i]) for i in range(64)]
    results = await asyncio.gather(*loads)
    assert [r.job_id for r in results] == list(range(n, n + 64))
    await off.aclose()


@pytest.mark.asyncio
async def test_stores_and_loads_are_independent_queues(gate: Gate) -> None:
    gpu, off = make(compute_stream=None)
    held = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=gate.stream)
    behind = off.store(gpu_blocks=[1], cpu_chunks=[1])
    load = off.load(cpu_chunks=[5], gpu_blocks=[5])
    r = await asyncio.wait_for(load, 5)  # the load does not wait for the held stores
    assert r.success and not held.done() and not behind.done()
    gate.open()
    assert (await behind).job_id == 1 and held.done()
    await off.aclose()


@pytest.mark.asyncio
async def test_cancelled_awaiter_does_not_cancel_the_copy(gate: Gate) -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[3], cpu_chunks=[9], stream=gate.stream)
    task = asyncio.create_task(asyncio.wait_for(t, 0.05))
    other = asyncio.create_task(_await(t))
    with pytest.raises(asyncio.TimeoutError):
        await task
    gate.open()
    r = await other
    assert r.success
    np.testing.assert_array_equal(off.cpu_tensors[0][9], gpu[0][3])
    await off.aclose()


async def _await(t: kv.Transfer) -> kv.TransferResult:
    return await t


def test_transfer_from_one_loop_awaited_in_another() -> None:
    gpu, off = make()

    async def submit() -> kv.Transfer:
        t = off.store(gpu_blocks=[1, 2], cpu_chunks=[3, 4])
        await t
        return off.store(gpu_blocks=[5], cpu_chunks=[6])

    t2 = asyncio.run(submit())
    r = asyncio.run(_await(t2))
    assert r.job_id == 1 and r.success
    off.close()


def test_loop_closed_with_transfers_pending(gate: Gate, caplog: pytest.LogCaptureFixture) -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[7], cpu_chunks=[8], stream=gate.stream)
    loop = asyncio.new_event_loop()
    with pytest.raises(asyncio.TimeoutError):
        loop.run_until_complete(asyncio.wait_for(_await(t), 0.05))
    loop.close()
    with caplog.at_level(logging.ERROR):
        gate.open()
        r = t.wait(timeout=5)
    assert r.success and not [x for x in caplog.records if x.levelno >= logging.ERROR]
    # a new loop can still await later transfers
    assert asyncio.run(_await(off.store(gpu_blocks=[1], cpu_chunks=[1]))).success
    off.close()


def test_sync_wait_without_a_loop_and_timeouts(gate: Gate) -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=gate.stream)
    assert not t.done()
    with pytest.raises(RuntimeError):
        t.result()
    with pytest.raises(TimeoutError):
        t.wait(timeout=0.05)
    gate.open()
    assert t.wait(timeout=5).success and t.done() and t.exception() is None
    assert t.result() == t.wait()
    off.close()


def test_threads_blocked_in_wait_all_wake_when_it_completes(gate: Gate) -> None:
    """`wait()` builds its condition on first use (under the transfer's lock): every thread
    blocked in it before the completion wakes, and one arriving after returns at once."""
    gpu, off = make()
    t = off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1], stream=gate.stream)
    results: list[bool] = []
    waiters = [threading.Thread(target=lambda: results.append(t.wait(timeout=60).success),
                                daemon=True) for _ in range(4)]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + 5
    while t._cond is None and time.monotonic() < deadline:  # a waiter blocks in it
        time.sleep(0.001)
    gate.open()
    for w in waiters:  # woken by the completion, well before their own timeout
        w.join(timeout=5)
    assert results == [True] * 4 and not any(w.is_alive() for w in waiters)
    assert t.wait(timeout=0).success
    off.close()


@pytest.mark.asyncio
async def test_an_awaited_transfer_builds_no_condition() -> None:
    """Only a blocking `wait()` needs a condition: `store()` and `await` build none (it
    cost the caller of `store()` microseconds)."""
    gpu, off = make()
    t = off.store(gpu_blocks=[0], cpu_chunks=[0])
    assert (await t).success and t._cond is None
    off.close()


@pytest.mark.asyncio
async def test_sync_wait_inside_a_running_loop_like_jupyter(gate: Gate) -> None:
    """A notebook cell runs inside the kernel's loop: `wait()` must not deadlock there."""
    gpu, off = make()
    t = off.store(gpu_blocks=[2], cpu_chunks=[2], stream=gate.stream)
    threading.Timer(0.05, gate.open).start()
    assert t.wait(timeout=5).success  # blocks this (loop) thread; completion runs elsewhere
    assert (await t).success  # and top-level await of a done transfer returns at once
    await off.aclose()


@pytest.mark.asyncio
async def test_waiting_does_not_spin_a_core(gate: Gate) -> None:
    gpu, off = make()
    t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
    threading.Timer(0.5, gate.open).start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    r = await t
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert r.success and wall >= 0.45
    assert cpu < 0.1 * wall, f"waiting burned {cpu:.3f} s CPU in {wall:.3f} s"
    await off.aclose()


@pytest.mark.asyncio
async def test_loop_stays_responsive_while_transfers_run(gate: Gate) -> None:
    gpu, off = make()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(32)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not ts[-1].done():
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    threading.Timer(0.1, gate.open).start()
    await asyncio.gather(*ts)
    await task
    assert ticks >= 20
    await off.aclose()


@pytest.mark.asyncio
async def test_done_callback_exception_is_logged_and_contained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu, off = make()
    seen: list[int] = []

    def bad(t: kv.Transfer) -> None:
        raise RuntimeError("boom")

    t = off.store(gpu_blocks=[0], cpu_chunks=[0])
    t.add_done_callback(bad)
    t.add_done_callback(lambda tr: seen.append(tr.job_id))
    with caplog.at_level(logging.ERROR, logger="kvasync"):
        await t
        off.drain_sync(5)  # (callbacks added in a loop ran before the await returned)
        t.add_done_callback(bad)  # already done: scheduled on this loop, still contained
        await asyncio.sleep(0)
    assert seen == [0]
    assert sum("boom" in (r.exc_text or "") or "raised" in r.getMessage()
               for r in caplog.records) >= 2
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_aclose_waits_for_thread_side_callbacks_without_blocking_the_loop(
        gate: Gate) -> None:
    """A done-callback added off the loop runs on the completion thread after the awaiters
    resume; aclose() waits for it without blocking the loop, which that callback may need
    (it used to call the blocking close() at once: a deadlock here)."""
    gpu, off = make()
    loop = asyncio.get_running_loop()
    noted: list[int] = []

    async def note() -> int:
        return 1

    def add() -> None:
        t = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
        t.add_done_callback(lambda _t: noted.append(
            asyncio.run_coroutine_threadsafe(note(), loop).result(3)))  # TimeoutError: blocked

    worker = threading.Thread(target=add)
    worker.start()
    worker.join()
    loop.call_later(0.05, gate.open)
    await asyncio.wait_for(off.aclose(), 20)
    assert noted == [1] and off._resources()["inflight"] == 0


@pytest.mark.asyncio
async def test_aclose_drains_in_order_and_releases_everything() -> None:
    gpu, off = make()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(50)]
    res = off._resources()
    assert res["completion_threads"] == 1
    await off.aclose()
    assert all(t.done() for t in ts)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    res = off._resources()
    assert res == {"completion_threads": 0, "resolver_tasks": 0, "stream_threads": 0,
                   "host_bytes": 0, "inflight": 0}, res
    await off.aclose()  # twice is a no-op
    off.close()
    with pytest.raises(kv.OffloaderClosedError):
        off.store(gpu_blocks=[0], cpu_chunks=[0])


@pytest.mark.asyncio
async def test_async_context_manager() -> None:
    gpu = [np.arange(64 * 16, dtype=np.uint8).reshape(64, 16)]
    async with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8) as off:
        t = off.store(gpu_blocks=[9], cpu_chunks=[1])
        r = await t
        host = off.cpu_tensors[0][1].copy()
    assert off.closed and r.success
    np.testing.assert_array_equal(host, gpu[0][9])
    with pytest.raises(kv.OffloaderClosedError):
        off.cpu_tensors


def test_close_from_another_thread_while_in_flight(gate: Gate) -> None:
    gpu, off = make()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream) for i in range(10)]
    closer = threading.Thread(target=off.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # close drains: it waits for the held transfers
    with pytest.raises(kv.OffloaderClosedError):
        off.store(gpu_blocks=[0], cpu_chunks=[0])
    gate.open()
    closer.join(timeout=5)
    assert not closer.is_alive()
    assert all(t.wait(0).success for t in ts)


@pytest.mark.asyncio
async def test_host_backend_awaits_never_spin_in_the_awaiting_task() -> None:
    """A host thread does the copy: a task polling it would hold the GIL the copy needs,
    so awaits go through the loop's resolver (the CUDA variant is in tests/gpu)."""
    tensors, off = make()
    async with off:
        assert not off._queues[("d2h", False)].spin_await
        r = await off.store(gpu_blocks=[1, 2], cpu_chunks=[3, 4])
        assert r.success and off._resources()["resolver_tasks"] == 1
        host = off.cpu_tensors
        for k in range(2):
            assert bytes(host[k][3]) == bytes(tensors[k][1])


def _lazy_offloader(monkeypatch: pytest.MonkeyPatch) -> tuple[list[np.ndarray], kv.Offloader]:
    """A host offloader whose queues run the lazy completion thread of the CUDA backend
    (the host backend normally keeps the eager one: nobody polls its transfers)."""
    from kvasync._backends._host import HostBackend
    from kvasync._scheduler import DirectionQueue

    monkeypatch.setattr(HostBackend, "poll_from_await", True)
    monkeypatch.setattr(DirectionQueue, "PARK_AFTER", 0.02)
    monkeypatch.setattr(DirectionQueue, "LAZY_THREAD", True)
    gpu, off = make()
    assert all(q.lazy for q in off._queues.values())
    return gpu, off


def test_lazy_thread_completes_unpolled_transfers_in_order_and_parks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody waits or awaits: callbacks still fire (in order), drain() returns, the idle
    thread parks, and a transfer submitted to the parked thread still completes."""
    gpu, off = _lazy_offloader(monkeypatch)
    with off:
        q = off._queues[("d2h", False)]
        seen: list[int] = []
        done = threading.Event()
        ts = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(40)]
        for t in ts:
            t.add_done_callback(lambda tr: seen.append(tr.job_id))
        ts[-1].add_done_callback(lambda tr: done.set())
        assert done.wait(10)
        assert seen == [t.job_id for t in ts]
        assert off.drain_sync(10)
        deadline = time.monotonic() + 5
        while not q._parked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert q._parked
        late = threading.Event()
        t = off.store(gpu_blocks=[50], cpu_chunks=[50])
        t.add_done_callback(lambda tr: late.set())
        assert late.wait(10) and t.result().success
        assert bytes(off.cpu_tensors[0][50]) == bytes(gpu[0][50])
        thread = q._thread
        assert thread is not None and thread.is_alive()
    thread.join(1)
    assert not thread.is_alive()  # close() stopped it


@pytest.mark.asyncio
async def test_lazy_thread_with_awaiters_and_waiters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Awaits and waits poll the queue themselves; results are right and in order."""
    gpu, off = _lazy_offloader(monkeypatch)
    async with off:
        for i in range(30):
            r = await off.store(gpu_blocks=[i], cpu_chunks=[i])
            assert r.success
            assert off.load(cpu_chunks=[i], gpu_blocks=[i + 30]).wait(10).success
        for i in range(30):
            for k in range(2):
                assert bytes(off.cpu_tensors[k][i]) == bytes(gpu[k][i])
                assert bytes(gpu[k][i + 30]) == bytes(gpu[k][i])


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_callback_added_to_a_done_transfer_runs_after_earlier_pending_ones(
        gate: Gate) -> None:
    """Transfer 0's loop callback waits for the resolver; transfer 1 completes (on the
    completion thread) before its callback is added: it still runs second."""
    gpu = [np.zeros((4, 4096), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 4, 1)
    try:
        t0 = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=gate.stream)
        t1 = off.store(gpu_blocks=[1], cpu_chunks=[1], stream=gate.stream)
        order: list[int] = []
        t0.add_done_callback(lambda t: order.append(0))
        gate.open()
        t1.wait(10)  # blocks the loop: the resolver has not scheduled t0's callback yet
        assert t0.done() and order == []
        t1.add_done_callback(lambda t: order.append(1))
        await t1
        await asyncio.sleep(0.01)
        assert order == [0, 1]
    finally:
        await off.aclose()


@pytest.mark.asyncio
async def test_timed_out_awaits_leave_no_futures_behind(gate: Gate) -> None:
    """wait_for(t, tiny) in a retry loop on a transfer that takes long: each timed-out
    await's future goes when the next one is made, not when the transfer completes."""
    gpu, off = make()
    t = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=gate.stream)
    for _ in range(200):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(t, 0.001)
    resolver = off._engine._resolvers[asyncio.get_running_loop()]
    assert len(resolver.waiting.get(t, [])) <= 1
    gate.open()
    assert (await t).success
    await off.aclose()
