"""The completion engine: one background task per event loop resolves awaited transfers.

Transfers complete on the scheduler's completion threads (which sleep in a blocking event
wait, so nothing spins while idle). The first `await` in a loop starts that loop's resolver
task; a completing transfer appends itself to the resolvers of the loops that await it and
wakes each with a single `call_soon_threadsafe` (coalesced while a wake is pending). The task
then sets the loop futures, in completion order, on the loop's own thread.

A closed loop is noticed (`call_soon_threadsafe` raises) and its resolver dropped; the
transfer itself still completes and `wait()` still works. `close()` stops every resolver once
it has no awaiters left.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import TYPE_CHECKING

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
        self.task = loop.create_task(self._run(), name="kvasync-completion")

    # any thread
    def notify(self, transfer: Transfer | None) -> None:
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

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._event.set()

    async def _run(self) -> None:
        try:
            while True:
                await self._event.wait()
                self._event.clear()
                self._drain()
                if self.stopping and not self.waiting:
                    return
        finally:
            self.dead = True
            self.engine._forget(self)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._ready:
                    return
                transfer = self._ready.popleft()
            for fut in self.waiting.pop(transfer, ()):
                if fut.done():  # the awaiting task was cancelled
                    continue
                try:
                    fut.set_result(transfer.result())
                except BaseException as exc:
                    fut.set_exception(exc)


class CompletionEngine:
    """Hands out loop futures for transfers and owns the per-loop resolver tasks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._resolvers: dict[asyncio.AbstractEventLoop, _LoopResolver] = {}
        self.closed = False

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
        waiters.append(fut)
        if not transfer._attach(resolver):
            waiters.remove(fut)
            if not waiters:
                resolver.waiting.pop(transfer, None)
            return None
        return fut

    @property
    def num_tasks(self) -> int:
        """Resolver tasks alive now (for resource accounting in tests)."""
        with self._lock:
            return sum(1 for r in self._resolvers.values() if not r.task.done())

    def close(self) -> None:
        """Stop every resolver once it has no awaiters left (idempotent)."""
        with self._lock:
            self.closed = True
            resolvers = list(self._resolvers.values())
        for resolver in resolvers:
            resolver.stopping = True
            resolver.notify(None)
