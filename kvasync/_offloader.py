"""The public offloader: a KV cache, its host copy, and awaitable stores and loads.

Data path of `store()` (and, mirrored, `load()`)::

    request ids --build_plan--> TransferPlan (descriptors) --backend copy path-->
    stream + events --completion thread--> Transfer completed --loop resolver--> await

Everything that can be wrong with a request is checked in `build_plan` before the direction
queue is touched, so a bad call raises and leaves no trace.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._arguments import (
    check_job_id,
    check_sizes,
    check_staging_bytes,
    chunks_for,
    host_chunks,
    ids_by_keyword,
    layer_spec,
    pick_backend,
)
from ._backends import Backend, Direction, HostMemory, Stream, load_backend
from ._completion import CompletionEngine
from ._errors import InvalidTransferError, OffloaderClosedError, TransferFailedError
from ._hostmem import row_offsets
from ._hostside import build_host_side
from ._layout import KVCacheLayout
from ._lifecycle import Lifecycle
from ._program import Ids, RefTable, TransferPlan, build_plan, split_plan
from ._scheduler import DirectionQueue
from ._stats import OffloaderStats, collect
from ._threadstate import completing_here, refuse_blocking_wait
from ._transfer import LayeredTransfer, Transfer

__all__ = ["Offloader"]

log = logging.getLogger("kvasync")


class Offloader:
    """Moves blocks of `layout` between its device tensors and a host copy.

    The host copy has `num_cpu_chunks` chunks per KV tensor; a chunk holds
    `blocks_per_chunk` blocks. Or give `cpu_bytes` instead: the host copy gets as many whole
    chunks as fit (rounded down; `cpu_bytes` below one chunk of every tensor is refused);
    `off.cpu_bytes` reports the bytes it uses. `store()` and `load()` return a `Transfer`
    that is already submitted; transfers of one direction run and complete in call order,
    the two directions are independent.

    The host copy is row-contiguous: one row per CPU chunk holding every KV tensor's
    `blocks_per_chunk` sub-blocks side by side (tensors ordered by KV-cache group), so the
    "staged" copy path moves whole rows; `cpu_tensors` are per-tensor (strided) views.
    `staging_bytes` sets the staged path's staging memory per direction. `host_tensors`
    (one caller-owned CPU array per KV tensor, rows of `blocks_per_chunk` pages; rows give
    `num_cpu_chunks` by default) replace the host copy: they stay the caller's, pinned by
    kvasync if need be and unpinned at close; the staged path needs rows and is not offered.

    `completion` picks how awaits learn of completions: "hybrid" (default) polls from the
    event loop near a transfer's predicted end, "thread" only wakes the loop from the
    completion thread (no polling at all; higher latency).

    Use it as ``async with Offloader(...) as off:`` or call `aclose()` / `close()`.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        num_cpu_chunks: int | None = None,
        blocks_per_chunk: int = 1,
        backend: str | Backend = "auto",
        *,
        cpu_bytes: int | None = None,
        copy_path: str = "auto",
        canonical: bool = False,
        host_region: Any | None = None,
        compute_stream: Any | None = None,
        max_streams: int = 4,
        completion: str = "hybrid",
        staging_bytes: int | None = None,
        host_tensors: Sequence[Any] | None = None,
    ) -> None:
        if not isinstance(layout, KVCacheLayout):
            raise InvalidTransferError(f"layout must be a KVCacheLayout, got {type(layout)}")
        num_cpu_chunks = host_chunks(host_tensors, host_region, num_cpu_chunks, cpu_bytes,
                                     copy_path)
        check_sizes(num_cpu_chunks, cpu_bytes, blocks_per_chunk, max_streams,
                    layout._guard.check)  # its tensors still own the memory the layout read
        self.layout = layout
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.canonical = bool(canonical)
        canon_sizes = layout.canonical_bytes_per_block() if self.canonical else None
        sizes = canon_sizes if canon_sizes is not None else [t.page for t in layout.tensors]
        row = row_offsets(layout, [s * self.blocks_per_chunk for s in sizes])[1]
        self.num_cpu_chunks = chunks_for(num_cpu_chunks, cpu_bytes, row, len(sizes),
                                         self.blocks_per_chunk)
        first = layout.tensors[0].info
        if isinstance(backend, Backend):
            self.backend = backend
        else:
            self.backend = load_backend(pick_backend(backend, layout.device),
                                        tensor_kind=first.kind, device_id=first.device_id)
        staging = check_staging_bytes(staging_bytes)
        if staging is not None and hasattr(self.backend, "staging_bytes"):
            self.backend.staging_bytes = int(staging)
        if copy_path != "auto" and copy_path not in self.backend.paths:
            raise InvalidTransferError(
                f"copy_path {copy_path!r} is not one of {('auto', *self.backend.paths)}"
            )
        self.copy_path = copy_path
        for i, t in enumerate(layout.tensors):
            self.backend.check_device_array(t.info, f"KV tensor {i}")
            self.backend.register_array(t.info)
        self._compute_override = compute_stream
        self.backend.compute_stream(compute_stream)  # validate early

        # host side: memory or region views, pinning, geometry, ref tables
        sub = canon_sizes if canon_sizes is not None else [t.page for t in layout.tensors]
        self._region = host_region
        host = build_host_side(layout, self.backend, sub, self.num_cpu_chunks,
                               self.blocks_per_chunk, self.canonical, host_region, host_tensors)
        self._host_mem: list[HostMemory] = host.memory
        self._cpu_views = host.views
        self._chunk_bytes = host.chunk_bytes
        self.host_pinned = host.pinned
        self._tables: dict[Direction, RefTable] = host.tables
        self._engine = CompletionEngine(completion)
        self._both_ways_at = -1e9  # perf_counter of the last submission that saw both busy
        lanes: list[tuple[Direction, bool]] = [
            ("d2h", False), ("h2d", False), ("d2h", True), ("h2d", True)
        ]
        self._queues: dict[tuple[Direction, bool], DirectionQueue] = {
            lane: DirectionQueue(self.backend, lane[0], self._engine, max_streams, lane[1])
            for lane in lanes
        }
        self._job_ids = itertools.count()
        self._submit_lock = threading.Lock()
        self._closed = False
        # what close() releases; it holds no reference back, so an offloader dropped
        # without close() is collected, and the finalizer releases the rest
        self._life = Lifecycle(list(self._queues.values()), self._engine, self.backend,
                               self._host_mem, self._cpu_views, host_region)
        weakref.finalize(self, self._life.collected, self._describe())

    # -- public API ---------------------------------------------------------------------------
    @property
    def cpu_tensors(self) -> list[np.ndarray]:
        """Host views, one per KV tensor: (num_cpu_chunks, cpu_page_bytes) uint8.

        Their memory is released by `close()`; a view still held after that keeps its pages
        mapped until it is collected, so it never dangles.
        """
        if self._closed:
            raise OffloaderClosedError("the offloader is closed; its host memory is released")
        return list(self._cpu_views)

    @property
    def staging_bytes(self) -> int:
        """Staging memory per direction of the "staged" copy path (split into buffers used
        round-robin, one slab each: four on CUDA, in device memory allocated at the path's
        first use; two on the host backend); 0 where the backend has no staged path."""
        return int(getattr(self.backend, "staging_bytes", 0))

    @property
    def cpu_bytes(self) -> int:
        """Bytes of the host copy: `num_cpu_chunks` chunks of every KV tensor."""
        return self.num_cpu_chunks * self._chunk_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        """True once a transfer failed; the failed direction refuses new transfers."""
        return any(q.failure is not None for q in self._queues.values())

    def stats(self) -> OffloaderStats:
        """A frozen snapshot of every lane's counters and timings by copy path, in flight and
        failed, with time percentiles (docs/metrics.md); O(1) per transfer to keep."""
        return collect(q.stats for q in self._queues.values())

    @ids_by_keyword("store(gpu_blocks=[...], cpu_chunks=[...])")
    def store(
        self,
        *,
        gpu_blocks: Ids,
        cpu_chunks: Ids,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
        job_id: int | None = None,
        stream: Any | None = None,
        path: str | None = None,
        urgent: bool = False,
    ) -> Transfer:
        """Copy GPU blocks into CPU chunks; returns the submitted Transfer (GPU -> host).

        Every argument is keyword-only: `store` and `load` take the same two id lists in
        opposite roles, so positional ids raise TypeError instead of copying the wrong blocks.
        `stream` overrides the compute stream to wait on; `path` the copy path. An `urgent`
        transfer runs in its direction's urgent lane: it is ordered after earlier urgent
        transfers (and the compute stream) but not after normal ones, so it is not stuck
        behind a large normal transfer; normal transfers stay FIFO among themselves.
        """
        return self._submit("d2h", gpu_blocks, cpu_chunks, group_sizes, block_indices,
                            job_id, stream, path, urgent)

    @ids_by_keyword("load(cpu_chunks=[...], gpu_blocks=[...])")
    def load(
        self,
        *,
        cpu_chunks: Ids,
        gpu_blocks: Ids,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
        job_id: int | None = None,
        stream: Any | None = None,
        path: str | None = None,
        urgent: bool = False,
    ) -> Transfer:
        """Copy CPU chunks into GPU blocks; returns the submitted Transfer (host -> GPU).

        Arguments as for `store`.
        """
        return self._submit("h2d", gpu_blocks, cpu_chunks, group_sizes, block_indices,
                            job_id, stream, path, urgent)

    @ids_by_keyword("load_layerwise(cpu_chunks=[...], gpu_blocks=[...])")
    def load_layerwise(
        self,
        *,
        cpu_chunks: Ids,
        gpu_blocks: Ids,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
        layers: Sequence[Sequence[int]] | None = None,
        job_id: int | None = None,
        stream: Any | None = None,
        path: str | None = None,
        urgent: bool = False,
    ) -> LayeredTransfer:
        """A load split per layer: each layer is awaitable and signals a device event.

        `layers` lists the tensor indices of each layer, in load order (default: one layer per
        tensor); together they must cover every tensor exactly once. `t.layers[i]` is the
        Transfer of layer i and `t.wait_layer(i, stream)` makes a compute stream wait (on the
        device, without blocking the host) until layer i has landed.
        """
        spec = layer_spec(layers, len(self.layout.tensors))
        if self._closed:
            raise OffloaderClosedError("the offloader is closed")
        self._path(path)
        self.layout._guard.check()
        plan = build_plan(self._tables["h2d"], gpu_blocks, cpu_chunks, group_sizes,
                          block_indices, False, self.num_cpu_chunks,
                          self.backend.reads_plan_later)
        parts = split_plan(plan, spec)
        check_job_id(job_id)  # both before an id is drawn: a refused call uses none
        stream = self.backend.compute_stream(
            stream if stream is not None else self._compute_override)  # once for every layer
        jid = job_id if job_id is not None else next(self._job_ids)
        signals = [self.backend.new_event(timing=False) for _ in parts]
        transfers = [
            self._enqueue("h2d", part, jid, stream, path, urgent, signal)
            for part, signal in zip(parts, signals)
        ]
        return LayeredTransfer(jid, transfers, signals, self.backend)

    def _path(self, path: str | None) -> str:
        """The copy path a call asked for (default: the offloader's), validated."""
        chosen = self.copy_path if path is None else path
        if chosen != "auto" and chosen not in self.backend.paths:
            raise InvalidTransferError(
                f"path {chosen!r} is not one of {('auto', *self.backend.paths)}"
            )
        return chosen

    def _submit(
        self,
        direction: Direction,
        gpu_blocks: Ids,
        cpu_chunks: Ids,
        group_sizes: Sequence[int] | None,
        block_indices: Sequence[int] | None,
        job_id: int | None,
        stream: Any | None,
        path: str | None,
        urgent: bool = False,
    ) -> Transfer:
        if self._closed:
            raise OffloaderClosedError("the offloader is closed")
        self.layout._guard.check()  # no copy into memory a tensor gave up (resize_, set_)
        plan = build_plan(
            self._tables[direction],
            gpu_blocks,
            cpu_chunks,
            group_sizes,
            block_indices,
            direction == "d2h",
            self.num_cpu_chunks,
            self.backend.reads_plan_later,
        )
        return self._enqueue(direction, plan, job_id, stream, path, urgent)

    def _enqueue(
        self,
        direction: Direction,
        plan: TransferPlan,
        job_id: int | None,
        stream: Any | None,
        path: str | None,
        urgent: bool = False,
        signal: Any | None = None,
    ) -> Transfer:
        chosen = self._path(path)
        check_job_id(job_id)
        compute: Stream | None = self.backend.compute_stream(
            stream if stream is not None else self._compute_override
        )
        concrete = self.backend.resolve_path(chosen, direction, plan, self.host_pinned,
                                             urgent=urgent, other_busy=self._both_ways(direction),
                                             layered=signal is not None)
        if self._closed:
            raise OffloaderClosedError("the offloader is closed")
        # only the job id is drawn under the offloader-wide lock; ordering within a lane is
        # the lane's own lock, so a big store never holds up a load's submission
        if job_id is None:
            with self._submit_lock:
                jid = next(self._job_ids)
        else:
            jid = job_id
        lane = (direction, bool(urgent))
        transfer = self._queues[lane].submit(plan, jid, concrete, compute, signal)
        return transfer

    #: seconds a sighting of both directions busy at once counts: a caller that submits a
    #: store and then a load, then waits for both, finds the other direction idle at every
    #: store and busy at every load (on the H200 that mix, kernel store + DMA load, was the
    #: worst pair: 50% of the bidirectional ceiling at 64 KiB, where DMA both ways made 61%)
    BOTH_WAYS_MEMORY = 0.1

    def _both_ways(self, direction: Direction) -> bool:
        """Whether the other direction has transfers in flight, or had at a submission in
        the last `BOTH_WAYS_MEMORY` seconds (its count is read without its lock: a hint)."""
        other = self._queues[("h2d" if direction == "d2h" else "d2h", False)]
        now = time.perf_counter()
        if other.inflight > 0:
            self._both_ways_at = now
            return True
        return now - self._both_ways_at < self.BOTH_WAYS_MEMORY

    # -- draining and closing ------------------------------------------------------------------
    async def drain(self) -> None:
        """Wait (without blocking the loop) until every submitted transfer finished.

        Failures are not raised here; they belong to the transfers that failed.
        """
        for last in [q.last_transfer for q in self._queues.values()]:
            if last is not None:
                try:
                    await last
                except TransferFailedError:
                    pass

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Block until every submitted transfer finished; False on timeout.

        Raises RuntimeError inside a done-callback that kvasync runs (the transfer being
        completed counts until its callbacks return, so this would wait for itself).
        """
        refuse_blocking_wait("drain_sync()")
        return all(q.drain(timeout) for q in self._queues.values())

    def close(self, timeout: float | None = None) -> None:
        """Refuse new work, drain both directions in order, then release threads, streams,
        events and host memory. Idempotent, and safe from any thread.

        Host memory is never released under a copy that may still touch it:

        - with `timeout`, a drain that does not finish in time raises TimeoutError; the
          release then happens when the last transfer in flight finishes (or in a later
          `close()`), and meanwhile nothing new is accepted;
        - interrupted (Ctrl-C), it leaves the same state; the next `close()` finishes;
        - inside a done-callback it does not wait: the release follows the last transfer.
        """
        self._closed = True
        self._life.close(timeout)

    async def aclose(self) -> None:
        """`drain()` then `close()`; new work is refused from the start. If the awaiting
        task is cancelled, the release still follows the last transfer in flight. Inside a
        done-callback (a loop run there) it is `close()`: it does not wait."""
        self._closed = True
        if completing_here():
            self.close()
            return
        self._life.begin()
        try:
            await self.drain()
        except BaseException:
            self._life.try_release()
            raise
        self.close()

    async def __aenter__(self) -> Offloader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _describe(self) -> str:
        return (
            f"kvasync.Offloader ({self.backend.name}, {len(self.layout.tensors)} tensors, "
            f"{self.num_cpu_chunks} chunks x {self.blocks_per_chunk} blocks)"
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<Offloader {self.backend.name} {len(self.layout.tensors)} tensors "
            f"{self.num_cpu_chunks} chunks x {self.blocks_per_chunk} blocks "
            f"({self.cpu_bytes} B host) {state}>"
        )

    def _resources(self) -> dict[str, int]:
        """Live threads, tasks and host bytes (for tests that count what close releases)."""
        return {
            "completion_threads": sum(q.thread_alive for q in self._queues.values()),
            "resolver_tasks": self._engine.num_tasks,
            "stream_threads": int(getattr(self.backend, "live_threads", 0)),
            "host_bytes": sum(m.nbytes for m in self._host_mem if m._release is not None),
            "inflight": sum(q.inflight for q in self._queues.values()),
        }
