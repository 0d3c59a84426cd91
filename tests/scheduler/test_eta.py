"""The lane predicts a transfer's end from its own path's learned rate, counted from when its
enqueue began: a prediction late by more than the waiters' polling window leaves a
completion to a thread wake."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._completion import CompletionEngine
from kvasync._polling import MIN_WINDOW, SPIN_WINDOW, WINDOW_SHARE, spin_window
from kvasync._transfer import Transfer, TransferResult

PAGE, BLOCKS = 64 << 10, 32  # 2 MiB of one tensor per full transfer


@pytest.mark.timeout(60)
def test_each_path_teaches_its_own_rate_and_predicts_with_it() -> None:
    rng = np.random.default_rng(1)
    gpu = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1)
    lane = off._queues[("d2h", False)]
    ids = list(range(BLOCKS))
    try:
        assert lane.path_rate == {}
        off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove").wait(30)
        assert set(lane.path_rate) == {"memmove"}
        off.store(gpu_blocks=ids, cpu_chunks=ids, path="staged").wait(30)
        assert set(lane.path_rate) == {"memmove", "staged"}
        # a made-up rate per path shows up in the predicted end of the next transfer
        lane.path_rate["memmove"] = 1e15
        lane.path_rate["staged"] = 1e6  # 2 MiB at 1 MB/s: ~2 s
        fast = off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove")
        fast.wait(30)
        slow = off.store(gpu_blocks=ids, cpu_chunks=ids, path="staged")
        assert slow._eta - fast._eta > 1.5
        slow.wait(30)
    finally:
        off.close()


@pytest.mark.timeout(60)
def test_small_transfers_teach_nothing() -> None:
    gpu = [np.zeros((BLOCKS, 4096), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1)
    try:
        off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1], path="memmove").wait(30)
        assert off._queues[("d2h", False)].path_rate == {}
    finally:
        off.close()


@pytest.mark.timeout(60)
def test_a_faster_sample_replaces_the_rate_a_slower_one_is_blended() -> None:
    """A path's first transfer is slow (tables, staging, first launch); the next ones must
    not be predicted late for long, so a faster sample counts at once."""
    gpu = [np.zeros((BLOCKS, PAGE), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1)
    lane = off._queues[("d2h", False)]
    ids = list(range(BLOCKS))
    try:
        lane.path_rate["memmove"] = 1.0  # far slower than any copy: replaced outright
        r = off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove").wait(30)
        assert lane.path_rate["memmove"] == pytest.approx(r.bytes / r.seconds)
        lane.path_rate["memmove"] = 1e12  # faster than a host memmove: the sample is blended
        r = off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove").wait(30)
        assert lane.path_rate["memmove"] == pytest.approx(
            0.5e12 + 0.5 * r.bytes / r.seconds, rel=1e-9)  # the sample's share shows
    finally:
        off.close()


class _Over:
    """A direction whose one transfer already ended on the device: a poll completes it."""

    lazy = True
    spin_await = True

    def __init__(self, transfer: Any) -> None:
        self.transfer, self.polls = transfer, 0

    def poll(self) -> int:
        self.polls += 1
        self.transfer._complete(TransferResult(1, True, 8, 1e-3), None)
        return 1

    def head_eta(self) -> tuple[float, float] | None:
        return None


def _predicted_late(engine: Any) -> tuple[Transfer, _Over]:
    t = Transfer(1, "h2d", 8, engine)
    q = _Over(t)
    t._poller = q
    t._eta = time.perf_counter() + 30.0  # the prediction says 30 s from now
    return t, q


@pytest.mark.timeout(20)
def test_wait_polls_once_before_sleeping_towards_a_late_prediction() -> None:
    t, q = _predicted_late(CompletionEngine())
    t0 = time.perf_counter()
    assert t.wait(10).success  # not 10 s: the poll before the sleep completed it
    assert time.perf_counter() - t0 < 1.0 and q.polls == 1


@pytest.mark.timeout(20)
@pytest.mark.asyncio
async def test_await_polls_once_before_handing_over_to_the_resolver() -> None:
    t, q = _predicted_late(CompletionEngine())
    r = await asyncio.wait_for(t, 10)
    assert r.success and q.polls == 1


def test_the_polling_window_is_a_share_of_the_predicted_time_within_bounds() -> None:
    assert spin_window(0.0) == MIN_WINDOW
    assert spin_window(0.02) == pytest.approx(WINDOW_SHARE * 0.02)
    assert spin_window(10.0) == SPIN_WINDOW


@pytest.mark.timeout(60)
def test_each_transfer_carries_the_window_of_its_prediction() -> None:
    gpu = [np.zeros((BLOCKS, PAGE), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1)
    lane = off._queues[("d2h", False)]
    ids = list(range(BLOCKS))
    try:
        lane.path_rate["memmove"] = 1e6  # 2 MiB at 1 MB/s: ~2 s predicted
        slow = off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove")
        assert slow._window == SPIN_WINDOW
        slow.wait(30)
        deadline = time.monotonic() + 10  # until the lane forgot the slow one's end
        while lane._tail_eta and time.monotonic() < deadline:
            time.sleep(0.001)
        lane.path_rate["memmove"] = 1e15
        fast = off.store(gpu_blocks=ids[:1], cpu_chunks=ids[:1], path="memmove")
        assert fast._window == MIN_WINDOW
        fast.wait(30)
    finally:
        off.close()
