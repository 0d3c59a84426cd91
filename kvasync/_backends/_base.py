"""The seam between kvasync's core and a device: streams, events, host memory, copy paths.

The core (descriptors, scheduler, completion) only talks to these four small interfaces, so
the host backend (CI, laptops, notebooks) and the CUDA backend run the very same descriptor
arrays with the very same ordering rules. Backends are chosen by name (`load_backend`).

Semantics every backend keeps (they are CUDA's):
- work enqueued on one `Stream` runs in enqueue order;
- `Stream.record(event)` marks the point the stream has reached; the event completes when
  the stream gets there; `Stream.wait_event(event)` holds later work on the stream until the
  event completes;
- `Backend.enqueue_copy` enqueues the copies of one descriptor batch on a stream; copies of
  one batch may run in any order and must not overlap at their destinations;
- a failure on the device is reported by the events recorded after it (`Event.error`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .._arrays import allocation_of

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._program import TransferPlan
    from ._calibrated import ComputeLoad, Preference

__all__ = ["Backend", "Direction", "Event", "HostMemory", "Overlap", "Stream"]

Direction = Literal["d2h", "h2d"]


class Event(ABC):
    """A point on a stream that completes when the stream reaches it."""

    @abstractmethod
    def query(self) -> bool:
        """True once the stream has reached this event (successfully or not); never blocks."""

    @abstractmethod
    def synchronize(self, timeout: float | None = None) -> bool:
        """Block until the event completes or `timeout` seconds pass; True if it completed."""

    @abstractmethod
    def error(self) -> BaseException | None:
        """The device failure that reached this event, if any (valid once completed)."""

    def landed(self) -> bool:
        """True once the event was recorded and its stream reached it without an error;
        never blocks. (A CUDA event never recorded reports itself complete to `query`.)"""
        return self.query() and self.error() is None

    @abstractmethod
    def elapsed_seconds(self, end: Event) -> float:
        """Seconds between this event and `end` (both completed), measured by the device."""


class Stream(ABC):
    """An ordered queue of device work."""

    @abstractmethod
    def record(self, event: Event) -> None:
        """Enqueue `event`; it completes when the stream reaches it."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Hold all later work on this stream until `event` completes."""


@dataclass
class HostMemory:
    """A page-aligned host allocation (possibly pinned) that kvasync owns or borrows.

    `release` undoes pinning and frees the mapping; it is idempotent.
    """

    ptr: int
    nbytes: int
    array: np.ndarray
    pinned: bool
    _release: Callable[[], None] | None = None

    def __repr__(self) -> str:
        state = "released" if self._release is None else ("pinned" if self.pinned else "pageable")
        return f"<HostMemory {self.ptr:#x} {self.nbytes} B {state}>"

    def release(self) -> None:
        fn, self._release = self._release, None
        if fn is not None:
            self.array = np.zeros(0, dtype=np.uint8)  # drop our view before unmapping
            fn()


@dataclass(frozen=True)
class Overlap:
    """How a transfer may start before its lane predecessor ends (`Backend.may_overlap`):
    whatever it writes at its destination, and its end event, must follow `after` (the
    predecessor's end); the rest (reading its source, staging) may run ahead. `start` is
    recorded where its own data movement begins (its device time counts from there)."""

    after: Event
    start: Event


class Backend(ABC):
    """A device kvasync can move KV blocks to and from; one instance per offloader."""

    name: str = ""
    #: copy paths this backend can run, the first is its default
    paths: tuple[str, ...] = ()
    #: an awaiting task may poll a short transfer's events itself (hybrid completion): right
    #: where the copy runs off the host (a GPU); wrong where a host thread copies, which a
    #: spinning task would starve of the GIL
    poll_from_await: bool = False
    #: the copy path reads a plan's id arrays after `enqueue_copy` returned (a host stream
    #: thread does); False lets plans alias the caller's arrays instead of copying them
    reads_plan_later: bool = True

    @abstractmethod
    def check_device_array(self, info: ArrayInfo, what: str) -> None:
        """Raise InvalidTransferError if `info` is not memory this backend treats as device."""

    @abstractmethod
    def new_stream(self) -> Stream:
        """A fresh non-default stream (the core pools them)."""

    @abstractmethod
    def new_event(self, timing: bool = True) -> Event:
        """A fresh event (the core pools them); `timing=False` for pure ordering events."""

    @abstractmethod
    def compute_stream(self, override: Any | None) -> Stream | None:
        """The stream every transfer must first wait on (None: nothing to wait for).

        `override` is what the caller passed (a backend stream or a foreign stream object);
        None means the backend's notion of the current stream.
        """

    @abstractmethod
    def alloc_host(self, nbytes: int, row_bytes: int) -> HostMemory:
        """Host memory for `nbytes`, pinned where the backend can (registered in chunks that
        end on multiples of `row_bytes`)."""

    @abstractmethod
    def enqueue_copy(
        self, stream: Stream, plan: TransferPlan, direction: Direction, path: str
    ) -> None:
        """Enqueue the copies of `plan` on `stream` using copy path `path`."""

    def enqueue_pieces(
        self, stream: Stream, pieces: Sequence[TransferPlan], direction: Direction, path: str,
        marks: Sequence[Event] | None = None, edges: tuple[bool, bool] = (True, True),
    ) -> None:
        """Enqueue the pieces of one big transfer on `stream`, in order (one `enqueue_copy`
        each; a backend may share set-up between them, and the pieces may run in any order
        among themselves, as the copies of one batch do).

        `marks`, if given, has one event per piece: each is recorded where it completes only
        once its piece and every piece before it have landed (later is allowed, never
        earlier); a transfer's `progress()` reads them. `edges` (first, last): False where
        another call enqueues the transfer's earlier (later) pieces on `stream`, maybe from
        another thread (a lane hands a big load's later pieces to its launcher)."""
        for k, piece in enumerate(pieces):
            self.enqueue_copy(stream, piece, direction, path)
            if marks is not None:
                stream.record(marks[k])

    def may_overlap(self, path: str, direction: Direction, previous: str) -> bool:
        """Whether a transfer on `path` may be enqueued with `enqueue_overlapped` behind a
        predecessor of its lane on path `previous` that may not have ended: the backend
        then orders its writes after it. False: the lane makes the stream wait first."""
        return False

    def enqueue_overlapped(
        self, stream: Stream, pieces: Sequence[TransferPlan], direction: Direction, path: str,
        overlap: Overlap, marks: Sequence[Event] | None = None,
        edges: tuple[bool, bool] = (True, True),
    ) -> None:
        """`enqueue_pieces` (or `enqueue_copy` for one piece) where `may_overlap` said so:
        `stream` has not waited for `overlap.after`; the backend records `overlap.start`
        and keeps the `Overlap` rules. Always the transfer's first pieces (`edges[0]`)."""
        raise NotImplementedError(f"the {self.name} backend does not overlap transfers")

    def resolve_path(
        self, path: str, direction: Direction, plan: TransferPlan, host_pinned: bool,
        urgent: bool = False, other_busy: bool = False, layered: bool = False,
    ) -> str:
        """Map the caller's path choice (maybe "auto") to a concrete path for this plan.

        `host_pinned` is False when the host memory could not be pinned; a backend must then
        never pick a path that dereferences host memory from the device. `urgent`: the plan
        goes to an urgent lane, so "auto" should pick the path that passes queued work.
        `other_busy`: the other direction has transfers in flight (both share the link).
        `layered`: the plan is one layer of a layer-wise load (many small transfers, each
        signalling its layer: per-transfer host cost matters more than bandwidth).
        """
        return self.paths[0] if path == "auto" else path

    def compute_load(self) -> ComputeLoad | None:
        """A compute loop to time copies beside (`Offloader.calibrate`), not yet started;
        None where the backend has none."""
        return None

    def prefer(self, choice: Mapping[str, Preference]) -> None:
        """Make "auto" take `choice[direction]` where it covers a plan (`preferred`)."""
        self._preferences = dict(choice)

    def preference(self, direction: Direction) -> Preference | None:
        """What `prefer` left for `direction` (None: the backend's own rules)."""
        prefs: dict[str, Preference] | None = self.__dict__.get("_preferences")
        return prefs.get(direction) if prefs else None

    def pin_functions(
        self,
    ) -> tuple[Callable[[int, int], bool], Callable[[int], bool]] | None:
        """(register, unregister) for pinning borrowed host memory, or None if not needed."""
        return None

    def allocation_ids(self, infos: Sequence[ArrayInfo]) -> list[int]:
        """Which allocation each device array lies in (equal ids: one allocation), for the
        pitched path's runs: from the arrays themselves (`allocation_of`)."""
        return [allocation_of(info) for info in infos]

    def register_array(self, info: ArrayInfo) -> None:  # noqa: B027 - optional hook
        """Tell the backend this memory takes part in transfers (for bounds checks)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release streams, events and other device handles."""
