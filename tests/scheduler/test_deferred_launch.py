"""Big staged and pitched stores are enqueued by the lane's launcher thread: `store()` returns once the
compute-stream order is recorded, and the lane keeps its order, failures and shutdown."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._scheduler import DirectionQueue

PAGE, BLOCKS, CHUNKS = 512, 32, 16


def _offloader(path: str = "staged") -> tuple[kv.Offloader, list[np.ndarray]]:
    rng = np.random.default_rng(7)
    gpu = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(3)]
    return kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), CHUNKS, 1, copy_path=path), gpu


def _launchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-launcher")]


@pytest.fixture
def defer_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DirectionQueue, "DEFER_MIN_BYTES", 0)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("defer_all")
async def test_deferred_stores_keep_order_with_later_transfers_of_the_lane() -> None:
    off, gpu = _offloader()
    # staged (deferred) then memmove (behind the launcher) into the same chunk: the later wins
    first = off.store(gpu_blocks=[1], cpu_chunks=[4])
    second = off.store(gpu_blocks=[2], cpu_chunks=[4], path="memmove")
    third = off.store(gpu_blocks=list(range(8)), cpu_chunks=list(range(8, 16)))
    done: list[int] = []
    for t in (first, second, third):
        t.add_done_callback(lambda f: done.append(f.result().job_id))
    results = [await t for t in (first, second, third)]
    assert all(r.success for r in results)
    assert done == sorted(done)  # completed in submission order
    for view, src in zip(off.cpu_tensors, gpu):
        np.testing.assert_array_equal(view[4], src[2])
        np.testing.assert_array_equal(view[8:16].reshape(8, PAGE), src[:8])
    assert _launchers()
    await off.aclose()
    assert not _launchers()  # joined by close


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("defer_all")
@pytest.mark.parametrize("path", ["staged", "pitched"])
async def test_store_returns_before_its_copy_is_enqueued(path: str) -> None:
    off, gpu = _offloader(path)
    gate, entered = threading.Event(), threading.Event()
    real = off.backend.enqueue_copy

    def slow(*args: Any, **kw: Any) -> None:
        entered.set()
        assert gate.wait(10)
        real(*args, **kw)

    off.backend.enqueue_copy = slow  # type: ignore[method-assign]
    t = off.store(gpu_blocks=[3], cpu_chunks=[0])  # returns while the launcher is held
    assert entered.wait(10) and not t.done()
    gate.set()
    assert (await t).success
    np.testing.assert_array_equal(off.cpu_tensors[0][0], gpu[0][3])
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("defer_all")
async def test_an_enqueue_failure_on_the_launcher_fails_its_transfer_and_those_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    off, _ = _offloader()
    real = off.backend.enqueue_copy
    calls = 0

    def flaky(*args: Any, **kw: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected enqueue failure")
        real(*args, **kw)

    # the launcher starts once all four are queued: a failure before the last submission
    # would (rightly) make that store() raise instead of failing its transfer
    start_launcher = DirectionQueue._ensure_launcher
    monkeypatch.setattr(DirectionQueue, "_ensure_launcher", lambda self: None)
    off.backend.enqueue_copy = flaky  # type: ignore[method-assign]
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(4)]
    monkeypatch.setattr(DirectionQueue, "_ensure_launcher", start_launcher)
    lane = off._submitter.lanes.queues[("d2h", False)]
    with lane._lock:
        lane._ensure_launcher()
    assert (await ts[0]).success
    with pytest.raises(kv.TransferFailedError, match="injected enqueue failure"):
        await ts[1]
    for t in ts[2:]:
        with pytest.raises(kv.TransferFailedError, match="queued behind a failed transfer"):
            await t
    with pytest.raises(kv.OffloaderBrokenError):
        off.store(gpu_blocks=[0], cpu_chunks=[0])
    await off.aclose()
    assert not _launchers()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("defer_all")
async def test_a_device_refusing_the_launchers_stream_calls_fails_the_transfer() -> None:
    off, _ = _offloader()
    real = off.backend.new_stream

    def refuse(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("context is destroyed")

    off.backend.new_stream = refuse  # type: ignore[method-assign]
    t = off.store(gpu_blocks=[0], cpu_chunks=[0])  # the launcher needs the lane's first stream
    with pytest.raises(kv.OffloaderBrokenError, match="refused new work"):
        await t
    off.backend.new_stream = real  # type: ignore[method-assign]
    await off.aclose()
    assert not _launchers()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_small_stores_and_loads_stay_on_the_callers_thread() -> None:
    off, _ = _offloader()  # default threshold: these stores are far below it
    assert (await off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1])).success
    assert (await off.load(cpu_chunks=[0, 1], gpu_blocks=[2, 3])).success
    assert not _launchers()
    await off.aclose()


def test_close_waits_for_deferred_stores_and_stops_the_launcher(
    defer_all: None,
) -> None:
    off, gpu = _offloader()
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(CHUNKS)]
    off.close()
    assert all(t.done() and t.result().success for t in ts)
    assert not _launchers()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("blocks", "deferred"), [(7, False), (8, True)])
async def test_the_default_threshold_defers_stores_of_one_mib_and_up(blocks: int,
                                                                     deferred: bool) -> None:
    """At the default `DEFER_MIN_BYTES` (1 MiB): 8 blocks of 2 x 64 KiB pages are deferred,
    7 (0.875 MiB) stay on the caller's thread."""
    page = 64 * 1024
    gpu = [np.full((16, page), i + 1, np.uint8) for i in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 16, 1, copy_path="staged")
    assert DirectionQueue.DEFER_MIN_BYTES == 1 << 20
    t = off.store(gpu_blocks=list(range(blocks)), cpu_chunks=list(range(blocks)))
    assert t.nbytes == blocks * 2 * page
    assert bool(_launchers()) == deferred
    assert (await t).success
    for view, src in zip(off.cpu_tensors, gpu):
        np.testing.assert_array_equal(view[:blocks].reshape(blocks, page), src[:blocks])
    await off.aclose()
    assert not _launchers()
