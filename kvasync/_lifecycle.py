"""Closing an offloader: once, from any thread or callback, resumable, never under a copy.

What an `Offloader` owns beyond plain objects (completion threads, stream threads, resolver
tasks, host memory, a shared region) is held by a `Lifecycle`, which never references the
offloader. So an offloader dropped without `close()` is collected like any object, and a
`weakref.finalize` on it asks its lifecycle to release everything (with a
`ResourceWarning`, as an unclosed file gives).

The rules, in order of importance:

1. Host memory is released only when no copy can touch it any more: every lane has nothing
   in flight. A close that cannot wait that long (a timeout ran out, Ctrl-C, a close from a
   done-callback, garbage collection) leaves the release to whoever completes the last
   transfer in flight (`on_idle`, run by the direction queue after that transfer's
   callbacks, outside its locks).
2. `close()` is idempotent and resumable: "closed" (no new work) is set first, then each
   release step is safe to run again, so a close interrupted half-way is finished by the
   next one. One thread at a time runs the steps (`_claim`).
3. Nothing blocks where it would wait for itself: inside a done-callback (the thread is
   completing a transfer, see `completing_here`) `close()` does not wait, and a blocking
   wait for an unfinished transfer raises instead of deadlocking.

The thread-local helpers (`_threadstate.py`) also carry callback containment: a
`BaseException` (Ctrl-C, `SystemExit`) raised by a done-callback is logged and contained on
kvasync's own threads, and re-raised on a caller's thread only after the completion
bookkeeping is done.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ._threadstate import completing_here, fork_generation, forked_since

if TYPE_CHECKING:
    from ._backends import Backend, HostMemory
    from ._completion import CompletionEngine
    from ._scheduler import DirectionQueue

__all__ = ["Lifecycle"]

log = logging.getLogger("kvasync")


# -- the lifecycle ----------------------------------------------------------------------------
class Lifecycle:
    """Everything an offloader must release, and the state machine that releases it.

    `views` is the offloader's list of host views (cleared in place before the memory under
    it is released); `region` a shared host region to close, or None.
    """

    #: seconds a release waits for a thread to exit (threads exit at once when idle)
    JOIN_TIMEOUT = 10.0
    #: seconds garbage collection waits for a lock (it may run on a thread holding it)
    GC_LOCK_TIMEOUT = 1.0

    def __init__(
        self,
        queues: list[DirectionQueue],
        engine: CompletionEngine,
        backend: Backend,
        host_mem: list[HostMemory],
        views: list[Any],
        region: Any | None,
    ) -> None:
        self.queues = queues
        self.engine = engine
        self.backend = backend
        self.host_mem = host_mem
        self.views = views
        self.region = region
        #: no new work is accepted
        self.closed = False
        #: every step of the release ran
        self.released = threading.Event()
        self._claim = threading.Lock()  # held by the thread running the release steps
        self._state = threading.Lock()  # guards `_closers`
        self._closers = 0  # blocking close() calls waiting for the drain
        for q in queues:
            q.on_idle = self.try_release
        self.generation = fork_generation()

    # -- state --------------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing in flight in any lane (read without the lanes' locks: once closed, a
        count only goes down)."""
        return all(q.inflight == 0 for q in self.queues)

    def _forked(self) -> bool:
        """In a forked child: only refuse new work. The threads to drain and join stayed in
        the parent, and so did whoever held a lock at the fork; the memory is the parent's
        (the child's copy goes with the child)."""
        if not forked_since(self.generation):
            return False
        self.begin(locked=False)
        return True

    def begin(self, locked: bool = True) -> None:
        """Refuse new work from here on (idempotent). `locked=False` from a finalizer,
        which must not take the lanes' locks (nobody can submit to a collected offloader)."""
        self.closed = True
        for q in self.queues:
            q.refuse_new(locked)

    # -- closing ------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Drain, then release; see `Offloader.close` for the contract."""
        if self._forked():
            return
        self.begin()
        if self.released.is_set():
            self._join_threads()
            return
        if completing_here():  # in a done-callback: never wait for ourselves
            self.try_release()
            return
        with self._state:
            self._closers += 1
        drained = False
        try:
            drained = self._drain(timeout)
        finally:
            with self._state:
                self._closers -= 1
            if not drained:  # timed out or interrupted: the last completion releases
                self.try_release()
        if not drained:
            left = sum(q.inflight for q in self.queues)
            raise TimeoutError(
                f"close() timed out after {timeout} s with {left} transfer(s) in flight; the "
                "offloader accepts no new work, and its threads and host memory are released "
                "when those transfers finish (or by a later close())"
            )
        with self._claim:
            self._release(join=True)
        self._join_threads()

    async def aclose(self, drain: Callable[[], Awaitable[None]]) -> None:
        """`drain()` then `close()`; see `Offloader.aclose` for the contract."""
        if self._forked():
            return
        if completing_here():
            self.close()
            return
        self.begin()
        try:
            await drain()
            # a transfer's awaiters resume before its thread-side done-callbacks return, and
            # it is in flight until they do: wait for those without blocking the loop (one
            # may need it, e.g. run_coroutine_threadsafe(...).result())
            nap = 0.0
            while not self.idle():
                await asyncio.sleep(nap)
                nap = min(2 * nap or 0.0005, 0.01)
        except BaseException:
            self.try_release()
            raise
        self.close()

    def _drain(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for q in self.queues:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not q.drain(left):
                return False
        return True

    def try_release(self) -> None:
        """Release now if closed, idle and nobody else is at it; else return at once.

        Run by the thread that completed the last transfer in flight, by a close that did
        not wait, and by garbage collection; it never blocks on another thread."""
        if not self.closed or self.released.is_set() or self._closers or not self.idle():
            return
        if not self._claim.acquire(blocking=False):
            return
        try:
            if not self._closers and self.idle():
                self._release(join=False)
        except Exception:  # this thread completes transfers or collects garbage: log it;
            # what did not run is retried by the next close()
            log.exception("kvasync: releasing a closed offloader failed")
        finally:
            self._claim.release()

    def _release(self, join: bool) -> None:
        """The release steps, each safe to run again (call with `_claim` held)."""
        if self.released.is_set():
            return
        lock_timeout = None if join else self.GC_LOCK_TIMEOUT
        for q in self.queues:
            q.request_stop(lock_timeout)
        if join:
            self._join_threads()
        self.engine.close(lock_timeout)
        self.backend.close()
        self.views.clear()  # drop our views before unmapping what they view
        for mem in self.host_mem:
            mem.release()
        region, self.region = self.region, None
        # a duck-typed region may have none; vLLM's is closed by its cleanup()
        close = getattr(region, "close", None) or getattr(region, "cleanup", None)
        if close is not None:
            try:
                close()
            except BaseException:
                self.region = region  # retried by the next close
                raise
        for q in self.queues:
            q.forget_pools(lock_timeout)
        self.released.set()

    def _join_threads(self) -> None:
        for q in self.queues:
            q.join_thread(self.JOIN_TIMEOUT)

    def resources(self) -> dict[str, int]:
        """Live threads, tasks and host bytes (for tests that count what close releases)."""
        return {
            "completion_threads": sum(q.thread_alive for q in self.queues),
            "resolver_tasks": self.engine.num_tasks,
            "stream_threads": int(getattr(self.backend, "live_threads", 0)),
            "host_bytes": sum(m.nbytes for m in self.host_mem if m._release is not None),
            "inflight": sum(q.inflight for q in self.queues),
        }

    # -- garbage collection -------------------------------------------------------------------
    def collected(self, what: str) -> None:
        """`weakref.finalize` callback of the offloader: release what it left behind.

        Runs on whichever thread dropped the last reference (or ran the cyclic collector),
        so it waits for no copy and for no lock without a bound (that thread may hold it):
        with transfers in flight, the last one to complete releases; when idle, it stops
        the completion threads without joining them (idle stream threads are joined)."""
        if self._forked():
            return
        unclosed = not self.closed
        self.begin(locked=False)
        try:
            self.try_release()
        finally:
            if unclosed:
                try:
                    warnings.warn(
                        f"unclosed {what}: released by garbage collection; call close() or "
                        "use 'with' / 'async with'",
                        ResourceWarning,
                        stacklevel=1,
                    )
                except Exception:  # a filter that turns warnings into errors
                    log.warning("kvasync: unclosed %s released by garbage collection", what)
