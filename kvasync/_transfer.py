"""The future of one submitted copy: `Transfer`, and what it resolves to, `TransferResult`.

A Transfer is completed exactly once, from the direction's completion thread, in
submission order. It can be waited on from sync code (`wait`), awaited from any number of
tasks in any number of event loops (each await gets its own loop future, so cancelling one
awaiter cancels neither the copy nor the other awaiters), and observed with callbacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._completion import SPIN_GRACE, SPIN_WINDOW
from ._errors import TransferFailedError
from ._lifecycle import (
    on_library_thread,
    raise_stashed,
    refuse_blocking_wait,
    stash_base_exception,
)

if TYPE_CHECKING:
    from ._completion import CompletionEngine

__all__ = ["LayeredTransfer", "Transfer", "TransferResult"]

log = logging.getLogger("kvasync")


@dataclass(frozen=True)
class TransferResult:
    """What a finished transfer did: `bytes` this rank copied, `seconds` of device time."""

    job_id: int
    success: bool
    bytes: int
    seconds: float


class Transfer:
    """A store or load that is already submitted; await it, `wait()` it, or poll `done()`."""

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_cond",
        "_engine",
        "_error",
        "_eta",
        "_queue",
        "_resolvers",
        "_result",
        "direction",
        "job_id",
        "nbytes",
    )

    def __init__(self, job_id: int, direction: str, nbytes: int, engine: CompletionEngine) -> None:
        self.job_id = job_id
        #: "d2h" for stores, "h2d" for loads
        self.direction = direction
        #: bytes this rank will copy
        self.nbytes = nbytes
        self._engine = engine
        self._cond = threading.Condition(threading.Lock())
        self._result: TransferResult | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Transfer], object]] = []
        self._resolvers: list[Any] = []
        #: the DirectionQueue running it and its predicted completion time (perf_counter)
        self._queue: Any = None
        self._eta = 0.0

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

    def result(self) -> TransferResult:
        """The result; raises TransferFailedError if it failed, RuntimeError if not done."""
        with self._cond:
            return self._outcome()

    def exception(self) -> BaseException | None:
        """The failure, or None (raises RuntimeError if not done)."""
        with self._cond:
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

        With the lazy completion thread (`DirectionQueue.LAZY_THREAD`, CUDA, the default): it
        sleeps until `SPIN_WINDOW` before the predicted end, then polls the direction itself
        until the end plus `SPIN_GRACE`, then sleeps again (the completion thread's wake-up
        took 0.3-0.4 ms after a 1 GiB copy on the H200 host).

        Inside a done-callback that kvasync runs, waiting for an unfinished transfer raises
        RuntimeError: the completion that would end the wait waits for the callback.
        """
        if not self.done():
            refuse_blocking_wait("wait() for an unfinished transfer")
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        q = self._queue
        if not self.done() and q is not None and q.lazy:  # polling callers
            lead = self._eta - SPIN_WINDOW - start
            if lead > 0:
                with self._cond:
                    self._cond.wait_for(self.done, lead if timeout is None else min(
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
        with self._cond:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not self._cond.wait_for(self.done, left):
                raise TimeoutError(f"{self!r} did not finish within {timeout} s")
            return self._outcome()

    def add_done_callback(self, fn: Callable[[Transfer], object]) -> None:
        """Call `fn(transfer)` once done: now if already done, else from the thread that
        completes it (the direction's completion thread, or an awaiting loop's or waiting
        thread when it polled the completion itself). Callbacks run in completion order.

        An exception raised by `fn` is logged and does not affect the transfer or others;
        a KeyboardInterrupt or SystemExit is re-raised only on a caller's thread, after the
        bookkeeping, never on kvasync's completion threads. A callback must not block on
        kvasync: see `wait()`.
        """
        with self._cond:
            if not self.done():
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)
        raise_stashed()

    def __await__(self) -> Generator[Any, None, TransferResult]:
        q = self._queue
        if not self.done() and q is not None and q.spin_await:
            # hybrid completion, short transfer: the awaiting task polls the direction itself
            # between loop iterations (no resolver hop, no thread wake: ~10 us after the
            # copy ends); past the predicted end plus a grace it falls back to the future
            now = time.perf_counter()
            if self._eta - now <= SPIN_WINDOW:
                deadline = max(self._eta, now) + SPIN_GRACE
                poll = q.poll
                while True:
                    poll()
                    if self.done() or time.perf_counter() > deadline:
                        break
                    yield  # one event-loop iteration, as asyncio.sleep(0)
        if self.done():
            return self.result()
        refuse_blocking_wait("awaiting an unfinished transfer")
        fut = self._engine.future_for(self)
        if fut is None:  # completed while registering
            return self.result()
        result: TransferResult = yield from fut.__await__()
        return result

    # -- completion (called by the scheduler's completion thread) -----------------------------
    def _attach(self, resolver: Any) -> bool:
        """Register a loop resolver to be told on completion; False if already done."""
        with self._cond:
            if self.done():
                return False
            if resolver not in self._resolvers:
                self._resolvers.append(resolver)
            return True

    def _complete(self, result: TransferResult | None, error: BaseException | None) -> None:
        with self._cond:
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
            self._cond.notify_all()
        for resolver in resolvers:
            resolver.notify(self)
        for fn in callbacks:
            _run_callback(fn, self)


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


class LayeredTransfer:
    """A load split per layer (`Offloader.load_layerwise`): one Transfer per layer.

    Awaiting it awaits every layer and returns one TransferResult (bytes and seconds summed).
    `layers[i]` is layer i's own Transfer; `events[i]` a device event recorded when layer i
    has landed, kept for the life of this object, that `wait_layer` makes a stream wait on.
    """

    def __init__(
        self, job_id: int, layers: list[Transfer], events: list[Any], backend: Any
    ) -> None:
        self.job_id = job_id
        self.layers = layers
        self.events = events
        self._backend = backend

    def __len__(self) -> int:
        return len(self.layers)

    def done(self) -> bool:
        return all(t.done() for t in self.layers)

    def wait_layer(self, index: int, stream: Any | None = None) -> None:
        """Make `stream` (default: the compute stream) wait on the device until layer `index`
        has landed; the host does not block (wraps cudaStreamWaitEvent on CUDA)."""
        target = self._backend.compute_stream(stream)
        if target is not None:
            target.wait_event(self.events[index])

    def _combine(self, results: list[TransferResult]) -> TransferResult:
        return TransferResult(
            self.job_id, True, sum(r.bytes for r in results), sum(r.seconds for r in results)
        )

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until every layer is done (TimeoutError after `timeout` per layer)."""
        return self._combine([t.wait(timeout) for t in self.layers])

    def __await__(self) -> Generator[Any, None, TransferResult]:
        results = []
        for t in self.layers:
            r = yield from t.__await__()
            results.append(r)
        return self._combine(results)

    def __repr__(self) -> str:
        return f"<LayeredTransfer job_id={self.job_id} {len(self.layers)} layers>"
