"""An awaited transfer completes through its loop's own polls when no thread wakes the loop:
a busy event loop keeps the GIL from kvasync's completion thread, so a transfer not launched
yet when awaited, or one that ends after its predicted end, must not depend on that thread."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

import pytest
from support import BusyLoop

from kvasync._completion import CompletionEngine
from kvasync._polling import SLOW_POLL, SLOW_POLL_MAX, SPIN_GRACE
from kvasync._transfer import Transfer, TransferResult


class _Silent:
    """A direction no completion thread serves: its one transfer gets a predicted end at
    `launch` (None before: still queued for a launcher) and ends on the device at `end`;
    only a poll completes it."""

    lazy = True
    spin_await = True

    def __init__(self, transfer: Transfer, launch: float, end: float, eta: float) -> None:
        self.transfer, self.launch, self.end, self.eta = transfer, launch, end, eta
        self.polls: list[float] = []

    def poll(self) -> int:
        now = time.perf_counter()
        self.polls.append(now)
        if now < self.end or self.transfer.done():
            return 0
        self.transfer._complete(TransferResult(1, True, 8, 1e-3), None)
        return 1

    def head_eta(self) -> tuple[float, float] | None:
        if self.transfer.done() or time.perf_counter() < self.launch:
            return None
        return self.eta, 0.25e-3


def _transfer(launch_in: float, end_in: float, eta_in: float,
              engine: CompletionEngine | None = None) -> tuple[Transfer, _Silent]:
    t = Transfer(1, "d2h", 8, engine or CompletionEngine())
    now = time.perf_counter()
    q = _Silent(t, now + launch_in, now + end_in, now + eta_in)
    t._poller = q
    t._eta = now + eta_in
    t._window = 0.25e-3
    return t, q


@pytest.mark.timeout(30)
@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["not launched yet", "ends late", "both"])
async def test_the_loop_polls_until_done_without_any_thread_wake(case: str) -> None:
    launch, end, eta = {
        "not launched yet": (0.03, 0.035, 0.034),  # a deferred launch, then a right guess
        "ends late": (0.0, 0.25, 0.01),  # 240 ms past its predicted end
        "both": (0.03, 0.25, 0.01),
    }[case]
    t, q = _transfer(launch, end, eta)
    t0 = time.perf_counter()
    r = await asyncio.wait_for(t, 10)  # nothing but the loop's own polls can complete it
    took = time.perf_counter() - t0
    assert r.success
    # at most one slow interval (plus a loop turn) after the device end
    assert took < end + SLOW_POLL_MAX + 0.05, took
    # past its grace the loop polls on a timer, not in a spin: a few dozen polls over a
    # quarter of a second, not thousands (within the window before and after its predicted
    # end it spins, by design)
    late = [p for p in q.polls if p > q.eta + SPIN_GRACE]
    assert len(late) < 60, len(late)


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_busy_loop_still_resolves_a_late_transfer_in_a_few_turns() -> None:
    async with BusyLoop() as busy:
        t, q = _transfer(0.0, 0.05, 0.01)
        before = busy.turns
        assert (await asyncio.wait_for(t, 10)).success
        turns = busy.turns - before
    # 50 ms of 1 ms slices; the resolver's timer fires between slices
    assert turns < 50 + 2 * SLOW_POLL_MAX / 1e-3 + 10, turns


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_wakes_of_the_resolver_do_not_restart_the_slow_polls() -> None:
    """Every new await or done-callback wakes the resolver; a late head it already polls
    keeps its slower interval instead of being polled at each wake."""
    t, q = _transfer(0.0, 0.3, 0.005)
    other, _ = _transfer(10.0, 10.0, 10.0, t._engine)  # not launched: its callbacks wake

    async def wake_often() -> None:
        while not t.done():
            other.add_done_callback(lambda _: None)  # the resolver re-evaluates
            await asyncio.sleep(0.002)

    waker = asyncio.ensure_future(wake_often())
    assert (await asyncio.wait_for(t, 10)).success
    await waker
    late = [p for p in q.polls if p > q.eta + SPIN_GRACE]
    assert len(late) < 60, len(late)  # ~120 wakes in the late part alone


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_direction_not_polled_from_awaits_is_left_to_its_thread() -> None:
    t, q = _transfer(10.0, 10.0, 0.001)
    q.spin_await = False  # e.g. the remote tier: its thread completes it
    threading.Timer(0.2, t._complete, (TransferResult(1, True, 8, 1e-3), None)).start()
    assert (await asyncio.wait_for(t, 10)).success
    assert q.polls == []


def test_a_loop_closed_with_a_late_transfer_awaited_logs_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """A loop closed without cancelling its tasks while its resolver slow-polls: the timed
    waits leave no task of their own behind to be reported as destroyed while pending."""

    def run_and_close() -> None:
        t, _ = _transfer(10.0, 10.0, 0.001)  # not launched for the whole test

        async def give_up() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(t, 0.1)

        loop = asyncio.new_event_loop()
        loop.run_until_complete(give_up())
        loop.close()  # as a framework may: pending tasks not cancelled

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        run_and_close()
        gc.collect()  # the loop, its tasks and the transfer go now
    assert "destroyed but it is pending" not in caplog.text, caplog.text


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_the_slow_interval_starts_over_once_no_head_is_late() -> None:
    """A head that was late grew the interval; once no head is late the resolver forgets it,
    so the next launch its lane waits for is polled soon again (`_late` keys on the lane and
    the prediction, and a not-launched head has none: the same key comes back)."""
    t1, q = _transfer(10.0, 0.04, 10.0)  # ends, seen by a slow poll, before any prediction
    assert (await asyncio.wait_for(t1, 10)).success
    resolver = t1._engine._resolver(asyncio.get_running_loop())
    assert resolver._slow == SLOW_POLL_MAX
    t2 = Transfer(2, "d2h", 8, t1._engine)  # the same lane, predicted right: none late
    now = time.perf_counter()
    q.transfer, q.launch, q.end, q.eta = t2, now, now + 0.01, now + 0.01
    t2._poller, t2._eta, t2._window = q, q.eta, 0.25e-3
    assert (await asyncio.wait_for(t2, 10)).success
    assert resolver._slow == SLOW_POLL and not resolver._late
