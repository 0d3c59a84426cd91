"""Completion of one lane: its in-flight FIFO, the completion thread, poll and finish.

A daemon thread per lane takes transfers in FIFO order, sleeps in the end event's blocking
wait, then completes the `Transfer` (result or failure) and recycles its stream and events
into the lane's pools. On CUDA the thread is lazy by default (`LAZY_THREAD`, see
`_lazy_loop`): transfers predicted to end soon are left to the awaiters and waiters that
poll the lane (it is their `_polling.Poller`), and the thread looks at them only after
their predicted end. Because end events of one lane complete in order, results are
reported in submission order. Done-callbacks run with the thread marked as completing
(`enter_completion`), so blocking waits there raise instead of deadlocking.

`LaneCompletion` is the completion half of `_scheduler.DirectionQueue` (which adds
submission): it holds the state both halves share, initialised here.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._backends import Backend, Direction, Event, Stream
from ._completion import CompletionEngine
from ._errors import TransferFailedError
from ._polling import SPIN_WINDOW
from ._program import TransferPlan
from ._stats import LaneRecorder
from ._threadstate import (
    enter_completion,
    exit_completion,
    mark_library_thread,
    on_library_thread,
    raise_stashed,
    timed_acquire,
)
from ._transfer import Transfer, TransferResult

__all__ = ["InFlight", "LaneCompletion"]

_STOP = object()


@dataclass
class InFlight:
    """One submitted transfer of a lane, until it completes."""

    transfer: Transfer
    plan: TransferPlan
    stream: Stream
    start: Event
    end: Event
    order: Event | None
    submit_error: BaseException | None
    eta: float
    finished: bool = False
    #: the concrete copy path it ran (its completion teaches that path's rate)
    path: str = ""
    #: its completion was counted in the stats / it left the in-flight count (`_settle`)
    recorded: bool = False
    left: bool = False


def _learn(rates: dict[str, float], path: str, rate: float) -> None:
    """A path's rate from one more transfer's: faster samples count at once, slower ones
    half (a slow first transfer, tables and staging, left the next predicted late, so their
    waiters slept past the end: a thread wake, 0.2-0.4 ms on the H200 host)."""
    old = rates.get(path)
    rates[path] = rate if old is None or rate > old else 0.5 * old + 0.5 * rate


def _outcome(rec: InFlight, error: BaseException | None, behind: BaseException | None,
             timed: bool) -> tuple[TransferResult | None, TransferFailedError | None]:
    """What `rec`'s transfer completes with: a failure (`_failure`) or its result, with its
    event time where `timed` (else 0: the clean-up after an interrupt reads no event)."""
    if error is not None or behind is not None:
        return None, _failure(rec.transfer.job_id, error, behind)
    seconds = rec.start.elapsed_seconds(rec.end) if timed else 0.0
    return TransferResult(rec.transfer.job_id, True, rec.plan.nbytes, seconds), None


def _failure(job_id: int, error: BaseException | None, behind: BaseException | None
             ) -> TransferFailedError:
    """What a transfer fails with: the lane's earlier failure `behind` if any (whatever its
    own status, it ran behind it), else its own `error` as a TransferFailedError of the job."""
    cause = behind if behind is not None else error
    if behind is None and isinstance(error, TransferFailedError):
        if error.job_id is None:
            error.job_id = job_id
        return error
    what = (f"queued behind a failed transfer ({behind})" if behind is not None
            else f"{type(error).__name__}: {error}")
    failed = TransferFailedError(f"job {job_id}: {what}", job_id)
    failed.__cause__ = cause
    return failed


class LaneCompletion:
    """The completion side of one lane ("d2h" stores or "h2d" loads, normal or urgent)."""

    def __init__(
        self, backend: Backend, direction: Direction, engine: CompletionEngine, urgent: bool
    ) -> None:
        self.backend = backend
        self.direction = direction
        #: the urgent lane of a direction is a queue of its own (see Offloader.store)
        self.urgent = urgent
        self.stats = LaneRecorder(direction, urgent)  # counters for Offloader.stats()
        self.engine = engine
        #: awaits of short transfers poll this queue themselves (see Transfer.__await__)
        self.spin_await = bool(engine.poll and getattr(backend, "poll_from_await", False))
        self._lock = threading.Lock()
        #: pools the completion refills (streams, timing and ordering events)
        self._free_streams: list[Stream] = []
        self._free_events: list[Event] = []
        self._free_order_events: list[Event] = []
        self._last_end: Event | None = None
        self._last_stream: Stream | None = None
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: lazy completion thread: not woken per transfer (see `_lazy_loop`)
        self.lazy = self.spin_await and self.LAZY_THREAD
        self._cv = threading.Condition(threading.Lock())
        self._parked = False
        self._stop = False
        #: in-flight records in submission order; advanced by whoever sees the head done
        self._fifo: deque[InFlight] = deque()
        self._finish_lock = threading.RLock()
        #: completion-time prediction (used by the loop resolvers to poll only near the end)
        self.bandwidth = float(getattr(backend, "initial_bandwidth", 10e9))
        #: bytes per second of device time, per concrete copy path: a lane's paths differ
        #: 10x at small pages, and a predicted end that is late by more than the waiters'
        #: polling window leaves the transfer to a thread wake (~0.4 ms after a big copy)
        self.path_rate: dict[str, float] = {}
        self.latency = float(getattr(backend, "initial_latency", 20e-6))
        self._tail_eta = 0.0
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.closed = False
        #: called (outside every lock) when a closed queue's last transfer completed
        self.on_idle: Callable[[], None] | None = None

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

    #: lazy thread: an unpolled short transfer completes at most `THREAD_GRACE` after its
    #: predicted (or real) end; it sleeps `TICK` at least, parks after `PARK_AFTER` idle. On
    #: the H200 vs the eager thread (False): 4 KiB round trip 66-85 -> 42-54 us p50, 64 KiB x
    #: 64 tasks 14-15k -> 16.5-19k/s
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
            if head.eta - now <= SPIN_WINDOW:  # near: its pollers' (no thread hand-off)
                late = head.eta + self.THREAD_GRACE - now
                if late > 0:
                    with cv:
                        if not self._stop:
                            cv.wait(max(late, self.TICK))
                    continue
            head.end.synchronize()
            self.poll()

    def head_eta(self) -> tuple[float, float] | None:
        """Predicted end (perf_counter) of the oldest unfinished transfer, and its window."""
        try:
            head = self._fifo[0]
        except IndexError:
            return None
        return head.eta, head.transfer._window

    def poll(self) -> int:
        """Complete, in order, every head transfer whose end event is done; how many.
        Called by the completion thread after each blocking wait, and by waiters and loop
        resolvers near a predicted end (a result then reaches them without a thread hop)."""
        done, idle = 0, False
        with self._finish_lock:
            while self._fifo and self._fifo[0].end.query():
                rec = self._fifo.popleft()
                rec.finished = True
                try:
                    idle = self._finish(rec)
                except BaseException:  # a Ctrl-C landed inside: complete it all the same
                    _settle(self, rec)
                    raise
                done += 1
        if done:
            if idle and self.closed and self.on_idle is not None:
                self.on_idle()  # a close that could not wait for this transfer releases now
            if not on_library_thread():
                raise_stashed()  # a callback's BaseException, now the bookkeeping is done
        return done

    def _finish(self, rec: InFlight) -> bool:
        """Complete `rec`'s transfer (callbacks included); True if the queue is now idle."""
        error = rec.submit_error or rec.end.error()
        with self._lock:
            behind = self.failure
            if behind is None and error is not None:
                self.failure = error
        result, error = _outcome(rec, error, behind, timed=True)
        if result is not None and result.bytes >= 1 << 20 and result.seconds > 0:
            rate = result.bytes / result.seconds  # learn the link's speed
            self.bandwidth = 0.8 * self.bandwidth + 0.2 * rate
            _learn(self.path_rate, rec.path, rate)
        with self._lock:
            self._recycle(rec)
        self.stats.finished(result, error)
        rec.recorded = True
        try:
            enter_completion()
            rec.transfer._complete(result, error)
        finally:
            exit_completion()
            idle = self._leave(rec)
        return idle

    def _leave(self, rec: InFlight) -> bool:
        """`rec` leaves the in-flight count (once); True if the queue is now idle."""
        with self._lock:
            if rec.left:
                return False
            rec.left, self._inflight = True, self._inflight - 1
            idle = self._inflight == 0
            if idle:
                self._tail_eta = 0.0
                self._idle.notify_all()
        return idle

    def _recycle(self, rec: InFlight) -> None:
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

    # The lifecycle (kvasync/_lifecycle.py) stops a lane's thread in these steps; each is
    # idempotent, so a close interrupted half-way is finished by the next one.
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

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _settle(lane: LaneCompletion, rec: InFlight) -> None:
    """What `_finish` left undone when an exception from outside (a Ctrl-C on the thread
    that polled) cut it short, each once: else waiters and close() wait forever."""
    error = rec.submit_error or rec.end.error()
    behind = lane.failure if lane.failure is not error else None
    result, error = _outcome(rec, error, behind, timed=False)
    if not rec.recorded:  # counted unless the oldest is no longer this job (it was)
        rec.recorded = True
        lane.stats.finished(result, error, rec.transfer.job_id)
    try:
        enter_completion()  # its callbacks, if they had not run, run as in `_finish`
        rec.transfer._complete(result, error)  # nothing if it completed already
    finally:
        exit_completion()
        lane._leave(rec)
    with lane._lock:
        idle = lane._inflight == 0
    if idle and lane.closed and lane.on_idle is not None:
        lane.on_idle()  # the release of a close that could not wait, as `poll` does
