"""The offloader's four lanes (each direction, normal and urgent) and its job ids.

`Lanes` holds one `DirectionQueue` per lane, the counter that draws job ids (under the only
offloader-wide lock) and the last sighting of both directions busy at once, which the copy
path choice reads. It waits for the lanes (`drain`) and counts what they hold; it holds no
reference back to the offloader.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from typing import Any

from ._backends import Backend, Direction, Stream
from ._completion import CompletionEngine
from ._errors import OffloaderBrokenError, TransferFailedError
from ._program import TransferPlan
from ._scheduler import DirectionQueue
from ._threadstate import fork_generation, forked_since
from ._transfer import Transfer

__all__ = ["Lane", "Lanes", "drain_queues", "drain_queues_sync"]

#: a lane: its direction, and whether it is the urgent one
Lane = tuple[Direction, bool]


class Lanes:
    """The four `DirectionQueue`s of one offloader, its job-id counter and submit lock."""

    def __init__(self, backend: Backend, engine: CompletionEngine, max_streams: int) -> None:
        order: list[Lane] = [("d2h", False), ("h2d", False), ("d2h", True), ("h2d", True)]
        self.queues: dict[Lane, DirectionQueue] = {
            lane: DirectionQueue(backend, lane[0], engine, max_streams, lane[1])
            for lane in order
        }
        self.engine = engine  # the transfers' completion engine (a refused layer's too)
        self.job_ids = itertools.count()
        self.submit_lock = threading.Lock()
        self.generation = fork_generation()  # a forked child cannot use these lanes
        self.both_ways_at = -1e9  # perf_counter of the last submission that saw both busy

    def submit(
        self,
        direction: Direction,
        urgent: bool,
        plan: TransferPlan,
        job_id: int | None,
        concrete: str,
        compute: Stream | None,
        signal: Any | None = None,
    ) -> Transfer:
        """Submit `plan` in its lane, drawing a job id if none was given."""
        # only the job id is drawn under the offloader-wide lock; ordering within a lane is
        # the lane's own lock, so a big store never holds up a load's submission
        check_process(self.generation)
        if job_id is None:
            with self.submit_lock:
                jid = next(self.job_ids)
        else:
            jid = job_id
        lane = (direction, bool(urgent))
        return self.queues[lane].submit(plan, jid, concrete, compute, signal)

    def both_ways(self, direction: Direction, memory: float) -> bool:
        """Whether the other direction has transfers in flight, or had at a submission in
        the last `memory` seconds (its count is read without its lock: a hint)."""
        other = self.queues[("h2d" if direction == "d2h" else "d2h", False)]
        now = time.perf_counter()
        if other.inflight > 0:
            self.both_ways_at = now
            return True
        return now - self.both_ways_at < memory

    @property
    def broken(self) -> bool:
        """True once a transfer of any lane failed."""
        return any(q.failure is not None for q in self.queues.values())

    async def drain(self) -> None:
        """Wait until each lane's last transfer finished; failures are not raised here."""
        check_process(self.generation)
        await drain_queues(self.queues.values())

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Block until every lane is idle; False on timeout."""
        check_process(self.generation)
        return drain_queues_sync(self.queues.values(), timeout)


async def drain_queues(queues: Iterable[DirectionQueue]) -> None:
    """Wait (without blocking the loop) until each queue's last transfer finished; its
    failure stays on it."""
    for last in [q.last_transfer for q in queues]:
        if last is not None:
            try:
                await last
            except TransferFailedError:
                pass


def drain_queues_sync(queues: Iterable[DirectionQueue], timeout: float | None = None) -> bool:
    """Block until every queue is idle; False on timeout (each queue waits up to it)."""
    return all(q.drain(timeout) for q in queues)


def check_process(generation: int) -> None:
    """OffloaderBrokenError in a forked child of the process that built the lanes: their
    transfers would wait forever for threads that stayed in the parent."""
    if forked_since(generation):
        raise OffloaderBrokenError(
            "this Offloader was built before a fork; its threads, streams and device context "
            "stayed in the parent process: build a new Offloader in this process"
        )
