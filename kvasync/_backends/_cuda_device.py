"""CUDA streams, events and host memory: the device half of the CUDA backend, no copies.

Facts this module is built on:

- streams are created non-blocking (never the legacy default stream), so they do not
  serialise against work on stream 0;
- events are created blocking: the core's completion thread sleeps in
  `cudaEventSynchronize` instead of spinning;
- a CUDA error while recording or waiting is captured, never raised: it sticks to the
  stream and reaches the events recorded on it afterwards, so a failing context fails
  transfers instead of raising out of `store()`/`load()` half-submitted;
- every call here goes through CuPy's runtime wrappers (`_cudart.cupy()`), which raise
  `CUDARuntimeError`; nothing CUDA happens at import or construction beyond
  `cupy.is_available()`.

`CudaDevice` is the `Backend` half that owns these handles; `CudaBackend` adds the copy
paths on top of it.
"""

from __future__ import annotations

import logging
import sys
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from .._arrays import stream_device
from .._errors import BackendUnavailableError, InvalidTransferError, TransferFailedError
from .._hostmem import MAX_REGISTER_CHUNK_BYTES, host_memory
from . import _cudart
from ._base import Backend, Event, HostMemory, Stream
from ._calibrated import ComputeLoad
from ._cuda_load import CudaMatmulLoad
from ._cudart import cupy

if TYPE_CHECKING:
    from .._arrays import ArrayInfo

__all__ = ["CudaDevice", "CudaEvent", "CudaStream", "device"]

log = logging.getLogger("kvasync")

_NOT_READY = 600  # cudaErrorNotReady


def _failure(call: str, exc: BaseException) -> TransferFailedError:
    """`exc` from CUDA call `call` as the TransferFailedError a transfer reports."""
    err = TransferFailedError(f"CUDA error in {call}: {exc}")
    err.__cause__ = exc
    return err


# -- events and streams -------------------------------------------------------------------------
class CudaEvent(Event):
    """A CuPy event (blocking sync); CUDA errors are captured, never raised.

    `raw` is the CuPy Event that owns the handle `ptr` (destroyed when `raw` is collected);
    `recorded` is set by `CudaStream.record` (an event never recorded queries complete).
    """

    __slots__ = ("_error", "ptr", "raw", "recorded")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.ptr = int(raw.ptr)
        self._error: BaseException | None = None
        self.recorded = False

    def __repr__(self) -> str:
        return f"<CudaEvent {self.ptr:#x}{' failed' if self._error is not None else ''}>"

    def query(self) -> bool:
        """Wraps `cudaEventQuery`; never blocks. An error status is captured (True)."""
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
        """Wraps `cudaEventSynchronize`; blocks the calling thread until the event
        completes. With `timeout`, polls `cudaEventQuery` with sleeps (50 us doubling to
        2 ms) instead, for at most `timeout` seconds. Errors are captured (True)."""
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
        """The captured failure, if any; no CUDA call."""
        return self._error

    def landed(self) -> bool:
        """Recorded, and `cudaEventQuery` says the stream reached it, without an error."""
        return self.recorded and self.query() and self._error is None

    def elapsed_seconds(self, end: Event) -> float:
        """Wraps `cudaEventElapsedTime`; never blocks (both events completed); 0.0 on
        error."""
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
    """A CUDA stream by handle: one of ours (`owner` is its CuPy Stream, which destroys
    the handle when collected) or a caller's (`owner` is the caller's object or None; we
    never destroy it).

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
        """Wraps `cudaEventRecord`; returns without waiting. An error is captured into
        the stream and the event."""
        assert isinstance(event, CudaEvent)
        if self._error is not None:
            event._error = self._error
            return
        try:
            cupy().cuda.runtime.eventRecord(event.ptr, self.ptr)
            event.recorded = True
        except Exception as exc:
            self._error = event._error = _failure("cudaEventRecord", exc)

    def wait_event(self, event: Event) -> None:
        """Wraps `cudaStreamWaitEvent`; returns without waiting (the device waits). An
        error, or the event's captured one, is captured into the stream."""
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


def device(device_id: int) -> Any:
    """Wraps `cupy.cuda.Device(device_id)`: a context manager making it current."""
    return cupy().cuda.Device(device_id)


def create_stream(device_id: int) -> CudaStream:
    """Wraps `cudaStreamCreateWithFlags(cudaStreamNonBlocking)` on `device_id`; never
    blocks. The CuPy Stream owns the handle."""
    with device(device_id):
        raw = cupy().cuda.Stream(non_blocking=True)
    return CudaStream(raw.ptr, raw, device_id)


def create_event(device_id: int, timing: bool = True) -> CudaEvent:
    """Wraps `cudaEventCreateWithFlags(cudaEventBlockingSync[ | cudaEventDisableTiming])`
    on `device_id`; never blocks. The CuPy Event owns the handle."""
    with device(device_id):
        raw = cupy().cuda.Event(block=True, disable_timing=not timing)
    return CudaEvent(raw)


def sm_count(device_id: int, default: int) -> int:
    """The device's SM count from CuPy's `Device.attributes` (`cudaDeviceGetAttribute`
    per attribute); `default` if the query fails. Never blocks on the device."""
    try:
        return int(cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])
    except Exception:
        return default


def host_pointer_error(device_id: int) -> RuntimeError | None:
    """Wraps `cudaDeviceGetAttribute(cudaDevAttrCanUseHostPointerForRegisteredMem)`: the
    error that rules out the kernel paths where the device cannot (None where it can, or
    where the query itself fails). Never blocks on the device."""
    rt = cupy().cuda.runtime
    try:
        if not rt.deviceGetAttribute(
            rt.cudaDevAttrCanUseHostPointerForRegisteredMem, device_id
        ):
            return RuntimeError("the device cannot use host pointers of registered memory")
    except Exception:
        pass
    return None


def _register_on(device_id: int, ptr: int, nbytes: int) -> bool:
    """Wraps `cudaHostRegister` with `device_id` current; blocks while the driver pins."""
    with cupy().cuda.Device(device_id):
        return _cudart.host_register(ptr, nbytes)


def _unregister_on(device_id: int, ptr: int) -> bool:
    """Wraps `cudaHostUnregister` with `device_id` current; blocks while the driver
    unpins."""
    with cupy().cuda.Device(device_id):
        return _cudart.host_unregister(ptr)


class CudaDevice(Backend):
    """The device half of the CUDA backend: streams, events, host memory, device checks
    and the adoption of the caller's compute stream (no copy paths: see `CudaBackend`)."""

    def __init__(self, device_id: int, tensor_kind: str) -> None:
        try:
            cp = cupy()
        except ImportError as exc:
            raise BackendUnavailableError(f"the cuda backend needs CuPy: {exc}") from exc
        if not cp.is_available():
            raise BackendUnavailableError(
                "the cuda backend needs a usable CUDA GPU (cupy.is_available() is False)"
            )
        self.device_id = max(int(device_id), 0)
        self.tensor_kind = tensor_kind
        self._current_wrappers: dict[int, CudaStream] = {}
        self._torch_raw_stream: Callable[[int], int] | None = None
        #: cudaHostRegister / cudaHostUnregister on this device; not bound methods: host
        #: memory's collection finalizer holds them and must not keep the backend (whose
        #: table cache holds that memory) alive
        self._register: Callable[[int, int], bool] = partial(_register_on, self.device_id)
        self._unregister: Callable[[int], bool] = partial(_unregister_on, self.device_id)
        self._warned_unpinned = False

    def _warn_once(self, message: str) -> None:
        """Log `message` as a warning, once per backend (a path fallback's reason)."""
        if not self._warned_unpinned:
            self._warned_unpinned = True
            log.warning("kvasync: %s", message)

    @abstractmethod
    def warm_up(self) -> None:
        """Bind the device and prepare the copy paths (once; idempotent)."""

    def _device(self) -> Any:
        return device(self.device_id)

    # -- memory ---------------------------------------------------------------------------------
    def check_device_array(self, info: ArrayInfo, what: str) -> None:
        """Wraps `cudaPointerGetAttributes(info.ptr)`; blocks briefly in the driver."""
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

    def allocation_ids(self, infos: Sequence[ArrayInfo]) -> list[int]:
        """Each array's allocation start as the driver sees it (`allocation_range`: arrays
        of one cudaMalloc segment share it); an id of its own for an array reaching past
        that allocation (mapped memory in chunks); the arrays' own ids where it fails."""
        try:
            with self._device():
                cupy().cuda.runtime.setDevice(self.device_id)  # makes its context current
                out = []
                for i, info in enumerate(infos):
                    base, size = _cudart.allocation_range(info.ptr)
                    out.append(base if info.end <= base + size else -1 - i)
                return out
        except Exception as exc:
            log.info("kvasync: cuMemGetAddressRange failed (%s); tensors of separate "
                     "storages are separate allocations", exc)
            return super().allocation_ids(infos)

    def pin_functions(self) -> tuple[Callable[[int, int], bool], Callable[[int], bool]]:
        return self._register, self._unregister

    def alloc_host(
        self, nbytes: int, row_bytes: int, cap: int = MAX_REGISTER_CHUNK_BYTES
    ) -> HostMemory:
        """mmap, then `cudaHostRegister` in chunks (`_hostmem.host_memory`); blocks while
        the driver pins."""
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
        """A non-blocking stream of ours (`create_stream`), after `warm_up()`."""
        self.warm_up()
        return create_stream(self.device_id)

    def compute_load(self) -> ComputeLoad:
        return CudaMatmulLoad(self.device_id)  # fp16 matmuls, not yet started

    def new_event(self, timing: bool = True) -> Event:
        """A blocking-sync event of ours (`create_event`)."""
        return create_event(self.device_id, timing)

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
        """The caller's stream, adopted by handle (never owned: we keep a reference to
        the caller's object and never destroy the handle); None: torch's (or CuPy's)
        current stream. No CUDA call beyond reading the current stream."""
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
        dev = stream_device(override)  # an event of ours cannot be recorded on another's
        if dev is not None and dev != self.device_id:
            raise InvalidTransferError(
                f"compute stream is on CUDA device {dev}, the backend uses {self.device_id}"
            )
        cp = cupy()
        if isinstance(override, cp.cuda.Stream):
            return CudaStream(override.ptr, override, self.device_id)
        handle = getattr(override, "cuda_stream", None)  # torch.cuda.Stream
        if isinstance(handle, int):
            return CudaStream(handle, override, self.device_id)
        proto = getattr(override, "__cuda_stream__", None)
        if callable(proto):
            _, handle = proto()
            return CudaStream(int(handle), override, self.device_id)
        raise InvalidTransferError(
            "compute_stream must be a torch.cuda.Stream, a cupy.cuda.Stream or a kvasync "
            f"CudaStream, got {type(override).__name__}"
        )
