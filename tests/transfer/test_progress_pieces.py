"""`progress()` of a transfer cut into pieces advances piece by piece, never ahead of the
bytes that landed, and ends at (n, n) (or (0, n) for a failure); host backend."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._lane_launch import LaneLaunch

PAGE, BLOCKS, TENSORS = 4096, 64, 2  # 512 KiB per transfer of every block


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("PIECE_BYTES", 64 << 10), ("KERNEL_PIECE_BYTES", 64 << 10),
                        ("FIRST_PIECE_BYTES", 16 << 10),
                        ("STAGED_FIRST_PIECE_BYTES", 16 << 10), ("STAGED_GROWTH", 4),
                        ("MIN_PIECE_SLOTS", 1),
                        ("MIN_FIRST_SLOTS", 1), ("DEFER_MIN_BYTES", 1 << 62),
                        ("STAGED_WHOLE_BYTES", 16 << 10)):
        monkeypatch.setattr(LaneLaunch, name, value)


def _offloader(path: str) -> tuple[kv.Offloader, list[np.ndarray]]:
    rng = np.random.default_rng(3)
    gpu = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(TENSORS)]
    return kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1, copy_path=path), gpu


def _gate_piece(off: kv.Offloader, path: str,
                held: int) -> tuple[threading.Event, threading.Event]:
    """Hold the host stream at the `held`-th piece (0-based) until the gate opens; the
    second event is set once the stream waits there (every piece before it has run and
    its mark, recorded behind it on the stream, is set)."""
    name = "_execute_staged" if path == "staged" else "_execute"
    real = getattr(off.backend, name)
    gate, entered, calls = threading.Event(), threading.Event(), [0]

    def gated(*args: Any) -> None:
        if calls[0] == held:
            entered.set()
            assert gate.wait(20)
        calls[0] += 1
        real(*args)

    setattr(off.backend, name, gated)
    return gate, entered


def _wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["memmove", "staged"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
async def test_progress_advances_piece_by_piece(path: str, direction: str) -> None:
    off, _ = _offloader(path)
    gate, entered = _gate_piece(off, path, held=2)
    ids = list(range(BLOCKS))
    t = (off.store(gpu_blocks=ids, cpu_chunks=ids) if direction == "d2h"
         else off.load(cpu_chunks=ids, gpu_blocks=ids))
    total = BLOCKS * PAGE * TENSORS
    assert entered.wait(10)  # two pieces (16 KiB, then 64 KiB) have landed
    held = t.progress()
    assert held.total == total and 0 < held.done < total and not t.done()
    time.sleep(0.02)
    assert t.progress() == held  # nothing beyond the held piece is counted
    gate.set()
    seen = [held.done]
    while not t.done():
        seen.append(t.progress().done)
        await __import__("asyncio").sleep(0)
    await t
    assert seen == sorted(seen)
    assert t.progress() == (total, total)
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failed_pieced_transfer_ends_at_zero() -> None:
    off, _ = _offloader("memmove")
    off.backend._fail_next.append(RuntimeError("injected"))  # the first piece fails
    ids = list(range(BLOCKS))
    t = off.load(cpu_chunks=ids, gpu_blocks=ids)
    with pytest.raises(kv.TransferFailedError):
        await t
    assert t.progress() == (0, BLOCKS * PAGE * TENSORS)
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_transfer_of_one_piece_reports_nothing_until_it_landed() -> None:
    off, _ = _offloader("memmove")
    gate, _ = _gate_piece(off, "memmove", held=0)
    t = off.store(gpu_blocks=[0], cpu_chunks=[0])
    time.sleep(0.02)
    assert t.progress() == (0, PAGE * TENSORS)
    gate.set()
    await t
    assert t.progress() == (PAGE * TENSORS, PAGE * TENSORS)
    await off.aclose()
