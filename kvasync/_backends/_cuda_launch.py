"""`cuLaunchKernel` through ctypes: the copy kernels' launch without CuPy's per-call
argument packing (a thin binding, like `_cudart`, kept in its own module)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from ._cudart import CudaCallError, error_name, libcuda

__all__ = ["KernelLauncher"]

_P = ctypes.c_void_p


class KernelLauncher:
    """`cuLaunchKernel` of one compiled function whose parameters are all 64-bit words.

    Why not CuPy's launch: it converts and packs every argument per call (7-8 us on the
    H200's host, measured), a third of a small transfer's budget; this writes the words
    into a per-thread parameter buffer and makes one ctypes call (~1-2 us). The driver
    copies the parameters during the call, so the buffer is reusable when it returns.
    The calling thread must have the function's context current (any runtime call on the
    device, e.g. the event record before every copy, makes it so).
    """

    def __init__(self, function_ptr: int, nargs: int) -> None:
        lib = libcuda()
        fn = lib.cuLaunchKernel
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, _P, _P, _P]
        self._fn = fn
        self._lib = lib
        self._func = int(function_ptr)
        self.nargs = nargs
        self._local = threading.local()

    def _buffers(self) -> tuple[Any, Any]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            words = (ctypes.c_uint64 * self.nargs)()
            base = ctypes.addressof(words)
            params = (ctypes.c_void_p * self.nargs)(*[base + 8 * i for i in range(self.nargs)])
            bufs = self._local.bufs = (words, params)
        return bufs

    def __call__(self, grid: int, block: int, stream: int, args: list[int]) -> None:
        """Wraps `cuLaunchKernel(f, grid,1,1, block,1,1, 0, stream, params, NULL)`; returns
        without waiting for the kernel. Raises CudaCallError on failure."""
        words, params = self._buffers()
        words[:] = args
        rc = self._fn(self._func, grid, 1, 1, block, 1, 1, 0, stream, params, None)
        if rc != 0:
            raise CudaCallError("cuLaunchKernel", rc, error_name(self._lib, rc))
