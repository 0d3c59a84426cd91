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

__all__ = ["SPIN_GRACE", "SPIN_WINDOW", "Poller"]

#: poll from the loop when an awaited transfer is predicted to end within this many seconds
SPIN_WINDOW = 1.5e-3
#: stop polling a transfer this long after its predicted end (then wait for the thread)
SPIN_GRACE = 2e-3


class Poller(Protocol):
    """What a waiter of a transfer may drive: the direction that runs it."""

    #: the completion thread is not woken per transfer: waiters poll near the end
    lazy: bool
    #: an awaiting task polls a short transfer itself between loop iterations
    spin_await: bool

    def poll(self) -> int:
        """Complete the finished transfers at the head of the direction; how many."""
        ...

    def head_eta(self) -> float | None:
        """The predicted end (perf_counter) of the oldest unfinished transfer, or None."""
        ...
