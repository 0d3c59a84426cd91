"""Launching a lane's transfers: streams and events from its pools, the copy enqueued
between a start and an end event, and the launcher thread of deferred transfers.

`LaneLaunch` sits between the completion half of a lane (`_lane_completion.LaneCompletion`,
its base) and its submission (`_scheduler.DirectionQueue`, its subclass): a submission
either launches at once on the caller's thread (`_launch`, then `_add` hands the record to
the completion side) or queues a `Launch` for the launcher thread (`_launch_loop`), which
does the same in submission order. Staged and pitched stores of 1 MiB or more are
deferred (`_deferred`): their enqueue costs the host more than the hand-off (~1 ms for a big
store's slabs), which the caller need not wait for. A big staged load
is split (`_split_at`): its caller enqueues the first pieces, so the copy starts at once,
and the launcher the rest (`Rest`). The sizes live in `_lane_pieces`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from typing import cast

from ._backends import Backend, Direction, Event, Overlap, Stream
from ._completion import CompletionEngine
from ._errors import OffloaderBrokenError
from ._lane_completion import InFlight, LaneCompletion
from ._lane_lend import LoopLending
from ._lane_pieces import PieceSizes
from ._program import TransferPlan
from ._threadstate import mark_library_thread, timed_acquire
from ._transfer import Transfer

__all__ = ["LaneLaunch", "Launch", "Rest"]


@dataclass
class Rest:
    """The later pieces of a big load whose first pieces the caller enqueued on `stream`
    between `start` and the `end` still to be recorded (`LaneLaunch._split_at`)."""

    stream: Stream
    start: Event
    end: Event
    pieces: list[TransferPlan]
    marks: list[Event] | None


@dataclass
class Launch:
    """A submitted transfer the lane has yet to enqueue on a stream (or to finish: `rest`)."""

    transfer: Transfer
    plan: TransferPlan
    job_id: int
    path: str
    order: Event | None
    signal: Event | None
    rest: Rest | None = None


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


class LaneLaunch(LaneCompletion, PieceSizes, LoopLending):
    """The launch half of a lane: pools, the enqueue of one transfer, the launcher thread."""

    def __init__(self, backend: Backend, direction: Direction, engine: CompletionEngine,
                 max_streams: int = 4, urgent: bool = False) -> None:
        super().__init__(backend, direction, engine, urgent)
        self._max_streams = max_streams
        self._streams: list[Stream] = []
        self._next_stream = 0
        #: deferred transfers not yet enqueued, oldest first, and the thread that enqueues
        #: them (`_launch_loop`), woken through `_launch_ready` (a condition of the lock)
        self._launches: deque[Launch] = deque()
        #: the path of the transfer whose end is `_last_end` (`may_overlap` asks for it)
        self._last_path = ""
        self._launcher: threading.Thread | None = None
        self._launch_ready = threading.Condition(self._lock)
        #: notified when the launcher has emptied `_launches` (`_wait_launched`)
        self._launched = threading.Condition(self._lock)
        self._init_lending()

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

    @staticmethod
    def _refused(job_id: int, exc: BaseException) -> OffloaderBrokenError:
        return OffloaderBrokenError(
            f"job {job_id}: the device refused new work: {type(exc).__name__}: {exc}", job_id
        )

    def _refused_launch(self, job: Launch, stream: Stream | None, exc: BaseException,
                        raise_refusal: bool) -> InFlight:
        """The device refused a stream call of `job`'s launch: raise (the caller's thread)
        or a record that fails the transfer in its place in the lane's order (the
        launcher), through an end already reached."""
        if raise_refusal:
            raise self._refused(job.job_id, exc) from exc
        done = _Reached()  # never recycled: the failure stops the lane's pools
        return InFlight(job.transfer, job.plan, cast(Stream, stream), done, done, None,
                        self._refused(job.job_id, exc), 0.0, path=job.path)

    def _launch(self, job: Launch, raise_refusal: bool = False) -> InFlight | None:
        """Enqueue `job` on a stream behind the lane's last transfer (under the lock): wait
        for its order event, record start, the copy, end (and its signal).

        A device that refuses the stream calls raises (`raise_refusal`, the caller's
        thread) or fails the transfer through an already-complete end (the launcher).
        On the caller's thread a big load may stop after its first pieces (`_split_at`):
        None, and `job.rest` holds what the launcher finishes (`_finish_rest`)."""
        if job.rest is not None:
            return self._finish_rest(job, job.rest)
        plan, path = job.plan, job.path
        stream: Stream | None = None
        overlap: Overlap | None = None
        try:
            stream = self._stream()
            start, end = self._event(), self._event()
            if job.order is not None:
                stream.wait_event(job.order)
            last = self._last_end
            if last is not None and stream is not self._last_stream:
                # same stream: already in order; a predecessor whose end carries a failure
                # is waited for first (the failure reaches this stream before any copy)
                if (last.error() is None
                        and self.backend.may_overlap(path, self.direction, self._last_path)):
                    overlap = Overlap(last, start)  # the backend waits for it
                else:
                    stream.wait_event(last)
            if overlap is None:
                stream.record(start)
        except Exception as exc:
            return self._refused_launch(job, stream, exc, raise_refusal)
        error: BaseException | None = None
        try:
            pieces = ([plan] if plan.nbytes <= self._whole_bytes(path)
                      else plan.pieces(*self._piece_slots(plan, path)))
            marks: list[Event] | None = None
            if len(pieces) > 1:
                marks = [self.backend.new_event(timing=False) for _ in pieces]
                # published before the pieces are enqueued, so progress advances while a
                # slow enqueue goes on (it counts a mark once it is recorded and reached)
                job.transfer._marks = list(zip(marks, accumulate(p.nbytes for p in pieces)))
            head = (self._split_at(path, job.signal, len(pieces)) if raise_refusal
                    else len(pieces))
            now = pieces[:head]
            now_marks = None if marks is None else marks[:head]
            split = {"edges": (True, False)} if head < len(pieces) else {}
            if overlap is not None:
                self.backend.enqueue_overlapped(stream, now, self.direction, path, overlap,
                                                now_marks, **split)
            elif now_marks is None:
                self.backend.enqueue_copy(stream, plan, self.direction, path)
            else:
                self.backend.enqueue_pieces(stream, now, self.direction, path, now_marks,
                                            **split)
            if split:
                job.rest = Rest(stream, start, end, pieces[head:],
                                None if marks is None else marks[head:])
                return None
        except Exception as exc:  # an API error: the copy never got (fully) enqueued
            error = exc
        return self._record_end(job, stream, start, end, overlap, error, raise_refusal)

    def _finish_rest(self, job: Launch, rest: Rest) -> InFlight:
        """The launcher's half of a split load: its later pieces, then `_record_end`."""
        error: BaseException | None = None
        try:
            self.backend.enqueue_pieces(rest.stream, rest.pieces, self.direction, job.path,
                                        rest.marks, edges=(False, True))
        except Exception as exc:
            error = exc
        return self._record_end(job, rest.stream, rest.start, rest.end, None, error, False)

    def _record_end(self, job: Launch, stream: Stream, start: Event, end: Event,
                overlap: Overlap | None, error: BaseException | None,
                raise_refusal: bool) -> InFlight:
        """Record `job`'s end (and signal) after its copy and make it the lane's last."""
        plan, path = job.plan, job.path
        try:
            if error is not None and overlap is not None:
                stream.wait_event(overlap.after)  # the backend may not have got that far
            stream.record(end)
            if job.signal is not None:
                stream.record(job.signal)
        except Exception as exc:
            return self._refused_launch(job, stream, exc, raise_refusal)
        self._last_end = end
        self._last_stream = stream
        # the path a successor's `may_overlap` is asked about: that of the last transfer
        # that enqueued a copy (an empty one leaves an earlier one's writes unordered by
        # its path); after a failed enqueue, none a store may overlap
        if error is not None:
            self._last_path = ""
        elif plan.num_descriptors:
            self._last_path = path
        return InFlight(job.transfer, plan, stream, start, end, job.order, error, 0.0,
                        path=path)

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
                    if not self._launches:
                        self._launched.notify_all()
                        self._caught_up.set()
                if rec is not None:
                    self._add(rec)

    def _wait_launched(self) -> None:
        """Wait (under the lock, released meanwhile) until the launcher has enqueued every
        deferred transfer: a transfer with a signal must be enqueued by its caller."""
        while self._launches:
            thread = self._launcher
            if thread is None or not thread.is_alive():
                raise OffloaderBrokenError(
                    f"the {self.direction} launcher thread stopped with transfers queued")
            self._launched.wait(0.05)

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
