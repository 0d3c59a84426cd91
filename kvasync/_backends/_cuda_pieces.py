"""The pieces of one big CUDA transfer, enqueued in order (`CudaBackend.enqueue_pieces`).

Each piece is checked (`concrete`: its CUDA stream and resolved path, InvalidTransferError
before it is enqueued) and enqueued (`enqueue`) by the backend's own calls, passed in; this
module only orders the pieces: fanned-out DMA batches share one fork and one join of the
helper streams, and a staged transfer goes piece after piece through one staging ring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ._cuda_dma import FanRound

if TYPE_CHECKING:
    from .._program import TransferPlan
    from ._base import Direction, Event, Overlap, Stream
    from ._cuda_device import CudaStream
    from ._cuda_dma import DmaPath

__all__ = ["enqueue_fanned", "enqueue_staged"]

#: `stream` and `path` of a piece, checked and resolved
Concrete = Callable[["Stream", "TransferPlan", "Direction", str], "tuple[CudaStream, str]"]


class Enqueue(Protocol):
    def __call__(self, stream: CudaStream, plan: TransferPlan, direction: Direction,
                 path: str, fan: FanRound | None = None,
                 edges: tuple[bool, bool] = (True, True), mark: Event | None = None,
                 overlap: Overlap | None = None) -> None: ...


def enqueue_fanned(stream: Stream, pieces: Sequence[TransferPlan], direction: Direction,
                   path: str, concrete: Concrete, enqueue: Enqueue, dma: DmaPath,
                   fan_out: int, fan_join_pieces: int,
                   marks: Sequence[Event] | None = None) -> None:
    """The pieces of one transfer; their fanned-out DMA batches share one fork and one
    join of the helper streams, whole pieces round-robin (`fan_join_pieces`). A piece's
    mark is recorded on the stream once it waited for the helpers' position after the
    piece (they go on with the next pieces meanwhile)."""
    fan: FanRound | None = None
    unmarked: list[Event] = []
    cuda_stream: CudaStream | None = None

    def join(end_round: bool = True) -> None:
        if fan is not None:
            fan.join(end_round)
        if cuda_stream is not None:
            for mark in unmarked:
                cuda_stream.record(mark)
        unmarked.clear()

    try:
        for k, piece in enumerate(pieces):
            cuda_stream, path_k = concrete(stream, piece, direction, path)
            if cuda_stream._error is not None:  # the failed stream marks the rest failed
                unmarked.extend((marks or [])[k:])
                return
            if piece.num_descriptors and path_k == "dma" and fan is None:
                fan = FanRound(dma, cuda_stream, fan_out)
            if fan is not None and fan_join_pieces and k % fan_join_pieces == 0:
                join()
            if piece.num_descriptors:
                enqueue(cuda_stream, piece, direction, path_k,
                        fan if path_k == "dma" else None)
            if marks is not None:
                unmarked.append(marks[k])
                join(end_round=False)  # the main stream catches up with the helpers
    finally:
        join()


def enqueue_staged(stream: Stream, pieces: Sequence[TransferPlan], direction: Direction,
                   concrete: Concrete, enqueue: Enqueue,
                   marks: Sequence[Event] | None = None,
                   overlap: Overlap | None = None,
                   edges: tuple[bool, bool] = (True, True)) -> None:
    """A big staged transfer, piece after piece through one staging ring: each piece's
    program is built as it is enqueued, so the first slab starts after a small piece's
    host work instead of the whole transfer's. Only the first piece waits for the
    stream's position (loads) and only the last makes the stream wait for its last row
    copy (stores): in between the ring's events keep the copy engines busy. A piece's mark
    follows its last row copy (stores) or unpack (loads). With `overlap` the first piece
    records its start and the first (loads) or last (stores) waits for its predecessor.
    `edges` (first, last) False: `pieces` follow (precede) pieces of the same transfer
    that another call enqueues on `stream` (`Backend.enqueue_pieces`)."""
    cuda_stream, _ = concrete(stream, pieces[0], direction, "staged")
    todo = [k for k, p in enumerate(pieces) if p.num_descriptors]
    first, last = (todo[0], todo[-1]) if todo else (-1, -1)
    first = first if edges[0] else -1
    last = last if edges[1] else -1
    if overlap is not None and not todo:  # nothing to copy: in order, as any transfer
        cuda_stream.wait_event(overlap.after)
        cuda_stream.record(overlap.start)
    for k, piece in enumerate(pieces):
        if cuda_stream._error is not None:  # the failed stream marks the rest failed
            for failed in (marks or [])[k:]:
                cuda_stream.record(failed)
            return
        mark = marks[k] if marks is not None else None
        if piece.num_descriptors:
            enqueue(cuda_stream, piece, direction, "staged", edges=(k == first, k == last),
                    mark=mark, overlap=overlap)
        elif mark is not None:
            cuda_stream.record(mark)  # nothing to copy: landed once the stream gets here
