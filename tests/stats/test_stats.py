"""`Offloader.stats()`, transfer progress and the DEBUG transfer log, on the host backend."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from support import Gate

import kvasync as kv
from kvasync._stats import WINDOW

pytestmark = pytest.mark.timeout(60)

PAGE = 1024
TENSORS = 2




@pytest.fixture
def off() -> Iterator[kv.Offloader]:
    gpu = [np.random.default_rng(i).integers(0, 256, (64, PAGE), dtype=np.uint8)
           for i in range(TENSORS)]
    o = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host")
    yield o
    o.close()


def test_a_new_offloader_has_four_empty_lanes(off: kv.Offloader) -> None:
    s = off.stats()
    assert {(x.direction, x.lane) for x in s.lanes} == {
        ("d2h", "normal"), ("h2d", "normal"), ("d2h", "urgent"), ("h2d", "urgent")}
    for lane in s.lanes:
        assert lane.submitted == lane.completed == lane.failures == lane.in_flight == 0
        assert lane.oldest_in_flight_seconds == 0.0 and lane.oldest_job_id is None
        assert dict(lane.paths) == {}
        assert lane.copy.p50 is None and lane.copy.window == 0 and lane.copy.count == 0
    assert s.transfers == s.bytes == s.failures == s.in_flight == 0
    with pytest.raises(KeyError, match="directions"):
        s.lane("up")


def test_the_snapshot_is_frozen_and_does_not_move(off: kv.Offloader) -> None:
    before = off.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.stores.submitted = 5  # type: ignore[misc]
    off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10)
    with pytest.raises(TypeError):
        off.stats().stores.paths["memmove"] = None  # type: ignore[index]
    assert before.stores.submitted == 0 and dict(before.stores.paths) == {}
    assert off.stats().stores.submitted == 1


def test_counts_and_bytes_by_concrete_path_and_lane(off: kv.Offloader) -> None:
    for i in range(3):
        off.store(gpu_blocks=[i, i + 10], cpu_chunks=[i, i + 10]).wait(10)
    off.store(gpu_blocks=[5], cpu_chunks=[5], path="staged").wait(10)
    off.load(cpu_chunks=[0], gpu_blocks=[20], urgent=True).wait(10)
    s = off.stats()
    stores = s.stores
    assert stores.submitted == stores.completed == 4 and stores.in_flight == 0
    assert set(stores.paths) == {"memmove", "staged"}
    mm, st = stores.paths["memmove"], stores.paths["staged"]
    assert (mm.transfers, mm.bytes, mm.failures) == (3, 3 * 2 * TENSORS * PAGE, 0)
    assert (st.transfers, st.bytes, st.failures) == (1, TENSORS * PAGE, 0)
    assert mm.seconds > 0 and st.seconds > 0
    assert stores.transfers == 4 and stores.bytes == 7 * TENSORS * PAGE
    urgent = s.lane("h2d", urgent=True)
    assert urgent.lane == "urgent" and urgent.transfers == 1
    assert dict(urgent.paths) == {"memmove": kv.PathStats(1, TENSORS * PAGE,
                                                          urgent.paths["memmove"].seconds, 0)}
    assert s.loads.submitted == 0  # the urgent load is not in the normal lane
    assert s.transfers == 5 and s.bytes == 8 * TENSORS * PAGE


def test_an_offloader_wide_staged_copy_path_counts_as_staged() -> None:
    gpu = [np.zeros((16, PAGE), np.uint8) for _ in range(TENSORS)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 16, backend="host",
                      copy_path="staged") as o:
        o.store(gpu_blocks=[1, 2], cpu_chunks=[3, 4]).wait(10)
        o.load(cpu_chunks=[3], gpu_blocks=[5]).wait(10)
        s = o.stats()
    assert set(s.stores.paths) == {"staged"} and set(s.loads.paths) == {"staged"}
    assert s.stores.paths["staged"].bytes == 2 * TENSORS * PAGE


def test_failures_count_per_path_and_add_no_timings(off: kv.Offloader) -> None:
    off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10)
    off.backend.inject_fault()  # type: ignore[attr-defined]
    bad = off.store(gpu_blocks=[1], cpu_chunks=[1])
    behind = off.store(gpu_blocks=[2], cpu_chunks=[2])  # fails behind it
    for t in (bad, behind):
        with pytest.raises(kv.TransferFailedError):
            t.wait(10)
    s = off.stats().stores
    assert s.failures == 2 and s.completed == 3 and s.in_flight == 0
    assert s.paths["memmove"] == kv.PathStats(1, TENSORS * PAGE,
                                              s.paths["memmove"].seconds, 2)
    assert s.copy.count == s.latency.count == s.queue_wait.count == 1
    assert bad.progress() == (0, TENSORS * PAGE)  # nothing is known to have landed
    assert off.stats().loads.failures == 0  # the other direction is untouched


def test_in_flight_and_the_oldest_jobs_age(off: kv.Offloader, gate: Gate) -> None:
    held = [off.store(gpu_blocks=[i], cpu_chunks=[i], stream=gate.stream, job_id=100 + i)
            for i in range(3)]
    time.sleep(0.2)
    s = off.stats().stores
    assert s.submitted == 3 and s.completed == 0
    assert s.in_flight == 3 and s.in_flight_bytes == 3 * TENSORS * PAGE
    assert s.oldest_job_id == 100
    assert 0.2 <= s.oldest_in_flight_seconds < 30
    later = off.stats().stores.oldest_in_flight_seconds
    assert later >= s.oldest_in_flight_seconds  # it ages while held
    assert off.stats().in_flight == 3 and held[0].progress() == (0, TENSORS * PAGE)
    gate.open()
    for t in held:
        t.wait(10)
    s = off.stats().stores
    assert (s.in_flight, s.in_flight_bytes, s.oldest_job_id) == (0, 0, None)
    assert s.oldest_in_flight_seconds == 0.0
    # they waited for the gate: the host latency holds the wait, the copy time does not
    assert s.latency.p99 is not None and s.latency.p99 >= 0.2
    assert s.queue_wait.p99 is not None and s.queue_wait.p99 >= 0.15
    assert s.copy.p99 is not None and s.copy.p99 < s.latency.p99
    assert held[-1].progress() == (TENSORS * PAGE, TENSORS * PAGE)


def test_percentiles_cover_a_bounded_recent_window(off: kv.Offloader) -> None:
    n = WINDOW + 76
    ts = [off.store(gpu_blocks=[i % 64], cpu_chunks=[i % 64]) for i in range(n)]
    for t in ts:
        t.wait(10)
    s = off.stats().stores
    copies = sorted(t.result().seconds for t in ts[-WINDOW:])  # the window: the newest
    assert s.copy.window == WINDOW and s.copy.count == n
    assert s.copy.p50 == copies[WINDOW // 2 - 1]
    assert s.copy.p90 == copies[int(np.ceil(0.9 * WINDOW)) - 1]
    assert s.copy.p99 == copies[int(np.ceil(0.99 * WINDOW)) - 1]
    assert s.copy.p50 <= s.copy.p90 <= s.copy.p99
    assert s.copy.sum == pytest.approx(sum(t.result().seconds for t in ts))
    # cumulative histogram: monotone, and its last bound (10 s) holds every sample
    assert list(s.copy.counts) == sorted(s.copy.counts) and s.copy.counts[-1] == n
    below = sum(1 for t in ts if t.result().seconds <= s.copy.buckets[5])
    assert s.copy.counts[5] == below
    assert s.size.p50 == TENSORS * PAGE and s.size.counts[0] == n  # 2 KiB <= 4 KiB


def test_layered_progress_counts_the_layers_that_landed(off: kv.Offloader,
                                                        gate: Gate) -> None:
    off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1]).wait(10)
    t = off.load_layerwise(cpu_chunks=[0, 1], gpu_blocks=[2, 3], stream=gate.stream)
    assert t.progress() == (0, 2 * TENSORS * PAGE) and t.progress().fraction == 0.0
    gate.open()
    t.layers[0].wait(10)
    done, total = t.progress()
    assert total == 2 * TENSORS * PAGE and done >= 2 * PAGE
    t.wait(10)
    assert t.progress() == (total, total) and t.progress().fraction == 1.0
    assert kv.Progress(0, 0).fraction == 1.0


@pytest.mark.asyncio
async def test_stats_are_current_when_an_await_returns(off: kv.Offloader) -> None:
    for i in range(5):
        await off.load(cpu_chunks=[i], gpu_blocks=[i])
        assert off.stats().loads.completed == i + 1  # counted before the awaiter woke
    await off.aclose()
    assert off.stats().loads.transfers == 5  # readable after close


def test_debug_log_tells_each_transfers_life(off: kv.Offloader,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvasync"):
        off.store(gpu_blocks=[1], cpu_chunks=[2], job_id=41).wait(10)
        off.backend.inject_fault()  # type: ignore[attr-defined]
        with pytest.raises(kv.TransferFailedError):
            off.store(gpu_blocks=[1], cpu_chunks=[2], job_id=42).wait(10)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvasync"]
    assert any("job 41 d2h normal lane: submitted 2048 B on path memmove" in m for m in lines)
    assert any("job 41 d2h normal lane: done, 2048 B on path memmove, copy" in m for m in lines)
    assert any("job 42" in m and "failed" in m and "injected device fault" in m for m in lines)


def test_no_log_records_are_made_when_debug_is_off(off: kv.Offloader,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default: the only cost is `isEnabledFor`; no message is ever formatted."""
    made: list[str] = []
    logger = logging.getLogger("kvasync")
    monkeypatch.setattr(logger, "debug", lambda *a, **k: made.append(str(a)))
    assert not logger.isEnabledFor(logging.DEBUG)
    off.store(gpu_blocks=[1], cpu_chunks=[2]).wait(10)
    assert made == []
    level = logger.level
    logger.setLevel(logging.DEBUG)  # setLevel clears the loggers' isEnabledFor caches
    try:
        off.store(gpu_blocks=[1], cpu_chunks=[2]).wait(10)
    finally:
        logger.setLevel(level)
    assert len(made) == 2  # submitted, done


def test_concurrent_submitters_and_snapshots_stay_consistent(off: kv.Offloader) -> None:
    stop = threading.Event()
    seen: list[kv.OffloaderStats] = []

    def watch() -> None:
        while not stop.is_set():
            seen.append(off.stats())

    watcher = threading.Thread(target=watch)
    watcher.start()

    def submit(k: int) -> None:
        for i in range(100):
            off.store(gpu_blocks=[k], cpu_chunks=[k], urgent=i % 2 == 1).wait(10)

    workers = [threading.Thread(target=submit, args=(k,)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    stop.set()
    watcher.join(10)
    for snap in seen:
        for lane in snap.lanes:
            assert lane.completed <= lane.submitted
            assert lane.transfers + lane.failures == lane.completed
            assert lane.copy.count == lane.transfers
    s = off.stats()
    assert s.stores.transfers == 200 and s.lane("d2h", urgent=True).transfers == 200
    assert s.in_flight == 0


def test_a_snapshot_of_a_busy_lane_does_not_block_on_the_copies() -> None:
    """stats() takes no lock a copy or its completion holds for long."""
    gpu = [np.zeros((256, 64 * 1024), np.uint8) for _ in range(TENSORS)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 256, backend="host") as o:
        ts = [o.store(gpu_blocks=list(range(256)), cpu_chunks=list(range(256)))
              for _ in range(4)]
        t0 = time.perf_counter()
        s = o.stats()
        took = time.perf_counter() - t0
        for t in ts:
            t.wait(30)
    assert took < 0.5, took
    assert s.stores.submitted == 4


def test_progress_via_asyncio(off: kv.Offloader) -> None:
    async def main() -> kv.Progress:
        t = off.store(gpu_blocks=[3], cpu_chunks=[3])
        await t
        return t.progress()

    assert asyncio.run(main()) == (TENSORS * PAGE, TENSORS * PAGE)


def test_a_completion_counted_with_its_job_id_is_never_counted_twice() -> None:
    """A completion interrupted between its count and its mark is counted again from the
    interrupt's clean-up, with its job id: that count is skipped when the oldest transfer
    in flight is no longer that job (the next one's entry stays for it)."""
    from kvasync._stats import LaneRecorder
    from kvasync._transfer import TransferResult

    rec = LaneRecorder("d2h", False)
    rec.submitted(7, "dma", 100)
    rec.submitted(8, "dma", 200)
    rec.finished(TransferResult(7, True, 100, 0.1), None, 7)
    rec.finished(TransferResult(7, True, 100, 0.1), None, 7)  # the clean-up: skipped
    assert rec.snapshot().completed == 1
    rec.finished(TransferResult(8, True, 200, 0.1), None, 8)
    assert rec.snapshot().completed == 2 and rec.snapshot().in_flight == 0
