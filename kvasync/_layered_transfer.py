"""A load split per layer: `LayeredTransfer`, one `Transfer` per layer, awaited as one.

Built by `Offloader.load_layerwise`; every layer runs in one lane, so the layers complete in
order and the whole is done when its last layer is.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Generator
from typing import Any

from ._errors import OffloaderBrokenError, OffloaderClosedError
from ._future import FutureMethods, Relay
from ._transfer import Progress, Transfer, TransferResult, transfer_progress

__all__ = ["LayeredTransfer", "layered_progress", "submit_layers"]


class LayeredTransfer(FutureMethods):
    """A load split per layer (`Offloader.load_layerwise`): one Transfer per layer.

    Awaiting it awaits every layer and returns one TransferResult (bytes and seconds summed).
    `layers[i]` is layer i's own Transfer; `events[i]` a device event recorded when layer i
    has landed, kept for the life of this object, that `wait_layer` makes a stream wait on.
    It has a Transfer's future methods; it is done when its last layer is (the layers run
    in one lane, which completes them in order).
    """

    def __init__(
        self, job_id: int, layers: list[Transfer], events: list[Any], backend: Any,
        enqueued: int | None = None
    ) -> None:
        self.job_id = job_id
        self.layers = layers
        self.events = events
        self._backend = backend
        # the last layer that went to the lane completes last; the ones after it (refused
        # by a close between layers) were done from the start
        self._tail = layers[(len(layers) if enqueued is None else enqueued) - 1]

    def __len__(self) -> int:
        return len(self.layers)

    def done(self) -> bool:
        return all(t.done() for t in self.layers)

    def progress(self) -> Progress:
        """`(bytes_done, bytes_total)`: the bytes of the layers that have landed so far."""
        return layered_progress(self)

    def result(self) -> TransferResult:
        """The summed result; raises the first layer's failure, RuntimeError if not done."""
        if not self.done():
            raise RuntimeError(f"{self!r} is not done yet")
        return self._combine([t.result() for t in self.layers])

    def exception(self) -> BaseException | None:
        """The first layer's failure, or None (raises RuntimeError if not done)."""
        if not self.done():
            raise RuntimeError(f"{self!r} is not done yet")
        return next((e for e in (t.exception() for t in self.layers) if e is not None), None)

    def add_done_callback(
        self, fn: Callable[[LayeredTransfer], object], *,
        context: contextvars.Context | None = None
    ) -> None:
        """Call `fn(self)` once every layer is done; where it runs as for a Transfer."""
        self._tail.add_done_callback(Relay(fn, self), context=context)

    def remove_done_callback(self, fn: Callable[[LayeredTransfer], object]) -> int:
        return self._tail.remove_done_callback(fn)

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


def layered_progress(t: LayeredTransfer) -> Progress:
    """The bytes of the layers that have landed (each layer has its own end event)."""
    parts = [transfer_progress(layer) for layer in t.layers]
    return Progress(sum(p.done for p in parts), sum(p.total for p in parts))


def submit_layers(submits: list[Callable[[], Transfer]], sizes: list[int], job_id: int,
                  engine: Any) -> tuple[list[Transfer], int]:
    """Submit each layer in order (`submits[i]()`); the transfers and how many were
    enqueued. Refused before the first, the call raises. Refused after (a close, or a
    failed direction, between two layers), the later layers are failed transfers instead:
    the ones enqueued write into the GPU blocks, and the caller must be able to wait."""
    transfers: list[Transfer] = []
    enqueued = 0
    for submit, nbytes in zip(submits, sizes):
        try:
            transfers.append(submit())
            enqueued = len(transfers)
        except (OffloaderClosedError, OffloaderBrokenError) as exc:
            if not transfers:
                raise
            refused = Transfer(job_id, "h2d", nbytes, engine)
            refused._complete(None, exc)
            transfers.append(refused)
    return transfers, enqueued
