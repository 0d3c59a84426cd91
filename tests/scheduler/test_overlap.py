"""A transfer the backend may overlap (`Backend.may_overlap`) is handed its predecessor's end
instead of waiting for it on its stream, and records its own start; everything else waits
as before. The host backend never overlaps; here a test double of it does, in the order
the CUDA staged path keeps (wait for the predecessor, then start, then copy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from support import Gate

import kvasync as kv
from kvasync._backends import Direction, Event, Overlap, Stream
from kvasync._backends._host import HostBackend, HostStream
from kvasync._program import TransferPlan

PAGE, BLOCKS = 4096, 16


class OverlappingHost(HostBackend):
    """The host backend, overlapping every transfer of `paths` after one of `after_paths`
    (`fail`: the overlapped enqueue raises before it waited for the predecessor)."""

    def __init__(self, paths: set[str], after_paths: set[str], fail: bool = False) -> None:
        super().__init__()
        self.overlap_paths, self.after_paths, self.fail = paths, after_paths, fail
        self.asked: list[tuple[str, str, str]] = []
        self.overlaps: list[Overlap] = []

    def may_overlap(self, path: str, direction: Direction, previous: str) -> bool:
        self.asked.append((path, direction, previous))
        return path in self.overlap_paths and previous in self.after_paths

    def enqueue_overlapped(self, stream: Stream, pieces: Sequence[TransferPlan],
                           direction: Direction, path: str, overlap: Overlap,
                           marks: Sequence[Event] | None = None,
                           edges: tuple[bool, bool] = (True, True)) -> None:
        self.overlaps.append(overlap)
        if self.fail:
            raise RuntimeError("the device refused the row copies")
        stream.wait_event(overlap.after)
        stream.record(overlap.start)
        if marks is None:
            self.enqueue_copy(stream, pieces[0], direction, path)
        else:
            self.enqueue_pieces(stream, pieces, direction, path, marks)


def _offloader(backend: Any) -> tuple[kv.Offloader, list[np.ndarray]]:
    rng = np.random.default_rng(7)
    gpu = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1, backend=backend)
    return off, gpu


@pytest.mark.timeout(60)
def test_a_queued_transfer_gets_its_predecessors_end_and_records_its_start(gate: Gate) -> None:
    backend = OverlappingHost({"staged"}, {"staged", "memmove"})
    off, gpu = _offloader(backend)
    lane = off._queues[("d2h", False)]
    try:
        first = off.store(gpu_blocks=[0, 1], cpu_chunks=[3, 4], path="memmove",
                          stream=gate.stream)
        end_of_first = lane._last_end
        second = off.store(gpu_blocks=[0, 1], cpu_chunks=[3, 4], path="staged",
                           stream=gate.stream)
        assert backend.asked == [("staged", "d2h", "memmove")]
        assert len(backend.overlaps) == 1 and backend.overlaps[0].after is end_of_first
        assert not second.done()
        gate.open()
        r1, r2 = first.wait(30), second.wait(30)
        assert r1.job_id < r2.job_id and r2.seconds >= 0.0
        np.testing.assert_array_equal(off.cpu_tensors[1][4], gpu[1][1])
    finally:
        gate.open()
        off.close()


@pytest.mark.timeout(60)
def test_what_the_backend_refuses_waits_on_the_stream(gate: Gate) -> None:
    backend = OverlappingHost({"staged"}, {"staged"})
    off, _ = _offloader(backend)
    try:
        ts = [off.store(gpu_blocks=[i], cpu_chunks=[i], path=p, stream=gate.stream)
              for i, p in enumerate(["memmove", "staged", "memmove", "staged", "staged"])]
        # asked only with a predecessor in flight; the answer follows the previous path
        assert [a[0] + "<" + a[2] for a in backend.asked] == [
            "staged<memmove", "memmove<staged", "staged<memmove", "staged<staged"]
        assert len(backend.overlaps) == 1  # only staged after staged
        gate.open()
        done = [t.wait(30).job_id for t in ts]
        assert done == sorted(done)
    finally:
        gate.open()
        off.close()


@pytest.mark.timeout(60)
def test_nothing_in_flight_means_no_overlap() -> None:
    backend = OverlappingHost({"staged"}, {"staged"})
    off, _ = _offloader(backend)
    try:
        for i in range(3):
            off.store(gpu_blocks=[i], cpu_chunks=[i], path="staged").wait(30)
        assert backend.overlaps == []
    finally:
        off.close()


def test_the_host_backend_never_overlaps() -> None:
    assert HostBackend().may_overlap("staged", "h2d", "staged") is False
    with pytest.raises(NotImplementedError):
        HostBackend().enqueue_overlapped(None, [], "h2d", "staged", None)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_an_empty_transfer_does_not_stand_for_the_writes_before_it(gate: Gate) -> None:
    """An empty staged store enqueues nothing on the staged path: a staged store after it
    must still wait for the memmove store before it, whose writes it does not follow."""
    backend = OverlappingHost({"staged"}, {"staged"})
    off, gpu = _offloader(backend)
    try:
        ts = [off.store(gpu_blocks=[0], cpu_chunks=[0], path="memmove", stream=gate.stream),
              off.store(gpu_blocks=[], cpu_chunks=[], path="staged", stream=gate.stream),
              off.store(gpu_blocks=[1], cpu_chunks=[0], path="staged", stream=gate.stream)]
        assert [a[2] for a in backend.asked] == ["memmove", "memmove"]
        assert backend.overlaps == []
        gate.open()
        for t in ts:
            t.wait(30)
        for k in range(2):  # the last store of chunk 0 wins
            np.testing.assert_array_equal(off.cpu_tensors[k][0], gpu[k][1])
    finally:
        gate.open()
        off.close()


@pytest.mark.timeout(60)
def test_a_failed_predecessor_is_waited_for(gate: Gate) -> None:
    backend = OverlappingHost({"staged"}, {"staged"})
    off, _ = _offloader(backend)
    lane = off._queues[("d2h", False)]
    try:
        first = off.store(gpu_blocks=[0], cpu_chunks=[0], path="staged", stream=gate.stream)
        end = lane._last_end
        end.error = lambda: RuntimeError("captured at record")  # type: ignore[method-assign]
        second = off.store(gpu_blocks=[1], cpu_chunks=[1], path="staged", stream=gate.stream)
        del end.error  # type: ignore[attr-defined]
        assert backend.overlaps == [] and backend.asked == []
        gate.open()
        first.wait(30), second.wait(30)
    finally:
        gate.open()
        off.close()


@pytest.mark.timeout(60)
def test_a_failed_overlapped_enqueue_still_ends_after_its_predecessor(gate: Gate) -> None:
    backend = OverlappingHost({"staged"}, {"staged"}, fail=True)
    off, _ = _offloader(backend)
    lane = off._queues[("d2h", False)]
    idle = HostStream(name="test-idle")  # the second waits for no compute
    try:
        first = off.store(gpu_blocks=[0], cpu_chunks=[0], path="staged", stream=gate.stream)
        second = off.store(gpu_blocks=[1], cpu_chunks=[1], path="staged", stream=idle)
        assert len(backend.overlaps) == 1
        end = lane._last_end
        assert end is not None and not end.synchronize(0.2)  # held behind the first
        assert lane._last_path == ""  # nobody overlaps a failed enqueue
        gate.open()
        assert first.wait(30).success
        with pytest.raises(kv.TransferFailedError):
            second.wait(30)
    finally:
        gate.open()
        off.close()
        idle.close()
