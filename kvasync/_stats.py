"""Counters and timings of every lane, read as frozen snapshots (`Offloader.stats()`).

Each lane (a direction's normal or urgent queue) owns one `LaneRecorder`. The scheduler
calls it twice per transfer, each time under a lock it already holds:

- `submitted` when the transfer was handed to the device queue (under the lane's submit
  lock, in submission order): the host time and the transfer's path and bytes go to a FIFO;
- `finished` when the transfer completed (under the lane's completion lock, in the same
  order, before its awaiters are woken): the FIFO's head leaves, its counters and timings
  are updated.

Both are O(1): a deque append or pop, a few integer additions, a store into a ring of
recent samples and a bisect into fixed histogram buckets. Percentiles are computed from the
rings only when a snapshot is taken. The recorder's own lock is taken by `finished` and by
`snapshot` only, so it is contended only while a snapshot copies the rings.

What the times mean (the host cannot read a device event's clock against its own):

- `copy`: device time from the transfer's start event to its end event (as in
  `TransferResult.seconds`): the copy itself;
- `latency`: host time from the submission (when `store()`/`load()` handed the transfer to
  the device queue) to the moment kvasync saw it complete;
- `queue_wait`: `latency - copy` (at least 0): the time the transfer was submitted but not
  copying: waiting for the compute stream, for earlier transfers of its lane, and for the
  host to notice the end. It bounds the device queue's wait from above.

Failed transfers count as failures only; they add no timing samples.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._transfer import TransferResult

__all__ = [
    "LaneRecorder",
    "LaneStats",
    "OffloaderStats",
    "PathStats",
    "Distribution",
    "collect",
]

log = logging.getLogger("kvasync")

#: recent samples kept per lane for the percentiles
WINDOW = 1024
#: histogram bucket upper bounds: seconds (copy, queue wait, latency) and bytes (size)
SECONDS_BUCKETS: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
SIZE_BUCKETS: tuple[float, ...] = tuple(float(4 ** k * 1024) for k in range(1, 12))  # 4 KiB..4 GiB


@dataclass(frozen=True)
class Distribution:
    """Percentiles of a lane's recent samples and a cumulative histogram of all of them.

    Seconds for the timings, bytes for `size`. `p50`, `p90`, `p99` (nearest rank) cover the
    last `window` successful transfers (at most 1024; None while there were none).
    `buckets` are upper bounds; `counts[i]` is how many samples since the offloader was
    built were at most `buckets[i]` (cumulative, as Prometheus histograms are); `count` and
    `sum` cover every sample.
    """

    p50: float | None
    p90: float | None
    p99: float | None
    window: int
    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


@dataclass(frozen=True)
class PathStats:
    """What one concrete copy path did in a lane: finished transfers, their bytes and device
    seconds (successful ones only), and the transfers that failed."""

    transfers: int
    bytes: int
    seconds: float
    failures: int


@dataclass(frozen=True)
class LaneStats:
    """One lane: a direction ("d2h" stores, "h2d" loads) and its normal or urgent queue.

    `paths` maps each concrete copy path that ran ("kernel", "dma", "staged", "memmove") to
    its `PathStats`. `in_flight` counts transfers submitted and not completed (their bytes
    in `in_flight_bytes`); `oldest_in_flight_seconds` is the host time since the oldest of
    them was submitted (0.0 when none is), `oldest_job_id` its job id. See `Offloader.stats`
    for what `copy`, `queue_wait` and `latency` measure; `size` is a histogram of
    transfer sizes in bytes (its percentiles in bytes too).
    """

    direction: str
    lane: str
    submitted: int
    completed: int
    failures: int
    in_flight: int
    in_flight_bytes: int
    oldest_in_flight_seconds: float
    oldest_job_id: int | None
    paths: Mapping[str, PathStats]
    copy: Distribution
    queue_wait: Distribution
    latency: Distribution
    size: Distribution

    @property
    def transfers(self) -> int:
        """Successful transfers, every path."""
        return sum(p.transfers for p in self.paths.values())

    @property
    def bytes(self) -> int:
        """Bytes of successful transfers, every path."""
        return sum(p.bytes for p in self.paths.values())


@dataclass(frozen=True)
class OffloaderStats:
    """A snapshot of an offloader's four lanes (`Offloader.stats()`); it never changes."""

    lanes: tuple[LaneStats, ...]
    #: `time.monotonic()` when the snapshot was taken
    taken_at: float

    def lane(self, direction: str, urgent: bool = False) -> LaneStats:
        """The lane of `direction` ("d2h" or "h2d"), normal or urgent."""
        want = "urgent" if urgent else "normal"
        for s in self.lanes:
            if s.direction == direction and s.lane == want:
                return s
        raise KeyError(f"no lane {direction!r} {want!r}: directions are 'd2h' and 'h2d'")

    @property
    def stores(self) -> LaneStats:
        """The normal store (GPU -> host) lane."""
        return self.lane("d2h")

    @property
    def loads(self) -> LaneStats:
        """The normal load (host -> GPU) lane."""
        return self.lane("h2d")

    @property
    def transfers(self) -> int:
        return sum(s.transfers for s in self.lanes)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.lanes)

    @property
    def failures(self) -> int:
        return sum(s.failures for s in self.lanes)

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.lanes)


class _Series:
    """A ring of recent samples and a cumulative histogram (written under one lock)."""

    __slots__ = ("buckets", "count", "counts", "next", "ring", "total")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound
        self.ring: list[float] = [0.0] * WINDOW
        self.next = 0
        self.count = 0
        self.total = 0.0

    def add(self, x: float) -> None:
        self.ring[self.next % WINDOW] = x
        self.next += 1
        self.counts[bisect_left(self.buckets, x)] += 1
        self.count += 1
        self.total += x

    def copy(self) -> tuple[list[float], list[int], int, float]:
        n = min(self.next, WINDOW)
        return self.ring[:n], list(self.counts), self.count, self.total

    def timing(self, copied: tuple[list[float], list[int], int, float]) -> Distribution:
        window, counts, count, total = copied
        window.sort()
        cumulative, acc = [], 0
        for c in counts[:-1]:
            acc += c
            cumulative.append(acc)
        return Distribution(_rank(window, 0.5), _rank(window, 0.9), _rank(window, 0.99),
                      len(window), self.buckets, tuple(cumulative), count, total)


def _rank(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


class _Path:
    __slots__ = ("bytes", "failures", "seconds", "transfers")

    def __init__(self) -> None:
        self.transfers = self.bytes = self.failures = 0
        self.seconds = 0.0


class LaneRecorder:
    """The counters of one lane; see the module docstring for who calls what, and when."""

    def __init__(self, direction: str, urgent: bool) -> None:
        self.direction = direction
        self.lane = "urgent" if urgent else "normal"
        #: (perf_counter at submission, job id, path, bytes) of each transfer in flight
        self._pending: deque[tuple[float, int, str, int]] = deque()
        self._submitted = 0  # written only by `submitted`
        self._submitted_bytes = 0
        self._lock = threading.Lock()  # `finished` and `snapshot`
        self._completed = 0
        self._completed_bytes = 0
        self._failures = 0
        self._paths: dict[str, _Path] = {}
        self._copy = _Series(SECONDS_BUCKETS)
        self._wait = _Series(SECONDS_BUCKETS)
        self._latency = _Series(SECONDS_BUCKETS)
        self._size = _Series(SIZE_BUCKETS)

    def submitted(self, job_id: int, path: str, nbytes: int) -> None:
        """A transfer was handed to the device queue (called in submission order)."""
        self._pending.append((time.perf_counter(), job_id, path, nbytes))
        self._submitted += 1
        self._submitted_bytes += nbytes
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kvasync: job %d %s %s lane: submitted %d B on path %s",
                      job_id, self.direction, self.lane, nbytes, path)

    def finished(self, result: TransferResult | None, error: BaseException | None,
                 job_id: int | None = None) -> None:
        """The oldest transfer in flight completed (called in completion order, which is
        submission order), with `result` or failed with `error`; with `job_id`, only if the
        oldest is that job's (a count interrupted half-way is not made twice)."""
        now = time.perf_counter()
        if job_id is not None and self._pending and self._pending[0][1] != job_id:
            return
        try:
            t0, jid, path, nbytes = self._pending.popleft()
        except IndexError:  # not submitted through `submitted`: nothing to account
            return
        with self._lock:
            p = self._paths.get(path)
            if p is None:
                p = self._paths[path] = _Path()
            self._completed += 1
            self._completed_bytes += nbytes
            latency = now - t0
            if result is None:
                p.failures += 1
                self._failures += 1
            else:
                p.transfers += 1
                p.bytes += nbytes
                p.seconds += result.seconds
                self._copy.add(result.seconds)
                self._wait.add(max(latency - result.seconds, 0.0))
                self._latency.add(latency)
                self._size.add(float(nbytes))
        if log.isEnabledFor(logging.DEBUG):
            if result is None:
                log.debug("kvasync: job %d %s %s lane: failed after %.6f s on path %s: %s",
                          jid, self.direction, self.lane, latency, path, error)
            else:
                log.debug("kvasync: job %d %s %s lane: done, %d B on path %s, copy %.6f s, "
                          "queued %.6f s", jid, self.direction, self.lane, nbytes, path,
                          result.seconds, max(latency - result.seconds, 0.0))

    def snapshot(self) -> LaneStats:
        """A frozen copy of this lane's counters (percentiles sorted outside the lock)."""
        with self._lock:
            completed, completed_bytes = self._completed, self._completed_bytes
            failures = self._failures
            paths = {name: PathStats(p.transfers, p.bytes, p.seconds, p.failures)
                     for name, p in sorted(self._paths.items())}
            series = [(s, s.copy()) for s in (self._copy, self._wait, self._latency, self._size)]
        # read after the completions: a transfer finishing meanwhile is counted in flight
        submitted, submitted_bytes = self._submitted, self._submitted_bytes
        now = time.perf_counter()
        try:
            oldest = self._pending[0]
        except IndexError:
            oldest = None
        copy, wait, latency, size = (s.timing(c) for s, c in series)
        in_flight = max(submitted - completed, 0)
        return LaneStats(
            direction=self.direction,
            lane=self.lane,
            submitted=submitted,
            completed=completed,
            failures=failures,
            in_flight=in_flight,
            in_flight_bytes=max(submitted_bytes - completed_bytes, 0) if in_flight else 0,
            oldest_in_flight_seconds=0.0 if oldest is None else max(now - oldest[0], 0.0),
            oldest_job_id=None if oldest is None else oldest[1],
            paths=MappingProxyType(paths),
            copy=copy,
            queue_wait=wait,
            latency=latency,
            size=size,
        )


def collect(recorders: Iterable[LaneRecorder]) -> OffloaderStats:
    """One snapshot of every lane, in the order given."""
    return OffloaderStats(tuple(r.snapshot() for r in recorders), time.monotonic())
