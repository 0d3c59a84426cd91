"""A transfer queued for the lane's launcher by a caller on an event loop: the loop lends its
thread to the launcher at its next turn (`LaneLaunch._lend_loop`), so a loop that other tasks
keep busy with Python does not starve the launcher of the GIL."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Any

import numpy as np
import pytest
from support import BusyLoop, record_calls

import kvasync as kv
from kvasync._lane_launch import LaneLaunch
from kvasync._scheduler import DirectionQueue

PAGE, BLOCKS, CHUNKS = 4096, 64, 64


def _offloader() -> kv.Offloader:
    rng = np.random.default_rng(3)
    gpu = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(16)]
    return kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), CHUNKS, 1, copy_path="staged")


@pytest.fixture
def defer_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DirectionQueue, "DEFER_MIN_BYTES", 0)


@pytest.fixture
def lends(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times `_lend_loop` ran (it still runs)."""
    return record_calls(monkeypatch, LaneLaunch, "_lend_loop")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("defer_all")
async def test_a_busy_loop_lends_its_thread_until_the_launch_is_done(
        lends: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside a task that runs Python 1 ms at a time, yielding with sleep(0), a deferred
    store's launch is done within a few of that task's turns (without lending the launcher
    waited for the GIL for hundreds of them: 1.5 s on a 2-core machine)."""
    off = _offloader()
    launched = record_calls(monkeypatch, LaneLaunch, "_launch")
    ts: list[kv.Transfer] = []
    try:
        async with BusyLoop() as busy:
            for i in range(5):
                launched.clear()
                before = busy.turns
                ts.append(off.store(gpu_blocks=[i, i + 8, i + 16],
                                    cpu_chunks=[i, i + 8, i + 16]))
                while not launched and busy.turns - before < 2000:
                    await asyncio.sleep(0)
                assert launched, "the launch never ran"
                assert busy.turns - before < 200, busy.turns - before
        # the host backend's copy thread wants the GIL too: await once the loop is idle
        results = [await t for t in ts]
    finally:
        off.close()
    assert all(r.success for r in results) and lends  # the loop lent its thread


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("defer_all")
async def test_one_lend_per_lane_and_loop_is_pending_at_a_time(lends: list[float]) -> None:
    off = _offloader()
    try:
        ts = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(6)]
        queue = off._queues[("d2h", False)]
        assert queue._lend_pending == {asyncio.get_running_loop()}  # scheduled, not run
        await asyncio.sleep(0)
        assert len(lends) == 1  # six submissions, one lend in that turn
        for t in ts:
            assert (await t).success
    finally:
        off.close()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("defer_all")
async def test_a_lend_blocks_the_loop_briefly_and_lends_again_while_work_is_queued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher slower than one lend: each lend blocks the loop about `LEND_S`, not the
    whole backlog, and the loop lends again at its next turns until the queue is empty."""
    off = _offloader()
    real_launch = LaneLaunch._launch

    def slow(self: Any, job: Any, raise_refusal: bool = False) -> Any:
        time.sleep(0.01)
        return real_launch(self, job, raise_refusal)

    monkeypatch.setattr(LaneLaunch, "_launch", slow)
    held: list[float] = []
    real_lend = LaneLaunch._lend_loop

    def timed(self: Any, loop: asyncio.AbstractEventLoop) -> None:
        t0 = time.perf_counter()
        real_lend(self, loop)
        held.append(time.perf_counter() - t0)

    monkeypatch.setattr(LaneLaunch, "_lend_loop", timed)
    try:
        ts = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(10)]  # ~100 ms
        for t in ts:
            assert (await t).success
        assert len(held) >= 5  # lent again turn after turn
        assert max(held) < 0.05, max(held)  # never the whole backlog at once
    finally:
        off.close()


def test_a_caller_off_any_loop_schedules_no_lend(lends: list[float]) -> None:
    """The class default defers stores of 1 MiB and up: this 2 MiB one goes to the launcher."""
    off = _offloader()
    try:
        t = off.store(gpu_blocks=list(range(32)), cpu_chunks=list(range(32)))  # 2 MiB
        assert t.wait(30).success
        assert not off._queues[("d2h", False)]._lend_pending and not lends
    finally:
        off.close()


@pytest.mark.usefixtures("defer_all")
def test_a_loop_closed_with_its_lend_pending_is_let_go_and_the_next_loop_lends(
        lends: list[float]) -> None:
    off = _offloader()
    queue = off._queues[("d2h", False)]
    try:
        old = asyncio.new_event_loop()
        got: list[kv.Transfer] = []
        old.call_soon(lambda: got.append(off.store(gpu_blocks=[1], cpu_chunks=[1])))
        old.call_soon(old.stop)
        old.run_forever()  # one turn: the store ran, its lend is queued for the next
        first = got[0]
        assert queue._lend_pending == {old} and not lends
        old.close()  # the pending lend never runs
        assert first.wait(30).success  # the launcher went on by itself
        ref = weakref.ref(old)
        del old

        async def submit_and_await() -> None:
            assert (await off.store(gpu_blocks=[2], cpu_chunks=[2])).success

        asyncio.run(submit_and_await())
        assert lends  # the new loop lent its thread
        gc.collect()
        assert ref() is None  # the closed loop was pruned, not kept
    finally:
        off.close()
