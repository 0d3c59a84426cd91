"""The scheduler: one FIFO queue per direction, from plan to stream/event to completion.

Submission (caller's thread, under the direction's lock), for every transfer:

1. take a stream from the direction's pool; make it wait on the compute stream (an ordering
   event recorded there), so stores read finished KV and loads land after pending writes
   (e.g. zeroing of freshly allocated blocks);
2. make it wait on the previous transfer's end event of the same direction, so transfers
   of one direction execute strictly in submission order;
3. record the start event, enqueue the copy path, record the end event.

Completion: a daemon thread per direction takes transfers in FIFO order, sleeps in the end
event's blocking wait, then completes the `Transfer` (result or failure) and recycles its
stream and events. On CUDA the thread is lazy by default (`LAZY_THREAD`, see `_lazy_loop`):
transfers predicted to end soon are left to the awaiters and waiters that poll the queue,
and the thread looks at them only after their predicted end. Because end events of one
direction complete in order, results are reported in submission order. A failure fails
that transfer and, through the event chain, every transfer queued behind it in the
direction; the direction then refuses new work (`OffloaderBrokenError`) until the
offloader is closed.

Closing (driven by `_lifecycle.Lifecycle`): `refuse_new`, then drain, then `request_stop`,
`join_thread`, `forget_pools`. A closed queue whose last transfer completes calls `on_idle`
(outside its locks, after the callbacks), which releases what a close could not wait for.
Done-callbacks run with the thread marked as completing (`enter_completion`), so blocking
waits there raise instead of deadlocking.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._backends import Backend, Direction, Event, Stream
from ._completion import CompletionEngine
from ._errors import OffloaderBrokenError, OffloaderClosedError, TransferFailedError
from ._polling import SPIN_WINDOW
from ._program import TransferPlan
from ._threadstate import (
    enter_completion,
    exit_completion,
    mark_library_thread,
    on_library_thread,
    raise_stashed,
    timed_acquire,
)
from ._transfer import Transfer, TransferResult

__all__ = ["DirectionQueue"]

log = logging.getLogger("kvasync")

_STOP = object()


@dataclass
class _InFlight:
    transfer: Transfer
    plan: TransferPlan
    stream: Stream
    start: Event
    end: Event
    order: Event | None
    submit_error: BaseException | None
    eta: float
    finished: bool = False


class DirectionQueue:
    """Submission and completion of one direction ("d2h" stores or "h2d" loads)."""

    def __init__(
        self,
        backend: Backend,
        direction: Direction,
        engine: CompletionEngine,
        max_streams: int = 4,
        urgent: bool = False,
    ) -> None:
        self.backend = backend
        self.direction = direction
        #: the urgent lane of a direction is a queue of its own (see Offloader.store)
        self.urgent = urgent
        self.engine = engine
        #: awaits of short transfers poll this queue themselves (see Transfer.__await__)
        self.spin_await = bool(engine.poll and getattr(backend, "poll_from_await", False))
        self._max_streams = max_streams
        self._lock = threading.Lock()
        self._streams: list[Stream] = []
        self._free_streams: list[Stream] = []
        self._next_stream = 0
        self._free_events: list[Event] = []
        self._free_order_events: list[Event] = []
        self._last_end: Event | None = None
        self._last_stream: Stream | None = None
        self.last_transfer: Transfer | None = None
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: lazy completion thread: not woken per transfer (see `_lazy_loop`)
        self.lazy = self.spin_await and self.LAZY_THREAD
        self._cv = threading.Condition(threading.Lock())
        self._parked = False
        self._stop = False
        #: in-flight records in submission order; advanced by whoever sees the head done
        self._fifo: deque[_InFlight] = deque()
        self._finish_lock = threading.RLock()
        #: completion-time prediction (used by the loop resolvers to poll only near the end)
        self.bandwidth = float(getattr(backend, "initial_bandwidth", 10e9))
        self.latency = float(getattr(backend, "initial_latency", 20e-6))
        self._tail_eta = 0.0
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.closed = False
        #: called (outside every lock) when a closed queue's last transfer completed
        self.on_idle: Callable[[], None] | None = None

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
            try:
                stream = self._stream()
                start, end = self._event(), self._event()
                order: Event | None = None
                if compute_stream is not None:
                    order = self._event(timing=False)
                    compute_stream.record(order)
                    stream.wait_event(order)
                if self._last_end is not None and stream is not self._last_stream:
                    stream.wait_event(self._last_end)  # same stream: already in order
                stream.record(start)
            except Exception as exc:  # the device refuses new work (e.g. a dead context)
                raise OffloaderBrokenError(
                    f"job {job_id}: the device refused new work: {type(exc).__name__}: {exc}",
                    job_id,
                ) from exc
            error: BaseException | None = None
            try:
                if plan.nbytes <= self._piece_bytes(path):
                    self.backend.enqueue_copy(stream, plan, self.direction, path)
                else:
                    self.backend.enqueue_pieces(stream, plan.pieces(*self._piece_slots(plan, path)),
                                                self.direction, path)
            except Exception as exc:  # an API error: the copy never got (fully) enqueued
                error = exc
            stream.record(end)
            if signal is not None:
                stream.record(signal)
            self._last_end = end
            self._last_stream = stream
            self.last_transfer = transfer  # set under the lock: the newest, for drain()
            self._inflight += 1
            self._ensure_thread()
            now = time.perf_counter()
            eta = max(now, self._tail_eta) + self.latency + plan.nbytes / self.bandwidth
            self._tail_eta = eta
            rec = _InFlight(transfer, plan, stream, start, end, order, error, eta)
            transfer._poller = self
            transfer._eta = eta
            self._fifo.append(rec)  # deque appends are atomic; order is set by self._lock
            if not self.lazy:
                self._pending.put(rec)
            else:
                with self._cv:  # wake the thread only if it parked (nothing was in flight)
                    if self._parked:
                        self._cv.notify()
        return transfer

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
        if path == "staged":  # it pipelines its own slabs through the staging buffers
            return 1 << 62
        return self.KERNEL_PIECE_BYTES if path == "kernel" else self.PIECE_BYTES

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

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._lazy_loop if self.lazy else self._complete_loop,
                name=f"kvasync-{self.direction}-completion", daemon=True,
            )
            self._thread.start()

    # -- completion ---------------------------------------------------------------------------
    def _complete_loop(self) -> None:
        """Eager: woken per submitted transfer, sleeps in each end event's blocking wait."""
        mark_library_thread()
        while True:
            rec = self._pending.get()
            if rec is _STOP:
                return
            if rec.finished:
                continue
            rec.end.synchronize()
            self.poll()

    #: lazy thread: an unpolled short transfer completes at most this long after its
    #: predicted end (or its real end, if later); the thread sleeps at least `TICK` at a
    #: time and parks (waits to be notified) after `PARK_AFTER` seconds with nothing in flight
    #: on by default since the H200 comparison of 2026-12-03 (docs/benchmarks/h200/lazy/):
    #: 4 KiB round trips 66-85 -> 42-54 us p50, store() of 64x128 blocks 123-163 -> 72-82 us
    #: p50, 64 KiB x 64 tasks 14-15k -> 16.5-19k transfers/s; False restores the eager thread
    LAZY_THREAD = True
    THREAD_GRACE = 0.3e-3
    TICK = 0.5e-3
    PARK_AFTER = 0.05

    def _lazy_loop(self) -> None:
        """Lazy: for queues whose awaiters and waiters poll the head themselves (CUDA).

        Waking a thread per transfer costs two GIL hand-offs that land inside the caller's
        next `store()`; so a transfer predicted to end soon is left to its pollers, and the
        thread only looks at it after its predicted end plus `THREAD_GRACE` (then blocks in
        its end event's wait). A transfer predicted to end later is waited on at once.
        Submission notifies the thread only when it parked.
        """
        mark_library_thread()
        cv = self._cv
        idle_since: float | None = None
        while True:
            with cv:
                if self._stop:
                    return
                head = self._fifo[0] if self._fifo else None
                if head is None:
                    now = time.perf_counter()
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= self.PARK_AFTER:
                        self._parked = True
                        cv.wait()
                        self._parked = False
                        idle_since = None
                    else:
                        cv.wait(self.TICK)
                    continue
            idle_since = None
            if head.finished:
                continue
            now = time.perf_counter()
            if head.eta - now <= SPIN_WINDOW:
                late = head.eta + self.THREAD_GRACE - now
                if late > 0:
                    with cv:
                        if not self._stop:
                            cv.wait(max(late, self.TICK))
                    continue
            head.end.synchronize()
            self.poll()

    def head_eta(self) -> float | None:
        """Predicted completion time (perf_counter) of the oldest unfinished transfer."""
        fifo = self._fifo
        try:
            return fifo[0].eta
        except IndexError:
            return None

    def poll(self) -> int:
        """Complete, in order, every head transfer whose end event is done; never blocks.

        Called by the completion thread after each blocking wait and by loop resolvers that
        poll near a transfer's predicted end, so a result reaches an awaiting task without a
        thread hop. Returns how many transfers it completed.
        """
        done = 0
        idle = False
        with self._finish_lock:
            while self._fifo and self._fifo[0].end.query():
                rec = self._fifo.popleft()
                rec.finished = True
                idle = self._finish(rec)
                done += 1
        if done:
            if idle and self.closed and self.on_idle is not None:
                self.on_idle()  # a close that could not wait for this transfer releases now
            if not on_library_thread():
                raise_stashed()  # a callback's BaseException, now the bookkeeping is done
        return done

    def _finish(self, rec: _InFlight) -> bool:
        """Complete `rec`'s transfer (callbacks included); True if the queue is now idle."""
        error = rec.submit_error or rec.end.error()
        with self._lock:
            if self.failure is not None:  # whatever its own status, it ran behind a failure
                behind = TransferFailedError(
                    f"job {rec.transfer.job_id}: queued behind a failed transfer "
                    f"({self.failure})",
                    rec.transfer.job_id,
                )
                behind.__cause__ = self.failure
                error = behind
            elif error is not None:
                self.failure = error
        result = None
        if error is None:
            seconds = rec.start.elapsed_seconds(rec.end)
            result = TransferResult(rec.transfer.job_id, True, rec.plan.nbytes, seconds)
            if rec.plan.nbytes >= 1 << 20 and seconds > 0:  # learn the link's speed
                self.bandwidth = 0.8 * self.bandwidth + 0.2 * (rec.plan.nbytes / seconds)
        elif not isinstance(error, TransferFailedError):
            err = TransferFailedError(
                f"job {rec.transfer.job_id}: {type(error).__name__}: {error}",
                rec.transfer.job_id,
            )
            err.__cause__ = error
            error = err
        elif error.job_id is None:
            error.job_id = rec.transfer.job_id
        with self._lock:
            self._recycle(rec)
        enter_completion()
        try:
            rec.transfer._complete(result, error)
        finally:
            exit_completion()
            with self._lock:
                self._inflight -= 1
                idle = self._inflight == 0
                if idle:
                    self._tail_eta = 0.0
                    self._idle.notify_all()
        return idle

    def _recycle(self, rec: _InFlight) -> None:
        if self.failure is not None:
            return  # events carrying a failure are not reused
        if rec.end is self._last_end:
            self._last_end = None  # completed: the next transfer need not wait on it
            self._last_stream = None
        if rec.stream not in self._free_streams:
            self._free_streams.append(rec.stream)
        self._free_events.append(rec.end)
        self._free_events.append(rec.start)
        if rec.order is not None:
            self._free_order_events.append(rec.order)
        rec.plan.keepalive.clear()

    # -- draining and shutdown -----------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Block until every submitted transfer completed; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    @property
    def inflight(self) -> int:
        return self._inflight

    # The lifecycle (kvasync/_lifecycle.py) closes a queue in these steps; each is
    # idempotent, so a close interrupted half-way is finished by the next one.
    def refuse_new(self, locked: bool = True) -> None:
        """From here on `submit()` raises OffloaderClosedError. `locked=False` is for a
        finalizer, which must not take the lock (nobody can submit to it any more)."""
        if not locked:
            self.closed = True
            return
        with self._lock:
            self.closed = True

    def request_stop(self, lock_timeout: float | None = None) -> None:
        """Tell the completion thread to exit once idle; does not wait for it."""
        self._stop = True
        self._pending.put(_STOP)
        if timed_acquire(self._cv, lock_timeout):  # bounded from a finalizer
            try:
                self._cv.notify_all()
            finally:
                self._cv.release()

    def join_thread(self, timeout: float | None = None) -> None:
        """Wait for the stopped completion thread to exit (not when called on it)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if not thread.is_alive():
            self._thread = None

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

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
