"""Thin bindings to the CUDA calls the CUDA backend needs, and nothing kvasync-specific.

Why a module of its own: CuPy covers the runtime API (streams, events, pinning, per-copy
memcpy) but not `cuMemcpyBatchAsync`, which we reach through ctypes on libcuda. Keeping
the two behind plain functions over integers (pointers, handles) lets the backend stay
readable and lets tests call each binding directly.

Nothing here runs at import: CuPy is imported on first use (`cupy()`), libcuda is opened
on first use (`batch_copier()`), so `import kvasync` never needs a driver.

Rules: only the calls kvasync uses are here; handles and pointers are ints; every
function's docstring opens with the call it wraps and whether the calling thread blocks
(none here waits for the device; pinning blocks while the driver locks pages). Driver
calls made through ctypes raise `CudaCallError`; CuPy's runtime wrappers raise CuPy's
`CUDARuntimeError`, which the functions below catch where their docstring says so. The
streams, events and copy paths (`_cuda_device`, `_cuda_dma`, `_cuda_kernel`,
`_cuda_staged`) reach CuPy only through `cupy()`.

Error state: CuPy's runtime wrappers call `cudaGetLastError` before they raise (CuPy's
`check_status`), so a failed `cudaHostRegister` leaves no pending error behind in CuPy's
(statically linked) runtime; `host_register` relies on that and returns False. Driver API
calls made through ctypes never touch the runtime's error state.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "ACCESS_ORDER_ANY",
    "ACCESS_ORDER_STREAM",
    "HOST_REGISTER_MAPPED",
    "HOST_REGISTER_PORTABLE",
    "BatchCopier",
    "CudaCallError",
    "allocation_range",
    "batch_copier",
    "cupy",
    "driver_version",
    "host_register",
    "host_unregister",
    "is_registered",
    "libcuda",
    "memcpy_2d",
    "memcpy_async",
    "memcpy_each",
    "memcpy_runs",
]

log = logging.getLogger("kvasync")

#: cudaHostRegisterPortable / cudaHostRegisterMapped (values from the CUDA headers)
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
#: CUmemcpySrcAccessOrder
ACCESS_ORDER_STREAM = 1
ACCESS_ORDER_ANY = 3
#: cudaMemcpyDefault: direction inferred from the pointers (UVA)
_MEMCPY_DEFAULT = 4
#: CU_MEM_LOCATION_TYPE_DEVICE / _HOST (hints; ignored for pinned and device memory)
_LOC_DEVICE = 1
_LOC_HOST = 2
#: the most descriptors handed to one cuMemcpyBatchAsync call (vLLM #49276: a 51,828-entry
#: batch crashed the driver; a few thousand per call costs nothing measurable)
MAX_BATCH = 8192

_cupy: ModuleType | None = None
_lock = threading.Lock()


class CudaCallError(RuntimeError):
    """A CUDA API call returned an error code (`code`, `name`, and which `call`)."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        super().__init__(f"{call} failed: {name} ({code}){detail}")
        self.call = call
        self.code = code
        self.name = name


def cupy() -> ModuleType:
    """The `cupy` module, imported on first use (never at kvasync import time); the one
    door to CuPy for every CUDA module of the backend."""
    global _cupy
    if _cupy is None:
        import cupy as cp

        _cupy = cp
    return _cupy


def driver_version() -> int:
    """Wraps `cudaDriverGetVersion`; never blocks. E.g. 13000 for a CUDA 13.0 driver."""
    return int(cupy().cuda.runtime.driverGetVersion())


# -- pinning -----------------------------------------------------------------------------------
def host_register(ptr: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
                  ) -> bool:
    """Wraps `cudaHostRegister(ptr, nbytes, flags)`; blocks while the driver pins the pages.
    False (logged, error state drained) on failure.

    Mapped so a kernel may dereference the host pointer (UVA), portable so every context
    sees the pages as pinned.
    """
    rt = cupy().cuda.runtime
    try:
        rt.hostRegister(ptr, nbytes, flags)
    except Exception as exc:  # CUDARuntimeError; CuPy already called cudaGetLastError
        log.warning("kvasync: cudaHostRegister(%#x, %d) failed: %s", ptr, nbytes, exc)
        return False
    return True


def host_unregister(ptr: int) -> bool:
    """Wraps `cudaHostUnregister(ptr)`; blocks while the driver unpins. False (logged) on
    failure."""
    rt = cupy().cuda.runtime
    try:
        rt.hostUnregister(ptr)
    except Exception as exc:
        log.warning("kvasync: cudaHostUnregister(%#x) failed: %s", ptr, exc)
        return False
    return True


def is_registered(ptr: int) -> bool:
    """Wraps `cudaPointerGetAttributes(ptr)`; never blocks. True if its type is
    `cudaMemoryTypeHost` (pinned / registered); False on any error."""
    rt = cupy().cuda.runtime
    try:
        return int(rt.pointerGetAttributes(ptr).type) == int(rt.memoryTypeHost)
    except Exception:
        return False


# -- per-copy memcpy ----------------------------------------------------------------------------
def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Wraps `cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream)`; returns
    without waiting for the copy. Raises CuPy's `CUDARuntimeError`."""
    cupy().cuda.runtime.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream)


def memcpy_each(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: int) -> None:
    """Wraps one `cudaMemcpyAsync` per descriptor (the fallback where the batch call is
    missing); returns without waiting. Raises CuPy's `CUDARuntimeError`."""
    memcpy_runs(zip(src.tolist(), dst.tolist(), sizes.tolist()), stream)


def memcpy_runs(runs: Iterable[tuple[int, int, int]], stream: int) -> None:
    """Wraps one `cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, stream)` per
    (src, dst, size); returns without waiting. Raises CuPy's `CUDARuntimeError`."""
    copy = cupy().cuda.runtime.memcpyAsync
    for s, d, n in runs:
        copy(d, s, n, _MEMCPY_DEFAULT, stream)


def memcpy_2d(src: np.ndarray, dst: np.ndarray, src_pitch: np.ndarray, dst_pitch: np.ndarray,
              width: np.ndarray, height: np.ndarray, stream: int) -> None:
    """Wraps one `cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
    cudaMemcpyDefault, stream)` per copy: `height` lines of `width` bytes, `src_pitch` /
    `dst_pitch` apart, on a copy engine; returns without waiting. Raises CuPy's
    `CUDARuntimeError`."""
    copy = cupy().cuda.runtime.memcpy2DAsync
    for s, d, sp, dp, w, h in zip(src.tolist(), dst.tolist(), src_pitch.tolist(),
                                  dst_pitch.tolist(), width.tolist(), height.tolist()):
        copy(d, dp, s, sp, w, h, _MEMCPY_DEFAULT, stream)


# -- cuMemcpyBatchAsync -------------------------------------------------------------------------
class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """Mirror of `CUmemcpyAttributes` (cuda.h, 12.8 and 13.x: 24 bytes)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_P = ctypes.c_void_p
_Z = ctypes.c_size_t


class BatchCopier:
    """`cuMemcpyBatchAsync` resolved through `cuGetProcAddress`, called in chunks.

    The CUDA 12.8 ABI takes a `size_t *failIdx` before the stream, the CUDA 13 ABI (the
    `_v2` entry point) does not; which one we ask for follows the driver version. One
    attribute entry (index 0) applies to the whole batch.
    """

    def __init__(self, lib: ctypes.CDLL, driver: int) -> None:
        self.driver = driver
        self.has_fail_idx = True
        self.abi = 0
        fn = None
        for version, fail_idx in ((13000, False), (12080, True)):
            if driver < version:
                continue
            ptr = _get_proc(lib, "cuMemcpyBatchAsync", version)
            if ptr:
                fn, self.has_fail_idx, self.abi = ptr, fail_idx, version
                break
        if fn is None:
            raise CudaCallError("cuGetProcAddress(cuMemcpyBatchAsync)", 500, "CUDA_ERROR_NOT_FOUND")
        argtypes: list[Any] = [_P, _P, _P, _Z, _P, _P, _Z]
        if self.has_fail_idx:
            argtypes.append(ctypes.POINTER(_Z))
        argtypes.append(_P)
        self._fn = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(fn)
        self._lib = lib
        self._idx = (_Z * 1)(0)
        self._attrs: dict[tuple[int, int], _MemcpyAttributes] = {}

    def _attr(self, order: int, src_device: int, dst_device: int) -> _MemcpyAttributes:
        key = (order, src_device * 1024 + dst_device)
        attr = self._attrs.get(key)
        if attr is None:
            attr = _MemcpyAttributes()
            attr.srcAccessOrder = order
            attr.srcLocHint.type = _LOC_DEVICE if src_device >= 0 else _LOC_HOST
            attr.srcLocHint.id = max(src_device, 0)
            attr.dstLocHint.type = _LOC_DEVICE if dst_device >= 0 else _LOC_HOST
            attr.dstLocHint.id = max(dst_device, 0)
            attr.flags = 0
            self._attrs[key] = attr
        return attr

    def __call__(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        sizes: np.ndarray,
        stream: int,
        order: int,
        src_device: int = -1,
        dst_device: int = -1,
        max_batch: int = MAX_BATCH,
    ) -> None:
        """Wraps `cuMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, {0}, 1, [failIdx,]
        stream)`, once per `max_batch` descriptors; returns without waiting for the copies.

        `src`, `dst`, `sizes` are contiguous uint64 arrays (read during the call only);
        `stream` must not be the legacy NULL stream. Raises CudaCallError on failure.
        """
        if stream in (0, 1):
            raise CudaCallError("cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE",
                                ": the legacy NULL stream is not allowed")
        n = len(sizes)
        attr = self._attr(order, src_device, dst_device)
        pattr = ctypes.byref(attr)
        fail = _Z(0)
        base_s, base_d, base_z = src.ctypes.data, dst.ctypes.data, sizes.ctypes.data
        for lo in range(0, n, max_batch):
            cnt = min(max_batch, n - lo)
            off = lo * 8
            args: list[Any] = [base_d + off, base_s + off, base_z + off, cnt, pattr, self._idx, 1]
            if self.has_fail_idx:
                args.append(ctypes.byref(fail))
            args.append(stream)
            rc = self._fn(*args)
            if rc != 0:
                where = f" at descriptor {lo + int(fail.value)}" if self.has_fail_idx else (
                    f" in descriptors [{lo}, {lo + cnt})")
                raise CudaCallError("cuMemcpyBatchAsync", rc, error_name(self._lib, rc), where)


def _get_proc(lib: ctypes.CDLL, name: str, version: int) -> int:
    """Wraps `cuGetProcAddress_v2(name, &pfn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
    &status)`; never blocks.

    Falls back to the 4-argument `cuGetProcAddress` of pre-12.0 drivers. 0 if not found.
    """
    pfn = ctypes.c_void_p(0)
    status = ctypes.c_int(0)
    getter = getattr(lib, "cuGetProcAddress_v2", None)
    if getter is not None:
        getter.restype = ctypes.c_int
        getter.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                           ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        rc = getter(name.encode(), ctypes.byref(pfn), version, 1, ctypes.byref(status))
    else:
        getter = lib.cuGetProcAddress
        getter.restype = ctypes.c_int
        getter.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                           ctypes.c_uint64]
        rc = getter(name.encode(), ctypes.byref(pfn), version, 1)
    if rc != 0 or status.value != 0:
        return 0
    return int(pfn.value or 0)


def error_name(lib: ctypes.CDLL, code: int) -> str:
    """Wraps `cuGetErrorName(code)`; never blocks. A placeholder when the driver does not
    know the code."""
    out = ctypes.c_char_p()
    try:
        fn = lib.cuGetErrorName
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        if fn(code, ctypes.byref(out)) == 0 and out.value:
            return out.value.decode()
    except Exception:
        pass
    return f"CUDA_ERROR_{code}"


_libcuda: ctypes.CDLL | None = None


def libcuda() -> ctypes.CDLL:
    """Wraps `dlopen("libcuda.so.1")` at the first call; raises OSError where it is
    missing."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


def allocation_range(ptr: int) -> tuple[int, int]:
    """Wraps `cuMemGetAddressRange_v2(&base, &size, ptr)`; never blocks. (start, bytes) of
    the allocation holding device address `ptr` (for mapped memory: its mapped chunk); the
    device's context current. Raises CudaCallError."""
    lib, base, size = libcuda(), ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise CudaCallError("cuMemGetAddressRange_v2", rc, error_name(lib, rc))
    return int(base.value), int(size.value)


_batch: BatchCopier | None = None
_batch_missing = False


def batch_copier() -> BatchCopier | None:
    """Wraps `cuDriverGetVersion` and the lookup of `cuMemcpyBatchAsync` (once per
    process); never blocks. The process-wide caller, or None where the driver lacks it
    (drivers before 12.8, or libcuda not loadable)."""
    global _batch, _batch_missing
    with _lock:
        if _batch is not None or _batch_missing:
            return _batch
        try:
            lib = libcuda()
            drv = ctypes.c_int(0)
            lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
            if lib.cuDriverGetVersion(ctypes.byref(drv)) != 0 or drv.value < 12080:
                raise CudaCallError("cuDriverGetVersion", 0, "driver older than 12.8")
            _batch = BatchCopier(lib, drv.value)
        except Exception as exc:
            _batch_missing = True
            log.info("kvasync: cuMemcpyBatchAsync unavailable (%s); DMA uses one "
                     "cudaMemcpyAsync per descriptor", exc)
        return _batch
