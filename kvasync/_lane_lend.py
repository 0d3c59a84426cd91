"""A caller on an event loop lends the loop's thread to the lane's launcher.

A mixin of `_lane_launch.LaneLaunch`. The launcher thread runs Python and needs the GIL. A
thread that wants the GIL gets it when the holder blocks, or after waiting the
interpreter's switch interval (5 ms) without a release; a loop whose tasks keep it busy
releases and retakes the GIL at every poll, which restarts that wait, so the launcher
starved: a 2 MiB staged store began 1.5 s after its call beside a task that ran Python 1 ms
at a time (host backend, 2-core machine). So when a transfer is queued for the launcher by
a caller on a loop's thread, that loop blocks at its next turn until the launcher caught up
(`_lend_loop`, `LEND_S` at a time, again at each turn while transfers stay queued): the
launcher then runs at once, on time the loop would have given the launch's Python anyway.
Off a loop's thread (a script, a worker thread) nothing changes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any

from ._threadstate import timed_acquire

__all__ = ["LoopLending"]


class LoopLending:
    """Lending a caller's event loop to the launcher (see the module)."""

    _lock: threading.Lock
    _launches: deque[Any]
    _launched: threading.Condition
    _launcher: threading.Thread | None
    _stop: bool
    #: the caller's event loop where a `_lend_loop` is scheduled and has not run yet
    _lend_pending: asyncio.AbstractEventLoop | None = None

    #: how long an event loop's thread waits for the launcher per `_lend_loop` (then the
    #: loop runs its other callbacks and lends again while transfers are still queued)
    LEND_S = 0.002

    def _lend_loop_soon(self) -> None:
        """(under the lock, a transfer just queued for the launcher) Where the caller runs
        an event loop, that loop lends its thread to the launcher once the caller's task
        yields (`_lend_loop`; one pending per lane and loop)."""
        loop = asyncio._get_running_loop()  # None off a loop's thread (one C call)
        if loop is None or (self._lend_pending is loop and not loop.is_closed()):
            return
        try:
            loop.call_soon(self._lend_loop, loop)
        except RuntimeError:  # the loop is closing: the launcher goes on by itself
            return
        self._lend_pending = loop

    def _lend_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`'s thread: wait up to `LEND_S` for the launcher to enqueue every queued
        transfer (the lane's condition wait releases the GIL to it), and lend again at the
        loop's next turn while some are still queued."""
        self._lend_pending = None
        if timed_acquire(self._lock, self.LEND_S):
            try:
                deadline = time.monotonic() + self.LEND_S
                while self._launches and not self._stop:
                    left = deadline - time.monotonic()
                    thread = self._launcher
                    if left <= 0 or thread is None or not thread.is_alive():
                        break
                    self._launched.wait(left)
            finally:
                self._lock.release()
        if self._launches and not self._stop and self._lend_pending is None:
            try:
                loop.call_soon(self._lend_loop, loop)
                self._lend_pending = loop
            except RuntimeError:
                pass
