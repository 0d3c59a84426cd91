"""The completion engine: one background task per event loop resolves awaited transfers.

Transfers complete on the scheduler's completion threads (which sleep in a blocking event
wait, so nothing spins while idle). The first `await` in a loop starts that loop's resolver
task; a completing transfer appends itself to the resolvers of the loops that await it and
wakes each with a single `call_soon_threadsafe` (coalesced while a wake is pending). The task
then sets the loop futures, in completion order, on the loop's own thread, and schedules the
done-callbacks added from that loop (`Transfer.add_done_callback` inside a loop).

Hybrid polling ("hybrid" mode, the default): a thread wake costs tens of microseconds, far
more than a small copy takes. So while a transfer some task awaits is predicted to end within
its window (`_polling.spin_window`: 5% of the predicted time, 0.25-1.5 ms; the scheduler
predicts each transfer's end from its bytes and its path's measured rate), the resolver
polls the direction's head event from the loop itself, yielding with ``sleep(0)`` between
polls, and completes the transfer there. Far from the predicted end it
sleeps on the wake-up from the completion thread (or a timer set just before the predicted
end). A head with no prediction yet (a launch still queued for the launcher thread) or
wrong by more than `SPIN_GRACE` is polled on a timer (`SLOW_POLL`, doubling to
`SLOW_POLL_MAX`) besides the thread's wake-up: a busy loop keeps the GIL from that thread for
seconds, and only the loop's own thread is sure to run. "thread" mode never polls.

A closed loop is noticed (`call_soon_threadsafe` raises) and its resolver dropped; the
transfer itself still completes and `wait()` still works. `close()` stops every resolver once
it has no awaiters left.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ._polling import SLOW_POLL, SLOW_POLL_MAX, SPIN_GRACE, Poller
from ._threadstate import timed_acquire

if TYPE_CHECKING:
    from ._transfer import Transfer, TransferResult

__all__ = ["CompletionEngine"]


class _LoopResolver:
    """Per-loop state: futures awaiting transfers and the task that resolves them."""

    def __init__(self, engine: CompletionEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.waiting: dict[Transfer, list[asyncio.Future[TransferResult]]] = {}
        self.dead = False
        self.stopping = False
        self._ready: deque[Transfer] = deque()
        self._lock = threading.Lock()
        self._wake_pending = False
        self._event = asyncio.Event()
        #: the future a timed wait (`_nap`) sleeps on; `_set` resolves it with the event
        self._nap_fut: asyncio.Future[None] | None = None
        #: the late heads being slow-polled (`_sleep`), when next, and the interval after
        self._late: frozenset[tuple[int, float | None]] = frozenset()
        self._slow_at = 0.0
        self._slow = SLOW_POLL
        self._thread = threading.get_ident()
        self.task = loop.create_task(self._run(), name="kvasync-completion")
        # a Ctrl-C that ended it was raised in the loop already: not "never retrieved"
        self.task.add_done_callback(_retrieve)
        # a loop closed without cancelling its tasks must not warn about ours: it holds no
        # resources, and the transfers it would have resolved still complete on their own
        self.task._log_destroy_pending = False  # type: ignore[attr-defined]

    # any thread
    def notify(self, transfer: Transfer | None) -> None:
        if threading.get_ident() == self._thread and self.loop.is_running():
            # completed by our own poll (or an await on this loop): no thread hop
            if transfer is not None:
                self._ready.append(transfer)
            self._set()
            return
        with self._lock:
            if transfer is not None:
                self._ready.append(transfer)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # loop closed: nobody is left to resolve
            self.dead = True

    def queue_done(self, transfer: Transfer, callback: tuple[Any, asyncio.AbstractEventLoop,
                                                             Any]) -> bool:
        """On the loop's thread: schedule `callback` of the done `transfer` behind the
        done-callbacks this resolver has yet to schedule (transfers that completed before
        it), keeping completion order; False if none are queued (the caller schedules it)."""
        with self._lock:
            if not self._ready or self.dead or self.task.done():
                return False
            transfer._attach(self, callback, keep=True)
            self._ready.append(transfer)
        self._set()
        return True

    def requeue(self, transfer: Transfer) -> None:
        """On the loop's thread: drain the done `transfer` here unless it is queued already.
        Its completion may have been told to a resolver whose task has since ended (an app
        cancelling every task), and then its awaiters and done-callbacks would wait forever.
        Every transfer that completed before it and was told to this resolver is queued
        ahead of it, so completion order holds; a second drain finds nothing left."""
        with self._lock:
            if transfer not in self._ready:
                self._ready.append(transfer)
        self._set()

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._set()

    # the loop's thread
    def _set(self) -> None:
        """Wake the resolver: set its event and end a timed wait (`_nap`)."""
        self._event.set()
        if self._nap_fut is not None:
            _end_nap(self._nap_fut)

    async def _nap(self, timeout: float) -> None:
        """Sleep until `_set` or for `timeout` s on a plain future and a loop timer:
        ``wait_for`` runs its awaitable in a task of its own before Python 3.12, and a loop
        closed without cancelling its tasks warns about every pending task (the resolver's
        own is marked not to)."""
        if self._event.is_set():
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self._nap_fut = fut
        timer = self.loop.call_later(timeout, _end_nap, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._nap_fut = None

    def _pollers(self) -> set[Poller]:
        return {t._poller for t in self.waiting if t._poller is not None}

    async def _run(self) -> None:
        #: after a cancellation: the awaits pending then, which this task goes on for
        kept: list[asyncio.Future[TransferResult]] | None = None
        try:
            while True:
                try:
                    if not self._ready:
                        if kept is not None:  # an awaiter giving up wakes nobody: look again
                            await self._nap(0.05)
                        else:
                            await self._sleep()
                except asyncio.CancelledError:
                    # an app or asyncio.run's shutdown cancelling every task: a task still
                    # awaiting a transfer here (a cleanup that waits for its copy) would
                    # wait forever, so this kvasync task goes on until none of those does;
                    # awaits begun later go to a successor (`_hand_over`) when it ends, so
                    # asyncio.run does not wait for a task it never cancelled
                    kept = self._pending()
                    if not kept:
                        raise
                    _uncancel(self.task)
                self._event.clear()
                self._drain()
                if self.stopping and not self.waiting:
                    return
                if kept is not None and all(f.done() for f in kept):
                    return
        finally:
            self.dead = True
            self.engine._forget(self)
            self._hand_over()

    def _pending(self) -> list[asyncio.Future[TransferResult]]:
        """The futures of the awaits that have not ended yet."""
        return [f for futs in self.waiting.values() for f in futs if not f.done()]

    def _hand_over(self) -> None:
        """(ending) A new resolver of the loop takes what is still owed here: the transfers
        told done but not drained (in completion order), then every transfer awaited or
        watched (a done-callback added in the loop), e.g. awaits begun after a
        cancellation, or those of a resolver a Ctrl-C ended inside its poll. Nothing when
        the loop is closed: its tasks are gone with it."""
        with self._lock:
            ready, self._ready = list(self._ready), deque()
        owed = {t: [f for f in futs if not f.done()] for t, futs in self.waiting.items()}
        owed = {t: futs for t, futs in owed.items()
                if futs or any(c[1] is self.loop for c in t._loop_callbacks)}
        if not (ready or owed) or self.loop.is_closed():
            return
        try:
            successor = self.engine._resolver(self.loop)
        except RuntimeError:  # the loop closed meanwhile
            return
        for transfer in ready:
            successor.waiting.setdefault(transfer, []).extend(owed.pop(transfer, []))
            successor.requeue(transfer)
        for transfer, futs in owed.items():
            successor.waiting.setdefault(transfer, []).extend(futs)
            if not transfer._attach(successor):  # done: told to us, maybe not drained
                successor.requeue(transfer)
        successor.notify(None)

    @staticmethod
    def _poll_all(queues: set[Poller]) -> None:
        for q in queues:
            try:
                q.poll()
            except (KeyboardInterrupt, SystemExit):
                raise  # the app's own (a Ctrl-C): a successor takes the awaits (_hand_over)
            except BaseException:  # a callback's, logged where it was raised: this
                pass  # task is kvasync's and keeps resolving the loop's awaiters

    async def _sleep(self) -> None:
        """Wait for the next completion: poll near a predicted end, else sleep. A head not
        launched yet or past its predicted end is polled every `SLOW_POLL` (doubling to
        `SLOW_POLL_MAX`) as well as left to the completion thread, whose wake a busy loop
        can hold up for seconds (it needs the GIL)."""
        if not self.engine.poll or not self.waiting:
            await self._event.wait()
            return
        while not self._event.is_set():
            queues = self._pollers()
            if not queues:
                break
            now = time.perf_counter()
            soonest = None  # when the first head's window opens
            late: set[tuple[int, float | None]] = set()  # polled heads unlaunched or past
            for q in queues:
                head = q.head_eta()
                if head is None or now - head[0] > SPIN_GRACE:
                    if q.spin_await:
                        late.add((id(q), None if head is None else head[0]))
                    continue
                eta, window = head
                soonest = eta - window if soonest is None else min(soonest, eta - window)
            if soonest is None and not late:
                break
            if late != self._late:  # other heads (or none): poll them now, then slower
                self._late, self._slow, self._slow_at = frozenset(late), SLOW_POLL, now
            if soonest is not None or now >= self._slow_at:  # a wake alone polls no late head
                self._poll_all(queues)  # ended before its window: no thread wake needed
                if self._event.is_set():
                    return
            if soonest is not None and soonest <= now:
                await asyncio.sleep(0)
                continue
            wait = soonest - now if soonest is not None else SLOW_POLL_MAX
            if late:
                if now >= self._slow_at:  # polled just now: the next in `_slow`, doubling
                    self._slow_at = now + self._slow
                    self._slow = min(2 * self._slow, SLOW_POLL_MAX)
                wait = min(wait, self._slow_at - now)
            await self._nap(wait)
        await self._event.wait()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._ready:
                    return
                transfer = self._ready.popleft()
            # as for an asyncio future: the done-callbacks run before the awaiters resume
            transfer._schedule_callbacks(self.loop)
            for fut in self.waiting.pop(transfer, ()):
                if fut.done():  # the awaiting task was cancelled
                    continue
                try:
                    fut.set_result(transfer.result())
                except BaseException as exc:
                    fut.set_exception(exc)


def _uncancel(task: asyncio.Task[None]) -> None:
    """Undo a cancellation the task went on from (Python 3.11+; before, nothing counts it)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


def _end_nap(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class CompletionEngine:
    """Hands out loop futures for transfers and owns the per-loop resolver tasks."""

    def __init__(self, mode: str = "hybrid") -> None:
        if mode not in ("hybrid", "thread"):
            from ._errors import InvalidTransferError

            raise InvalidTransferError(f"completion must be 'hybrid' or 'thread', got {mode!r}")
        self._lock = threading.Lock()
        self._resolvers: dict[asyncio.AbstractEventLoop, _LoopResolver] = {}
        self.closed = False
        #: poll near predicted ends from the loop ("hybrid") or only wait for the thread
        self.poll = mode == "hybrid"

    def _resolver(self, loop: asyncio.AbstractEventLoop) -> _LoopResolver:
        with self._lock:
            for stale in [lp for lp, r in self._resolvers.items() if r.dead or lp.is_closed()]:
                del self._resolvers[stale]
            resolver = self._resolvers.get(loop)
            if resolver is None or resolver.dead or resolver.task.done():
                resolver = _LoopResolver(self, loop)
                resolver.stopping = self.closed
                self._resolvers[loop] = resolver
            return resolver

    def _forget(self, resolver: _LoopResolver) -> None:
        with self._lock:
            if self._resolvers.get(resolver.loop) is resolver:
                del self._resolvers[resolver.loop]

    def future_for(self, transfer: Transfer) -> asyncio.Future[TransferResult] | None:
        """A future of the running loop that resolves with `transfer` (None: already done)."""
        loop = asyncio.get_running_loop()
        resolver = self._resolver(loop)
        fut: asyncio.Future[TransferResult] = loop.create_future()
        waiters = resolver.waiting.setdefault(transfer, [])
        # drop the futures of cancelled awaits (wait_for(t, 0.01) in a retry loop would
        # pile them up for as long as a slow transfer runs)
        waiters[:] = [f for f in waiters if not f.done()]
        waiters.append(fut)
        if not transfer._attach(resolver):
            waiters.remove(fut)
            if not waiters:
                resolver.waiting.pop(transfer, None)
            return None
        if self.poll:
            resolver.notify(None)  # an idle resolver re-evaluates: start polling if near
        return fut

    def future_after_callbacks(
        self, transfer: Transfer
    ) -> asyncio.Future[TransferResult] | None:
        """For an awaiter of a done `transfer` whose done-callbacks added from the running
        loop are not scheduled yet: a future the resolver sets right after scheduling them
        (it drains in completion order, so callbacks keep that order); else None."""
        loop = asyncio.get_running_loop()
        if not any(c[1] is loop for c in transfer._loop_callbacks):
            return None
        fut: asyncio.Future[TransferResult] = loop.create_future()
        resolver = self._resolver(loop)
        resolver.waiting.setdefault(transfer, []).append(fut)
        resolver.requeue(transfer)
        return fut

    def watch(self, transfer: Transfer, callback: tuple[Any, asyncio.AbstractEventLoop, Any]
              ) -> bool:
        """Have the running loop's resolver schedule `callback` (fn, loop, context) once
        `transfer` is done (a done-callback added inside a loop); False if it is done and
        nothing completed before it waits for the resolver (the caller schedules it)."""
        resolver = self._resolver(callback[1])
        if not transfer._attach(resolver, callback):
            # done already, maybe between the callbacks of earlier transfers and their
            # scheduling: those run first
            return resolver.queue_done(transfer, callback)
        resolver.waiting.setdefault(transfer, [])  # watched: the resolver polls near its end
        if self.poll:
            resolver.notify(None)
        return True

    @property
    def num_tasks(self) -> int:
        """Resolver tasks alive now (for resource accounting in tests)."""
        with self._lock:
            return sum(1 for r in self._resolvers.values() if not r.task.done())

    def close(self, lock_timeout: float | None = None) -> None:
        """Stop every resolver once it has no awaiters left (idempotent). `lock_timeout`
        bounds the wait for the lock (a finalizer may run on a thread that holds it)."""
        if not timed_acquire(self._lock, lock_timeout):
            return
        try:
            self.closed = True
            resolvers = list(self._resolvers.values())
        finally:
            self._lock.release()
        for resolver in resolvers:
            resolver.stopping = True
            resolver.notify(None)
