"""The scheduler: one FIFO queue per direction, from plan to stream/event to completion.

Submission (under the direction's lock), for every transfer:

1. on the caller's thread, record an ordering event on the compute stream, so stores read
   finished KV and loads land after pending writes (e.g. zeroing of freshly allocated
   blocks);
2. take a stream from the direction's pool; make it wait on that event and on the previous
   transfer's end event of the same direction, so transfers of one direction execute
   strictly in submission order;
3. record the start event, enqueue the copy path, record the end event.

Steps 2-3 run on the caller's thread too, except for staged and pitched stores of 1 MiB or
more: their program and launches cost the host more than a hand-off (~1 ms for a big
store's slabs), so the lane's launcher thread does it (and every later transfer of the
lane until it caught up), and `store()` returns after step 1.

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
import time

from ._backends import Backend, Direction, Event, Stream
from ._completion import CompletionEngine
from ._errors import OffloaderBrokenError, OffloaderClosedError
from ._lane_launch import LaneLaunch, Launch
from ._polling import spin_window
from ._program import TransferPlan
from ._threadstate import timed_acquire
from ._transfer import Transfer

__all__ = ["DirectionQueue"]

log = logging.getLogger("kvasync")


class DirectionQueue(LaneLaunch):
    """Submission and completion of one direction ("d2h" stores or "h2d" loads).

    This class submits; launching (pools, enqueue, the launcher thread) is its base class,
    `_lane_launch.LaneLaunch`, and completion (thread, poll, finish, recycling) that one's,
    `_lane_completion.LaneCompletion`.
    """

    def __init__(self, backend: Backend, direction: Direction, engine: CompletionEngine,
                 max_streams: int = 4, urgent: bool = False) -> None:
        super().__init__(backend, direction, engine, max_streams, urgent)
        self.last_transfer: Transfer | None = None

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
        launcher caught up, which keeps the lane's order. A big staged load returns after
        its first pieces (`_split_at`): the launcher enqueues the rest. A transfer with a
        `signal` first waits for the launcher to catch up.
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
            job = Launch(transfer, plan, job_id, path, order, signal)
            if signal is not None and self._launches:
                self._wait_launched()  # its signal must be recorded when this returns
            if self._launches or self._deferred(plan, path, signal):
                self._note_submitted(job)
                self._launches.append(job)
                self._ensure_launcher()
                self._lend_loop_soon()
                return transfer
            launched = time.perf_counter()  # the device time learned below counts from here
            rec = self._launch(job, raise_refusal=True)
            self._note_submitted(job, launched)
            if rec is None:  # a big load's first pieces are enqueued, the launcher does the rest
                self._launches.append(job)
                self._ensure_launcher()
                self._lend_loop_soon()
            else:
                self._add(rec)
        return transfer

    def _note_submitted(self, job: Launch, launched: float | None = None) -> None:
        """Count `job` in flight and predict its end (under the lock): from `launched` (when
        its enqueue began; now for a deferred one) or the lane's last predicted end, at
        its path's learned rate."""
        self.last_transfer = job.transfer  # set under the lock: the newest, for drain()
        self._inflight += 1
        self._ensure_thread()
        now = time.perf_counter() if launched is None else launched
        eta = max(now, self._tail_eta) + self.latency
        eta += job.plan.nbytes / self.path_rate.get(job.path, self.bandwidth)
        self._tail_eta = eta
        job.transfer._poller = self
        job.transfer._eta = eta
        job.transfer._window = spin_window(eta - now)
        self.stats.submitted(job.job_id, job.path, job.plan.nbytes)

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
