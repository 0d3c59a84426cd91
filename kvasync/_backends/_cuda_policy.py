"""Choosing a CUDA copy path: the measured calibration and the "auto" rules. Never enqueues
anything itself (measuring drives the backend's own enqueue).

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

The thresholds below are the defaults of `CudaBackend`'s class attributes of the same
names (the backend passes its current values to `choose_auto`):

- `URGENT_KERNEL`: an urgent transfer under "auto" takes the kernel path: the copy engines
  do not let a later stream's copy pass batch DMA already queued, whatever the stream
  priority. Measured on the H200 (docs/benchmarks/h200/fanout/once/), a 256 KiB urgent
  load behind a 512 MiB load of random 256 KiB pages: DMA 1.12 ms p50 (10.2 ms without
  the helper streams), kernel 0.30 ms; behind stores and contiguous loads both stay
  < 0.4 ms.
- `CONTENDED_DMA_BYTES`: while the other direction has transfers in flight, "auto" sends
  descriptors of at least this many bytes (mean) to DMA: a store and a load at once on
  the H200 (1 submitting thread) reached, as % of the bidirectional ceiling, 2 MiB pages
  dma/dma 91 against kernel/kernel 74 and auto 84; 64 KiB 68 against 61 and 62
  (docs/benchmarks/h200/lazy/bench/); 0 turns it off.
- `STAGED_MIN_BYTES`: "auto" sends transfers of at least this many bytes to "staged"
  (when the plan can be staged, the lane is not urgent and the plan is not one layer of a
  layer-wise load); 0 turns staged off under "auto". Below it, a transfer's fixed host
  cost (program, job upload, events: ~50-100 us) outweighs what the copy engines save on
  the link.
- `STAGED_MAX_PAGE_BYTES`: ... and whose descriptors average less than this many bytes.
  Pages of 256 KiB and more need no staging: DMA moves them near the ceiling alone (0.94 /
  0.91 of it against staged 0.93 / 0.91, H200, 64 tensors) and, beside a bf16 matmul loop,
  kept the matmul at 100% while moving 96% / 92% of the link, where staged moved 37%
  (docs/benchmarks/bench.json, section interference). At 4-16 KiB staged moved 59-77% of
  the link at 96-101% of the matmul; the kernel cut the matmul to 64% on stores and DMA is
  driver-bound.
- `PITCHED_MIN_LINE_BYTES` / `PITCHED_MIN_HEIGHT`: "auto" sends a plan to "pitched" (one
  2-D copy per block and run of evenly spaced tensors, copy engines only) ahead of every
  rule but the urgent one when its pages average at least `PITCHED_MIN_LINE_BYTES` and its
  copies at least `PITCHED_MIN_HEIGHT` lines (not for one layer of a layer-wise load: a
  layer's copies are 2 lines); 0 turns it off. Measured on an H100 (64 tensors of one
  pool, 1 GiB per transfer, random blocks, docs/benchmarks/bench.json): alone at 64 /
  256 KiB / 2 MiB pages pitched moved 0.95 / 0.98 / 0.99 of the ceiling (h2d) and 0.94 /
  0.97 / 0.99 (d2h), staged 0.96 / 0.95 / - and 0.95 / 0.95 / -; store and load at once
  at 64 KiB 0.94 of the bidirectional ceiling against staged 0.92; beside a bf16 matmul
  loop at 256 KiB it kept 97-98% of the matmul at 94-98% of the link, staged 92-97% at
  50-71%. At 16 KiB its copies ran at 0.73 / 0.73 alone (staged 0.95 / 0.94), and at
  4 KiB at 0.49 / 0.55: smaller pages stay staged. A run of lines never crosses an
  allocation (the driver refuses such a 2-D copy), so tensors allocated one by one make
  short copies and stay on the other rules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ._base import Direction, HostMemory, Stream
from ._calibrated import Preference, preferred
from ._cuda_device import CudaStream, device
from ._cudart import cupy

if TYPE_CHECKING:
    from .._program import TransferPlan

__all__ = [
    "CAL_BYTES",
    "CAL_PAGES",
    "CONTENDED_DMA_BYTES",
    "PITCHED_MIN_HEIGHT",
    "PITCHED_MIN_LINE_BYTES",
    "STAGED_MAX_PAGE_BYTES",
    "STAGED_MIN_BYTES",
    "URGENT_KERNEL",
    "Calibration",
    "choose_auto",
    "device_calibration",
    "measure",
]

log = logging.getLogger("kvasync")

URGENT_KERNEL = True
CONTENDED_DMA_BYTES = 64 << 10
STAGED_MIN_BYTES = 2 << 20
STAGED_MAX_PAGE_BYTES = 128 << 10
PITCHED_MIN_LINE_BYTES = 64 << 10
PITCHED_MIN_HEIGHT = 8.0
#: the concrete paths calibration times
PATHS = ("kernel", "dma")


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


def choose_auto(
    direction: Direction, plan: TransferPlan, urgent: bool, other_busy: bool, layered: bool,
    urgent_kernel: bool, contended_dma_bytes: int, staged_min_bytes: int,
    stage: Callable[[TransferPlan, Direction], bool], calibration: Callable[[], Calibration],
    staged_max_page_bytes: int = STAGED_MAX_PAGE_BYTES,
    pitched_min_line_bytes: int = 0, pitch: Callable[[TransferPlan], float] | None = None,
    pitched_min_height: float = PITCHED_MIN_HEIGHT, pref: Preference | None = None,
) -> str:
    """The "auto" rules for `plan` (whose host side is pinned and registered), in order:
    urgent -> kernel; empty -> dma; not layered, pages of at least `pitched_min_line_bytes`
    on average and `pitch(plan)` (lines per 2-D copy, 0 where the plan has no pitched
    form) at least `pitched_min_height` -> pitched; big enough, descriptors below
    `staged_max_page_bytes` on average, and `stage(plan, direction)` (which builds the
    staged program, False if the plan cannot be staged) -> staged; the other direction busy
    with big descriptors -> dma; else the calibration's choice (`calibration()` measures at
    its first call). A calibration beside compute (`pref`, `Offloader.calibrate`) goes
    ahead of the staged rule where it covers the plan (`preferred`). Reads `plan.nbytes`,
    `plan.num_descriptors` and what `pitch` and `stage` read; positional arguments: this
    runs on every submission."""
    nbytes, count = plan.nbytes, plan.num_descriptors
    if urgent and urgent_kernel:
        return "kernel"
    if count == 0:
        return "dma"
    if pitched_min_line_bytes and pitch is not None and not layered \
            and nbytes >= pitched_min_line_bytes * count and pitch(plan) >= pitched_min_height:
        return "pitched"
    if pref is not None:
        chosen = preferred(pref, plan, urgent, layered,
                           lambda path: path != "staged" or stage(plan, direction))
        if chosen is not None:
            return chosen
    if staged_min_bytes and nbytes >= staged_min_bytes and not layered \
            and nbytes < staged_max_page_bytes * count and stage(plan, direction):
        return "staged"
    if other_busy and contended_dma_bytes and nbytes >= contended_dma_bytes * count:
        return "dma"
    return calibration().choose(direction, nbytes, count)


_CALIBRATIONS: dict[int, Calibration] = {}
_CAL_LOCK = threading.Lock()
#: page sizes calibrated (bytes)
CAL_PAGES = (4096, 16384, 65536, 262144, 1048576, 2097152)
#: bytes per calibration transfer (large enough that fixed costs are a few percent)
CAL_BYTES = 64 * 1024 * 1024


def device_calibration(device_id: int, measure: Callable[[], Calibration]) -> Calibration:
    """The device's measured path costs (`measure()` at the first call in the process;
    the H200 reference figures if that fails)."""
    cal = _CALIBRATIONS.get(device_id)
    if cal is not None:
        return cal
    with _CAL_LOCK:
        cal = _CALIBRATIONS.get(device_id)
        if cal is None:
            try:
                cal = measure()
            except Exception as exc:
                log.error("kvasync: calibrating the copy paths failed (%s); using the "
                          "H200 reference figures", exc)
                cal = Calibration.static_default()
                cal.notes.append(f"measuring failed: {exc}")
            _CALIBRATIONS[device_id] = cal
    return cal


#: the backend's enqueue of one plan on one concrete path (`CudaBackend._enqueue`)
Enqueue = Callable[[CudaStream, "TransferPlan", Direction, str], None]


def measure(device_id: int, warm_up: Callable[[], None],
            alloc_host: Callable[[int, int], HostMemory], new_stream: Callable[[], Stream],
            enqueue: Enqueue) -> Calibration:
    """Time both paths per direction and page size on scratch buffers (~0.3-0.5 s);
    blocks the calling thread (`cudaStreamSynchronize` after every timed transfer)."""
    t_start = time.perf_counter()
    warm_up()
    cp = cupy()
    pages = list(CAL_PAGES)
    gbps: dict[str, dict[str, list[float]]] = {
        d: {p: [] for p in PATHS} for d in ("h2d", "d2h")}
    latency: dict[str, dict[str, float]] = {d: {} for d in ("h2d", "d2h")}
    host = alloc_host(CAL_BYTES * 2, 4096)
    reps = 3
    try:
        if not host.pinned:
            raise RuntimeError("scratch host memory could not be pinned")
        with device(device_id):
            dev_base = int(cp.cuda.runtime.malloc(CAL_BYTES * 2))
            stream: CudaStream | None = None
            try:
                new = new_stream()
                assert isinstance(new, CudaStream)
                stream = new
                rng = np.random.default_rng(0)
                host_base = host.ptr
                for direction in ("h2d", "d2h"):
                    # fixed cost first (one 4 KiB copy), so rates below exclude it
                    one = np.full(1, 4096, dtype=np.uint64)
                    s1 = np.asarray([host_base if direction == "h2d" else dev_base], np.uint64)
                    d1 = np.asarray([dev_base if direction == "h2d" else host_base], np.uint64)
                    for path in PATHS:
                        latency[direction][path] = min(
                            _time_raw(enqueue, stream, direction, path, s1, d1, one)
                            for _ in range(5))
                    for page in pages:
                        n = CAL_BYTES // page
                        slots = 2 * n
                        g = rng.permutation(slots)[:n].astype(np.uint64) * np.uint64(page)
                        h = rng.permutation(slots)[:n].astype(np.uint64) * np.uint64(page)
                        gd, hd = g + np.uint64(dev_base), h + np.uint64(host_base)
                        src, dst = (hd, gd) if direction == "h2d" else (gd, hd)
                        sizes = np.full(n, page, dtype=np.uint64)
                        for path in PATHS:
                            t = min(_time_raw(enqueue, stream, direction, path, src, dst, sizes)
                                    for _ in range(reps))
                            t = max(t - latency[direction][path], 0.05 * t)
                            gbps[direction][path].append(n * page / t / 1e9)
            finally:  # every way out: nothing queued still reads the scratch as it goes
                _drop_scratch(cp, stream, dev_base)
    finally:
        host.release()
    cal = Calibration(pages, gbps, latency, True, time.perf_counter() - t_start)
    log.info("kvasync: calibrated copy paths in %.2f s: %s", cal.seconds, cal.gbps)
    return cal


def _drop_scratch(cp: Any, stream: CudaStream | None, dev_base: int) -> None:
    """Wait for what the calibration queued on `stream`, then free its device scratch
    (errors dropped: a failed calibration falls back to the static table, and 128 MiB of
    device memory stayed allocated for good)."""
    try:
        if stream is not None:
            cp.cuda.runtime.streamSynchronize(stream.ptr)
    except Exception:
        pass
    try:
        cp.cuda.runtime.free(dev_base)
    except Exception:
        pass


def _time_raw(
    enqueue: Enqueue, stream: CudaStream, direction: Direction, path: str,
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
) -> float:
    """Wall seconds from the first host call until the copies drained (blocks in
    `cudaStreamSynchronize`)."""
    from .._program import TransferPlan

    rt = cupy().cuda.runtime
    t0 = time.perf_counter()
    plan = TransferPlan.raw(None, src, dst, sizes)  # type: ignore[arg-type]
    enqueue(stream, plan, direction, path)
    rt.streamSynchronize(stream.ptr)
    return max(time.perf_counter() - t0, 1e-9)
