"""Thread-local state of kvasync's threads and of threads completing a transfer.

Who is completing a transfer here (so nothing may block on kvasync), whether this is one of
kvasync's own threads (nothing a callback raises may end it), and a `BaseException` a
done-callback raised on a caller's thread, kept until the completion's bookkeeping is done.
A leaf module: the transfer, the scheduler, the completion engine and the lifecycle all
read it, and it imports nothing of kvasync.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = [
    "completing_here",
    "enter_completion",
    "exit_completion",
    "fork_generation",
    "forked_since",
    "mark_library_thread",
    "on_library_thread",
    "raise_stashed",
    "refuse_blocking_wait",
    "stash_base_exception",
    "timed_acquire",
]


_local = threading.local()


# -- process ------------------------------------------------------------------------------------
#: bumped in the child of every fork: what an object built before the fork runs on (threads,
#: locks other threads held, streams, the CUDA context) stayed in the parent
_generation = [0]


def _forked() -> None:
    _generation[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def fork_generation() -> int:
    """The process's fork generation: record it when building what owns threads."""
    return _generation[0]


def forked_since(generation: int) -> bool:
    """True in a forked child of the process that recorded `generation`."""
    return generation != _generation[0]


# -- thread context ---------------------------------------------------------------------------
def mark_library_thread() -> None:
    """Called first by kvasync's own threads: nothing a callback raises may end them."""
    _local.library = True


def on_library_thread() -> bool:
    return bool(getattr(_local, "library", False))


def enter_completion() -> None:
    """This thread starts completing a transfer (its done-callbacks are about to run)."""
    _local.completing = getattr(_local, "completing", 0) + 1


def exit_completion() -> None:
    _local.completing = getattr(_local, "completing", 1) - 1


def completing_here() -> bool:
    """True inside a done-callback that kvasync runs while completing a transfer: the
    transfer counts as in flight until its callbacks return, and other transfers of its
    direction wait behind it, so nothing here may block on kvasync."""
    return bool(getattr(_local, "completing", 0))


def stash_base_exception(exc: BaseException) -> None:
    """Keep the first BaseException a callback raised on a caller's thread for later."""
    if getattr(_local, "stash", None) is None:
        _local.stash = exc


def raise_stashed() -> None:
    """Re-raise what `stash_base_exception` kept (once the bookkeeping is done)."""
    exc = getattr(_local, "stash", None)
    if exc is not None:
        _local.stash = None
        raise exc


def refuse_blocking_wait(what: str) -> None:
    """Raise instead of deadlocking: a done-callback must not wait for transfers."""
    if completing_here():
        raise RuntimeError(
            f"{what} inside a done-callback would deadlock: the callback runs while its "
            "transfer is being completed, and transfers behind it wait for the callback to "
            "return; note what you need and wait outside the callback"
        )


def timed_acquire(lock: Any, timeout: float | None) -> bool:
    """`lock.acquire()`, bounded when `timeout` is given (see `_lifecycle.Lifecycle.collected`)."""
    if timeout is None:
        lock.acquire()
        return True
    return bool(lock.acquire(timeout=timeout))

