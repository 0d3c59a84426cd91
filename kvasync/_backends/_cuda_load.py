"""The CUDA backend's compute load for a calibration beside compute: a matmul loop.

Facts it is built on: a model's big GEMMs hold every SM for milliseconds at a time, so an SM
copy kernel beside them either waits for SMs or takes them from the model; the copy engines
take none. `n` = 8192 half-precision matmuls (~1-2 ms each on an H100/H200, all SMs busy)
behave like the bench's bf16 loop (`kvasync.bench`, section interference). CuPy runs them
(cuBLAS), so the calibration needs no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from ._calibrated import ComputeLoad
from ._cudart import cupy

__all__ = ["CudaMatmulLoad"]


class CudaMatmulLoad(ComputeLoad):
    """`n` x `n` fp16 matmuls on their own non-blocking stream, `depth` kept queued by the
    feeder thread; each one's end is a timing event. `side` is an idle non-blocking stream
    for the measured transfers and for the window's marks (`cudaEventRecord` there runs at
    once, so a mark's time is when the host reached it)."""

    def __init__(self, device_id: int, n: int = 8192, depth: int = 6) -> None:
        super().__init__()
        cp = cupy()
        self._device_id = device_id
        self._depth = depth
        with cp.cuda.Device(device_id):
            self._stream = cp.cuda.Stream(non_blocking=True)
            self.side = cp.cuda.Stream(non_blocking=True)
            rng = cp.random.default_rng(0)
            self._a = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
            self._b = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
            self._c = cp.empty((n, n), dtype=cp.float16)
            cp.cuda.Device(device_id).synchronize()
            self._base = cp.cuda.Event(block=True)
            self._base.record(self._stream)
        self._events: list[Any] = []

    def _run(self) -> None:
        cp = cupy()
        pending: deque[Any] = deque()
        with cp.cuda.Device(self._device_id), self._stream:
            while not self._stop.is_set():
                cp.matmul(self._a, self._b, out=self._c)
                ev = cp.cuda.Event(block=True)  # timing; `synchronize` sleeps, no spin
                ev.record(self._stream)
                self._events.append(ev)
                pending.append(ev)
                if len(pending) >= self._depth:
                    pending.popleft().synchronize()
            self._stream.synchronize()

    def _ends(self) -> list[float]:
        """`cudaEventElapsedTime` from the base event to every matmul's end, in seconds
        (waits for the last one queued so far: `cudaEventSynchronize`)."""
        cp = cupy()
        events = list(self._events)
        if events:
            events[-1].synchronize()
        return [cp.cuda.get_elapsed_time(self._base, ev) / 1e3 for ev in events]

    def _mark(self) -> Callable[[], float]:
        cp = cupy()
        with cp.cuda.Device(self._device_id):
            ev = cp.cuda.Event(block=True)
            ev.record(self.side)

        def at() -> float:
            ev.synchronize()
            return float(cp.cuda.get_elapsed_time(self._base, ev)) / 1e3

        return at

    def close(self) -> None:
        """Stop the feeder, then hand the matmul's memory back to the device (CuPy's pool
        would keep it from the model: `cudaFree` through `free_all_blocks`)."""
        super().close()
        self._events.clear()
        self._a = self._b = self._c = None
        cupy().get_default_memory_pool().free_all_blocks()
