"""The CUDA "kernel" copy path: a few CTAs load and store pinned, mapped host memory.

Facts this path is built on (H200, docs/benchmarks; the kernels are in `_cuda_kernels`):

- SM loads and stores reach host memory that is pinned and mapped (`cudaHostRegister`
  with the mapped flag, UVA) over PCIe; they need no per-block driver work, so a few CTAs
  with one warp per block reach the link at every page size. 4 to 132 CTAs of 512
  threads all give the same GB/s at 4 KiB and 64 KiB (the link is the limit);
  `DEFAULT_GRID` = 16 keeps the SM footprint, and the slowdown of concurrent compute,
  small;
- the GPU must never dereference pageable memory (it would poison the context): the
  backend only picks this path where the host side is registered;
- plans built by the offloader use the table kernel (addresses computed on the GPU from
  slot ids and a static per-direction `RefTable` uploaded once, host work O(blocks));
  raw descriptor plans use the flat one (host work O(descriptors)).

Driver calls per `enqueue`: one `cudaMemcpyAsync` of the job (from a pinned staging
buffer, reused through `StagingPool`) and one `cuLaunchKernel`; the first use of a table
adds one `cudaMemcpyAsync` of the table and one `cudaEventRecord`, and a later user on
another stream one `cudaEventQuery` or `cudaStreamWaitEvent` until the upload is done.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._base import Direction
from ._cuda_device import CudaEvent, CudaStream, create_event
from ._cuda_kernels import CopyKernels, PackedTable, pack_job, pack_table, split_descriptors
from ._cudart import cupy

if TYPE_CHECKING:
    from .._program import RefTable, TransferPlan

__all__ = ["DEFAULT_GRID", "KernelPath", "StagingPool", "TableCache"]

#: CTAs of the copy kernels (of 512 threads each); see the module docstring
DEFAULT_GRID = 16
_H2D = 1  # cudaMemcpyHostToDevice


# -- staging buffers ----------------------------------------------------------------------------
class _Staging:
    """A pinned host buffer and a device buffer of one size class, returned to the pool
    when the last reference (the plan's keepalive) goes."""

    __slots__ = ("dev", "dev_ptr", "host", "host_ptr", "pool", "size", "words")

    def __init__(self, pool: StagingPool, size: int, host: Any, dev: Any,
                 words: np.ndarray) -> None:
        self.pool: StagingPool | None = pool
        self.size = size
        self.host = host
        self.dev = dev
        self.host_ptr = int(host.ptr)
        self.dev_ptr = int(dev.ptr)
        self.words = words

    def __del__(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            try:
                pool.give(self)
            except Exception:
                pass


class StagingPool:
    """Descriptor staging in power-of-two size classes (>= 4 KiB), reused across transfers.

    A buffer is taken at submission and attached to the plan's keepalive; the core drops
    the plan only after the transfer's end event completed, so reuse is never early.
    """

    def __init__(self, device_id: int, keep_per_class: int = 8) -> None:
        self._device_id = device_id
        self._free: dict[int, list[tuple[Any, Any, np.ndarray]]] = {}
        # reentrant: `_Staging.__del__` gives back, and the cyclic collector may run it on a
        # thread inside `give` or `take` (a failed enqueue's traceback holds a buffer)
        self._lock = threading.RLock()
        self._keep = keep_per_class
        self.closed = False

    def take(self, nwords: int) -> _Staging:
        """A buffer pair of at least `nwords` 8-byte words; a new size class wraps
        `cudaHostAlloc` and `cudaMalloc` (through CuPy's pools; may block in the driver)."""
        size = max(4096, 1 << max(int(nwords * 8) - 1, 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            pair = free.pop() if free else None
        if pair is None:
            cp = cupy()
            with cp.cuda.Device(self._device_id):
                host = cp.cuda.alloc_pinned_memory(size)
                pair = (host, cp.cuda.alloc(size),
                        np.frombuffer(host, dtype=np.uint64, count=size // 8))
        return _Staging(self, size, *pair)

    def give(self, st: _Staging) -> None:
        with self._lock:
            if self.closed:
                return
            free = self._free.setdefault(st.size, [])
            if len(free) < self._keep:
                free.append((st.host, st.dev, st.words))

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._free.clear()


# -- device tables ------------------------------------------------------------------------------
@dataclass
class _TableEntry:
    """A RefTable uploaded to the device for the table kernel."""

    table: RefTable
    packed: PackedTable
    dev: Any
    rows_addr: int
    frags_addr: int
    ready: CudaEvent | None
    stream_ptr: int
    #: piece count per refs array (pack_job's cache)
    pieces: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)


class TableCache:
    """Device copies of RefTables (the last `SIZE`, by identity), shared by the kernel and
    staged paths; `entries` is the cache itself (tests read it)."""

    #: a layer-wise staged load uses one staging table per (layer, staging buffer): 128
    #: for 32 layers and four buffers, which must all stay cached across loads
    SIZE = 256

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self.entries: OrderedDict[int, _TableEntry] = OrderedDict()
        self._lock = threading.Lock()

    def entry(self, table: RefTable, stream: CudaStream, keepalive: list[Any]) -> _TableEntry:
        """The device copy of `table`, uploaded on `stream` at first use (static per
        direction); later users on other streams wait for the upload once."""
        with self._lock:
            return self._entry_locked(table, stream, keepalive)

    def _entry_locked(self, table: RefTable, stream: CudaStream, keepalive: list[Any]
                      ) -> _TableEntry:
        entry = self.entries.get(id(table))
        if entry is None or entry.table is not table:
            cp = cupy()
            packed = pack_table(table)
            words = np.concatenate([packed.rows, packed.frags])
            nbytes = max(len(words) * 8, 8)
            dev = cp.cuda.alloc(nbytes)
            host = cp.cuda.alloc_pinned_memory(nbytes)
            np.frombuffer(host, dtype=np.uint64, count=len(words))[:] = words
            ready = create_event(self.device_id, timing=False)  # before the copy: no raise
            keepalive += [host, dev]  # after it could free `dev` under the queued upload
            cp.cuda.runtime.memcpyAsync(int(dev.ptr), int(host.ptr), len(words) * 8, _H2D,
                                        stream.ptr)
            stream.record(ready)
            assert isinstance(ready, CudaEvent)
            entry = _TableEntry(table, packed, dev, int(dev.ptr),
                                int(dev.ptr) + len(packed.rows) * 8, ready, stream.ptr)
            self.entries[id(table)] = entry
            while len(self.entries) > self.SIZE:
                self.entries.popitem(last=False)
        elif entry.ready is not None and entry.stream_ptr != stream.ptr:
            if entry.ready.query():
                entry.ready = None
            else:
                stream.wait_event(entry.ready)
        keepalive.append(entry)  # in flight it outlives a cache eviction
        return entry

    def clear(self) -> None:
        self.entries.clear()


# -- the path -----------------------------------------------------------------------------------
class KernelPath:
    """Enqueues plans as copy-kernel launches (`copy`); the kernels compile at warm-up."""

    def __init__(self, kernels: CopyKernels, staging: StagingPool, tables: TableCache) -> None:
        self.kernels = kernels
        self.staging = staging
        self.tables = tables

    def copy(self, stream: CudaStream, plan: TransferPlan, direction: Direction,
             grid: int) -> None:
        """Launch the table kernel (plans) or the flat one (raw descriptors) on `stream`
        with `grid` CTAs; returns without waiting."""
        rt = cupy().cuda.runtime
        if plan.segments and plan._flat is None and self.table_kernel_fits(plan):
            entry = self.tables.entry(plan.table, stream, plan.keepalive)
            staged: list[_Staging] = []

            def alloc(nwords: int) -> np.ndarray:
                staged.append(self.staging.take(nwords))
                return staged[0].words

            job = pack_job(plan.segments, entry.packed.pieces, alloc, entry.pieces)
            st = staged[0]
            plan.keepalive.append(st)
            if job.total_units == 0:
                return
            if job.fits_32:  # else a segment's unit index would wrap: the flat kernel
                rt.memcpyAsync(st.dev_ptr, st.host_ptr, len(job.words) * 8, _H2D, stream.ptr)
                self.kernels.launch_table(stream.owner, entry.rows_addr, entry.frags_addr,
                                          entry.packed, st.dev_ptr, job, grid)
                return
        src, dst, sizes = split_descriptors(*plan.flat())
        n = len(sizes)
        st = self.staging.take(3 * n)
        st.words[:n] = src
        st.words[n : 2 * n] = dst
        st.words[2 * n : 3 * n] = sizes
        plan.keepalive.append(st)
        rt.memcpyAsync(st.dev_ptr, st.host_ptr, 3 * n * 8, _H2D, stream.ptr)
        self.kernels.launch_flat(stream.owner, st.dev_ptr, n, grid)

    @staticmethod
    def table_kernel_fits(plan: TransferPlan) -> bool:
        """The table kernel indexes slots and units with 32 bits (else: the flat kernel;
        a plan that passes may still have a segment of too many units: `Job.fits_32`)."""
        return plan.table.slots_fit_32 and plan.nbytes // 1024 + plan.num_descriptors < 1 << 31
