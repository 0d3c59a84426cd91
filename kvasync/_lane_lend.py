"""A caller on an event loop lends the loop's thread to the lane's launcher.

A mixin of `_lane_launch.LaneLaunch`. The launcher thread runs Python and needs the GIL. A
thread that wants the GIL gets it when the holder blocks, or after waiting the
interpreter's switch interval (5 ms) without a release; a loop whose tasks keep it busy
releases and retakes the GIL at every poll, which restarts that wait, so the launcher
starved: a 2 MiB staged store began 1.5 s after its call beside a task that ran Python 1 ms
at a time (host backend, 2-core machine). So when a transfer is queued for the launcher by
a caller on a loop's thread, that loop blocks at its next turn until the launcher caught up
(`_lend_loop`, at most `LEND_S` at a time, again at each turn while transfers stay queued):
the launcher then runs at once. Its Python needs the GIL anyway; the loop loses only what it
could have run while the launcher sat in CUDA calls (which release the GIL). Off a loop's
thread (a script, a worker thread) nothing changes; a Jupyter cell runs on the kernel's
loop thread, so there the loop lends after the cell.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any

__all__ = ["LoopLending"]


class LoopLending:
    """Lending a caller's event loop to the launcher (see the module)."""

    _launches: deque[Any]
    _launcher: threading.Thread | None
    _stop: bool
    #: set by the launcher whenever it has emptied `_launches`, cleared when a transfer is
    #: queued for it: a lend waits on it, never on the lane's lock
    _caught_up: threading.Event
    #: the loops where a `_lend_loop` is scheduled and has not run yet (guarded by
    #: `_lend_lock`; a loop closed with its lend pending is pruned)
    _lend_pending: set[asyncio.AbstractEventLoop]
    _lend_lock: threading.Lock

    #: how long an event loop's thread waits for the launcher per `_lend_loop` (then the
    #: loop runs its other callbacks and lends again while transfers are still queued)
    LEND_S = 0.002

    def _init_lending(self) -> None:
        """Called by the lane's constructor: caught up, nothing pending."""
        self._caught_up = threading.Event()
        self._caught_up.set()
        self._lend_pending = set()
        self._lend_lock = threading.Lock()

    def _lend_loop_soon(self) -> None:
        """(under the lock, a transfer just queued for the launcher) Where the caller runs
        an event loop, that loop lends its thread to the launcher once the caller's task
        yields (`_lend_loop`; one pending per lane and loop)."""
        self._caught_up.clear()
        loop = asyncio._get_running_loop()  # None off a loop's thread (one C call)
        if loop is not None:
            self._schedule_lend(loop)

    def _schedule_lend(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`'s thread: `_lend_loop` at its next turn, unless one is pending."""
        with self._lend_lock:
            if loop in self._lend_pending:
                return
            self._lend_pending = {x for x in self._lend_pending if not x.is_closed()}
            try:
                loop.call_soon(self._lend_loop, loop)
            except RuntimeError:  # the loop is closing: the launcher goes on by itself
                return
            self._lend_pending.add(loop)

    def _lend_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`'s thread: wait up to `LEND_S` for the launcher to empty its queue
        (the wait releases the GIL to it), and lend again at the loop's next turn while
        transfers are still queued and the launcher lives."""
        with self._lend_lock:
            self._lend_pending.discard(loop)
        self._caught_up.wait(self.LEND_S)
        thread = self._launcher
        if (self._launches and not self._stop and thread is not None
                and thread.is_alive()):
            self._schedule_lend(loop)
