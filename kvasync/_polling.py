"""Hybrid polling: how close to a transfer's predicted end its waiters poll for it.

A thread wake costs tens of microseconds, far more than a small copy takes, so an awaiting
task or a waiting thread may complete a transfer itself by polling its direction near the
predicted end. What it polls is a `Poller`, handed to the transfer when it is submitted
(the direction queue that runs it): the future never needs the scheduler's type, and the
scheduler never needs the future's waiting logic. A leaf module: it imports nothing of
kvasync.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["SLOW_POLL", "SLOW_POLL_MAX", "SPIN_GRACE", "SPIN_WINDOW", "Poller", "spin_window"]

#: poll from the loop when an awaited transfer is predicted to end within this many seconds
#: (at most: `spin_window` scales it down for shorter predictions)
SPIN_WINDOW = 1.5e-3
#: the window is this share of the predicted time to the end, at least `MIN_WINDOW`: a
#: prediction is off by a few percent, so polling 1.5 ms ahead of a 20 ms load spent CPU
#: (awaiting it cost 10.6% of a core on the H200 host)
WINDOW_SHARE = 0.05
MIN_WINDOW = 0.25e-3
#: stop polling a transfer this long after its predicted end (then wait for the thread)
SPIN_GRACE = 2e-3
#: a loop's awaiters of a transfer with no predicted end yet (its launch is still queued for
#: the launcher thread) or past it by `SPIN_GRACE` poll at this interval, doubling up to
#: `SLOW_POLL_MAX`, rather than only wait for the completion thread's wake: that thread needs
#: the GIL, which a busy event loop keeps from it (CPython hands the GIL to a waiting thread
#: after 5 ms without a release, and each loop turn releases and retakes it). Beside a task
#: running Python 1 ms at a time an awaited 200 MiB staged store took 72,523 turns (77 s,
#: H100) with the thread alone
SLOW_POLL = 1e-3
SLOW_POLL_MAX = 8e-3


def spin_window(predicted: float) -> float:
    """How long before its predicted end (`predicted` seconds from now at submission) the
    waiters of a transfer start polling."""
    return min(SPIN_WINDOW, max(MIN_WINDOW, WINDOW_SHARE * predicted))


class Poller(Protocol):
    """What a waiter of a transfer may drive: the direction that runs it."""

    #: the completion thread is not woken per transfer: waiters poll near the end
    lazy: bool
    #: an awaiting task polls a short transfer itself between loop iterations
    spin_await: bool

    def poll(self) -> int:
        """Complete the finished transfers at the head of the direction; how many."""
        ...

    def head_eta(self) -> tuple[float, float] | None:
        """The predicted end (perf_counter) of the oldest unfinished transfer and how long
        before it its waiters poll (`spin_window`), or None."""
        ...
