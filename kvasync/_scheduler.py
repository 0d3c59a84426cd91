"""The scheduler: one FIFO queue per direction, from plan to stream/event to completion.

Submission (under the direction's lock), for every transfer:

1. on the caller's thread, record an ordering event on the compute stream, so stores read
   finished KV and loads land after pending writes (e.g. zeroing of freshly allocated
   blocks);
2. take a stream from the direction's pool; make it wait on that event and on the previous
   transfer's end event of the same direction, so transfers of one direction execute
   strictly in submission order;
3. record the start event, enqueue the copy path, record the end event.

Steps 2-3 run on the caller's thread too, except for big staged stores: their slabs cost
the host ~1 ms to enqueue, so the lane's launcher thread does it (and every later transfer
of the lane until it caught up), and `store()` returns after step 1.

Completion (`_lane_completion.py`, the base class): a daemon thread per direction takes
transfers in FIFO order, sleeps in the end event's blocking wait, then completes the
`Transfer` (result or failure) and recycles its stream and events; on CUDA it is lazy and
leaves transfers predicted to end soon to their pollers. Results are reported in submission
order. A failure fails that transfer and, through the event chain, every transfer queued
behind it in the direction; the direction then refuses new work (`OffloaderBrokenError`)
until the offloader is closed.

Closing (driven by `_lifecycle.Lifecycle`): `refuse_new`, then drain, then `request_stop`,
`join_thread`, `forget_pools`. A closed queue whose last transfer completes calls `on_idle`
(outside its locks, after the callbacks), which releases what a close could not wait for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

from ._backends import Backend, Direction, Event, Stream
from ._completion import CompletionEngine
from ._errors import OffloaderBrokenError, OffloaderClosedError
from ._lane_completion import InFlight, LaneCompletion
from ._program import TransferPlan
from ._threadstate import mark_library_thread, timed_acquire
from ._transfer import Transfer

__all__ = ["DirectionQueue"]

log = logging.getLogger("kvasync")


@dataclass
class _Launch:
    """A submitted transfer the lane has yet to enqueue on a stream."""

    transfer: Transfer
    plan: TransferPlan
    job_id: int
    path: str
    order: Event | None
    signal: Event | None


class _Reached(Event):
    """An end that is already reached: a deferred transfer whose stream calls the device
    refused completes through it, failed, in its place in the lane's order."""

    def query(self) -> bool:
        return True

    def synchronize(self, timeout: float | None = None) -> bool:
        return True

    def error(self) -> BaseException | None:
        return None

    def elapsed_seconds(self, end: Event) -> float:
        return 0.0

class DirectionQueue(LaneCompletion):
    """Submission and completion of one direction ("d2h" stores or "h2d" loads).

    This class submits; the completion half (thread, poll, finish, recycling) is the base
    class, `_lane_completion.LaneCompletion`.
    """

    def __init__(
        self,
        backend: Backend,
        direction: Direction,
        engine: CompletionEngine,
        max_streams: int = 4,
        urgent: bool = False,
    ) -> None:
        super().__init__(backend, direction, engine, urgent)
        self._max_streams = max_streams
        self._streams: list[Stream] = []
        self._next_stream = 0
        self.last_transfer: Transfer | None = None
        #: deferred transfers not yet enqueued, oldest first, and the thread that enqueues
        #: them (`_launch_loop`), woken through `_launch_ready` (a condition of the lock)
        self._launches: deque[_Launch] = deque()
        self._launcher: threading.Thread | None = None
        self._launch_ready = threading.Condition(self._lock)

    # -- pools (called under the lock) --------------------------------------------------------
    def _stream(self) -> Stream:
        if self._free_streams:
            return self._free_streams.pop()
        if len(self._streams) < self._max_streams:
            s = self.backend.new_stream()
            self._streams.append(s)
            return s
        # every pooled stream is busy: share one round-robin (order is kept by events)
        s = self._streams[self._next_stream % len(self._streams)]
        self._next_stream += 1
        return s

    def _event(self, timing: bool = True) -> Event:
        pool = self._free_events if timing else self._free_order_events
        if pool:
            return pool.pop()
        return self.backend.new_event(timing=timing)

    # -- submission ---------------------------------------------------------------------------
    def submit(
        self,
        plan: TransferPlan,
        job_id: int,
        path: str,
        compute_stream: Stream | None,
        signal: Event | None = None,
    ) -> Transfer:
        """Enqueue `plan` behind everything submitted before in this queue.

        `signal`, if given, is an extra event recorded right after the copy, owned by the
        caller (never pooled), so a compute stream may wait on it at any later time.

        The compute-stream order event is recorded here, on the caller's thread, so the copy
        sees the compute work submitted before this call. A big staged store
        (`_deferred`) then returns: the lane's launcher thread enqueues its slabs, which
        would hold the caller ~1 ms; so does every later transfer of the lane until the
        launcher caught up, which keeps the lane's order.
        """
        transfer = Transfer(job_id, self.direction, plan.nbytes, self.engine)
        with self._lock:
            if self.closed:
                raise OffloaderClosedError("the offloader is closed")
            if self.failure is not None:
                raise OffloaderBrokenError(
                    f"the {self._name} direction failed earlier ({self.failure}); "
                    "close the offloader and build a new one",
                    job_id,
                )
            order: Event | None = None
            try:
                if compute_stream is not None:
                    order = self._event(timing=False)
                    compute_stream.record(order)
            except Exception as exc:  # the device refuses new work (e.g. a dead context)
                raise self._refused(job_id, exc) from exc
            job = _Launch(transfer, plan, job_id, path, order, signal)
            if self._launches or self._deferred(plan, path, signal):
                self._note_submitted(job)
                self._launches.append(job)
                self._ensure_launcher()
                return transfer
            rec = self._launch(job, raise_refusal=True)
            self._note_submitted(job)
            self._add(rec)
        return transfer

    def _note_submitted(self, job: _Launch) -> None:
        """Count `job` in flight and predict its end (under the lock)."""
        self.last_transfer = job.transfer  # set under the lock: the newest, for drain()
        self._inflight += 1
        self._ensure_thread()
        eta = max(time.perf_counter(), self._tail_eta) + self.latency
        eta += job.plan.nbytes / self.bandwidth
        self._tail_eta = eta
        job.transfer._poller = self
        job.transfer._eta = eta
        self.stats.submitted(job.job_id, job.path, job.plan.nbytes)

    @staticmethod
    def _refused(job_id: int, exc: BaseException) -> OffloaderBrokenError:
        return OffloaderBrokenError(
            f"job {job_id}: the device refused new work: {type(exc).__name__}: {exc}", job_id
        )

    def _launch(self, job: _Launch, raise_refusal: bool = False) -> InFlight:
        """Enqueue `job` on a stream behind the lane's last transfer (under the lock): wait
        for its order event, record start, the copy, end (and its signal).

        A device that refuses the stream calls raises (`raise_refusal`, the caller's
        thread) or fails the transfer through an already-complete end (the launcher)."""
        plan, path = job.plan, job.path
        stream: Stream | None = None
        try:
            stream = self._stream()
            start, end = self._event(), self._event()
            if job.order is not None:
                stream.wait_event(job.order)
            if self._last_end is not None and stream is not self._last_stream:
                stream.wait_event(self._last_end)  # same stream: already in order
            stream.record(start)
        except Exception as exc:
            if raise_refusal:
                raise self._refused(job.job_id, exc) from exc
            done = _Reached()  # never recycled: the failure stops the lane's pools
            return InFlight(job.transfer, plan, cast(Stream, stream), done, done, None,
                            self._refused(job.job_id, exc), 0.0)
        error: BaseException | None = None
        try:
            if plan.nbytes <= self._piece_bytes(path):
                self.backend.enqueue_copy(stream, plan, self.direction, path)
            else:
                self.backend.enqueue_pieces(stream, plan.pieces(*self._piece_slots(plan, path)),
                                            self.direction, path)
        except Exception as exc:  # an API error: the copy never got (fully) enqueued
            error = exc
        try:
            stream.record(end)
            if job.signal is not None:
                stream.record(job.signal)
        except Exception as exc:
            if raise_refusal:
                raise self._refused(job.job_id, exc) from exc
            done = _Reached()
            return InFlight(job.transfer, plan, stream, done, done, None,
                            self._refused(job.job_id, exc), 0.0)
        self._last_end = end
        self._last_stream = stream
        return InFlight(job.transfer, plan, stream, start, end, job.order, error, 0.0)

    def _add(self, rec: InFlight) -> None:
        """Hand `rec` to the completion side (under the lock)."""
        rec.eta = rec.transfer._eta
        self._fifo.append(rec)  # deque appends are atomic; order is set by self._lock
        if not self.lazy:
            self._pending.put(rec)
        else:
            with self._cv:  # wake the thread only if it parked (nothing was in flight)
                if self._parked:
                    self._cv.notify()

    #: staged stores of at least this many bytes are enqueued by the lane's launcher thread
    #: (the caller only validates, builds the plan and records the order event): a 64 x 128
    #: blocks store of 16 KiB pages spent ~1.5 ms enqueueing its slabs on the H200 host
    DEFER_MIN_BYTES = 4 << 20
    DEFER_PATHS = frozenset({"staged"})

    def _deferred(self, plan: TransferPlan, path: str, signal: Event | None) -> bool:
        # loads stay on the caller's thread: a compute stream may wait on their events as
        # soon as load() returns, and waiting on an event not yet recorded does not wait
        return (self.direction == "d2h" and signal is None and path in self.DEFER_PATHS
                and plan.nbytes >= self.DEFER_MIN_BYTES)

    def _ensure_launcher(self) -> None:
        if self._launcher is None:
            self._launcher = threading.Thread(target=self._launch_loop,
                                              name=f"kvasync-{self.direction}-launcher",
                                              daemon=True)
            self._launcher.start()
        else:
            self._launch_ready.notify()

    def _launch_loop(self) -> None:
        """The launcher thread: enqueue deferred transfers in submission order, under the
        lane's lock (a caller's submission waits for the launch in progress)."""
        mark_library_thread()
        with self._lock:
            while True:
                while not self._launches and not self._stop:
                    self._launch_ready.wait()
                if not self._launches:
                    return
                job = self._launches[0]
                try:
                    rec = self._launch(job)
                finally:
                    self._launches.popleft()
                self._add(rec)

    #: bytes per piece of a big transfer (about 0.6 ms of PCIe time) and the fewest slots.
    #: Pieces bound how long a DMA transfer holds the copy engines (which ignore stream
    #: priority), so an urgent transfer gets through; kernel copies share the link with an
    #: urgent lane's kernel anyway, so they are cut only into `KERNEL_PIECE_BYTES` pieces,
    #: which lets the device start while the host packs the rest (each piece costs a pack
    #: and a launch, a quarter of a mid-size store's host time at 32 MiB)
    PIECE_BYTES = 32 << 20
    KERNEL_PIECE_BYTES = 256 << 20
    MIN_PIECE_SLOTS = 2048
    #: the first piece of a big transfer is this small (then 4x per piece up to the limit):
    #: packing 256 MiB of 4 KiB pages took ~0.5 ms on the H200 host, time in which the
    #: device sat idle; 8 MiB packs in tens of microseconds
    FIRST_PIECE_BYTES = 8 << 20
    MIN_FIRST_SLOTS = 256

    def _piece_bytes(self, path: str) -> int:
        # staged pieces pipeline through one staging ring like one program; a piece's
        # program is built when it is enqueued, so the first slab need not wait for a whole
        # gigabyte's (~3 ms of host time at 4 KiB pages on the H200 host). They grow to the
        # kernel's size: at 32 MiB each piece's job upload and table lookups cost the H200
        # 1 GiB staged transfers 5-8% of their device time
        return self.KERNEL_PIECE_BYTES if path in ("kernel", "staged") else self.PIECE_BYTES

    def _piece_slots(self, plan: TransferPlan, path: str = "dma") -> tuple[int, int]:
        """(slots per piece, slots of the first piece) for a big `plan` on `path`."""
        limit = self._piece_bytes(path)
        slots = sum(len(s.src_slots) for s in plan.segments)
        if slots == 0 or plan.nbytes <= limit:
            return max(slots, 1), max(slots, 1)
        per_slot = plan.nbytes / slots
        most = max(self.MIN_PIECE_SLOTS, int(limit / per_slot))
        first = max(self.MIN_FIRST_SLOTS, int(self.FIRST_PIECE_BYTES / per_slot))
        return most, min(first, most)

    @property
    def _name(self) -> str:
        name = "store (d2h)" if self.direction == "d2h" else "load (h2d)"
        return f"urgent {name}" if self.urgent else name

    # The lifecycle (kvasync/_lifecycle.py) closes a queue in these steps (and the base's
    # `request_stop`, `join_thread`); each is idempotent, so a close interrupted half-way
    # is finished by the next one.
    def refuse_new(self, locked: bool = True) -> None:
        """From here on `submit()` raises OffloaderClosedError. `locked=False` is for a
        finalizer, which must not take the lock (nobody can submit to it any more)."""
        if not locked:
            self.closed = True
            return
        with self._lock:
            self.closed = True

    def request_stop(self, lock_timeout: float | None = None) -> None:
        """Tell the completion thread and the launcher to exit once idle; no waiting."""
        super().request_stop(lock_timeout)
        if timed_acquire(self._lock, lock_timeout):
            try:
                self._launch_ready.notify_all()
            finally:
                self._lock.release()

    def join_thread(self, timeout: float | None = None) -> None:
        """Wait for the stopped completion thread and launcher to exit."""
        super().join_thread(timeout)
        thread = self._launcher
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if not thread.is_alive():
            self._launcher = None

    def forget_pools(self, lock_timeout: float | None = None) -> None:
        """Drop pooled streams and events (after the backend closed them)."""
        if not timed_acquire(self._lock, lock_timeout):
            return
        try:
            self._free_streams.clear()
            self._streams.clear()
            self._free_events.clear()
            self._free_order_events.clear()
            self._last_end = None
            self._last_stream = None
        finally:
            self._lock.release()
