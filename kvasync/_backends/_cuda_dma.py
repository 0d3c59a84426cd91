"""The CUDA "dma" copy path: the copy engines, fed by the driver one descriptor at a time.

Facts this path is built on (H200, docs/benchmarks):

- the copy engines run queued copies in FIFO order per direction and ignore stream
  priorities; each copy costs driver time on the host (~1.6 us per `cudaMemcpyAsync`,
  7.6 us + 0.5 us per descriptor for one `cuMemcpyBatchAsync`), so small scattered pages
  are driver-bound (4 KiB stores 5.9 GB/s, loads 2.1 GB/s);
- `cuMemcpyBatchAsync` has two ABIs (CUDA 12.8 with a failure index, 13 without;
  `_cudart.BatchCopier`) and is called in chunks of at most 8192 descriptors. Source order
  is STREAM for stores (they read live KV cache) and ANY for loads (host memory no stream
  writes). Where the driver lacks it, or for one copy, each coalesced run is one
  `cudaMemcpyAsync`;
- one engine leaves a gap between copies; several streams keep several engines busy, so
  big batches are spread over helper streams (fan-out) forked off and joined back to the
  transfer's stream with events.

Driver calls per `enqueue`: up to `EACH_RUNS` runs, one `cudaMemcpyAsync` each; else one
batch call per 8192 descriptors, or with fan-out one per helper plus an event record and
a stream wait per helper at the fork and at the join (~17 calls for 4 helpers).

The thresholds are the defaults of `CudaBackend`'s class attributes of the same names
(the backend passes its current values per call):

- `EACH_RUNS`: up to this many runs, one `cudaMemcpyAsync` each beats a batch call (1.6 us
  per copy against 7.6 us + 0.5 us per descriptor, measured on the H200).
- `FAN_OUT`, `FAN_MIN_BYTES`: a batch whose descriptors average at least `FAN_MIN_BYTES` is
  spread over `FAN_OUT` helper streams, so several copy engines work at once and one
  engine's per-copy gap hides behind the others' copies. Measured on the H200 (1 GiB of
  random pages, GB/s h2d / d2h, 1 stream -> 4): 256 KiB 49.3 / 49.2 -> 52.2 / 51.6,
  1 MiB 52.6 / 53.8 -> 53.4 / 54.5; 16 KiB pages got slower (the driver is their limit).
- `FAN_JOIN_PIECES`: a multi-piece transfer forks the helpers once and joins them after
  its last piece (0), or every this many pieces: a fork and join per 32 MiB piece cost
  ~17 API calls, which showed as CPU time while a 20 ms transfer was awaited.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _cudart
from ._base import Direction
from ._cuda_device import CudaStream, _failure, device
from ._cudart import cupy

if TYPE_CHECKING:
    from .._program import TransferPlan

__all__ = ["EACH_RUNS", "FAN_JOIN_PIECES", "FAN_MIN_BYTES", "FAN_OUT", "DmaPath", "FanRound"]

EACH_RUNS = 4
FAN_OUT = 4
FAN_MIN_BYTES = 128 << 10
FAN_JOIN_PIECES = 0


@dataclass
class _Fan:
    """Helper streams of one main stream for fanned-out DMA, with their fork/join events."""

    owners: list[Any]  # CuPy Streams (kept alive)
    streams: list[int]  # their handles
    fork: Any  # CuPy Event recorded on the main stream
    joins: list[Any]  # one CuPy Event per helper

    @classmethod
    def create(cls, device_id: int, ways: int) -> _Fan:
        """Wraps `cudaStreamCreateWithFlags` and `cudaEventCreateWithFlags`; never blocks."""
        cp = cupy()
        with device(device_id):
            owners = [cp.cuda.Stream(non_blocking=True) for _ in range(ways)]
            fork = cp.cuda.Event(disable_timing=True)
            joins = [cp.cuda.Event(disable_timing=True) for _ in range(ways)]
        return cls(owners, [int(o.ptr) for o in owners], fork, joins)


class FanRound:
    """Helper streams forked off one main stream for a stretch of DMA batches, then joined.

    `helper()` hands out the helper streams round-robin; each one, at its first use, waits
    for a fork event recorded on the main stream (cudaEventRecord + cudaStreamWaitEvent),
    so it starts after everything enqueued on the main stream before. `join()` records an
    event on each helper used and makes the main stream wait for it, so what follows on
    the main stream stays in order; it must run even if a batch call failed.

    The helpers belong to the main stream (one submitter at a time, under its queue's
    lock), and the events are re-recorded per round: a wait takes the record made before
    it, so reuse is safe.
    """

    __slots__ = ("dma", "fan", "main", "next", "used", "ways")

    def __init__(self, dma: DmaPath, stream: CudaStream, ways: int) -> None:
        self.dma, self.main, self.ways = dma, stream.ptr, ways
        self.fan: _Fan | None = None  # looked up (or created) at the first helper()
        self.used = 0  # helpers forked in this round: 0..ways
        self.next = 0

    def helper(self) -> int:
        """The next helper stream's handle, forked off the main stream at its first use
        (wraps `cudaEventRecord` + `cudaStreamWaitEvent`; returns without waiting)."""
        fan = self.fan
        if fan is None:
            fan = self.dma.fans.get(self.main)
            if fan is None or len(fan.streams) < self.ways:
                fan = self.dma.fans[self.main] = _Fan.create(self.dma.device_id, self.ways)
            self.fan = fan
        rt = cupy().cuda.runtime
        i = self.next
        self.next = (i + 1) % self.ways
        if i >= self.used:
            if self.used == 0:
                rt.eventRecord(fan.fork.ptr, self.main)
            rt.streamWaitEvent(fan.streams[i], fan.fork.ptr, 0)
            self.used = i + 1
        return fan.streams[i]

    def join(self, end_round: bool = True) -> None:
        """The main stream waits for every helper used since the last join (each helper is
        tried even if an earlier one's calls failed; the first failure is raised). Wraps
        `cudaEventRecord` + `cudaStreamWaitEvent` per helper; returns without waiting.

        `end_round=False` keeps the helpers forked: the main stream catches up with them
        (so an event recorded on it next marks what they copied so far) while they go on
        with later batches without a new fork."""
        fan, used = self.fan, self.used
        if end_round:
            self.used = self.next = 0
        if fan is None:
            return
        rt = cupy().cuda.runtime
        error: BaseException | None = None
        for i in range(used):
            try:
                rt.eventRecord(fan.joins[i].ptr, fan.streams[i])
                rt.streamWaitEvent(self.main, fan.joins[i].ptr, 0)
            except Exception as exc:  # a dead context: keep joining, report the first
                error = error or exc
        if error is not None:
            raise error


class DmaPath:
    """Enqueues plans on the copy engines (`copy`); owns the helper streams of fan-out.

    `counts` is the backend's per-path counter dict (shared, not copied): this path adds
    to "dma_each", "dma_batch" and "dma_fanned".
    """

    def __init__(self, device_id: int, counts: dict[str, int]) -> None:
        self.device_id = device_id
        self.counts = counts
        #: helper streams of fanned-out DMA batches, per main stream handle
        self.fans: dict[int, _Fan] = {}

    def copy(self, stream: CudaStream, plan: TransferPlan, direction: Direction,
             batch: _cudart.BatchCopier | None, fan: FanRound | None = None, *,
             each_runs: int = EACH_RUNS, fan_out: int = FAN_OUT,
             fan_min_bytes: int = FAN_MIN_BYTES) -> None:
        """Enqueue `plan` on `stream` (returns without waiting). `batch`: the batch call,
        None where missing or disabled. `fan`: the helper round of a multi-piece transfer,
        which takes a fanned batch whole onto its next helper stream (else the batch is
        split over a round of its own)."""
        batch = batch if stream.ptr not in (0, 1) else None  # None: batch call disabled
        runs = plan.runs()  # small whole-page plans: Python ints, no NumPy
        if runs is not None:
            if len(runs) <= each_runs or batch is None:
                self._memcpy_runs(runs, stream)
                return
            src, dst, sizes = (np.array(col, dtype=np.uint64) for col in zip(*runs))
        else:
            src, dst, sizes = plan.coalesced()
            if len(sizes) == 1 or batch is None:  # one copy: the plain call is cheaper
                self._memcpy_runs(zip(src.tolist(), dst.tolist(), sizes.tolist()), stream)
                return
        order = _cudart.ACCESS_ORDER_STREAM if direction == "d2h" else (
            _cudart.ACCESS_ORDER_ANY)
        src_dev, dst_dev = (self.device_id, -1) if direction == "d2h" else (
            -1, self.device_id)
        ways = fan_ways(sizes, fan_out, fan_min_bytes, whole=fan is not None)
        try:
            if ways == 1:
                batch(src, dst, sizes, stream.ptr, order, src_dev, dst_dev)
            elif fan is not None:
                batch(src, dst, sizes, fan.helper(), order, src_dev, dst_dev)
                self.counts["dma_fanned"] += 1
            else:
                self._batch_fanned(batch, src, dst, sizes, stream, ways, order, src_dev,
                                   dst_dev)
        except _cudart.CudaCallError as exc:
            raise _failure("cuMemcpyBatchAsync", exc) from exc
        self.counts["dma_batch"] += 1

    def _batch_fanned(self, batch: _cudart.BatchCopier, src: np.ndarray, dst: np.ndarray,
                      sizes: np.ndarray, stream: CudaStream, ways: int, order: int,
                      src_dev: int, dst_dev: int) -> None:
        """One batch split into `ways` contiguous slices, one per helper stream, forked off
        and joined back to `stream` around it (see `FanRound`)."""
        fan = FanRound(self, stream, ways)
        n = len(sizes)
        bounds = [n * i // ways for i in range(ways + 1)]
        try:
            for i in range(ways):
                lo, hi = bounds[i], bounds[i + 1]
                batch(src[lo:hi], dst[lo:hi], sizes[lo:hi], fan.helper(), order, src_dev,
                      dst_dev)
        finally:
            fan.join()
        self.counts["dma_fanned"] += 1

    def _memcpy_runs(self, runs: Iterable[tuple[int, int, int]], stream: CudaStream) -> None:
        """One `cudaMemcpyAsync` per run; returns without waiting."""
        try:
            _cudart.memcpy_runs(runs, stream.ptr)
        except Exception as exc:
            raise _failure("cudaMemcpyAsync", exc) from exc
        self.counts["dma_each"] += 1

    def close(self) -> None:
        self.fans.clear()


def fan_ways(sizes: np.ndarray, fan_out: int, fan_min_bytes: int, whole: bool = False) -> int:
    """Helper streams for a batch (1: none); `whole`: it goes onto one helper of a
    multi-piece round, so it need not be long enough to be sliced."""
    n = len(sizes)
    if fan_out < 2 or n < (2 if whole else 2 * fan_out):
        return 1
    if int(sizes.sum()) < fan_min_bytes * n:
        return 1
    return fan_out
