"""The CUDA backend: the copy paths over CuPy streams and events, wired together.

Copy paths (all over the same plans, all selectable per offloader or per call), one
module each, with the facts each is built on:

- ``"kernel"`` (`_cuda_kernel`): warps of a few CTAs load and store pinned, mapped host
  memory directly. Never used when the host memory is not pinned.
- ``"dma"`` (`_cuda_dma`): the copy engines, through `cuMemcpyBatchAsync` or one
  `cudaMemcpyAsync` per coalesced descriptor; big batches fan out over helper streams.
- ``"staged"`` (`_cuda_staged`): a kernel packs scattered pages into a device buffer, the
  copy engines move the buffer in a few long runs.
- ``"pitched"`` (`_cuda_pitched`): one `cudaMemcpy2DAsync` per block moves its page of
  every evenly spaced KV tensor to or from its host row: copy engines only. A plan whose
  copies are single lines (tensors not evenly spaced) runs as ``"dma"``, which coalesces
  contiguous pages into one copy.
- ``"auto"``: per transfer, the rules and the measured costs of `_cuda_policy`.

Streams, events, host memory and the caller's compute stream are `_cuda_device`; the CUDA
calls themselves go through `_cudart` (CuPy's runtime, imported on first use, and ctypes
on libcuda). Nothing CUDA happens at import or construction beyond `cupy.is_available()`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from .._errors import InvalidTransferError, TransferFailedError
from .._program import check_stageable, mean_height, stageable
from . import _cuda_dma, _cuda_policy, _cudart
from ._base import Direction, Event, Overlap, Stream
from ._cuda_device import (
    CudaDevice,
    CudaEvent,
    CudaStream,
    host_pointer_error,
    sm_count,
)
from ._cuda_dma import DmaPath, FanRound
from ._cuda_kernel import DEFAULT_GRID, KernelPath, StagingPool, TableCache
from ._cuda_kernels import CopyKernels
from ._cuda_pieces import enqueue_fanned, enqueue_staged
from ._cuda_pitched import enqueue_pitched, pitched_path
from ._cuda_policy import Calibration, choose_auto, device_calibration, measure
from ._cuda_registered import RegisteredCheck
from ._cuda_staged import StagedPath, StagingRing
from ._cudart import cupy

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._program import TransferPlan

__all__ = ["DEFAULT_GRID", "Calibration", "CudaBackend", "CudaEvent", "CudaStream"]

log = logging.getLogger("kvasync")

_PATHS = ("kernel", "dma")


class CudaBackend(CudaDevice):
    """KV blocks in CUDA device memory (torch tensors or CuPy arrays), host copy pinned.

    `grid` is the CTA count of the copy kernels (default `DEFAULT_GRID`); `use_batch_api`
    False forces the per-copy `cudaMemcpyAsync` DMA fallback (None: batch where available).
    The upper-case class attributes are the tuning knobs, read at every use (their
    measurements: `_cuda_policy`, `_cuda_dma`).
    """

    name = "cuda"
    paths = ("auto", "kernel", "dma", "staged", "pitched")
    #: device staging bytes per direction of the "staged" path, in `STAGING_BUFFERS`
    #: buffers used round-robin (one slab each)
    STAGING_BYTES = 64 << 20
    STAGING_BUFFERS = 4
    #: "auto" rules (`_cuda_policy`): the smallest staged transfer (0: never), an urgent
    #: transfer takes the kernel, the smallest mean descriptor to DMA beside the other way
    STAGED_MIN_BYTES = _cuda_policy.STAGED_MIN_BYTES
    STAGED_MAX_PAGE_BYTES = _cuda_policy.STAGED_MAX_PAGE_BYTES
    PITCHED_MIN_LINE_BYTES = _cuda_policy.PITCHED_MIN_LINE_BYTES
    PITCHED_MIN_HEIGHT = _cuda_policy.PITCHED_MIN_HEIGHT
    URGENT_KERNEL = _cuda_policy.URGENT_KERNEL
    CONTENDED_DMA_BYTES = _cuda_policy.CONTENDED_DMA_BYTES
    #: DMA (`_cuda_dma`): runs sent as single copies, fan-out helper streams, the smallest
    #: mean descriptor fanned out, pieces per fork/join (0: one per transfer)
    EACH_RUNS = _cuda_dma.EACH_RUNS
    FAN_OUT = _cuda_dma.FAN_OUT
    FAN_MIN_BYTES = _cuda_dma.FAN_MIN_BYTES
    FAN_JOIN_PIECES = _cuda_dma.FAN_JOIN_PIECES
    poll_from_await = True
    reads_plan_later = False  # descriptors and slot ids are packed during enqueue_copy

    def __init__(
        self,
        device_id: int = 0,
        tensor_kind: str = "torch",
        grid: int | None = None,
        *,
        use_batch_api: bool | None = None,
    ) -> None:
        super().__init__(device_id, tensor_kind)
        if grid is not None and (isinstance(grid, bool) or not isinstance(grid, int) or grid < 1):
            raise InvalidTransferError(f"grid must be an int >= 1, got {grid!r}")
        #: CTAs of the copy kernels (mutable: the benchmark sweeps it)
        self.grid = int(grid) if grid is not None else DEFAULT_GRID
        self._use_batch_api = use_batch_api
        self._lock = threading.Lock()
        self._ready = False
        self._closed = False
        self._kernels = CopyKernels()
        self._kernel_error: BaseException | None = None
        self._batch: _cudart.BatchCopier | None = None
        self._staging = StagingPool(self.device_id)
        self._table_cache = TableCache(self.device_id)
        self._registered = RegisteredCheck(self.device_id)
        #: how many transfers each concrete path ran (for tests and the benchmark)
        self.counts: dict[str, int] = dict.fromkeys(
            ("kernel", "dma", "dma_batch", "dma_each", "dma_fanned", "staged", "pitched"), 0)
        #: staging bytes per direction of the "staged" path (set before its first use)
        self.staging_bytes = self.STAGING_BYTES
        #: CTAs of the staged path's pack/unpack kernel (0: one per SM, set at warm-up)
        self.staged_grid = 0
        self._kernel = KernelPath(self._kernels, self._staging, self._table_cache)
        self._dma = DmaPath(self.device_id, self.counts)
        self._staged = StagedPath(self.device_id, self._kernels, self._table_cache,
                                  self._staging)

    # -- set-up ---------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Bind the device, compile the kernels and find the batch call (once; idempotent).
        Blocks while NVRTC compiles (first time in the process)."""
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            with self._device():
                try:
                    self._kernels.compile()
                except Exception as exc:  # NVRTC missing or broken: DMA still works
                    self._kernel_error = exc
                    log.error("kvasync: compiling the CUDA copy kernels failed (%s); only the "
                              "DMA path will be used", exc)
                if self._use_batch_api is not False:
                    self._batch = _cudart.batch_copier()
                if not self.staged_grid:
                    self.staged_grid = sm_count(self.device_id, 4 * DEFAULT_GRID)
                error = host_pointer_error(self.device_id)
                if error is not None:
                    self._kernel_error = error
                    log.error("kvasync: %s; only the DMA path will be used", error)
            self._ready = True

    @property
    def kernel_available(self) -> bool:
        self.warm_up()
        return self._kernel_error is None

    @property
    def batch_available(self) -> bool:
        self.warm_up()
        return self._batch is not None

    # -- path choice ----------------------------------------------------------------------------
    def resolve_path(
        self, path: str, direction: Direction, plan: TransferPlan, host_pinned: bool,
        urgent: bool = False, other_busy: bool = False, layered: bool = False,
    ) -> str:
        if path not in self.paths:
            raise InvalidTransferError(f"unknown copy path {path!r}; choose one of {self.paths}")
        if path == "dma":
            return path
        if path == "pitched":  # copies of one line are 1-D copies: DMA coalesces them
            return "dma" if pitched_path(plan) and mean_height(plan) < 2 else "pitched"
        if path == "staged":
            if not self.kernel_available:
                self._warn_once("copy path 'staged' needs working kernels; using 'dma'")
                return "dma"
            check_stageable(plan, direction, self._ring(direction).slab_bytes)
            return "staged"
        if not host_pinned or not self.kernel_available:
            if path == "kernel":
                self._warn_once("copy path 'kernel' needs pinned host memory and working "
                                "kernels; using 'dma'")
            return "dma"
        if not self._registered.check(plan, direction):
            self._warn_once("the host copy is not registered with CUDA (pageable); the "
                            "kernel path must not touch it, using 'dma'")
            return "dma"
        if path == "kernel":
            return "kernel"
        return choose_auto(direction, plan, urgent, other_busy, layered, self.URGENT_KERNEL,
                           self.CONTENDED_DMA_BYTES, self.STAGED_MIN_BYTES, self._stage,
                           self.calibration, self.STAGED_MAX_PAGE_BYTES,
                           self.PITCHED_MIN_LINE_BYTES, mean_height, self.PITCHED_MIN_HEIGHT,
                           self.preference(direction))

    def _stage(self, plan: TransferPlan, direction: Direction) -> bool:
        """Whether "auto" may stage `plan` (its program is built piece by piece later)."""
        return stageable(lambda: self._ring(direction).slab_bytes, plan, direction == "d2h")

    def calibration(self) -> Calibration:
        """The device's measured path costs (the first call in the process measures them,
        blocking ~0.3-0.5 s)."""
        return device_calibration(self.device_id, lambda: measure(
            self.device_id, self.warm_up, self.alloc_host, self.new_stream, self._enqueue))

    # -- copies ---------------------------------------------------------------------------------
    def enqueue_copy(self, stream: Stream, plan: TransferPlan, direction: Direction,
                     path: str) -> None:
        cuda_stream, path = self._concrete(stream, plan, direction, path)
        # a failed stream's next event carries its error; an empty plan copies nothing
        if cuda_stream._error is None and plan.num_descriptors:
            self._enqueue(cuda_stream, plan, direction, path)

    def may_overlap(self, path: str, direction: Direction, previous: str) -> bool:
        """Staged loads after any transfer, staged stores after a staged one: the ring's
        helper runs every row copy in order (`StagedPath.enqueue` orders the rest)."""
        return (path == "staged" and self.kernel_available
                and (direction == "h2d" or previous == "staged"))

    def enqueue_overlapped(self, stream: Stream, pieces: Sequence[TransferPlan],
                           direction: Direction, path: str, overlap: Overlap,
                           marks: Sequence[Event] | None = None,
                           edges: tuple[bool, bool] = (True, True)) -> None:
        enqueue_staged(stream, pieces, direction, self._concrete, self._enqueue, marks,
                       overlap, edges)

    def enqueue_pieces(
        self, stream: Stream, pieces: Sequence[TransferPlan], direction: Direction, path: str,
        marks: Sequence[Event] | None = None, edges: tuple[bool, bool] = (True, True),
    ) -> None:
        """The pieces of one transfer (`_cuda_pieces`): their fanned-out DMA batches share
        one fork and one join of the helper streams, whole pieces round-robin
        (`FAN_JOIN_PIECES`); a staged transfer goes piece after piece through one ring
        (the only path a lane splits: `edges`)."""
        if path == "staged":
            return enqueue_staged(stream, pieces, direction, self._concrete, self._enqueue,
                                  marks, edges=edges)
        if len(pieces) < 2 or (path != "dma" and path != "auto") or self._batch is None:
            super().enqueue_pieces(stream, pieces, direction, path, marks)
            return
        enqueue_fanned(stream, pieces, direction, path, self._concrete, self._enqueue,
                       self._dma, self.FAN_OUT, self.FAN_JOIN_PIECES, marks)

    def _concrete(self, stream: Stream, plan: TransferPlan, direction: Direction,
                  path: str) -> tuple[CudaStream, str]:
        """`stream` and `path` (resolved) checked: InvalidTransferError before anything is
        enqueued."""
        if path == "auto":
            path = self.resolve_path(path, direction, plan, True)
        if path not in _PATHS and path not in ("staged", "pitched"):
            raise InvalidTransferError(f"unknown copy path {path!r}; choose one of {self.paths}")
        if not isinstance(stream, CudaStream):
            raise InvalidTransferError(f"expected a CudaStream, got {type(stream).__name__}")
        return stream, path

    def _enqueue(self, stream: CudaStream, plan: TransferPlan, direction: Direction,
                 path: str, fan: FanRound | None = None,
                 edges: tuple[bool, bool] = (True, True), mark: Event | None = None,
                 overlap: Overlap | None = None) -> None:
        if self._closed:
            raise TransferFailedError("the cuda backend is closed")
        if not self._ready:
            self.warm_up()
        if path in ("kernel", "staged") and self._kernel_error is not None:
            raise TransferFailedError(f"copy kernels unavailable: {self._kernel_error}")
        if cupy().cuda.runtime.getDevice() == self.device_id:  # cheaper than a Device()
            self._copy(stream, plan, direction, path, fan, edges, mark, overlap)
        else:
            with self._device():
                self._copy(stream, plan, direction, path, fan, edges, mark, overlap)
        self.counts[path] += 1

    def _copy(self, stream: CudaStream, plan: TransferPlan, direction: Direction, path: str,
              fan: FanRound | None, edges: tuple[bool, bool] = (True, True),
              mark: Event | None = None, overlap: Overlap | None = None) -> None:
        if path == "kernel":
            self._kernel.copy(stream, plan, direction, self.grid)
        elif path == "pitched":
            enqueue_pitched(stream, plan)
        elif path == "staged":
            self._staged.enqueue(self._ring(direction), stream, plan, direction,
                                 self.staged_grid or DEFAULT_GRID, self._batch, edges, mark,
                                 overlap)
        else:
            self._dma.copy(stream, plan, direction, self._batch, fan,
                           each_runs=self.EACH_RUNS, fan_out=self.FAN_OUT,
                           fan_min_bytes=self.FAN_MIN_BYTES)

    def _ring(self, direction: str) -> StagingRing:
        """The staging ring of `direction` (first use: `staging_bytes`, `STAGING_BUFFERS`)."""
        return self._staged.rings.get(direction) or self._staged.ring(
            direction, self, self.staging_bytes, self.STAGING_BUFFERS)

    # -- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release staging and tables (idempotent; in-flight work holds what it uses)."""
        if self._closed:
            return
        self._closed = True
        self._staging.close()
        self._table_cache.clear()
        self._staged.close()
        self._dma.close()
        self._registered.clear()

    def __repr__(self) -> str:
        return (f"<CudaBackend device={self.device_id} paths={self.paths} grid={self.grid}"
                f"{' closed' if self._closed else ''}>")
