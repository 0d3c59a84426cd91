"""The asyncio future methods shared by `Transfer` and `LayeredTransfer`.

A transfer is awaitable from any loop and cannot be cancelled, so it has the future methods
it can honour (`get_loop` answers the caller's loop; `cancel` is always refused) and is not
an asyncio future: see `FutureMethods`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["Callback", "FutureMethods", "Relay"]

Callback = Callable[[Any], object]


class FutureMethods:
    """The asyncio future methods that a transfer awaitable from any loop can honour.

    There is deliberately no `_asyncio_future_blocking`, so `asyncio.isfuture()` is False:
    asyncio stops waiting on a future it was given by cancelling it (`gather` when cancelled,
    `wait_for` on timeout before Python 3.12, `wait_for(t, 0)`), and a submitted copy cannot
    be cancelled, so it would wait for the copy to end instead. Told it is an awaitable,
    asyncio wraps it in a task wherever it may cancel, and cancelling that task stops only
    the waiting. Where asyncio just watches (`asyncio.wait`), the methods below serve.
    """

    __slots__ = ()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop of the caller (a transfer belongs to no single loop)."""
        loop = asyncio._get_running_loop()
        if loop is None:
            raise RuntimeError(
                f"{self!r} belongs to no event loop; get_loop() answers the caller's running "
                "loop and there is none (use wait() outside a loop)"
            )
        return loop

    def cancel(self, msg: Any | None = None) -> bool:
        """Always False: a submitted copy cannot be recalled (the device is already told).

        To stop *waiting*, cancel the task that awaits the transfer: that task gets
        CancelledError, while the copy and every other awaiter carry on.
        """
        return False

    def cancelled(self) -> bool:
        """Always False (see `cancel`)."""
        return False


class Relay:
    """A done-callback of a LayeredTransfer, registered on its last layer: calls `fn` with
    the LayeredTransfer, and equals `fn` so that removing `fn` finds it."""

    __slots__ = ("fn", "owner")

    def __init__(self, fn: Callback, owner: Any) -> None:
        self.fn = fn
        self.owner = owner

    def __call__(self, _layer: Any) -> object:
        return self.fn(self.owner)

    def __eq__(self, other: object) -> bool:
        return other is self or other == self.fn

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<done-callback {self.fn!r} of {self.owner!r}>"
