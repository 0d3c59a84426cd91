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
  overlap only across streams: slabs alternate between two staging buffers, the kernel
  runs on the transfer's stream, the DMA on a helper stream, and events hand each buffer
  back and forth.

Per slab, one `enqueue` makes: one pinned job upload and one kernel launch (the table
kernel over a staging `RefTable`), one DMA call (`cudaMemcpyAsync` for up to 4 runs, else
one `cuMemcpyBatchAsync`), and three event calls. Host work does not grow with the number of
KV tensors.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .._descriptors import TransferPlan
from .._staged import StagedProgram, kernel_plan, prepare_staged, slab_descriptors
from ._base import Direction
from ._cudart import cupy

if TYPE_CHECKING:
    from ._cuda import CudaBackend, CudaEvent, CudaStream

__all__ = ["StagingRing", "enqueue_staged"]


class StagingRing:
    """Two device staging buffers of one direction, a helper stream for its DMA, and per
    buffer a `ready` event (packed, or landed) and a `free` event (its last reader done).

    Owned by the backend; the buffers are freed when the ring is collected (in-flight
    transfers hold it through their plan's keepalive).
    """

    def __init__(self, backend: CudaBackend, slab_bytes: int) -> None:
        cp = cupy()
        self.slab_bytes = int(slab_bytes)
        with cp.cuda.Device(backend.device_id):
            self.buffers = [cp.cuda.alloc(self.slab_bytes) for _ in range(2)]
        self.ptrs = [int(b.ptr) for b in self.buffers]
        helper = backend.new_stream()
        self.helper: CudaStream = helper  # type: ignore[assignment]
        self.ready: list[CudaEvent] = [backend.new_event(timing=False)  # type: ignore[misc]
                                       for _ in range(2)]
        self.free: list[CudaEvent] = [backend.new_event(timing=False)  # type: ignore[misc]
                                      for _ in range(2)]
        self.next = 0
        #: one transfer at a time enqueues on the ring (lanes may submit concurrently)
        self.lock = threading.Lock()


def enqueue_staged(backend: CudaBackend, ring: StagingRing, stream: CudaStream,
                   plan: TransferPlan, direction: Direction, grid: int) -> None:
    """Enqueue `plan`'s staged program on `stream` (kernel side) and the ring's helper
    stream (copy engines); when `stream` reaches its next event, every slab has landed.

    Stores: pack slab k into buffer b (after b's last DMA), DMA b -> host rows on the
    helper; `stream` finally waits for the last DMA. Loads: the helper waits for `stream`'s
    position (compute and FIFO waits), DMAs rows into b (after b's last unpack), and
    `stream` unpacks after each landing."""
    program: StagedProgram = plan.staged or prepare_staged(plan, direction, ring.slab_bytes)
    if not program.slabs:
        return
    store = direction == "d2h"
    helper = ring.helper
    plan.keepalive.append(ring)
    with ring.lock:
        if not store:
            fork = backend.new_event(timing=False)
            stream.record(fork)
            helper.wait_event(fork)
            plan.keepalive.append(fork)
        last = 0
        for slab in program.slabs:
            b = ring.next
            ring.next = 1 - b
            last = b
            kplan = kernel_plan(program, slab, plan.table, ring.ptrs[b])
            src, dst, sizes = slab_descriptors(program, slab, ring.ptrs[b])
            runs = TransferPlan.raw(None, src, dst, sizes)  # type: ignore[arg-type]
            if store:
                stream.wait_event(ring.free[b])
                backend._kernel_copy(stream, kplan, direction, grid)
                stream.record(ring.ready[b])
                helper.wait_event(ring.ready[b])
                backend._dma_copy(helper, runs, direction)  # type: ignore[arg-type]
                helper.record(ring.free[b])
            else:
                helper.wait_event(ring.free[b])
                backend._dma_copy(helper, runs, direction)  # type: ignore[arg-type]
                helper.record(ring.ready[b])
                stream.wait_event(ring.ready[b])
                backend._kernel_copy(stream, kplan, direction, grid)
                stream.record(ring.free[b])
            plan.keepalive.append(kplan)
            plan.keepalive.append(runs)
        if store:
            stream.wait_event(ring.free[last])


def staged_info(ring: StagingRing | None) -> dict[str, Any]:
    """What a ring holds (for stats and the bench)."""
    if ring is None:
        return {"buffers": 0, "slab_bytes": 0}
    return {"buffers": len(ring.ptrs), "slab_bytes": ring.slab_bytes}
