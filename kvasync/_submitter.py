"""From a checked request to a transfer in its lane: the offloader's submission path.

`Submitter` holds what a submission reads (the layout, backend, ref tables, chunk count,
whether the host copy is pinned, the lanes) and the offloader's closed flag, checked before
the request is read and again just before the lane is touched. It builds the copy program
(`build_plan`: every error of a request raises here, before any lane sees it), picks the
concrete copy path, and submits; a layer-wise load becomes one transfer per layer. What the
offloader's caller may change between calls (its default path and compute stream, how long
a sighting of both directions busy counts) comes with each call; it holds no reference back
to the offloader.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from ._arguments import check_job_id
from ._backends import Backend, Direction, Stream
from ._errors import InvalidTransferError, OffloaderClosedError
from ._lanes import Lanes
from ._layered_transfer import LayeredTransfer, submit_layers
from ._layout import KVCacheLayout
from ._program import Ids, RefTable, TransferPlan, build_plan, split_plan
from ._transfer import Transfer

__all__ = ["Submitter"]


class Submitter:
    """Builds, routes and submits one offloader's transfers (see the module docstring)."""

    def __init__(self, layout: KVCacheLayout, backend: Backend,
                 tables: dict[Direction, RefTable], num_cpu_chunks: int, host_pinned: bool,
                 lanes: Lanes) -> None:
        self.layout = layout
        self.backend = backend
        self.tables = tables
        self.num_cpu_chunks = num_cpu_chunks
        self.host_pinned = host_pinned
        self.lanes = lanes
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise OffloaderClosedError("the offloader is closed")

    def path(self, chosen: str) -> str:
        """The copy path a call asked for (or the offloader's default), validated."""
        if chosen != "auto" and chosen not in self.backend.paths:
            raise InvalidTransferError(
                f"path {chosen!r} is not one of {('auto', *self.backend.paths)}"
            )
        return chosen

    def plan(self, direction: Direction, gpu_blocks: Ids, cpu_chunks: Ids,
             group_sizes: Sequence[int] | None, block_indices: Sequence[int] | None,
             path: str | None = None) -> TransferPlan:
        """The checked copy program of a request (with `path`: that path checked first)."""
        self.check_open()
        if path is not None:
            self.path(path)
        self.layout._guard.check()  # no copy into memory a tensor gave up (resize_, set_)
        return build_plan(self.tables[direction], gpu_blocks, cpu_chunks, group_sizes,
                          block_indices, direction == "d2h", self.num_cpu_chunks,
                          self.backend.reads_plan_later)

    def resolve(self, direction: Direction, plan: TransferPlan, path: str, urgent: bool,
                layered: bool, both_ways_memory: float) -> str:
        """The concrete copy path of `plan` by `path` ("auto": the backend picks, told if
        the other way is busy too); InvalidTransferError where `plan` cannot take it."""
        other_busy = self.lanes.both_ways(direction, both_ways_memory)
        return self.backend.resolve_path(self.path(path), direction, plan, self.host_pinned,
                                         urgent=urgent, other_busy=other_busy,
                                         layered=layered)

    def enqueue(self, direction: Direction, plan: TransferPlan, job_id: int | None,
                stream: Any | None, default_stream: Any | None, path: str, urgent: bool,
                signal: Any | None, both_ways_memory: float,
                concrete: str | None = None) -> Transfer:
        """Submit `plan` after `stream` (default: `default_stream`), the compute stream to
        wait on, by `path` (`resolve`), or by `concrete`, a path `resolve` gave."""
        if concrete is None:
            concrete = self.resolve(direction, plan, path, urgent, signal is not None,
                                    both_ways_memory)
        check_job_id(job_id)
        compute: Stream | None = self.backend.compute_stream(
            stream if stream is not None else default_stream)
        self.check_open()
        return self.lanes.submit(direction, urgent, plan, job_id, concrete, compute, signal)

    def load_layers(self, plan: TransferPlan, spec: list[list[int]], job_id: int | None,
                    stream: Any | None, default_stream: Any | None, path: str, urgent: bool,
                    both_ways_memory: float) -> LayeredTransfer:
        """One load per layer of `spec`, all with one job id, each signalling a device
        event when its layer has landed."""
        parts = split_plan(plan, spec)
        check_job_id(job_id)  # all before an id is drawn: a refused call uses none
        # every layer's path before any is enqueued: a layer that cannot take it (a staged
        # layer wider than a staging buffer) refuses the call with nothing enqueued
        paths = [self.resolve("h2d", part, path, urgent, True, both_ways_memory)
                 for part in parts]
        compute = self.backend.compute_stream(
            stream if stream is not None else default_stream)  # once for every layer
        jid = job_id if job_id is not None else next(self.lanes.job_ids)
        signals = [self.backend.new_event(timing=False) for _ in parts]
        transfers, enqueued = submit_layers(
            [partial(self.enqueue, "h2d", part, jid, compute, default_stream, path, urgent,
                     signal, both_ways_memory, concrete)
             for part, signal, concrete in zip(parts, signals, paths)],
            [part.nbytes for part in parts], jid, self.lanes.engine)
        return LayeredTransfer(jid, transfers, signals, self.backend, enqueued)
