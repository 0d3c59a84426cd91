"""The copy paths over raw descriptors (vLLM's copy-op cases and the sizes vLLM cannot do).

Every path must copy exactly the described bytes, for any size and alignment, and touch
no byte outside them (destinations are poisoned first; a tail overrun shows up).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvasync._backends import _cudart
from kvasync._backends._cuda import CudaBackend, CudaEvent, CudaStream
from kvasync._program import TransferPlan

pytestmark = pytest.mark.gpu

VLLM_SIZES = [8, 4096, 8192, 8200, 16384, 4088]
ODD_SIZES = [1, 3, 4097, 70001, 2 * 1024 * 1024 + 5]
#: (source misalignment, destination misalignment): congruent mod 16, 8, 4, and not at all
OFFSETS = [(0, 0), (5, 5), (8, 0), (4, 12), (3, 7), (1, 0)]
PATHS = ["kernel", "dma", "dma-each"]
POISON = 0xA5


def _backend(path: str) -> tuple[CudaBackend, str]:
    if path == "dma-each":
        return CudaBackend(0, "cupy", use_batch_api=False), "dma"
    return CudaBackend(0, "cupy"), path


class Region:
    """A byte region on the device or in pinned host memory, readable as numpy."""

    def __init__(self, backend: CudaBackend, where: str, nbytes: int) -> None:
        import cupy

        self.where = where
        self.nbytes = nbytes
        if where == "host":
            self.mem = backend.alloc_host(nbytes, 4096)
            assert self.mem.pinned
            self.host = self.mem.array[:nbytes]
            self.ptr = self.mem.ptr
        else:
            self.dev = cupy.zeros(nbytes, dtype=cupy.uint8)
            self.ptr = int(self.dev.data.ptr)

    def write(self, data: np.ndarray) -> None:
        import cupy

        if self.where == "host":
            self.host[:] = data
        else:
            self.dev.set(data)
            cupy.cuda.runtime.deviceSynchronize()

    def read(self) -> np.ndarray:
        if self.where == "host":
            return self.host.copy()
        return self.dev.get()

    def close(self) -> None:
        if self.where == "host":
            self.mem.release()


def _layout(sizes: list[int], s_off: int, d_off: int) -> tuple[list[int], list[int], int]:
    """Descriptor offsets with a gap after each (so overruns hit poisoned bytes)."""
    src, dst = [], []
    pos = 64
    for n in sizes:
        src.append(pos + s_off)
        dst.append(pos + d_off)
        pos += n + 64 + 17
    return src, dst, pos + 64


def _run(backend: CudaBackend, path: str, direction: str, src: np.ndarray, dst: np.ndarray,
         sizes: np.ndarray) -> CudaEvent:
    stream = backend.new_stream()
    end = backend.new_event()
    plan = TransferPlan.raw(None, src, dst, sizes)  # type: ignore[arg-type]
    backend.enqueue_copy(stream, plan, direction, path)  # type: ignore[arg-type]
    stream.record(end)
    assert end.synchronize(timeout=30)
    assert isinstance(end, CudaEvent)
    return end


def _check(
    backend: CudaBackend, path: str, kinds: tuple[str, str], sizes: list[int], s_off: int,
    d_off: int, repeat: int = 1,
) -> None:
    sizes = sizes * repeat
    so, do, total = _layout(sizes, s_off, d_off)
    src_r = Region(backend, kinds[0], total)
    dst_r = Region(backend, kinds[1], total)
    try:
        data = np.random.default_rng(len(sizes) + s_off).integers(0, 256, total, dtype=np.uint8)
        src_r.write(data)
        dst_r.write(np.full(total, POISON, dtype=np.uint8))
        direction = "h2d" if kinds[0] == "host" else "d2h"
        ev = _run(
            backend, path, direction,
            np.asarray(so, np.uint64) + np.uint64(src_r.ptr),
            np.asarray(do, np.uint64) + np.uint64(dst_r.ptr),
            np.asarray(sizes, np.uint64),
        )
        assert ev.error() is None
        want = np.full(total, POISON, dtype=np.uint8)
        for s, d, n in zip(so, do, sizes):
            want[d : d + n] = data[s : s + n]
        got = dst_r.read()
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{bad.size} wrong bytes, first at {bad[:5].tolist()}"
    finally:
        src_r.close()
        dst_r.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kinds", [("host", "dev"), ("dev", "host"), ("dev", "dev")],
                         ids=["h2d", "d2h", "d2d"])
def test_vllm_copy_op_sizes(path: str, kinds: tuple[str, str]) -> None:
    """vLLM's swap_blocks cases: sizes [8, 4096, 8192, 8200, 16384, 4088] x 8."""
    backend, concrete = _backend(path)
    _check(backend, concrete, kinds, VLLM_SIZES, 0, 0, repeat=8)
    backend.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("offsets", OFFSETS, ids=[f"{a}-{b}" for a, b in OFFSETS])
@pytest.mark.parametrize("kinds", [("host", "dev"), ("dev", "host")], ids=["h2d", "d2h"])
def test_any_size_and_alignment(path: str, offsets: tuple[int, int], kinds: tuple[str, str]
                                ) -> None:
    backend, concrete = _backend(path)
    _check(backend, concrete, kinds, VLLM_SIZES + ODD_SIZES, *offsets)
    backend.close()


def test_many_small_descriptors_chunk_the_batch_call() -> None:
    """20,000 x 128 B: more than one cuMemcpyBatchAsync chunk (8192)."""
    backend = CudaBackend(0, "cupy")
    if not backend.batch_available:
        pytest.skip("driver has no cuMemcpyBatchAsync")
    _check(backend, "dma", ("host", "dev"), [128] * 20000, 0, 0)
    assert backend.counts["dma_batch"] == 1
    backend.close()


def test_batch_dma_runs_on_our_stream_not_the_legacy_one() -> None:
    backend = CudaBackend(0, "cupy")
    stream = backend.new_stream()
    assert isinstance(stream, CudaStream) and stream.ptr not in (0, 1, 2)
    if not backend.batch_available:
        pytest.skip("driver has no cuMemcpyBatchAsync")
    _check(backend, "dma", ("dev", "host"), [4096] * 64, 0, 0)
    assert backend.counts["dma_batch"] == 1 and backend.counts["dma_each"] == 0
    batch = _cudart.batch_copier()
    assert batch is not None
    z = np.zeros(1, np.uint64)
    with pytest.raises(_cudart.CudaCallError, match="legacy"):
        batch(z, z, z, 0, _cudart.ACCESS_ORDER_STREAM)
    backend.close()


def test_per_copy_fallback_is_used_without_the_batch_api() -> None:
    backend = CudaBackend(0, "cupy", use_batch_api=False)
    _check(backend, "dma", ("host", "dev"), [4096, 3, 8200], 0, 0)
    assert backend.counts["dma_each"] == 1 and backend.counts["dma_batch"] == 0
    backend.close()


def test_empty_plan_enqueues_nothing() -> None:
    backend = CudaBackend(0, "cupy")
    e = np.zeros(0, np.uint64)
    for path in ("kernel", "dma"):
        ev = _run(backend, path, "h2d", e, e, e)
        assert ev.error() is None
    assert backend.counts["kernel"] == 0 and backend.counts["dma"] == 0
    backend.close()


@pytest.mark.parametrize("grid", [1, 3, 64])
def test_grid_size_is_a_parameter(grid: int) -> None:
    backend = CudaBackend(0, "cupy", grid=grid)
    _check(backend, "kernel", ("host", "dev"), [4096] * 100 + [70001], 0, 0)
    backend.close()


def test_kernel_warm_up_compiles_once(cp: Any) -> None:
    backend = CudaBackend(0, "cupy")
    backend.warm_up()
    assert backend.kernel_available
    first = backend._kernels._flat
    backend.warm_up()
    assert backend._kernels._flat is first
    backend.close()
