"""A big staged load is split: its caller enqueues the first pieces (the copy starts at
once) and the lane's launcher thread the rest, so `load()` returns without paying for every
slab; the lane keeps its order, and a later transfer with a signal (a layer-wise load) is
enqueued only after the launcher caught up, so its signal is recorded when the call returns."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._lane_launch import LaneLaunch

PAGE, BLOCKS, TENSORS = 4096, 64, 3
SLOT = PAGE * TENSORS  # one block of every tensor


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 2, 8, 16, 16, 16, 6 slots for a load of every block (staged)."""
    for name, value in (("STAGED_WHOLE_BYTES", 4 * SLOT), ("FIRST_PIECE_BYTES", 2 * SLOT),
                        ("STAGED_FIRST_PIECE_BYTES", 2 * SLOT), ("STAGED_GROWTH", 4),
                        ("KERNEL_PIECE_BYTES", 16 * SLOT)):
        monkeypatch.setattr(LaneLaunch, name, value)


class Spy:
    """Wraps the backend's `enqueue_pieces`: who enqueued how many pieces, with which
    edges."""

    def __init__(self, backend: Any) -> None:
        self.real = backend.enqueue_pieces
        self.calls: list[tuple[str, int, tuple[bool, bool]]] = []
        backend.enqueue_pieces = self

    def __call__(self, stream: Any, pieces: Any, direction: Any, path: str,
                 marks: Any = None, edges: tuple[bool, bool] = (True, True)) -> None:
        self.calls.append((threading.current_thread().name, len(pieces), edges))
        self.real(stream, pieces, direction, path, marks, edges=edges)


def _offloader() -> tuple[kv.Offloader, list[np.ndarray], Spy]:
    rng = np.random.default_rng(3)
    gpu = [np.zeros((BLOCKS, PAGE), dtype=np.uint8) for _ in range(TENSORS)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1, copy_path="staged")
    for view in off.cpu_tensors:
        view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    return off, gpu, Spy(off.backend)


@pytest.mark.timeout(60)
def test_a_big_load_enqueues_its_first_pieces_on_the_caller_and_the_rest_on_the_launcher(
) -> None:
    off, gpu, spy = _offloader()
    try:
        chunks = np.random.default_rng(0).permutation(BLOCKS)
        t = off.load(cpu_chunks=chunks, gpu_blocks=list(range(BLOCKS)))
        # a later load into block 0 queues behind the launcher: it lands last
        later = off.load(cpu_chunks=[chunks[5]], gpu_blocks=[0], path="memmove")
        r, r_later = t.wait(30), later.wait(30)
        assert r.success and r_later.success and r.job_id < r_later.job_id
        assert r.bytes == BLOCKS * SLOT and t.progress().fraction == 1.0
        caller = threading.current_thread().name
        assert spy.calls[0] == (caller, LaneLaunch.SPLIT_HEAD_PIECES, (True, False))
        assert spy.calls[1][0].endswith("-launcher") and spy.calls[1][2] == (False, True)
        assert spy.calls[0][1] + spy.calls[1][1] == 6
        for view, dst in zip(off.cpu_tensors, gpu):
            np.testing.assert_array_equal(dst[1:], view[chunks[1:]].reshape(BLOCKS - 1, PAGE))
            np.testing.assert_array_equal(dst[0], view[chunks[5]].reshape(PAGE))
    finally:
        off.close()


@pytest.mark.timeout(60)
def test_small_loads_signals_and_stores_are_not_split() -> None:
    off, gpu, spy = _offloader()
    try:
        off.load(cpu_chunks=[1, 2, 3], gpu_blocks=[4, 5, 6]).wait(30)  # one program
        off.load_layerwise(cpu_chunks=list(range(BLOCKS)), gpu_blocks=list(range(BLOCKS)),
                           layers=[[0, 1, 2]]).wait(30)
        threads = {name for name, _, _ in spy.calls}
        assert threads <= {threading.current_thread().name}
        assert all(edges == (True, True) for _, _, edges in spy.calls)
    finally:
        off.close()


@pytest.mark.timeout(60)
def test_a_layerwise_load_behind_a_split_load_waits_for_the_launcher() -> None:
    off, gpu, _ = _offloader()
    lane = off._queues[("h2d", False)]
    every = list(range(BLOCKS))
    try:
        off.load(cpu_chunks=every, gpu_blocks=every).wait(30)  # starts the launcher
        wake = lane._ensure_launcher
        lane._ensure_launcher = lambda: None  # type: ignore[method-assign]
        big = off.load(cpu_chunks=every, gpu_blocks=every)  # its rest waits, unseen
        assert lane._launches
        done: list[Any] = []
        caller = threading.Thread(target=lambda: done.append(off.load_layerwise(
            cpu_chunks=[7], gpu_blocks=[0], layers=[[0], [1, 2]])))
        caller.start()
        caller.join(0.3)
        assert caller.is_alive() and not done  # queued, its signals would not be recorded
        with lane._lock:
            wake()
        caller.join(10)
        assert done and not lane._launches
        layered = done[0]
        assert big.wait(30).success and layered.wait(30).success
        for view, dst in zip(off.cpu_tensors, gpu):
            np.testing.assert_array_equal(dst[0], view[7].reshape(PAGE))  # the later wins
            np.testing.assert_array_equal(dst[1:], view[1:BLOCKS].reshape(BLOCKS - 1, PAGE))
    finally:
        off.close()
