"""Shared state of one bench run: the device pool, offloaders per page size, measured ceilings.

The only bench module that touches CUDA (CuPy and torch, imported only when a GPU is usable)
or reads kvasync state that is not public API; sections use `kvasync.Offloader`'s API. Read:

- ``backend.counts`` (CUDA): transfers per concrete path, to say what ``auto`` ran;
- ``backend.grid`` (CUDA): the copy kernels' CTAs, set for the row re-creating vLLM's policy
  (12 CTAs for small loads) and restored after;
- ``backend.calibration()`` (CUDA): what ``auto`` measured at start-up, kept in the metadata;
- ``backend.alloc_host``: host memory of the kind kvasync copies from, for the ceilings
  (measured in `ceilings.py`);
- ``backend._staged`` and ``backend._batch`` (CUDA): the staged path's own slab row copy,
  which `rows.py` runs bare over the host rows at ``cpu_tensors``' addresses, the bound
  under the staged path.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvasync as kv

from .ceilings import Ceilings, sync_round_trips
from .common import GiB, MiB, Options, fmt_size
from .rows import RowCopy, bare_row_seconds, host_rows, row_runs

__all__ = ["BenchUnavailable", "Context", "Ran", "Timing", "bare_rows", "cuda_unavailable_reason",
           "row_copier", "submit"]

#: vLLM's shipped policy: loads below this page size run its Triton kernel with 12 programs,
#: everything else batched DMA (re-created with kvasync's own kernel and DMA paths)
VLLM_LOAD_KERNEL_BELOW = 28 * 1024
VLLM_KERNEL_CTAS = 12
#: seconds any single bench transfer may take before the run reports it stuck
WAIT_S = 300.0


class BenchUnavailable(Exception):
    """This run cannot happen on this machine; the message says why."""


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here (None: it can). Never raises."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); install kvasync[cuda12] or kvasync[cuda13]"
    try:
        if bool(cupy.is_available()):
            return None
    except Exception as exc:
        return f"CuPy cannot reach a GPU ({type(exc).__name__}: {exc})"
    return "CuPy sees no usable CUDA GPU (cupy.is_available() is False)"


def _torch_cuda() -> Any | None:
    """torch, where it is installed and sees the GPU; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def submit(off: kv.Offloader, direction: str, gpu: Any, cpu: Any, **kw: Any) -> kv.Transfer:
    """`off.store` (direction "d2h") or `off.load` ("h2d"), block ids by keyword."""
    if direction == "d2h":
        return off.store(gpu_blocks=gpu, cpu_chunks=cpu, **kw)
    return off.load(cpu_chunks=cpu, gpu_blocks=gpu, **kw)


@dataclass
class Ran:
    """Which concrete copy paths the transfers inside `Context.ran_paths` ran ("?": unknown)."""

    text: str = "?"


@dataclass
class Timing:
    """Wall seconds of each timed transfer, bytes per transfer, median device seconds, and
    the median seconds the call itself held the caller."""

    samples: list[float]
    nbytes: int
    device_seconds: float
    ran: str
    call_seconds: float = 0.0


class Context:
    """One run's device, pool and ceilings; sections take it and return rows.

    The pool is 2 x `total` bytes of device memory (host memory on the host backend) filled
    with random bytes; `offloader(page)` views it as `tensors` KV tensors of `page`-byte
    blocks, one offloader per page size, with host memory for every block.
    """

    def __init__(self, opts: Options, progress: Callable[[str], None] | None = None) -> None:
        reason = cuda_unavailable_reason()
        if opts.backend == "cuda" and reason is not None:
            raise BenchUnavailable(f"--backend cuda cannot run here: {reason}")
        self.opts = opts
        if opts.backend not in ("auto", "cuda", "host"):
            raise BenchUnavailable(f"unknown backend {opts.backend!r}: auto, cuda or host")
        self.gpu = opts.backend == "cuda" or (opts.backend == "auto" and reason is None)
        self.backend_name = "cuda" if self.gpu else "host"
        #: why the GPU sections cannot run (None on a GPU)
        self.no_gpu_reason = None if self.gpu else (
            "the run uses the host backend (--backend host)" if opts.backend == "host"
            else reason)
        self.progress: Callable[[str], None] = progress or (lambda msg: None)
        self.cp: Any = None
        self.torch: Any = None
        if self.gpu:
            import cupy

            self.cp = cupy
            self.torch = _torch_cuda()
        self.quick = opts.quick
        self.total = opts.total_bytes or (GiB if self.gpu else 128 * MiB)
        self.pool_bytes = 2 * self.total
        self.reps = max(1, opts.reps)
        self.tensors = opts.tensors
        for page in opts.pages:
            if not self.fits(page, self.tensors):
                raise BenchUnavailable(
                    f"a transfer of {fmt_size(self.total)} cannot hold one block of "
                    f"{self.tensors} tensors x {fmt_size(page)}: raise --total-mib or lower "
                    "--tensors")
        self.rng = np.random.default_rng(0)
        self.pool = self._random_pool(self.pool_bytes)
        self._offloaders: dict[tuple[int, int], kv.Offloader] = {}
        self._owned: list[kv.Offloader] = []
        self._probe = self.make_offloader([self.device_array((1, 4096))], 1)
        self._ceilings = Ceilings(gpu=self.gpu, cp=self.cp, pool_ptr=self._ptr(self.pool),
                                  total=self.total, pool_bytes=self.pool_bytes,
                                  reps=self.reps, alloc_host=self._probe.backend.alloc_host,
                                  progress=self.progress)
        #: copy paths every section measures: "auto" first, then what the backend offers
        self.paths: tuple[str, ...] = ("auto", *[p for p in self._probe.backend.paths
                                                  if p != "auto"])

    # -- memory and offloaders ------------------------------------------------------------------
    def device_array(self, shape: tuple[int, ...]) -> Any:
        """A zeroed uint8 array in device memory (torch, else CuPy; NumPy on the host)."""
        if self.torch is not None:
            return self.torch.zeros(shape, dtype=self.torch.uint8, device="cuda")
        if self.cp is not None:
            return self.cp.zeros(shape, dtype=self.cp.uint8)
        return np.zeros(shape, dtype=np.uint8)

    def _random_pool(self, nbytes: int) -> Any:
        if self.torch is not None:
            pool = self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")
            pool.random_(0, 256)
            return pool
        if self.cp is not None:
            return self.cp.random.randint(0, 256, nbytes, dtype=self.cp.uint8)
        return self.rng.integers(0, 256, nbytes, dtype=np.uint8)

    def _ptr(self, array: Any) -> int:
        if self.torch is not None:
            return int(array.data_ptr())
        if self.cp is not None:
            return int(array.data.ptr)
        return int(array.ctypes.data)

    def fits(self, page: int, tensors: int) -> bool:
        """Whether one transfer of `total` bytes holds a block of `tensors` x `page`."""
        return tensors * page <= self.total

    def pool_views(self, page: int, tensors: int) -> list[Any]:
        """The pool as `tensors` arrays of (blocks, `page`) bytes."""
        n = self.pool_bytes // (tensors * page)
        flat = self.pool[: tensors * n * page]
        cube = flat.view(tensors, n, page) if self.torch is not None else flat.reshape(
            tensors, n, page)
        return [cube[i] for i in range(tensors)]

    def make_offloader(self, tensors: list[Any], num_cpu_chunks: int,
                       **kwargs: Any) -> kv.Offloader:
        """An Offloader over `tensors` (one group) on this run's backend; closed with the run."""
        kwargs.setdefault("backend", self.backend_name)
        off = kv.Offloader(kv.KVCacheLayout.from_tensors(tensors),
                           num_cpu_chunks=num_cpu_chunks, **kwargs)
        if self.gpu and not off.host_pinned:
            print("WARNING: kvasync could not pin its host memory; every figure is pageable "
                  "DMA", file=sys.stderr)
        self._owned.append(off)
        return off

    def offloader(self, page: int, tensors: int | None = None) -> kv.Offloader:
        """The offloader over the pool viewed as `tensors` (default: the run's) x `page`."""
        t = tensors or self.tensors
        off = self._offloaders.get((page, t))
        if off is None:
            views = self.pool_views(page, t)
            off = self.make_offloader(views, int(views[0].shape[0]))
            self._offloaders[(page, t)] = off
        return off

    def ids(self, page: int, nbytes: int | None = None,
            tensors: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Random distinct GPU block ids and CPU chunk ids (int64) moving about `nbytes`
        (default `total`) with `offloader(page, tensors)`."""
        t = tensors or self.tensors
        n = self.pool_bytes // (t * page)
        k = max(1, min(n, (nbytes or self.total) // (t * page)))
        return self.rng.permutation(n)[:k], self.rng.permutation(n)[:k]

    # -- timing ------------------------------------------------------------------------------------
    @contextmanager
    def ran_paths(self, off: kv.Offloader) -> Iterator[Ran]:
        """Report in the yielded `Ran` which concrete paths ran inside the block."""
        ran = Ran()
        before = _path_counts(off)
        try:
            yield ran
        finally:
            after = _path_counts(off)
            concrete = [p for p in off.backend.paths if p != "auto"]
            if after is not None and before is not None:
                ran.text = "+".join(p for p in after if after[p] > before.get(p, 0)) or "?"
            elif len(concrete) == 1:
                ran.text = concrete[0]

    def time_transfer(self, off: kv.Offloader, direction: str, gpu: Any, cpu: Any,
                      path: str, reps: int | None = None, **kw: Any) -> Timing:
        """`reps` timed transfers after one warm-up: wall seconds from the call until the
        transfer is done (host work included: what an ``await`` sees)."""
        samples: list[float] = []
        device: list[float] = []
        calls: list[float] = []
        moved = 0
        with self.ran_paths(off) as ran:
            for rep in range((reps or self.reps) + 1):
                t0 = time.perf_counter()
                t = submit(off, direction, gpu, cpu, path=path, **kw)
                tc = time.perf_counter()
                r = t.wait(WAIT_S)
                dt = time.perf_counter() - t0
                moved = r.bytes
                if rep:
                    samples.append(dt)
                    device.append(r.seconds)
                    calls.append(tc - t0)
        return Timing(samples, moved, statistics.median(device), ran.text,
                      statistics.median(calls))

    @contextmanager
    def grid(self, off: kv.Offloader, ctas: int | None) -> Iterator[None]:
        """Run the block with the copy kernels at `ctas` CTAs (no-op for None or a backend
        without kernels)."""
        backend: Any = off.backend
        old = getattr(backend, "grid", None)
        if ctas is None or old is None:
            yield
            return
        backend.grid = ctas
        try:
            yield
        finally:
            backend.grid = old

    def vllm_policy(self, direction: str, page: int) -> tuple[str, int | None] | None:
        """(path, kernel CTAs) that re-create vLLM's shipped choice, where this backend has
        both a kernel and a DMA path; None elsewhere."""
        if not {"kernel", "dma"} <= set(self.paths):
            return None
        if direction == "h2d" and page < VLLM_LOAD_KERNEL_BELOW:
            return "kernel", VLLM_KERNEL_CTAS
        return "dma", None

    # -- ceilings (`ceilings.py`) -------------------------------------------------------------
    @property
    def ceiling_note(self) -> str:
        return self._ceilings.note

    def ceiling(self, direction: str) -> float:
        """GB/s of one contiguous copy of `total` bytes in `direction` (median, cached)."""
        return self._ceilings.ceiling(direction)

    def bidirectional_ceiling(self) -> tuple[float, dict[str, float]]:
        """GB/s (both directions summed) of two contiguous copies at once, one each way (the
        best of the variants tried), and each variant's GB/s."""
        return self._ceilings.bidirectional(), dict(self._ceilings.variants)

    def sync_round_trips(self, nbytes: int, reps: int, warm: int) -> list[float]:
        """Seconds of `cudaMemcpyAsync` (pinned host -> device) + `cudaStreamSynchronize`,
        no asyncio: the floor under any awaited round trip (GPU only)."""
        return sync_round_trips(self.cp, nbytes, reps, warm)

    # -- metadata and closing -----------------------------------------------------------------
    def device_name(self) -> str:
        """The GPU's name (the host CPU on the host backend)."""
        if self.torch is not None:
            return str(self.torch.cuda.get_device_name(0))
        if self.cp is not None:
            name = self.cp.cuda.runtime.getDeviceProperties(0)["name"]
            return name.decode() if isinstance(name, bytes) else str(name)
        return f"host CPU ({platform.machine()}, {os.cpu_count()} cores)"

    def meta(self) -> dict[str, Any]:
        """Device, software, options and the ceilings measured so far."""
        versions = {"python": platform.python_version(), "numpy": np.__version__,
                    "kvasync": kv.__version__}
        if self.torch is not None:
            versions["torch"] = str(self.torch.__version__)
        if self.cp is not None:
            versions["cupy"] = str(self.cp.__version__)
            rt = self.cp.cuda.runtime
            versions["cuda_runtime"] = str(rt.runtimeGetVersion())
            versions["cuda_driver"] = str(rt.driverGetVersion())
        meta: dict[str, Any] = {
            "backend": self.backend_name, "device": self.device_name(), "versions": versions,
            "host": f"{platform.platform()}, {os.cpu_count()} cores", "paths": list(self.paths),
            "tensors": self.tensors, "total_bytes": self.total, "reps": self.reps,
            "pages": list(self.opts.pages), "quick": self.quick, "ceiling": self.ceiling_note,
            "ceilings_gbps": {k: round(v, 2) for k, v in self._ceilings.measured.items()}}
        cal = getattr(self._probe.backend, "calibration", None)
        if self.gpu and callable(cal):
            try:
                meta["calibration"] = cal().as_dict()
            except Exception as exc:
                meta["calibration"] = {"error": f"{type(exc).__name__}: {exc}"}
        return meta

    def close(self) -> None:
        """Close every offloader of the run and release the ceiling's host memory."""
        self._ceilings.close()
        for off in reversed(self._owned):
            try:
                off.close(timeout=WAIT_S)
            except Exception as exc:
                print(f"WARNING: closing {off!r} failed: {exc}", file=sys.stderr)
        self._owned.clear()
        self._offloaders.clear()


def _path_counts(off: kv.Offloader) -> dict[str, int] | None:
    """Transfers run per concrete path so far, where the backend counts them (None: not)."""
    counts = getattr(off.backend, "counts", None)
    if not isinstance(counts, dict):
        return None
    return {p: int(counts.get(p, 0)) for p in off.backend.paths if p != "auto"}


def bare_rows(ctx: Context, off: kv.Offloader, cpu: Any, direction: str, stream_ptr: int,
              hold: Callable[[], None]) -> list[float] | None:
    """Event seconds of the copy engines alone on the host rows of `off`'s `cpu` chunks
    (ranked and merged as the staged program does: `rows.row_runs`), to and from `ctx`'s
    device pool, each rep behind `hold()` on the stream at `stream_ptr`
    (`rows.bare_row_seconds`, with the staged path's own row copy); None off the GPU or
    where a row is not one contiguous run."""
    found = host_rows(off.cpu_tensors, cpu) if ctx.gpu else None
    if found is None:
        return None
    starts, sizes = row_runs(*found)
    if int(sizes.sum()) > ctx.pool_bytes:
        return None
    return bare_row_seconds(ctx.cp, starts, sizes, ctx._ptr(ctx.pool), direction, stream_ptr,
                            hold, ctx.reps, row_copier(off))


@dataclass(frozen=True)
class _StreamAt:
    """The stream at an address, as much of one as `StagedPath._dma` reads (`ptr`)."""

    ptr: int


def row_copier(off: kv.Offloader, use_batch: bool = True) -> RowCopy:
    """The staged path's own slab row copy (`StagedPath._dma` of `off`'s CUDA backend: a
    `cudaMemcpyAsync` per run for a lone run or without the batch call, else one
    `cuMemcpyBatchAsync` with its access order and location hints), on the stream at the
    address it is given; `use_batch` False asks for the per-run copies."""
    backend: Any = off.backend
    staged = backend._staged
    batch = backend._batch if use_batch else None

    def copy(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: int,
             store: bool) -> None:
        staged._dma(batch, _StreamAt(stream), src, dst, sizes, store)

    return copy
