"""The CUDA "staged" copy path: a pack/unpack kernel on the device, copy engines for rows.

Facts this path is built on (H200, ../shared/probes/staged_rows.py and the bench):

- the copy engines reach the link's ceiling only with long descriptors; scattered 4-16 KiB
  pages cost ~1 us of driver time each. With row-contiguous host memory the host side of
  a transfer is a few long runs (`_staged.StagedProgram`), one descriptor each;
- a kernel gathers scattered device pages into a contiguous device buffer at HBM speed
  (terabytes per second), so it is busy for a few percent of the link time and leaves the
  SMs to the model, where an SM copy straight over PCIe holds its CTAs for the whole
  transfer (a direct warp kernel cut a concurrent matmul to 44% during stores);
- the copy engines ignore stream priorities and run queued DMA in order, so pack and DMA
  overlap only across streams: slabs go round-robin through the staging buffers (four by
  default), the kernel runs on the transfer's stream, the DMA on a helper stream, and
  events hand each buffer back and forth;
- with only two buffers, 4 KiB loads beside a bf16 matmul moved 56% of the link: the
  matmul's kernels hold the SMs, an unpack starts late, and the next DMA into its buffer
  waits for it. More buffers let the copy engines run ahead. Borrowing the idle direction's
  buffers raised the link share there but made that direction's next transfer wait on the
  device for the borrower's enqueued slabs (docs/performance.md), so each direction keeps
  its own.

Per piece, one move of every slab's kernel job to the device: a store's is fetched by the
flat copy kernel from pinned memory (a copy-engine upload would queue behind the loads'
row copies, and every slab of a store+load at once waited for it); a load's is copied on
the helper stream ahead of its row copies (a kernel there would hold the first row copy
until a model's kernel frees the SMs); per slab one kernel launch
(the table kernel over a staging `RefTable` of its buffer), one DMA call
(`cudaMemcpyAsync` for one run, else one `cuMemcpyBatchAsync`) and four event calls.
Host work does not grow with the number of KV tensors.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from .._errors import InvalidTransferError, TransferFailedError
from .._program import StagedProgram, TransferPlan, prepare_staged, slab_descriptors, staging_table
from . import _cudart
from ._base import Direction, Event, Overlap
from ._cuda_device import CudaEvent, CudaStream, create_event
from ._cuda_kernel import StagingPool, TableCache
from ._cuda_kernels import CopyKernels, pack_job
from ._cudart import cupy

if TYPE_CHECKING:
    from ._cuda_device import CudaDevice
    from ._cuda_kernel import _Staging

__all__ = ["StagedPath", "StagingRing"]

_H2D = 1  # cudaMemcpyHostToDevice


class StagingRing:
    """The device staging buffers of one direction (used round-robin), a helper stream for
    its DMA, and per buffer a `ready` event (packed, or landed) and a `free` event (its last
    reader done). More than two buffers let the copy engines run ahead of a pack or unpack
    that a busy GPU schedules late (a model's kernels hold the SMs).

    Owned by the backend; the buffers are freed when the ring is collected (in-flight
    transfers hold it through their plan's keepalive).
    """

    def __init__(self, backend: CudaDevice, slab_bytes: int, count: int = 2) -> None:
        cp = cupy()
        self.slab_bytes = int(slab_bytes)
        with cp.cuda.Device(backend.device_id):
            self.buffers = [cp.cuda.alloc(self.slab_bytes) for _ in range(count)]
        self.ptrs = [int(b.ptr) for b in self.buffers]
        helper = backend.new_stream()
        self.helper: CudaStream = helper  # type: ignore[assignment]
        self.ready: list[CudaEvent] = [backend.new_event(timing=False)  # type: ignore[misc]
                                       for _ in range(count)]
        self.free: list[CudaEvent] = [backend.new_event(timing=False)  # type: ignore[misc]
                                      for _ in range(count)]
        self.next = 0
        #: one transfer at a time enqueues on the ring (lanes may submit concurrently)
        self.lock = threading.Lock()


#: up to this many runs, one cudaMemcpyAsync each; more go in one batch call, which the
#: copy engines run back to back: 4 runs of 4 MiB (64 KiB pages x 64 tensors) as separate
#: copies kept the engines 0.96-0.97 busy, as one batch 0.98 (H200, 1 GiB transfers)
EACH_RUNS = 1
#: bytes of job words one warp of the flat kernel fetches from pinned memory
FETCH_BYTES = 2048


class StagedPath:
    """Enqueues staged programs (`enqueue`) with the pieces it shares with the kernel path
    (the copy kernels, the device table cache, the job staging pool)."""

    def __init__(self, device_id: int, kernels: CopyKernels, tables: TableCache,
                 staging: StagingPool) -> None:
        self.device_id = device_id
        self.kernels = kernels
        self.tables = tables
        self.staging = staging
        #: the staging ring per direction, allocated at first use (`ring`)
        self.rings: dict[str, StagingRing] = {}
        self._ring_lock = threading.Lock()

    def ring(self, direction: str, device: CudaDevice, staging_bytes: int,
             buffers: int) -> StagingRing:
        """The staging ring of `direction`, allocated on `device` at first use (in
        max(`buffers`, 2) buffers of `staging_bytes` / that count; InvalidTransferError
        where the device cannot give that much); later calls return it whatever they pass."""
        ring = self.rings.get(direction)
        if ring is not None:
            return ring
        with self._ring_lock:
            ring = self.rings.get(direction)
            if ring is None:
                n = max(int(buffers), 2)
                try:
                    ring = StagingRing(device, max(int(staging_bytes) // n, 1), n)
                except (MemoryError, OverflowError, ValueError) as exc:  # CuPy's OOM too
                    raise InvalidTransferError(
                        f"cannot allocate the staged path's staging_bytes={staging_bytes} "
                        f"per direction on the device: {exc}") from exc
                self.rings[direction] = ring
            return ring

    def close(self) -> None:
        self.rings.clear()

    def enqueue(self, ring: StagingRing, stream: CudaStream, plan: TransferPlan,
                direction: Direction, grid: int, batch: _cudart.BatchCopier | None,
                edges: tuple[bool, bool] = (True, True), mark: Event | None = None,
                overlap: Overlap | None = None) -> None:
        """Enqueue `plan`'s staged program on `stream` (kernel side) and the ring's helper
        stream (copy engines); when `stream` reaches its next event, every slab has landed.

        Every slab's kernel job is packed into one pinned buffer and reaches the device
        before its kernel: for stores fetched by a kernel on `stream` (`_fetch`: no copy
        engine, where it would wait behind the other direction's row copies), for loads
        copied on the helper ahead of the piece's row copies (in their order; no kernel
        stands before the first row copy).
        Stores: pack slab k into buffer b (after b's last DMA), DMA b -> host rows on the
        helper; `stream` finally waits for the last DMA. Loads: the helper waits for
        `stream`'s position (compute and FIFO waits), DMAs rows into b (after b's last
        unpack), and `stream` unpacks after each landing. Returns without waiting.

        `edges` (first, last) are False for the inner pieces of one transfer: the helper
        already follows the first piece's fork (loads) and the stream waits for the last
        piece's final row copy only (stores), so pieces pipeline like one program. `mark`,
        if given, is recorded once this piece has landed: on the helper after its last row
        copy (stores), on `stream` after its last unpack (loads).

        `overlap` (`Backend.may_overlap`): `stream` has not waited for the transfer's
        predecessor. The first piece records `overlap.start` on the helper, before its
        row copies; a load's first piece makes `stream` wait for `overlap.after` after the
        fork (its rows land in free buffers meanwhile, its unpacks wait), a store's last
        piece before its final wait (its packs run ahead, its row copies queue behind the
        predecessor's on the helper anyway)."""
        first_edge, last_edge = edges
        program: StagedProgram = plan.staged or prepare_staged(plan, direction,
                                                               ring.slab_bytes)
        store = direction == "d2h"
        if not program.slabs:
            if overlap is not None and (first_edge or last_edge):
                stream.wait_event(overlap.after)  # in order, as any transfer
                if first_edge:
                    stream.record(overlap.start)
            if mark is not None:
                stream.record(mark)
            return
        helper = ring.helper
        keep = plan.keepalive
        keep.append(ring)
        with ring.lock:
            cur: int | None = None  # the buffer of the slab being enqueued
            try:
                nbuf = len(ring.ptrs)
                first = ring.next
                order = [(first + k) % nbuf for k in range(len(program.slabs))]
                entries = {b: self.tables.entry(
                    staging_table(plan.table, program.rows, store, ring.ptrs[b],
                                  program.rows_per_slab),
                    stream, keep) for b in dict.fromkeys(order)}
                jobs = [pack_job(slab.segments, entries[b].packed.pieces, None, entries[b].pieces)
                        for b, slab in zip(order, program.slabs)]
                offsets = [0]
                for job in jobs:
                    offsets.append(offsets[-1] + len(job.words))
                total = offsets[-1]
                nfetch = -(-total * 8 // FETCH_BYTES) if store else 0  # `_fetch` descriptors
                st = self.staging.take(total + 3 * nfetch)
                keep.append(st)
                for job, off in zip(jobs, offsets):
                    st.words[off : off + len(job.words)] = job.words
                if store:
                    self._fetch(stream, st, total, nfetch)
                else:
                    if first_edge:
                        fork = create_event(self.device_id, timing=False)
                        stream.record(fork)
                        helper.wait_event(fork)
                        keep.append(fork)
                        if overlap is not None:
                            helper.record(overlap.start)
                            stream.wait_event(overlap.after)  # before the first unpack
                    # on the helper, ahead of this piece's row copies, which every unpack
                    # waits for anyway: no kernel (SMs) stands before the first row copy
                    cupy().cuda.runtime.memcpyAsync(st.dev_ptr, st.host_ptr, total * 8, _H2D,
                                                    helper.ptr)
                last = first
                ring.next = (first + len(program.slabs)) % nbuf
                for k, (b, slab) in enumerate(zip(order, program.slabs)):
                    last = cur = b
                    entry = entries[b]
                    job_addr = st.dev_ptr + offsets[k] * 8
                    src, dst, sizes = slab_descriptors(program, slab, ring.ptrs[b])
                    if store:
                        stream.wait_event(ring.free[b])
                        if jobs[k].total_units:
                            self.kernels.launch_table(stream.owner, entry.rows_addr,
                                                      entry.frags_addr, entry.packed, job_addr,
                                                      jobs[k], grid)
                        stream.record(ring.ready[b])
                        helper.wait_event(ring.ready[b])
                        if k == 0 and first_edge and overlap is not None:
                            helper.record(overlap.start)
                        self._dma(batch, helper, src, dst, sizes, store)
                        helper.record(ring.free[b])
                    else:
                        helper.wait_event(ring.free[b])
                        self._dma(batch, helper, src, dst, sizes, store)
                        helper.record(ring.ready[b])
                        stream.wait_event(ring.ready[b])
                        if jobs[k].total_units:
                            self.kernels.launch_table(stream.owner, entry.rows_addr,
                                                      entry.frags_addr, entry.packed, job_addr,
                                                      jobs[k], grid)
                        stream.record(ring.free[b])
                    keep.append((src, dst, sizes))
                    cur = None
                if store and last_edge:
                    if overlap is not None:
                        stream.wait_event(overlap.after)
                    stream.wait_event(ring.free[last])
                if mark is not None:
                    (helper if store else stream).record(mark)
            except BaseException:
                self._rejoin(ring, stream, cur, keep)
                raise

    def _rejoin(self, ring: StagingRing, stream: CudaStream, cur: int | None,
                keep: list[object]) -> None:
        """After an enqueue failed part-way: `stream`, on which the lane records the
        transfer's end next, waits for everything queued on the ring's helper (else the
        transfer ends, and its memory may go, under its own row copies), and `cur`, the
        buffer of the slab in progress, is handed back after both streams (else the ring's
        next user of it, this direction's urgent lane, races the half-done slab). A failure
        here is dropped: the first one is what the caller raises."""
        try:
            join = create_event(self.device_id, timing=False)
            keep.append(join)
            ring.helper.record(join)
            stream.wait_event(join)
        except Exception:
            pass
        if cur is not None:
            try:  # even if the join failed: the buffer's next user waits for this much
                stream.record(ring.free[cur])
            except Exception:
                pass

    def _fetch(self, stream: CudaStream, st: _Staging, total: int, nfetch: int) -> None:
        """Copy the `total` job words from the pinned buffer to its device twin on `stream`
        with the flat copy kernel, reading host memory over the bus (unified addressing
        maps pinned memory into the device's address space): a `cudaMemcpyAsync` here
        would queue on a copy engine behind the row copies of this ring or of the other
        direction's (the engines run queued copies in order), and every slab waits for
        its job. The kernel's descriptors, `nfetch` pieces of `FETCH_BYTES`, follow the
        words in the same pinned buffer."""
        nbytes = total * 8
        starts = np.arange(nfetch, dtype=np.uint64) * np.uint64(FETCH_BYTES)
        desc = st.words[total : total + 3 * nfetch]
        desc[:nfetch] = starts + np.uint64(st.host_ptr)
        desc[nfetch : 2 * nfetch] = starts + np.uint64(st.dev_ptr)
        desc[2 * nfetch :] = np.minimum(np.uint64(FETCH_BYTES), np.uint64(nbytes) - starts)
        self.kernels.launch_flat(stream.owner, st.host_ptr + nbytes, nfetch, nfetch)

    def _dma(self, batch: _cudart.BatchCopier | None, helper: CudaStream, src: np.ndarray,
             dst: np.ndarray, sizes: np.ndarray, store: bool) -> None:
        """One slab's runs on the helper stream: plain copies for a few, else one batch call
        (not fanned out: the runs are long, and each fork/join costs ~17 API calls)."""
        try:
            if batch is None or len(sizes) <= EACH_RUNS:
                _cudart.memcpy_runs(zip(src.tolist(), dst.tolist(), sizes.tolist()),
                                    helper.ptr)
            else:
                order = _cudart.ACCESS_ORDER_STREAM if store else _cudart.ACCESS_ORDER_ANY
                src_dev, dst_dev = (self.device_id, -1) if store else (-1, self.device_id)
                batch(src, dst, sizes, helper.ptr, order, src_dev, dst_dev)
        except _cudart.CudaCallError as exc:
            raise TransferFailedError(f"staged row copy failed: {exc}") from exc
