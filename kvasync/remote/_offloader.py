"""`RemoteOffloader`: the offloader's store/load API with its host rows in a remote pool.

The same pieces as `Offloader`, wired to a `NixlBackend` instead of a local device: requests
are validated and planned by `build_plan` over a `RefTable` whose host side is the pool
region's rows (the row-contiguous layout of an offloader's own host copy), before anything
is enqueued; the four `DirectionQueue` lanes give per-direction FIFO order, urgent lanes and
failures on the transfer that caused them; results are the same `Transfer`/`TransferResult`.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from .._arguments import check_job_id, ids_by_keyword, layer_spec
from .._backends import Direction, Stream
from .._completion import CompletionEngine
from .._errors import (
    InvalidTransferError,
    OffloaderBrokenError,
    OffloaderClosedError,
)
from .._lanes import check_process, drain_queues, drain_queues_sync
from .._layered_transfer import LayeredTransfer, submit_layers
from .._layout import KVCacheLayout
from .._program import RefTable, TransferPlan, build_plan, split_plan
from .._scheduler import DirectionQueue
from .._threadstate import fork_generation, forked_since
from .._transfer import Transfer
from ._backend import NixlBackend
from ._rows import pool_row_bytes, pool_tables

__all__ = ["RemoteOffloader"]

Ids = Sequence[int] | np.ndarray


class RemoteOffloader:
    """Moves blocks of `layout` between its tensors and `num_cpu_chunks` chunk rows held by
    the `RemotePool` at `peer` ("HOST:PORT"), through NIXL.

    `store()` / `load()` take the arguments of `Offloader.store` / `load` and return a
    submitted `Transfer`; stores and loads are each FIFO, `urgent=True` uses the direction's
    urgent lane. A transfer that NIXL fails, that takes longer than `timeout` seconds, or
    that the pool's end interrupts fails with `TransferFailedError`, and its direction then
    refuses new work. The rows stay the pool's until `close()` (or this process's end).
    On the host the tensors are NumPy/CPU arrays (DRAM); torch CUDA tensors move as VRAM.
    Host transfers go through local staging buffers of `staging_bytes` in the pool's row
    layout, so NIXL moves runs of rows, not pages (one buffer per transfer running at once).
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        num_cpu_chunks: int,
        blocks_per_chunk: int = 1,
        *,
        peer: str | tuple[str, int],
        canonical: bool = False,
        compute_stream: Any | None = None,
        max_streams: int = 4,
        completion: str = "hybrid",
        timeout: float = 30.0,
        staging_bytes: int = 16 << 20,
    ) -> None:
        _check_arguments(layout, num_cpu_chunks, blocks_per_chunk, max_streams, staging_bytes,
                         timeout, completion)  # all before the pool gives us a region
        self.layout = layout
        self.num_cpu_chunks = int(num_cpu_chunks)
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.canonical = bool(canonical)
        first = layout.tensors[0].info
        if first.device not in ("cpu", "cuda"):
            raise InvalidTransferError(f"unsupported tensor device {first.device!r}")
        self.row_bytes = pool_row_bytes(layout, self.blocks_per_chunk, self.canonical)
        self.backend = NixlBackend(peer, self.num_cpu_chunks * self.row_bytes, 4096,
                                   device=first.device, device_id=first.device_id,
                                   timeout=float(timeout),
                                   # more than the region is never used (and 16 TiB of it
                                   # failed the first store, breaking its direction)
                                   staging_bytes=min(int(staging_bytes),
                                                     self.num_cpu_chunks * self.row_bytes))
        try:
            for i, t in enumerate(layout.tensors):
                self.backend.check_device_array(t.info, f"KV tensor {i}")
                self.backend.register_array(t.info)
            self._compute_override = compute_stream
            self.backend.compute_stream(compute_stream)  # validate early
            self._tables: dict[Direction, RefTable] = pool_tables(
                layout, self.num_cpu_chunks, self.blocks_per_chunk, self.canonical,
                self.backend.remote_base)
            self._engine = CompletionEngine(completion)
            lanes: list[tuple[Direction, bool]] = [("d2h", False), ("h2d", False),
                                                   ("d2h", True), ("h2d", True)]
            self._queues = {lane: DirectionQueue(self.backend, lane[0], self._engine,
                                                 max_streams, lane[1]) for lane in lanes}
        except BaseException:  # the pool's region, the link and its thread go back
            self.backend.close()
            raise
        self._job_ids = itertools.count()
        self._submit_lock = threading.Lock()
        self._closed = False
        # dropped unclosed: its threads stop and the pool gets its rows back (no reference
        # to self, so it can be collected at all)
        self._generation = fork_generation()
        self._finalizer = weakref.finalize(self, _collected, list(self._queues.values()),
                                           self._engine, self.backend, self._generation)

    # -- public API ---------------------------------------------------------------------------
    @property
    def peer(self) -> str:
        """The pool's control address."""
        return self.backend.peer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        """True once a transfer failed or the pool went away."""
        return (self.backend.peer_lost.is_set() and not self._closed) or any(
            q.failure is not None for q in self._queues.values())

    @ids_by_keyword("store(gpu_blocks=[...], cpu_chunks=[...])")
    def store(self, *, gpu_blocks: Ids, cpu_chunks: Ids,
              group_sizes: Sequence[int] | None = None,
              block_indices: Sequence[int] | None = None, job_id: int | None = None,
              stream: Any | None = None, urgent: bool = False) -> Transfer:
        """Copy blocks into the pool's chunk rows; returns the submitted Transfer.

        Arguments as for `Offloader.store`."""
        return self._submit("d2h", gpu_blocks, cpu_chunks, group_sizes, block_indices,
                            job_id, stream, urgent)

    @ids_by_keyword("load(cpu_chunks=[...], gpu_blocks=[...])")
    def load(self, *, cpu_chunks: Ids, gpu_blocks: Ids,
             group_sizes: Sequence[int] | None = None,
             block_indices: Sequence[int] | None = None, job_id: int | None = None,
             stream: Any | None = None, urgent: bool = False) -> Transfer:
        """Copy the pool's chunk rows into blocks; returns the submitted Transfer.

        Arguments as for `Offloader.load`."""
        return self._submit("h2d", gpu_blocks, cpu_chunks, group_sizes, block_indices,
                            job_id, stream, urgent)

    @ids_by_keyword("load_layerwise(cpu_chunks=[...], gpu_blocks=[...])")
    def load_layerwise(self, *, cpu_chunks: Ids, gpu_blocks: Ids,
                       group_sizes: Sequence[int] | None = None,
                       block_indices: Sequence[int] | None = None,
                       layers: Sequence[Sequence[int]] | None = None,
                       job_id: int | None = None, stream: Any | None = None,
                       urgent: bool = False) -> LayeredTransfer:
        """A load split per layer, as `Offloader.load_layerwise`: `t.layers[i]` is layer i's
        Transfer (layers land in order, one lane) and `t.wait_layer(i, stream)` makes a
        host compute stream (`HostStream`) wait until layer i has landed.

        A CUDA compute stream cannot wait on a remote layer (NIXL completes on the host, not
        as a device event): on CUDA tensors, unless `stream` (or the offloader's
        `compute_stream`) is a `HostStream`, this raises `InvalidTransferError` before
        anything is enqueued; await the layers instead, or use `load()`."""
        spec = layer_spec(layers, len(self.layout.tensors))
        if self._closed:
            raise OffloaderClosedError("the remote offloader is closed")
        check_process(self._generation)
        self.layout._guard.check()
        plan = build_plan(self._tables["h2d"], gpu_blocks, cpu_chunks, group_sizes,
                          block_indices, False, self.num_cpu_chunks, True)
        parts = split_plan(plan, spec)
        check_job_id(job_id)
        compute = self.backend.compute_stream(
            stream if stream is not None else self._compute_override)
        if not self.backend.can_signal(compute):
            raise InvalidTransferError(
                "load_layerwise: a CUDA compute stream cannot wait per layer on the remote "
                "tier (NIXL completes transfers on the host, with no device event to wait "
                "on); await t.layers[i] on the host, pass a kvasync HostStream as stream=, "
                "or use load()")
        if self.backend.peer_lost.is_set() and not self._closed:
            raise OffloaderBrokenError(self.backend.peer_error, job_id)
        if job_id is None:
            with self._submit_lock:
                job_id = next(self._job_ids)
        signals = [self.backend.new_event(timing=False) for _ in parts]
        queue = self._queues[("h2d", bool(urgent))]
        transfers, enqueued = submit_layers(
            [partial(queue.submit, part, job_id, "nixl", compute, signal)
             for part, signal in zip(parts, signals)],
            [part.nbytes for part in parts], job_id, self._engine)
        return LayeredTransfer(job_id, transfers, signals, self.backend, enqueued)

    def _submit(self, direction: Direction, gpu_blocks: Ids, cpu_chunks: Ids,
                group_sizes: Sequence[int] | None, block_indices: Sequence[int] | None,
                job_id: int | None, stream: Any | None, urgent: bool) -> Transfer:
        if self._closed:
            raise OffloaderClosedError("the remote offloader is closed")
        check_process(self._generation)  # a forked child: the link and threads are the parent's
        self.layout._guard.check()  # its tensors still own the memory the layout read
        plan = build_plan(self._tables[direction], gpu_blocks, cpu_chunks, group_sizes,
                          block_indices, direction == "d2h", self.num_cpu_chunks, True)
        return self._enqueue(direction, plan, job_id, stream, urgent)

    def _enqueue(self, direction: Direction, plan: TransferPlan, job_id: int | None,
                 stream: Any | None, urgent: bool = False) -> Transfer:
        check_job_id(job_id)
        compute: Stream | None = self.backend.compute_stream(
            stream if stream is not None else self._compute_override)
        if self.backend.peer_lost.is_set() and not self._closed:
            raise OffloaderBrokenError(self.backend.peer_error, job_id)
        if job_id is None:
            with self._submit_lock:
                job_id = next(self._job_ids)
        return self._queues[(direction, bool(urgent))].submit(plan, job_id, "nixl", compute)

    # -- draining and closing ------------------------------------------------------------------
    async def drain(self) -> None:
        """Wait until every submitted transfer finished (failures stay on their transfers)."""
        check_process(self._generation)  # a forked child: the parent's transfers never end here
        await drain_queues(self._queues.values())

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Block until every submitted transfer finished; False on timeout."""
        check_process(self._generation)
        return drain_queues_sync(self._queues.values(), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drain, stop threads, deregister the tensors and give the rows back to the pool.
        Idempotent and thread-safe; a pool that died does not make it hang (every transfer
        ends by the backend's timeout at the latest)."""
        if forked_since(self._generation):  # a forked child: the link and threads are the
            self._closed = True  # parent's, and so is any lock a parent thread held
            for q in self._queues.values():
                q.refuse_new(locked=False)
            return
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        queues = list(self._queues.values())
        for q in queues:
            q.refuse_new()
        deadline = None if timeout is None else time.monotonic() + timeout
        for q in queues:
            q.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for q in queues:
            q.request_stop()
        for q in queues:
            q.join_thread(timeout)
        self._engine.close()
        self.backend.close()
        for q in queues:
            q.forget_pools()

    async def aclose(self) -> None:
        if not forked_since(self._generation):
            await self.drain()
        self.close()

    async def __aenter__(self) -> RemoteOffloader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> RemoteOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<RemoteOffloader {self.peer} {len(self.layout.tensors)} tensors "
                f"{self.num_cpu_chunks} chunks x {self.blocks_per_chunk} blocks {state}>")

    def _resources(self) -> dict[str, int]:
        """Live threads and in-flight transfers (for tests that count what close releases)."""
        return {
            "completion_threads": sum(q.thread_alive for q in self._queues.values()),
            "resolver_tasks": self._engine.num_tasks,
            "stream_threads": self.backend.live_threads,
            "inflight": sum(q.inflight for q in self._queues.values()),
        }


def _check_arguments(layout: Any, num_cpu_chunks: Any, blocks_per_chunk: Any,
                     max_streams: Any, staging_bytes: Any, timeout: Any,
                     completion: Any) -> None:
    """InvalidTransferError for a constructor argument out of its domain."""
    if not isinstance(layout, KVCacheLayout):
        raise InvalidTransferError(f"layout must be a KVCacheLayout, got {type(layout)}")
    for name, value, low in (("num_cpu_chunks", num_cpu_chunks, 1),
                             ("blocks_per_chunk", blocks_per_chunk, 1),
                             ("max_streams", max_streams, 1),
                             ("staging_bytes", staging_bytes, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InvalidTransferError(f"{name} must be an int >= {low}, got {value!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidTransferError(f"timeout must be a number > 0, got {timeout!r}")
    if completion not in ("hybrid", "thread"):
        raise InvalidTransferError(f"completion must be 'hybrid' or 'thread', got {completion!r}")


#: seconds a collected offloader's release waits for a lock (it may run on a thread holding it)
_GC_LOCK_TIMEOUT = 1.0


def _collected(queues: list[DirectionQueue], engine: CompletionEngine,
               backend: NixlBackend, generation: int) -> None:
    """An unclosed RemoteOffloader was collected: refuse new work, stop its threads and,
    when nothing is in flight (else those transfers end by the backend's timeout and the
    pool frees the rows when the link drops), close the backend: the pool's rows go back.
    Nothing in a forked child, whose exit runs it too: the link is the parent's."""
    if forked_since(generation):
        return
    for q in queues:
        q.refuse_new(locked=False)
    for q in queues:
        q.request_stop(_GC_LOCK_TIMEOUT)
    engine.close(_GC_LOCK_TIMEOUT)
    if all(q.inflight == 0 for q in queues):
        backend.close()
    warnings.warn("unclosed kvasync RemoteOffloader: released by garbage collection; call "
                  "close() or use 'with' / 'async with'", ResourceWarning, stacklevel=1)
