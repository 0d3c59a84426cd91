"""The public offloader: a KV cache, its host copy, and awaitable stores and loads.

Data path of `store()` (and, mirrored, `load()`)::

    request ids --build_plan--> TransferPlan (descriptors) --backend copy path-->
    stream + events --completion thread--> Transfer completed --loop resolver--> await

Everything that can be wrong with a request is checked in `build_plan` before the direction
queue is touched, so a bad call raises and leaves no trace.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._arguments import check_timeout, ids_by_keyword, layer_spec
from ._backends import Backend, Direction, HostMemory
from ._calibrate import AutoCalibration, calibrate_offloader
from ._completion import CompletionEngine
from ._errors import OffloaderClosedError
from ._hostside import build_host_side
from ._lanes import Lanes
from ._layered_transfer import LayeredTransfer
from ._layout import KVCacheLayout
from ._lifecycle import Lifecycle
from ._offloader_setup import host_geometry, open_backend
from ._program import Ids, RefTable, TransferPlan
from ._stats import OffloaderStats, collect
from ._submitter import Submitter
from ._threadstate import refuse_blocking_wait
from ._transfer import Transfer

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
    `staging_bytes` sets the staged path's staging memory per direction (CUDA default
    64 MiB): beside a model whose kernels hold every SM, the copy engines run ahead of the
    packs only as far as it reaches (docs/performance.md), so more keeps the link busier
    there. `host_tensors`
    (one caller-owned CPU array per KV tensor, rows of `blocks_per_chunk` pages; rows give
    `num_cpu_chunks` by default) replace the host copy: they stay the caller's, pinned by
    kvasync if need be and unpinned at close; the staged path needs rows and is not offered.

    `completion` picks how awaits learn of completions: "hybrid" (default) polls from the
    event loop near a transfer's predicted end, "thread" only wakes the loop from the
    completion thread (no polling at all; higher latency).

    Use it as ``async with Offloader(...) as off:`` or call `aclose()` / `close()`.
    """

    def __init__(
        self, layout: KVCacheLayout, num_cpu_chunks: int | None = None,
        blocks_per_chunk: int = 1, backend: str | Backend = "auto", *,
        cpu_bytes: int | None = None, copy_path: str = "auto", canonical: bool = False,
        host_region: Any | None = None, compute_stream: Any | None = None,
        max_streams: int = 4, completion: str = "hybrid", staging_bytes: int | None = None,
        host_tensors: Sequence[Any] | None = None,
    ) -> None:
        sub, self.num_cpu_chunks = host_geometry(
            layout, num_cpu_chunks, blocks_per_chunk, cpu_bytes, bool(canonical), max_streams,
            copy_path, host_region, host_tensors)
        self.layout = layout
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.canonical = bool(canonical)
        self.backend = open_backend(layout, backend, staging_bytes, copy_path, compute_stream)
        self.copy_path = copy_path
        self._compute_override = compute_stream

        # host side: memory or region views, pinning, geometry, ref tables
        self._region = host_region
        host = build_host_side(layout, self.backend, sub, self.num_cpu_chunks,
                               self.blocks_per_chunk, self.canonical, host_region, host_tensors)
        self._host_mem: list[HostMemory] = host.memory
        self._cpu_views = host.views
        self._chunk_bytes = host.chunk_bytes
        self.host_pinned = host.pinned
        self._tables: dict[Direction, RefTable] = host.tables
        self._engine = CompletionEngine(completion)
        self._lanes = Lanes(self.backend, self._engine, max_streams)
        self._queues = self._lanes.queues
        self._submitter = Submitter(layout, self.backend, self._tables, self.num_cpu_chunks,
                                    self.host_pinned, self._lanes)
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
        if self._submitter.closed:
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
        return self._submitter.closed

    @property
    def broken(self) -> bool:
        """True once a transfer failed; the failed direction refuses new transfers."""
        return self._lanes.broken

    def stats(self) -> OffloaderStats:
        """A frozen snapshot of every lane's counters and timings by copy path, in flight and
        failed, with time percentiles (docs/metrics.md); O(1) per transfer to keep."""
        return collect(q.stats for q in self._queues.values())

    @ids_by_keyword("store(gpu_blocks=[...], cpu_chunks=[...])")
    def store(
        self, *, gpu_blocks: Ids, cpu_chunks: Ids, group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None, job_id: int | None = None,
        stream: Any | None = None, path: str | None = None, urgent: bool = False,
    ) -> Transfer:
        """Copy GPU blocks into CPU chunks; returns the submitted Transfer (GPU -> host).

        Every argument is keyword-only: `store` and `load` take the same two id lists in
        opposite roles, so positional ids raise TypeError instead of copying the wrong blocks.
        `stream` overrides the compute stream to wait on; `path` the copy path. An `urgent`
        transfer runs in its direction's urgent lane: it is ordered after earlier urgent
        transfers (and the compute stream) but not after normal ones, so it is not stuck
        behind a large normal transfer; normal transfers stay FIFO among themselves.
        """
        plan = self._submitter.plan("d2h", gpu_blocks, cpu_chunks, group_sizes, block_indices)
        return self._enqueue("d2h", plan, job_id, stream, path, urgent)

    @ids_by_keyword("load(cpu_chunks=[...], gpu_blocks=[...])")
    def load(
        self, *, cpu_chunks: Ids, gpu_blocks: Ids, group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None, job_id: int | None = None,
        stream: Any | None = None, path: str | None = None, urgent: bool = False,
    ) -> Transfer:
        """Copy CPU chunks into GPU blocks; returns the submitted Transfer (host -> GPU).

        Arguments as for `store`.
        """
        plan = self._submitter.plan("h2d", gpu_blocks, cpu_chunks, group_sizes, block_indices)
        return self._enqueue("h2d", plan, job_id, stream, path, urgent)

    @ids_by_keyword("load_layerwise(cpu_chunks=[...], gpu_blocks=[...])")
    def load_layerwise(
        self, *, cpu_chunks: Ids, gpu_blocks: Ids, group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
        layers: Sequence[Sequence[int]] | None = None, job_id: int | None = None,
        stream: Any | None = None, path: str | None = None, urgent: bool = False,
    ) -> LayeredTransfer:
        """A load split per layer: each layer is awaitable and signals a device event.

        `layers` lists the tensor indices of each layer, in load order (default: one layer per
        tensor); together they must cover every tensor exactly once. `t.layers[i]` is the
        Transfer of layer i and `t.wait_layer(i, stream)` makes a compute stream wait (on the
        device, without blocking the host) until layer i has landed.
        """
        spec = layer_spec(layers, len(self.layout.tensors))
        chosen = self.copy_path if path is None else path
        plan = self._submitter.plan("h2d", gpu_blocks, cpu_chunks, group_sizes, block_indices,
                                    chosen)
        return self._submitter.load_layers(plan, spec, job_id, stream, self._compute_override,
                                           chosen, urgent, self.BOTH_WAYS_MEMORY)

    def _enqueue(self, direction: Direction, plan: TransferPlan, job_id: int | None,
                 stream: Any | None, path: str | None, urgent: bool = False,
                 signal: Any | None = None) -> Transfer:
        return self._submitter.enqueue(direction, plan, job_id, stream, self._compute_override,
                                       self.copy_path if path is None else path, urgent,
                                       signal, self.BOTH_WAYS_MEMORY)

    #: seconds a sighting of both directions busy at once counts: a caller that submits a
    #: store and then a load, then waits for both, finds the other direction idle at every
    #: store and busy at every load (on the H200 that mix, kernel store + DMA load, was the
    #: worst pair: 50% of the bidirectional ceiling at 64 KiB, where DMA both ways made 61%)
    BOTH_WAYS_MEMORY = 0.1

    def calibrate(self, *, seconds: float = 0.4, keep: float = 0.97,
                  apply: bool = True) -> AutoCalibration:
        """Time each copy path alone and beside a compute loop (GPU matmuls; NumPy ones on
        the host backend) on scratch memory shaped like this layout, and (`apply`) make
        "auto" prefer, per direction, the path moving the most beside it among those keeping
        `keep` of its rate (the full rule: docs/design.md). Blocks a few seconds; the KV
        cache and host copy are not touched. `seconds`: each window (`_calibrate`)."""
        self._submitter.check_open()
        return calibrate_offloader(self, type(self), seconds, keep, bool(apply))

    # -- draining and closing ------------------------------------------------------------------
    async def drain(self) -> None:
        """Wait (without blocking the loop) until every submitted transfer finished.

        Failures are not raised here; they belong to the transfers that failed.
        """
        await self._lanes.drain()

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Block until every submitted transfer finished; False on timeout.

        Raises RuntimeError inside a done-callback that kvasync runs (the transfer being
        completed counts until its callbacks return, so this would wait for itself).
        """
        refuse_blocking_wait("drain_sync()")
        return self._lanes.drain_sync(timeout)

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
        timeout = check_timeout(timeout)
        self._submitter.closed = True
        self._life.close(timeout)

    async def aclose(self) -> None:
        """`drain()` then `close()`; new work is refused from the start. If the awaiting
        task is cancelled, the release still follows the last transfer in flight. Inside a
        done-callback (a loop run there) it is `close()`: it does not wait."""
        self._submitter.closed = True
        await self._life.aclose(self.drain)

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
        state = "closed" if self._submitter.closed else "open"
        return (
            f"<Offloader {self.backend.name} {len(self.layout.tensors)} tensors "
            f"{self.num_cpu_chunks} chunks x {self.blocks_per_chunk} blocks "
            f"({self.cpu_bytes} B host) {state}>"
        )

    def _resources(self) -> dict[str, int]:
        """Live threads, tasks and host bytes (for tests that count what close releases)."""
        return self._life.resources()
