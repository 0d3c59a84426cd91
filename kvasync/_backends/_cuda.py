"""The CUDA backend: CuPy streams and events, copy kernels and batched DMA.

Copy paths (all over the same plans, all selectable per offloader or per call):

- ``"kernel"``: warps of a few CTAs load and store pinned, mapped host memory directly
  (`_cuda_kernels`). Plans built by the offloader use the table kernel (addresses computed
  on the GPU from slot ids, host work O(blocks)); raw descriptor plans use the flat one.
  Never used when the host memory is not pinned: the GPU must not dereference pageable
  memory.
- ``"dma"``: the copy engines, through `cuMemcpyBatchAsync` in chunks of at most 8192
  coalesced descriptors (source order STREAM for stores, which read live KV cache; ANY for
  loads, which read host memory no stream writes), or one `cudaMemcpyAsync` per coalesced
  descriptor where the driver lacks the batch call.
- ``"auto"``: per transfer, whichever of the two the measured costs say is faster.

Why "auto" is calibrated on the device and not a fixed threshold: where the crossover
lies depends on the link, the driver's per-descriptor cost, the CPU and the direction (on
the H200, 4 KiB stores through batch DMA reach 5.9 GB/s and loads 2.1 GB/s, while at
2 MiB DMA beats the kernel; vLLM's fixed 28 KiB threshold loses most of the link on
stores). So at the first "auto" transfer the backend times both paths once per direction
and page size on scratch buffers (~0.3-0.5 s), caches the table per device for the
process, and picks the path with the lower predicted time (latency + bytes / rate at the
transfer's mean descriptor size). Near-ties (within 10% for loads, 15% for stores) go to
DMA, which leaves the SMs to the model (a kernel copy slows a concurrent matmul far more
than the copy engines do).

Streams are created non-blocking (never the legacy default stream); events block (the
core's completion thread sleeps in `cudaEventSynchronize`). Nothing CUDA happens at import
or construction beyond `cupy.is_available()`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._errors import BackendUnavailableError, InvalidTransferError, TransferFailedError
from .._hostmem import MAX_REGISTER_CHUNK_BYTES, host_memory
from .._program import build_staged, prepare_staged
from . import _cudart
from ._base import Backend, Direction, Event, HostMemory, Stream
from ._cuda_kernels import CopyKernels, PackedTable, pack_job, pack_table, split_descriptors
from ._cuda_staged import StagingRing, enqueue_staged
from ._cudart import cupy

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._program import RefTable, TransferPlan

__all__ = ["DEFAULT_GRID", "Calibration", "CudaBackend", "CudaEvent", "CudaStream"]

log = logging.getLogger("kvasync")

#: CTAs of the copy kernels (of 512 threads each). Measured on the H200
#: (docs/benchmarks): 4 to 132 CTAs all give the same GB/s at 4 KiB and 64 KiB, the link
#: is the limit; 16 keeps the SM footprint (and the slowdown of concurrent compute) small.
DEFAULT_GRID = 16
_NOT_READY = 600  # cudaErrorNotReady
_H2D = 1  # cudaMemcpyHostToDevice
_PATHS = ("kernel", "dma")


def _failure(call: str, exc: BaseException) -> TransferFailedError:
    err = TransferFailedError(f"CUDA error in {call}: {exc}")
    err.__cause__ = exc
    return err


# -- events and streams -------------------------------------------------------------------------
class CudaEvent(Event):
    """A CuPy event (blocking sync); CUDA errors are captured, never raised."""

    __slots__ = ("_error", "ptr", "raw")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.ptr = int(raw.ptr)
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"<CudaEvent {self.ptr:#x}{' failed' if self._error is not None else ''}>"

    def query(self) -> bool:
        if self._error is not None:
            return True
        status = int(cupy().cuda.runtime.eventQuery(self.ptr))
        if status == 0:
            return True
        if status == _NOT_READY:
            return False
        self._error = _failure("cudaEventQuery", RuntimeError(_status_name(status)))
        return True

    def synchronize(self, timeout: float | None = None) -> bool:
        if self._error is not None:
            return True
        try:
            if timeout is None:
                cupy().cuda.runtime.eventSynchronize(self.ptr)
                return True
            deadline = time.monotonic() + max(timeout, 0.0)
            delay = 50e-6
            while not self.query():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2e-3)
            return True
        except Exception as exc:
            self._error = _failure("cudaEventSynchronize", exc)
            return True

    def error(self) -> BaseException | None:
        return self._error

    def elapsed_seconds(self, end: Event) -> float:
        assert isinstance(end, CudaEvent)
        try:
            return float(cupy().cuda.runtime.eventElapsedTime(self.ptr, end.ptr)) / 1e3
        except Exception:
            return 0.0


def _status_name(status: int) -> str:
    try:
        return str(cupy().cuda.runtime.CUDARuntimeError(status))
    except Exception:
        return f"cudaError {status}"


class CudaStream(Stream):
    """A CUDA stream by handle: one of ours (`owner` is its CuPy Stream) or a caller's.

    A CUDA error while recording or waiting sticks to the stream and is handed to the
    events recorded on it afterwards, so a failing context fails transfers instead of
    raising out of `store()`/`load()` half-submitted.
    """

    __slots__ = ("_error", "device_id", "owner", "ptr")

    def __init__(self, ptr: int, owner: Any, device_id: int) -> None:
        self.ptr = int(ptr)
        self.owner = owner
        self.device_id = device_id
        self._error: BaseException | None = None

    def record(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        if self._error is not None:
            event._error = self._error
            return
        try:
            cupy().cuda.runtime.eventRecord(event.ptr, self.ptr)
        except Exception as exc:
            self._error = event._error = _failure("cudaEventRecord", exc)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        if event._error is not None and self._error is None:
            self._error = event._error
        if self._error is not None:
            return
        try:
            cupy().cuda.runtime.streamWaitEvent(self.ptr, event.ptr, 0)
        except Exception as exc:
            self._error = _failure("cudaStreamWaitEvent", exc)

    def __repr__(self) -> str:
        return f"<CudaStream {self.ptr:#x} device={self.device_id}>"


# -- staging buffers ----------------------------------------------------------------------------
class _Staging:
    """A pinned host buffer and a device buffer of one size class, returned to the pool
    when the last reference (the plan's keepalive) goes."""

    __slots__ = ("dev", "dev_ptr", "host", "host_ptr", "pool", "size", "words")

    def __init__(self, pool: _StagingPool, size: int, host: Any, dev: Any,
                 words: np.ndarray) -> None:
        self.pool: _StagingPool | None = pool
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


class _StagingPool:
    """Descriptor staging in power-of-two size classes (>= 4 KiB), reused across transfers.

    A buffer is taken at submission and attached to the plan's keepalive; the core drops
    the plan only after the transfer's end event completed, so reuse is never early.
    """

    def __init__(self, device_id: int, keep_per_class: int = 8) -> None:
        self._device_id = device_id
        self._free: dict[int, list[tuple[Any, Any, np.ndarray]]] = {}
        self._lock = threading.Lock()
        self._keep = keep_per_class
        self.closed = False

    def take(self, nwords: int) -> _Staging:
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


@dataclass
class _Fan:
    """Helper streams of one main stream for fanned-out DMA, with their fork/join events."""

    owners: list[Any]  # CuPy Streams (kept alive)
    streams: list[int]  # their handles
    fork: Any  # CuPy Event recorded on the main stream
    joins: list[Any]  # one CuPy Event per helper

    @classmethod
    def create(cls, backend: CudaBackend, ways: int) -> _Fan:
        cp = cupy()
        with backend._device():
            owners = [cp.cuda.Stream(non_blocking=True) for _ in range(ways)]
            fork = cp.cuda.Event(disable_timing=True)
            joins = [cp.cuda.Event(disable_timing=True) for _ in range(ways)]
        return cls(owners, [int(o.ptr) for o in owners], fork, joins)


class _FanRound:
    """Helper streams forked off one main stream for a stretch of DMA batches, then joined.

    `helper()` hands out the helper streams round-robin; each one, at its first use, waits
    for a fork event recorded on the main stream (cudaEventRecord + cudaStreamWaitEvent),
    so it starts after everything enqueued on the main stream before. `join()` records an
    event on each helper used and makes the main stream wait for it, so what follows on
    the main stream stays in order; it must run even if a batch call failed.

    The helpers belong to the main stream (one submitter at a time, under its queue's
    lock), and the events are re-recorded per round: a wait takes the record made before
    it, so reuse is safe.
    """

    __slots__ = ("backend", "fan", "main", "next", "used", "ways")

    def __init__(self, backend: CudaBackend, stream: CudaStream, ways: int) -> None:
        self.backend, self.main, self.ways = backend, stream.ptr, ways
        self.fan: _Fan | None = None  # looked up (or created) at the first helper()
        self.used = 0  # helpers forked in this round: 0..ways
        self.next = 0

    def helper(self) -> int:
        """The next helper stream's handle, forked off the main stream at its first use."""
        fan = self.fan
        if fan is None:
            fan = self.backend._fans.get(self.main)
            if fan is None or len(fan.streams) < self.ways:
                fan = self.backend._fans[self.main] = _Fan.create(self.backend, self.ways)
            self.fan = fan
        rt = cupy().cuda.runtime
        i = self.next
        self.next = (i + 1) % self.ways
        if i >= self.used:
            if self.used == 0:
                rt.eventRecord(fan.fork.ptr, self.main)
            rt.streamWaitEvent(fan.streams[i], fan.fork.ptr, 0)
            self.used = i + 1
        return fan.streams[i]

    def join(self) -> None:
        """The main stream waits for every helper used since the last join (each helper is
        tried even if an earlier one's calls failed; the first failure is raised)."""
        fan, used = self.fan, self.used
        self.used = self.next = 0
        if fan is None:
            return
        rt = cupy().cuda.runtime
        error: BaseException | None = None
        for i in range(used):
            try:
                rt.eventRecord(fan.joins[i].ptr, fan.streams[i])
                rt.streamWaitEvent(self.main, fan.joins[i].ptr, 0)
            except Exception as exc:  # a dead context: keep joining, report the first
                error = error or exc
        if error is not None:
            raise error


def _register_on(device_id: int, ptr: int, nbytes: int) -> bool:
    """cudaHostRegister with `device_id` current."""
    with cupy().cuda.Device(device_id):
        return _cudart.host_register(ptr, nbytes)


def _unregister_on(device_id: int, ptr: int) -> bool:
    """cudaHostUnregister with `device_id` current."""
    with cupy().cuda.Device(device_id):
        return _cudart.host_unregister(ptr)


# -- calibration --------------------------------------------------------------------------------
@dataclass
class Calibration:
    """Measured GB/s per (direction, path, page size) plus each path's fixed latency."""

    pages: list[int]
    #: gbps[direction][path] -> one rate per entry of `pages`
    gbps: dict[str, dict[str, list[float]]]
    #: latency[direction][path]: seconds for one small descriptor, submission to done
    latency: dict[str, dict[str, float]]
    measured: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def rate(self, direction: str, path: str, size: float) -> float:
        """GB/s at mean descriptor size `size`, interpolated in log2(size)."""
        xs = np.log2(np.asarray(self.pages, dtype=np.float64))
        ys = np.asarray(self.gbps[direction][path], dtype=np.float64)
        return float(np.interp(np.log2(max(size, 1.0)), xs, ys))

    def predict(self, direction: str, path: str, nbytes: int, count: int) -> float:
        """Predicted seconds for `nbytes` in `count` descriptors."""
        size = nbytes / max(count, 1)
        gbps = max(self.rate(direction, path, size), 1e-3)
        return self.latency[direction][path] + nbytes / (gbps * 1e9)

    #: the kernel must beat DMA by this factor to be chosen: SM stores over PCIe slow a
    #: concurrent model far more than copy engines do (d2h especially, notes: interference)
    #: (h2d 0.90: at 256 KiB loads the kernel won calibration by a few percent, then moved
    #: 65% of the link and cost a matmul 13%, where DMA moved 99% at 2%: hotpath run)
    MARGIN: ClassVar[dict[str, float]] = {"h2d": 0.90, "d2h": 0.85}

    def choose(self, direction: str, nbytes: int, count: int) -> str:
        """The path with the lower predicted time, DMA unless the kernel wins by a margin
        (10% for loads, 15% for stores). Cached per (direction, size bucket, count bucket):
        the choice is on every submission's path."""
        key = (direction, nbytes.bit_length(), count.bit_length())
        cache = self.__dict__.setdefault("_choices", {})
        hit = cache.get(key)
        if hit is not None:
            return str(hit)
        k = self.predict(direction, "kernel", nbytes, count)
        d = self.predict(direction, "dma", nbytes, count)
        choice = "kernel" if k < d * self.MARGIN.get(direction, 0.97) else "dma"
        cache[key] = choice
        return choice

    def as_dict(self) -> dict[str, Any]:
        return {"pages": self.pages, "gbps": self.gbps, "latency": self.latency,
                "measured": self.measured, "seconds": self.seconds, "notes": self.notes}

    @classmethod
    def static_default(cls) -> Calibration:
        """The H200 reference figures (../shared/notes), used if measuring fails."""
        pages = [4096, 16384, 65536, 262144, 2097152]
        return cls(
            pages,
            {
                "h2d": {"kernel": [51.1, 51.2, 51.4, 50.8, 50.9],
                        "dma": [2.1, 3.6, 39.5, 45.9, 54.2]},
                "d2h": {"kernel": [52.3, 52.6, 52.5, 52.4, 52.4],
                        "dma": [5.9, 18.6, 40.5, 48.5, 53.4]},
            },
            {d: {"kernel": 20e-6, "dma": 15e-6} for d in ("h2d", "d2h")},
            measured=False,
        )


_CALIBRATIONS: dict[int, Calibration] = {}
_CAL_LOCK = threading.Lock()
#: page sizes calibrated (bytes)
CAL_PAGES = (4096, 16384, 65536, 262144, 1048576, 2097152)
#: bytes per calibration transfer (large enough that fixed costs are a few percent)
CAL_BYTES = 64 * 1024 * 1024


# -- the backend --------------------------------------------------------------------------------
class CudaBackend(Backend):
    """KV blocks in CUDA device memory (torch tensors or CuPy arrays), host copy pinned.

    `grid` is the CTA count of the copy kernels (default `DEFAULT_GRID`); `use_batch_api`
    False forces the per-copy `cudaMemcpyAsync` DMA fallback (None: batch where available).
    """

    name = "cuda"
    paths = ("auto", "kernel", "dma", "staged")
    #: device staging bytes per direction of the "staged" path, in `STAGING_BUFFERS`
    #: buffers used round-robin (one slab each)
    STAGING_BYTES = 64 << 20
    STAGING_BUFFERS = 4
    #: "auto" sends transfers of at least this many bytes to "staged" (when the plan can be
    #: staged, the lane is not urgent and the plan is not one layer of a layer-wise load);
    #: 0 turns staged off under "auto". Below it, a transfer's fixed host cost (program,
    #: job upload, events: ~50-100 us) outweighs what the copy engines save on the link
    STAGED_MIN_BYTES = 2 << 20
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
        try:
            cp = cupy()
        except ImportError as exc:
            raise BackendUnavailableError(f"the cuda backend needs CuPy: {exc}") from exc
        if not cp.is_available():
            raise BackendUnavailableError(
                "the cuda backend needs a usable CUDA GPU (cupy.is_available() is False)"
            )
        if grid is not None and (isinstance(grid, bool) or not isinstance(grid, int) or grid < 1):
            raise InvalidTransferError(f"grid must be an int >= 1, got {grid!r}")
        self.device_id = max(int(device_id), 0)
        self.tensor_kind = tensor_kind
        #: CTAs of the copy kernels (mutable: the benchmark sweeps it)
        self.grid = int(grid) if grid is not None else DEFAULT_GRID
        self._use_batch_api = use_batch_api
        self._lock = threading.Lock()
        self._ready = False
        self._closed = False
        self._kernels = CopyKernels()
        self._kernel_error: BaseException | None = None
        self._batch: _cudart.BatchCopier | None = None
        self._staging = _StagingPool(self.device_id)
        self._tables: OrderedDict[int, _TableEntry] = OrderedDict()
        self._table_lock = threading.Lock()
        self._warned_unpinned = False
        self._pinned_cache: dict[tuple[int, str], tuple[Any, bool]] = {}
        self._current_wrappers: dict[int, CudaStream] = {}
        self._torch_raw_stream: Callable[[int], int] | None = None
        #: how many transfers each concrete path ran (for tests and the benchmark)
        self.counts: dict[str, int] = {"kernel": 0, "dma": 0, "dma_batch": 0, "dma_each": 0,
                                       "dma_fanned": 0, "staged": 0}
        #: staging bytes per direction of the "staged" path (set before its first use)
        self.staging_bytes = self.STAGING_BYTES
        #: CTAs of the staged path's pack/unpack kernel (0: one per SM, set at warm-up)
        self.staged_grid = 0
        self._rings: dict[str, StagingRing] = {}
        self._ring_lock = threading.Lock()
        #: helper streams of fanned-out DMA batches, per main stream handle
        self._fans: dict[int, _Fan] = {}
        #: cudaHostRegister / cudaHostUnregister on this device; not bound methods: host
        #: memory's collection finalizer holds them and must not keep the backend (whose
        #: table cache holds that memory) alive
        self._register: Callable[[int, int], bool] = partial(_register_on, self.device_id)
        self._unregister: Callable[[int], bool] = partial(_unregister_on, self.device_id)

    # -- set-up ---------------------------------------------------------------------------------
    def _device(self) -> Any:
        return cupy().cuda.Device(self.device_id)

    def warm_up(self) -> None:
        """Bind the device, compile the kernels and find the batch call (once; idempotent)."""
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
                    try:
                        self.staged_grid = int(cupy().cuda.Device(self.device_id)
                                               .attributes["MultiProcessorCount"])
                    except Exception:
                        self.staged_grid = 4 * DEFAULT_GRID
                rt = cupy().cuda.runtime
                try:
                    if not rt.deviceGetAttribute(
                        rt.cudaDevAttrCanUseHostPointerForRegisteredMem, self.device_id
                    ):
                        self._kernel_error = RuntimeError(
                            "the device cannot use host pointers of registered memory")
                        log.error("kvasync: %s; only the DMA path will be used",
                                  self._kernel_error)
                except Exception:
                    pass
            self._ready = True

    @property
    def kernel_available(self) -> bool:
        self.warm_up()
        return self._kernel_error is None

    @property
    def batch_available(self) -> bool:
        self.warm_up()
        return self._batch is not None

    # -- memory ---------------------------------------------------------------------------------
    def check_device_array(self, info: ArrayInfo, what: str) -> None:
        if info.device != "cuda":
            raise InvalidTransferError(
                f"{what}: the cuda backend needs CUDA device memory, got {info.device} memory"
            )
        if info.device_id != self.device_id:
            raise InvalidTransferError(
                f"{what}: lives on CUDA device {info.device_id}, the backend uses device "
                f"{self.device_id}"
            )
        self.warm_up()
        rt = cupy().cuda.runtime
        try:
            with self._device():
                kind = int(rt.pointerGetAttributes(info.ptr).type)
        except Exception as exc:
            raise InvalidTransferError(f"{what}: not CUDA memory ({exc})") from None
        if kind not in (int(rt.memoryTypeDevice), int(rt.memoryTypeManaged)):
            raise InvalidTransferError(
                f"{what}: pointer {info.ptr:#x} is not device memory (cudaMemoryType {kind})"
            )

    def pin_functions(self) -> tuple[Callable[[int, int], bool], Callable[[int], bool]]:
        return self._register, self._unregister

    def alloc_host(
        self, nbytes: int, row_bytes: int, cap: int = MAX_REGISTER_CHUNK_BYTES
    ) -> HostMemory:
        mem = host_memory(nbytes, row_bytes, self._register, self._unregister, cap)
        if not mem.pinned:
            log.error(
                "kvasync: could not pin %.2f GB of host memory with cudaHostRegister; the "
                "host copy is pageable, transfers use DMA only and run far slower",
                mem.nbytes / 1e9,
            )
        return mem

    # -- streams and events ---------------------------------------------------------------------
    def new_stream(self) -> Stream:
        self.warm_up()
        with self._device():
            raw = cupy().cuda.Stream(non_blocking=True)
        return CudaStream(raw.ptr, raw, self.device_id)

    def new_event(self, timing: bool = True) -> Event:
        with self._device():
            raw = cupy().cuda.Event(block=True, disable_timing=not timing)
        return CudaEvent(raw)

    def _wrap_current(self, ptr: int, owner: Any) -> CudaStream:
        """One CudaStream wrapper per current-stream handle (cached: called per transfer)."""
        cache: dict[int, CudaStream] = self._current_wrappers
        wrapped = cache.get(ptr)
        if wrapped is None or wrapped._error is not None:
            wrapped = CudaStream(ptr, owner, self.device_id)
            if len(cache) > 64:
                cache.clear()
            cache[ptr] = wrapped
        return wrapped

    def compute_stream(self, override: Any | None) -> Stream | None:
        if override is None:
            if self.tensor_kind == "torch" and "torch" in sys.modules:
                raw = self._torch_raw_stream
                if raw is None:
                    import torch

                    # torch's own C++ accessor (what Triton calls): 0.2 us against 1.7 us
                    # for torch.cuda.current_stream(); the stream is torch's and outlives us
                    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                        lambda dev: torch.cuda.current_stream(dev).cuda_stream)
                    self._torch_raw_stream = raw
                return self._wrap_current(int(raw(self.device_id)), None)
            with self._device():
                cs = cupy().cuda.get_current_stream()
            return self._wrap_current(cs.ptr, cs)
        if isinstance(override, CudaStream):
            return override
        cp = cupy()
        if isinstance(override, cp.cuda.Stream):
            return CudaStream(override.ptr, override, self.device_id)
        handle = getattr(override, "cuda_stream", None)  # torch.cuda.Stream
        if isinstance(handle, int):
            dev = getattr(getattr(override, "device", None), "index", None)
            if dev is not None and int(dev) != self.device_id:
                raise InvalidTransferError(
                    f"compute stream is on CUDA device {dev}, the backend uses {self.device_id}"
                )
            return CudaStream(handle, override, self.device_id)
        proto = getattr(override, "__cuda_stream__", None)
        if callable(proto):
            _, handle = proto()
            return CudaStream(int(handle), override, self.device_id)
        raise InvalidTransferError(
            "compute_stream must be a torch.cuda.Stream, a cupy.cuda.Stream or a kvasync "
            f"CudaStream, got {type(override).__name__}"
        )

    # -- path choice ----------------------------------------------------------------------------
    #: an urgent transfer under "auto" takes the kernel path: the copy engines do not let a
    #: later stream's copy pass batch DMA already queued, whatever the stream priority.
    #: Measured on the H200 (docs/benchmarks/h200/fanout/once/), a 256 KiB urgent load
    #: behind a 512 MiB load of random 256 KiB pages: DMA 1.12 ms p50 (10.2 ms without the
    #: helper streams), kernel 0.30 ms; behind stores and contiguous loads both stay < 0.4 ms
    URGENT_KERNEL = True
    #: while the other direction has transfers in flight, "auto" sends descriptors of at
    #: least this many bytes (mean) to DMA: a store and a load at once on the H200
    #: (1 submitting thread) reached, as % of the bidirectional ceiling, 2 MiB pages
    #: dma/dma 91 against kernel/kernel 74 and auto 84; 64 KiB 68 against 61 and 62
    #: (docs/benchmarks/h200/lazy/bench/); 0 turns it off
    CONTENDED_DMA_BYTES = 64 << 10

    def resolve_path(
        self, path: str, direction: Direction, plan: TransferPlan, host_pinned: bool,
        urgent: bool = False, other_busy: bool = False, layered: bool = False,
    ) -> str:
        if path not in self.paths:
            raise InvalidTransferError(f"unknown copy path {path!r}; choose one of {self.paths}")
        if path == "dma":
            return "dma"
        if path == "staged":
            if not self.kernel_available:
                if not self._warned_unpinned:
                    self._warned_unpinned = True
                    log.warning("kvasync: copy path 'staged' needs working kernels; using "
                                "'dma'")
                return "dma"
            prepare_staged(plan, direction, self._ring(direction).slab_bytes)
            return "staged"
        if not host_pinned or not self.kernel_available:
            if path == "kernel" and not self._warned_unpinned:
                self._warned_unpinned = True
                log.warning("kvasync: copy path 'kernel' needs pinned host memory and working "
                            "kernels; using 'dma'")
            return "dma"
        if not self._host_side_registered(plan, direction):
            if not self._warned_unpinned:
                self._warned_unpinned = True
                log.warning("kvasync: the host copy is not registered with CUDA (pageable); "
                            "the kernel path must not touch it, using 'dma'")
            return "dma"
        if path == "kernel" or (urgent and self.URGENT_KERNEL):
            return "kernel"
        if plan.num_descriptors == 0:
            return "dma"
        if self.STAGED_MIN_BYTES and plan.nbytes >= self.STAGED_MIN_BYTES and not layered:
            program = build_staged(plan, direction == "d2h", self._ring(direction).slab_bytes)
            if program is not None:
                plan.staged = program
                return "staged"
        if (other_busy and self.CONTENDED_DMA_BYTES
                and plan.nbytes >= self.CONTENDED_DMA_BYTES * plan.num_descriptors):
            return "dma"
        return self.calibration().choose(direction, plan.nbytes, plan.num_descriptors)

    def _host_side_registered(self, plan: TransferPlan, direction: Direction) -> bool:
        """True if every host tensor of the plan's table is CUDA-registered (checked once
        per table): a safety net under the caller's `host_pinned` claim, since a kernel
        dereferencing pageable memory would poison the whole CUDA context."""
        table = plan.table
        if table is None or not plan.segments:
            return True  # raw descriptors (tests, calibration): the caller vouches
        key = (id(table), direction)
        hit = self._pinned_cache.get(key)
        if hit is not None and hit[0] is table:
            return hit[1]
        side = table.dst if direction == "d2h" else table.src
        ok = True
        with self._device():
            for base, stride, rows in zip(side.base, side.row_stride, side.num_rows):
                last = base + max(rows - 1, 0) * stride
                if not (_cudart.is_registered(base) and _cudart.is_registered(last)):
                    ok = False
                    break
        self._pinned_cache[key] = (table, ok)
        return ok

    def calibration(self) -> Calibration:
        """The device's measured path costs (measured at the first call in the process)."""
        cal = _CALIBRATIONS.get(self.device_id)
        if cal is not None:
            return cal
        with _CAL_LOCK:
            cal = _CALIBRATIONS.get(self.device_id)
            if cal is None:
                try:
                    cal = self._measure()
                except Exception as exc:
                    log.error("kvasync: calibrating the copy paths failed (%s); using the "
                              "H200 reference figures", exc)
                    cal = Calibration.static_default()
                    cal.notes.append(f"measuring failed: {exc}")
                _CALIBRATIONS[self.device_id] = cal
        return cal

    def _measure(self) -> Calibration:
        """Time both paths per direction and page size on scratch buffers (~0.3-0.5 s)."""
        t_start = time.perf_counter()
        self.warm_up()
        cp = cupy()
        pages = list(CAL_PAGES)
        gbps: dict[str, dict[str, list[float]]] = {
            d: {p: [] for p in _PATHS} for d in ("h2d", "d2h")}
        latency: dict[str, dict[str, float]] = {d: {} for d in ("h2d", "d2h")}
        host = self.alloc_host(CAL_BYTES * 2, 4096)
        reps = 3
        try:
            if not host.pinned:
                raise RuntimeError("scratch host memory could not be pinned")
            with self._device():
                dev_base = int(cp.cuda.runtime.malloc(CAL_BYTES * 2))
                stream = self.new_stream()
                assert isinstance(stream, CudaStream)
                rng = np.random.default_rng(0)
                host_base = host.ptr
                for direction in ("h2d", "d2h"):
                    # fixed cost first (one 4 KiB copy), so rates below exclude it
                    one = np.full(1, 4096, dtype=np.uint64)
                    s1 = np.asarray([host_base if direction == "h2d" else dev_base], np.uint64)
                    d1 = np.asarray([dev_base if direction == "h2d" else host_base], np.uint64)
                    for path in _PATHS:
                        latency[direction][path] = min(
                            self._time_raw(stream, direction, path, s1, d1, one)
                            for _ in range(5))
                    for page in pages:
                        n = CAL_BYTES // page
                        slots = 2 * n
                        g = rng.permutation(slots)[:n].astype(np.uint64) * np.uint64(page)
                        h = rng.permutation(slots)[:n].astype(np.uint64) * np.uint64(page)
                        gd, hd = g + np.uint64(dev_base), h + np.uint64(host_base)
                        src, dst = (hd, gd) if direction == "h2d" else (gd, hd)
                        sizes = np.full(n, page, dtype=np.uint64)
                        for path in _PATHS:
                            t = min(self._time_raw(stream, direction, path, src, dst, sizes)
                                    for _ in range(reps))
                            t = max(t - latency[direction][path], 0.05 * t)
                            gbps[direction][path].append(n * page / t / 1e9)
                cp.cuda.runtime.streamSynchronize(stream.ptr)
                cp.cuda.runtime.free(dev_base)
        finally:
            host.release()
        cal = Calibration(pages, gbps, latency, True, time.perf_counter() - t_start)
        log.info("kvasync: calibrated copy paths in %.2f s: %s", cal.seconds, cal.gbps)
        return cal

    def _time_raw(
        self, stream: CudaStream, direction: Direction, path: str,
        src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
    ) -> float:
        """Wall seconds from the first host call until the copies drained."""
        from .._program import TransferPlan

        rt = cupy().cuda.runtime
        t0 = time.perf_counter()
        plan = TransferPlan.raw(None, src, dst, sizes)  # type: ignore[arg-type]
        self._enqueue(stream, plan, direction, path)
        rt.streamSynchronize(stream.ptr)
        return max(time.perf_counter() - t0, 1e-9)

    # -- copies ---------------------------------------------------------------------------------
    def enqueue_copy(
        self, stream: Stream, plan: TransferPlan, direction: Direction, path: str
    ) -> None:
        cuda_stream, path = self._concrete(stream, plan, direction, path)
        if cuda_stream._error is not None:
            return  # the stream failed: its next event carries the error
        if plan.num_descriptors == 0:
            return
        self._enqueue(cuda_stream, plan, direction, path)

    def enqueue_pieces(
        self, stream: Stream, pieces: Sequence[TransferPlan], direction: Direction, path: str
    ) -> None:
        """The pieces of one transfer; their fanned-out DMA batches share one fork and one
        join of the helper streams, whole pieces round-robin (`FAN_JOIN_PIECES`)."""
        if len(pieces) < 2 or (path != "dma" and path != "auto") or self._batch is None:
            super().enqueue_pieces(stream, pieces, direction, path)
            return
        fan: _FanRound | None = None
        try:
            for k, piece in enumerate(pieces):
                cuda_stream, concrete = self._concrete(stream, piece, direction, path)
                if cuda_stream._error is not None:
                    return
                if piece.num_descriptors == 0:
                    continue
                if concrete == "dma" and fan is None:
                    fan = _FanRound(self, cuda_stream, self.FAN_OUT)
                if fan is not None and self.FAN_JOIN_PIECES and k % self.FAN_JOIN_PIECES == 0:
                    fan.join()
                self._enqueue(cuda_stream, piece, direction, concrete,
                              fan if concrete == "dma" else None)
        finally:
            if fan is not None:
                fan.join()

    def _concrete(self, stream: Stream, plan: TransferPlan, direction: Direction,
                  path: str) -> tuple[CudaStream, str]:
        """`stream` and `path` (resolved) checked: InvalidTransferError before anything is
        enqueued."""
        if path == "auto":
            path = self.resolve_path(path, direction, plan, True)
        if path not in _PATHS and path != "staged":
            raise InvalidTransferError(f"unknown copy path {path!r}; choose one of {self.paths}")
        if not isinstance(stream, CudaStream):
            raise InvalidTransferError(f"expected a CudaStream, got {type(stream).__name__}")
        return stream, path

    def _enqueue(self, stream: CudaStream, plan: TransferPlan, direction: Direction,
                 path: str, fan: _FanRound | None = None) -> None:
        if self._closed:
            raise TransferFailedError("the cuda backend is closed")
        if not self._ready:
            self.warm_up()
        if path in ("kernel", "staged") and self._kernel_error is not None:
            raise TransferFailedError(f"copy kernels unavailable: {self._kernel_error}")
        if cupy().cuda.runtime.getDevice() == self.device_id:  # cheaper than a Device()
            self._copy(stream, plan, direction, path, fan)
        else:
            with self._device():
                self._copy(stream, plan, direction, path, fan)
        self.counts[path] += 1

    def _copy(self, stream: CudaStream, plan: TransferPlan, direction: Direction, path: str,
              fan: _FanRound | None) -> None:
        if path == "kernel":
            self._kernel_copy(stream, plan, direction)
        elif path == "staged":
            enqueue_staged(self, self._ring(direction), stream, plan, direction,
                           self.staged_grid or DEFAULT_GRID)
        else:
            self._dma_copy(stream, plan, direction, fan)

    def _ring(self, direction: str) -> StagingRing:
        """The staging ring of `direction` (allocated at first use: 2 x staging_bytes/2)."""
        ring = self._rings.get(direction)
        if ring is not None:
            return ring
        with self._ring_lock:
            ring = self._rings.get(direction)
            if ring is None:
                n = max(int(self.STAGING_BUFFERS), 2)
                ring = StagingRing(self, max(int(self.staging_bytes) // n, 1), n)
                self._rings[direction] = ring
            return ring

    def _kernel_copy(self, stream: CudaStream, plan: TransferPlan, direction: Direction,
                     grid: int | None = None) -> None:
        """Launch the table kernel (plans) or the flat one (raw descriptors) on `stream`
        with `grid` CTAs (default `self.grid`)."""
        grid = self.grid if grid is None else grid
        rt = cupy().cuda.runtime
        if plan.segments and plan._flat is None and self._table_kernel_fits(plan):
            entry = self._table_entry(plan.table, stream, plan.keepalive)
            staged: list[_Staging] = []

            def alloc(nwords: int) -> np.ndarray:
                staged.append(self._staging.take(nwords))
                return staged[0].words

            job = pack_job(plan.segments, entry.packed.pieces, alloc, entry.pieces)
            st = staged[0]
            plan.keepalive.append(st)
            if job.total_units == 0:
                return
            rt.memcpyAsync(st.dev_ptr, st.host_ptr, len(job.words) * 8, _H2D, stream.ptr)
            self._kernels.launch_table(stream.owner, entry.rows_addr, entry.frags_addr,
                                       entry.packed, st.dev_ptr, job, grid)
            return
        src, dst, sizes = split_descriptors(*plan.flat())
        n = len(sizes)
        st = self._staging.take(3 * n)
        st.words[:n] = src
        st.words[n : 2 * n] = dst
        st.words[2 * n : 3 * n] = sizes
        plan.keepalive.append(st)
        rt.memcpyAsync(st.dev_ptr, st.host_ptr, 3 * n * 8, _H2D, stream.ptr)
        self._kernels.launch_flat(stream.owner, st.dev_ptr, n, grid)

    @staticmethod
    def _table_kernel_fits(plan: TransferPlan) -> bool:
        """The table kernel indexes slots and units with 32 bits (else: the flat kernel)."""
        return plan.table.slots_fit_32 and plan.nbytes // 1024 + plan.num_descriptors < 1 << 31

    def _table_entry(self, table: RefTable, stream: CudaStream, keepalive: list[Any]
                     ) -> _TableEntry:
        """The device copy of `table`, uploaded on `stream` at first use (static per
        direction); later users on other streams wait for the upload once."""
        with self._table_lock:
            return self._table_entry_locked(table, stream, keepalive)

    def _table_entry_locked(self, table: RefTable, stream: CudaStream, keepalive: list[Any]
                            ) -> _TableEntry:
        entry = self._tables.get(id(table))
        if entry is None or entry.table is not table:
            cp = cupy()
            packed = pack_table(table)
            words = np.concatenate([packed.rows, packed.frags])
            nbytes = max(len(words) * 8, 8)
            dev = cp.cuda.alloc(nbytes)
            host = cp.cuda.alloc_pinned_memory(nbytes)
            np.frombuffer(host, dtype=np.uint64, count=len(words))[:] = words
            cp.cuda.runtime.memcpyAsync(int(dev.ptr), int(host.ptr), len(words) * 8, _H2D,
                                        stream.ptr)
            keepalive.append(host)
            ready = self.new_event(timing=False)
            stream.record(ready)
            assert isinstance(ready, CudaEvent)
            entry = _TableEntry(table, packed, dev, int(dev.ptr),
                                int(dev.ptr) + len(packed.rows) * 8, ready, stream.ptr)
            self._tables[id(table)] = entry
            while len(self._tables) > 64:
                self._tables.popitem(last=False)
        elif entry.ready is not None and entry.stream_ptr != stream.ptr:
            if entry.ready.query():
                entry.ready = None
            else:
                stream.wait_event(entry.ready)
        keepalive.append(entry)  # in flight it outlives a cache eviction
        return entry

    #: up to this many runs, one cudaMemcpyAsync each beats a batch call (1.6 us per copy
    #: against 7.6 us + 0.5 us per descriptor, measured on the H200)
    EACH_RUNS = 4

    def _dma_copy(self, stream: CudaStream, plan: TransferPlan, direction: Direction,
                  fan: _FanRound | None = None) -> None:
        """`fan`: the helper round of a multi-piece transfer, which takes a fanned batch
        whole onto its next helper stream (else the batch is split over a round of its
        own)."""
        batch = self._batch if stream.ptr not in (0, 1) else None  # None: batch call disabled
        runs = plan.runs()  # small whole-page plans: Python ints, no NumPy
        if runs is not None:
            if len(runs) <= self.EACH_RUNS or batch is None:
                self._memcpy_runs(runs, stream)
                return
            src, dst, sizes = (np.array(col, dtype=np.uint64) for col in zip(*runs))
        else:
            src, dst, sizes = plan.coalesced()
            if len(sizes) == 1 or batch is None:  # one copy: the plain call is cheaper
                self._memcpy_runs(zip(src.tolist(), dst.tolist(), sizes.tolist()), stream)
                return
        order = _cudart.ACCESS_ORDER_STREAM if direction == "d2h" else (
            _cudart.ACCESS_ORDER_ANY)
        src_dev, dst_dev = (self.device_id, -1) if direction == "d2h" else (
            -1, self.device_id)
        ways = self._fan_ways(sizes, whole=fan is not None)
        try:
            if ways == 1:
                batch(src, dst, sizes, stream.ptr, order, src_dev, dst_dev)
            elif fan is not None:
                batch(src, dst, sizes, fan.helper(), order, src_dev, dst_dev)
                self.counts["dma_fanned"] += 1
            else:
                self._batch_fanned(batch, src, dst, sizes, stream, ways, order, src_dev,
                                   dst_dev)
        except _cudart.CudaCallError as exc:
            raise _failure("cuMemcpyBatchAsync", exc) from exc
        self.counts["dma_batch"] += 1

    #: a batch whose descriptors average at least `FAN_MIN_BYTES` is spread over
    #: `FAN_OUT` helper streams, so several copy engines work at once and one engine's
    #: per-copy gap hides behind the others' copies. Measured on the H200 (1 GiB of random
    #: pages, GB/s h2d / d2h, 1 stream -> 4): 256 KiB 49.3 / 49.2 -> 52.2 / 51.6, 1 MiB
    #: 52.6 / 53.8 -> 53.4 / 54.5; 16 KiB pages got slower (the driver is their limit)
    FAN_OUT = 4
    FAN_MIN_BYTES = 128 << 10
    #: a multi-piece transfer forks the helpers once and joins them after its last piece
    #: (0), or every this many pieces: a fork and join per 32 MiB piece cost ~17 API calls,
    #: which showed as CPU time while a 20 ms transfer was awaited
    FAN_JOIN_PIECES = 0

    def _fan_ways(self, sizes: np.ndarray, whole: bool = False) -> int:
        """Helper streams for a batch (1: none); `whole`: it goes onto one helper of a
        multi-piece round, so it need not be long enough to be sliced."""
        n = len(sizes)
        if self.FAN_OUT < 2 or n < (2 if whole else 2 * self.FAN_OUT):
            return 1
        if int(sizes.sum()) < self.FAN_MIN_BYTES * n:
            return 1
        return self.FAN_OUT

    def _batch_fanned(self, batch: _cudart.BatchCopier, src: np.ndarray, dst: np.ndarray,
                      sizes: np.ndarray, stream: CudaStream, ways: int, order: int,
                      src_dev: int, dst_dev: int) -> None:
        """One batch split into `ways` contiguous slices, one per helper stream, forked off
        and joined back to `stream` around it (see `_FanRound`)."""
        fan = _FanRound(self, stream, ways)
        n = len(sizes)
        bounds = [n * i // ways for i in range(ways + 1)]
        try:
            for i in range(ways):
                lo, hi = bounds[i], bounds[i + 1]
                batch(src[lo:hi], dst[lo:hi], sizes[lo:hi], fan.helper(), order, src_dev,
                      dst_dev)
        finally:
            fan.join()
        self.counts["dma_fanned"] += 1

    def _memcpy_runs(self, runs: Iterable[tuple[int, int, int]], stream: CudaStream) -> None:
        try:
            _cudart.memcpy_runs(runs, stream.ptr)
        except Exception as exc:
            raise _failure("cudaMemcpyAsync", exc) from exc
        self.counts["dma_each"] += 1

    # -- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release staging buffers and device tables (idempotent; in-flight work keeps what
        it uses alive through its plan)."""
        if self._closed:
            return
        self._closed = True
        self._staging.close()
        self._tables.clear()
        self._rings.clear()
        self._fans.clear()
        self._pinned_cache.clear()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (f"<CudaBackend device={self.device_id} paths={self.paths} "
                f"grid={self.grid}{state}>")
