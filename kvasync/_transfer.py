"""The future of one submitted copy: `Transfer`, and what it resolves to, `TransferResult`.

A Transfer is completed exactly once, from the direction's completion thread, in
submission order. It can be waited on from sync code (`wait`), awaited from any number of
tasks in any number of event loops (each await gets its own loop future, so cancelling one
awaiter cancels neither the copy nor the other awaiters), and observed with callbacks.

It also has the methods of an asyncio future that a multi-loop object can honour:
`get_loop()` answers the caller's running loop, and a done-callback added inside a loop
runs on that loop, scheduled by the loop's resolver task (what `asyncio.wait` needs). A
submitted copy cannot be recalled: `cancel()` returns False, and `asyncio.isfuture()` is
False on purpose (see `FutureMethods`), so asyncio wraps a transfer in a task wherever it
stops waiting by cancelling. A load split per layer is a `LayeredTransfer`
(`kvasync._layered_transfer`), one Transfer per layer.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ._errors import TransferFailedError
from ._future import Callback, FutureMethods
from ._polling import SPIN_GRACE, SPIN_WINDOW, Poller
from ._threadstate import (
    on_library_thread,
    raise_stashed,
    refuse_blocking_wait,
    stash_base_exception,
)

__all__ = ["LoopFutures", "Progress", "Transfer", "TransferResult", "transfer_progress"]

log = logging.getLogger("kvasync")


class Progress(NamedTuple):
    """Bytes of a transfer that have landed, and its total: `done, total = t.progress()`."""

    done: int
    total: int

    @property
    def fraction(self) -> float:
        """`done / total`; 1.0 for a transfer of no bytes."""
        return 1.0 if self.total == 0 else self.done / self.total


@dataclass(frozen=True)
class TransferResult:
    """What a finished transfer did: `bytes` this rank copied, `seconds` of device time."""

    job_id: int
    success: bool
    bytes: int
    seconds: float


class LoopFutures(Protocol):
    """What a transfer needs from the completion engine (`_completion.CompletionEngine`):
    loop futures for its awaiters and loop-side done-callbacks. Declared here, so the
    engine depends on the transfer and not the other way round."""

    def future_for(self, transfer: Transfer) -> asyncio.Future[TransferResult] | None: ...

    def future_after_callbacks(
        self, transfer: Transfer
    ) -> asyncio.Future[TransferResult] | None: ...

    def watch(self, transfer: Transfer, callback: tuple[Any, asyncio.AbstractEventLoop, Any]
              ) -> bool: ...


class Transfer(FutureMethods):
    """A store or load that is already submitted; await it, `wait()` it, or poll `done()`.

    `Offloader.store()` and `load()` make them; nothing else needs to. Pass it as it is
    wherever asyncio or anyio take an awaitable or a future (`asyncio.wait`, `as_completed`,
    `gather`, `shield`, `wait_for`, `timeout()`, task groups, anyio's `fail_after`);
    cancelling any of them stops the waiting, never the copy.
    """

    __slots__ = ("__weakref__", "_callbacks", "_cond", "_engine", "_error", "_eta", "_lock",
                 "_loop_callbacks", "_marks", "_poller", "_resolvers", "_result", "_window",
                 "direction", "job_id", "nbytes")

    def __init__(self, job_id: int, direction: str, nbytes: int, engine: LoopFutures) -> None:
        self.job_id = job_id
        #: "d2h" for stores, "h2d" for loads
        self.direction = direction
        #: bytes this rank will copy
        self.nbytes = nbytes
        self._engine = engine
        #: guards the state below; `_cond` over it is built only for a thread that blocks
        #: in `wait()` (most transfers are awaited, and a Condition costs the caller of
        #: `store()`/`load()` microseconds)
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None
        self._result: TransferResult | None = None
        self._error: BaseException | None = None
        #: callbacks added outside any event loop: (fn, context), run by the completing thread
        self._callbacks: list[tuple[Callback, contextvars.Context | None]] = []
        #: callbacks added inside a loop: (fn, loop, context), scheduled by that loop's resolver
        self._loop_callbacks: list[tuple[Callback, asyncio.AbstractEventLoop,
                                         contextvars.Context | None]] = []
        self._resolvers: list[Any] = []
        #: set at submission: the direction running it (its waiters may poll it) and its
        #: predicted completion time (perf_counter)
        self._poller: Poller | None = None
        self._eta = 0.0
        self._window = SPIN_WINDOW  # its waiters poll from `_eta` - `_window`
        #: (event, bytes landed once it completes) per piece of a pieced transfer, in
        #: order; set as the pieces are enqueued (see `progress`)
        self._marks: list[tuple[Any, int]] = []

    def __repr__(self) -> str:
        state = "pending"
        if self._result is not None:
            state = "done"
        elif self._error is not None:
            state = "failed"
        kind = "store" if self.direction == "d2h" else "load"
        return f"<Transfer {kind} job_id={self.job_id} {self.nbytes} B {state}>"

    # -- state -------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the transfer finished (successfully or not)."""
        return self._result is not None or self._error is not None

    def progress(self) -> Progress:
        """`(bytes_done, bytes_total)`, never blocking: a transfer cut into pieces (above
        64 MiB on the staged path, 256 MiB on the kernel path, 32 MiB on DMA when it spans
        enough blocks) advances piece by piece; one of a single piece stays at (0, n) until
        it has landed."""
        return transfer_progress(self)

    def result(self) -> TransferResult:
        """The result; raises TransferFailedError if it failed, RuntimeError if not done."""
        with self._lock:
            return self._outcome()

    def exception(self) -> BaseException | None:
        """The failure, or None (raises RuntimeError if not done)."""
        with self._lock:
            if not self.done():
                raise RuntimeError(f"{self!r} is not done yet")
            return self._error

    def _outcome(self) -> TransferResult:
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError(f"{self!r} is not done yet")
        return self._result

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block this thread until done (no event loop needed); TimeoutError after `timeout`.

        With the lazy completion thread (`LaneCompletion.LAZY_THREAD`, CUDA, the default): it
        polls once, sleeps until its window (`_polling.spin_window`) before the predicted
        end, then polls the direction itself until the end plus `SPIN_GRACE`, then sleeps
        again (the completion thread's wake-up took 0.2-0.4 ms on the H200 host).

        Inside a done-callback that kvasync runs, waiting for an unfinished transfer raises
        RuntimeError: the completion that would end the wait waits for the callback.
        """
        if not self.done():
            refuse_blocking_wait("wait() for an unfinished transfer")
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        q = self._poller
        if not self.done() and q is not None and q.lazy:  # polling callers
            lead = self._eta - self._window - start
            if lead > 0:
                q.poll()  # already over (one event query): no thread wake needed
                with self._lock:
                    self._waitable().wait_for(self.done, lead if timeout is None else min(
                        lead, timeout))
            now = time.perf_counter()
            stop = max(self._eta, now) + SPIN_GRACE
            if deadline is not None:
                stop = min(stop, deadline)
            poll = q.poll
            while not self.done() and now < stop:
                if not poll():
                    time.sleep(0)  # lets the completion thread run
                now = time.perf_counter()
        with self._lock:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not self._waitable().wait_for(self.done, left):
                raise TimeoutError(f"{self!r} did not finish within {timeout} s")
            return self._outcome()

    def _waitable(self) -> threading.Condition:
        """The condition a blocking `wait()` sleeps on (call with `_lock` held)."""
        if self._cond is None:
            self._cond = threading.Condition(self._lock)
        return self._cond

    def add_done_callback(
        self, fn: Callable[[Transfer], object], *, context: contextvars.Context | None = None
    ) -> None:
        """Call `fn(transfer)` once done (in `context` when given).

        Added inside a running event loop (as asyncio's own combinators do), `fn` is scheduled
        on that loop with `call_soon`, as for an asyncio future of that loop; the loop's
        resolver task schedules it when the transfer completes. Added outside any loop, `fn`
        runs now if already done, else on the thread that completes the transfer (the
        direction's completion thread, or a thread that polled the completion itself). Either
        way, callbacks run in completion order.

        An exception raised by `fn` is logged and does not affect the transfer or others;
        a KeyboardInterrupt or SystemExit is re-raised only on a caller's thread, after the
        bookkeeping, never on kvasync's completion threads. A callback must not block on
        kvasync: see `wait()`.
        """
        loop = asyncio._get_running_loop()
        if loop is not None:
            if not self._engine.watch(self, (fn, loop, context)):
                loop.call_soon(_run_loop_callback, fn, self, context=context)
            return
        with self._lock:
            if not self.done():
                self._callbacks.append((fn, context))
                return
        _run_callback(_in_context(fn, context), self)
        raise_stashed()

    def remove_done_callback(self, fn: Callback) -> int:
        """Remove every registration of `fn` that has not run yet; returns how many."""
        with self._lock:
            before = len(self._callbacks) + len(self._loop_callbacks)
            self._callbacks = [c for c in self._callbacks if c[0] != fn]
            self._loop_callbacks = [c for c in self._loop_callbacks if c[0] != fn]
            return before - len(self._callbacks) - len(self._loop_callbacks)

    def _schedule_callbacks(self, loop: asyncio.AbstractEventLoop) -> None:
        """Schedule the done-callbacks added from `loop` (its resolver calls this on the
        loop's thread once the transfer is done, in completion order)."""
        if not self._loop_callbacks:  # ours are added on this thread: no lock needed to see
            return
        with self._lock:
            mine = [(fn, ctx) for fn, lp, ctx in self._loop_callbacks if lp is loop]
            if mine:
                self._loop_callbacks = [c for c in self._loop_callbacks if c[1] is not loop]
        for fn, ctx in mine:
            loop.call_soon(_run_loop_callback, fn, self, context=ctx)

    def __await__(self) -> Generator[Any, None, TransferResult]:
        q = self._poller
        if not self.done() and q is not None and q.spin_await:
            # hybrid completion, short transfer: the awaiting task polls the direction itself
            # between loop iterations (no resolver hop, no thread wake: ~10 us after the
            # copy ends); past the predicted end plus a grace it falls back to the future
            now = time.perf_counter()
            if self._eta - now > self._window:
                q.poll()  # already over (one event query): no resolver wake needed
            else:
                deadline = max(self._eta, now) + SPIN_GRACE
                poll = q.poll
                while True:
                    poll()
                    if self.done() or time.perf_counter() > deadline:
                        break
                    yield  # one event-loop iteration, as asyncio.sleep(0)
        if not self.done():
            refuse_blocking_wait("awaiting an unfinished transfer")
            fut = self._engine.future_for(self)
            if fut is not None:
                result: TransferResult = yield from fut.__await__()
                return result
        if self._loop_callbacks:  # done-callbacks added from this loop run first, in order
            fut = self._engine.future_after_callbacks(self)
            if fut is not None:
                after: TransferResult = yield from fut.__await__()
                return after
        return self.result()

    # -- completion (called by the scheduler's completion thread) -----------------------------
    def _attach(self, resolver: Any, callback: tuple[Callback, asyncio.AbstractEventLoop,
                                                     contextvars.Context | None] | None = None,
                keep: bool = False) -> bool:
        """Register a loop resolver to be told on completion (and a done-callback it will
        schedule); False if already done (`keep`: the callback is held all the same, for a
        resolver that schedules it now: `_LoopResolver.queue_done`)."""
        with self._lock:
            if self.done():
                if keep and callback is not None:
                    self._loop_callbacks.append(callback)
                return False
            if resolver not in self._resolvers:
                self._resolvers.append(resolver)
            if callback is not None:
                self._loop_callbacks.append(callback)
            return True

    def _complete(self, result: TransferResult | None, error: BaseException | None) -> None:
        with self._lock:
            if self.done():
                return
            if error is not None:
                if not isinstance(error, TransferFailedError):
                    wrapped = TransferFailedError(
                        f"job {self.job_id}: {type(error).__name__}: {error}", self.job_id
                    )
                    wrapped.__cause__ = error
                    error = wrapped
                self._error = error
            else:
                self._result = result
            callbacks, self._callbacks = self._callbacks, []
            resolvers, self._resolvers = self._resolvers, []
            if self._cond is not None:
                self._cond.notify_all()
        for resolver in resolvers:
            resolver.notify(self)
        for fn, ctx in callbacks:
            _run_callback(_in_context(fn, ctx), self)


def _in_context(fn: Callback, context: contextvars.Context | None) -> Callback:
    if context is None:
        return fn
    return functools.partial(context.run, fn)  # type: ignore[call-arg]


def _run_callback(fn: Callable[[Transfer], object], transfer: Transfer) -> None:
    """Run one done-callback; nothing it raises may stop completion.

    An Exception is logged. A BaseException (KeyboardInterrupt, SystemExit) is logged too;
    on kvasync's own threads it ends there, on a caller's thread (one that polled, or
    `add_done_callback` on a finished transfer) it is re-raised once the completion's
    bookkeeping is done (`raise_stashed`)."""
    try:
        fn(transfer)
    except Exception:
        log.exception("kvasync: done-callback %r of %r raised", fn, transfer)
    except BaseException as exc:
        log.error("kvasync: done-callback %r of %r raised %s", fn, transfer,
                  type(exc).__name__, exc_info=True)
        if not on_library_thread():
            stash_base_exception(exc)


def _run_loop_callback(fn: Callable[[Transfer], object], transfer: Transfer) -> None:
    """Run a done-callback scheduled on its event loop: an Exception is logged, a
    BaseException propagates there at once, as from any callback of that loop (stashed,
    it would surface later from an unrelated call on the loop's thread)."""
    try:
        fn(transfer)
    except Exception:
        log.exception("kvasync: done-callback %r of %r raised", fn, transfer)


def transfer_progress(t: Transfer) -> Progress:
    """Bytes known to have landed: (n, n) once the transfer succeeded, (0, n) if it failed.
    Before that, a transfer cut into pieces counts the pieces whose marks (device events
    recorded after each piece, in order) have completed; one in a single piece stays at
    (0, n) until its end event completes."""
    if t.done():
        return Progress(t.nbytes if t.exception() is None else 0, t.nbytes)
    done = 0
    for mark, landed in t._marks:
        if not mark.landed():
            break
        done = landed
    return Progress(done, t.nbytes)
