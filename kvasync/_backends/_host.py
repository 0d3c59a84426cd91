"""The host backend: host memory stands in for the GPU, a thread stands in for each stream.

Not a mock. A `HostStream` is an ordered worker thread that executes the very descriptor
arrays the CUDA backend executes (`memmove` per descriptor), records events when it reaches
them and waits on other streams' events. Every descriptor is bounds-checked against the
memory the offloader registered, so a pointer-math bug shows up as a failed transfer (the
host analogue of an illegal-address fault), never as a segfault or silently wrong bytes.

It is what CI, laptops and notebooks without a GPU use.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import InvalidTransferError, TransferFailedError
from .._hostmem import host_memory
from .._program import (
    StagedProgram,
    build_pitched,
    check_pitchable,
    check_stageable,
    kernel_plan,
    pitched_lines,
    prepare_staged,
    slab_descriptors,
    stageable,
)
from ._base import Backend, Direction, Event, HostMemory, Stream
from ._calibrated import ComputeLoad, HostMatmulLoad, preferred

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._program import TransferPlan

__all__ = ["AddressRanges", "HostBackend", "HostEvent", "HostStream"]

_memmove = ctypes.memmove


class _Mark:
    """One recording of an event: what a wait captured at enqueue time (CUDA's rule)."""

    __slots__ = ("error", "flag", "time")

    def __init__(self, done: bool) -> None:
        self.flag = threading.Event()
        if done:
            self.flag.set()
        self.time = 0.0
        self.error: BaseException | None = None


class HostEvent(Event):
    """Completes when its stream's worker reaches it; carries the stream's failure, if any.

    Like cudaStreamWaitEvent, a wait captures the event's latest recording when it is
    enqueued; recording the event again later does not move what that wait waits for.
    """

    def __init__(self) -> None:
        self._mark = _Mark(done=True)  # an unrecorded event counts as complete

    def _arm(self) -> _Mark:
        self._mark = _Mark(done=False)
        return self._mark

    def query(self) -> bool:
        return self._mark.flag.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        return self._mark.flag.wait(timeout)

    def error(self) -> BaseException | None:
        return self._mark.error

    def elapsed_seconds(self, end: Event) -> float:
        assert isinstance(end, HostEvent)
        return max(end._mark.time - self._mark.time, 0.0)

    def __repr__(self) -> str:
        return f"<HostEvent {'done' if self.query() else 'pending'}>"


_STOP = object()


class HostStream(Stream):
    """An ordered queue of host work run by one daemon thread (started lazily).

    A failure (a copy that faults, or waiting on an event that carries a failure) sticks to
    the stream: later copies on it are skipped and later events carry the error, as a
    CUDA error poisons the work behind it.
    """

    def __init__(self, backend: HostBackend | None = None, name: str = "kvasync-host") -> None:
        self._backend = backend
        self._name = name
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def _put(self, item: Any) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._q.put(item)

    def record(self, event: Event) -> None:
        assert isinstance(event, HostEvent)
        self._put(("record", event._arm()))

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, HostEvent)
        self._put(("wait", event._mark))

    def enqueue(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` on the stream (used by copies and by tests as 'compute')."""
        self._put(("call", fn, args))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            op = item[0]
            if op == "record":
                mark: _Mark = item[1]
                mark.time = time.perf_counter()
                mark.error = self._error
                mark.flag.set()
            elif op == "wait":
                mark = item[1]
                mark.flag.wait()
                if mark.error is not None and self._error is None:
                    self._error = mark.error
            elif op == "call":
                if self._error is not None:
                    continue
                try:
                    item[1](*item[2])
                except BaseException as exc:
                    self._error = exc

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._q.put(_STOP)
            thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "running" if self.alive else "idle"
        return f"<HostStream {self._name} {state}>"


class AddressRanges:
    """The address ranges copies may touch, merged and sorted; `check` fails descriptors
    outside them as a device would fault on an illegal address (thread-safe)."""

    def __init__(self, where: str = "the registered tensors") -> None:
        self._where = where
        self._ranges: list[tuple[int, int]] = []
        self._starts = np.zeros(0, dtype=np.uint64)
        self._ends = np.zeros(0, dtype=np.uint64)
        self._lock = threading.Lock()

    def add(self, lo: int, hi: int) -> None:
        with self._lock:
            merged: list[tuple[int, int]] = []
            for a, b in sorted([*self._ranges, (lo, hi)]):
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            self._ranges = merged
            self._starts = np.asarray([a for a, _ in merged], dtype=np.uint64)
            self._ends = np.asarray([b for _, b in merged], dtype=np.uint64)

    def add_array(self, info: ArrayInfo) -> tuple[int, int] | None:
        """Add every byte an array's rows span; returns that range (None if empty)."""
        if info.nbytes == 0:
            return None
        lo = info.ptr
        hi = max(info.ptr + (info.shape[0] - 1) * info.row_stride + info.row_bytes,
                 info.ptr + info.nbytes)
        self.add(lo, hi)
        return lo, hi

    def check(self, ptrs: np.ndarray, sizes: np.ndarray, what: str = "descriptor") -> None:
        starts, ends = self._starts, self._ends
        idx = np.searchsorted(starts, ptrs, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        ok &= (ptrs + sizes) <= ends[safe]
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise TransferFailedError(
                f"illegal address: {what} {bad} [{int(ptrs[bad]):#x}, +{int(sizes[bad])}) "
                f"lies outside {self._where}"
            )


class _HostRing:
    """The staging buffers of one direction of the "staged" path."""

    def __init__(self, nbytes: int) -> None:
        self.slab_bytes = max(int(nbytes) // 2, 1)
        try:
            self.buffers = [host_memory(self.slab_bytes, self.slab_bytes) for _ in range(2)]
        except (OSError, MemoryError) as exc:
            raise InvalidTransferError(f"cannot allocate the staged path's staging_bytes="
                                       f"{nbytes} per direction: {exc}") from exc
        self.lock = threading.Lock()


class HostBackend(Backend):
    """Backend whose device memory is host memory; used without a GPU."""

    name = "host"
    paths = ("memmove", "staged", "pitched")
    #: staging bytes per direction of the "staged" path (two buffers of half each)
    STAGING_BYTES = 8 << 20

    def __init__(self, tensor_kind: str = "numpy", device_id: int = -1) -> None:
        self._bounds = AddressRanges()
        self._streams: list[HostStream] = []
        self._fail_next: list[BaseException] = []
        self.staging_bytes = self.STAGING_BYTES
        self._rings: dict[str, _HostRing] = {}
        self._ring_lock = threading.Lock()
        #: how many transfers each concrete path ran (for tests and the benchmark)
        self.counts: dict[str, int] = {"memmove": 0, "staged": 0, "pitched": 0}

    # -- memory ------------------------------------------------------------------------------
    def check_device_array(self, info: ArrayInfo, what: str) -> None:
        if info.device != "cpu":
            raise InvalidTransferError(
                f"{what}: the host backend needs host (CPU) arrays, got {info.device} memory; "
                "use backend='cuda' for GPU tensors"
            )

    def register_array(self, info: ArrayInfo) -> None:
        self._bounds.add_array(info)

    def _add_range(self, lo: int, hi: int) -> None:
        self._bounds.add(lo, hi)

    def alloc_host(self, nbytes: int, row_bytes: int) -> HostMemory:
        mem = host_memory(nbytes, row_bytes)
        self._add_range(mem.ptr, mem.ptr + mem.nbytes)
        return mem

    def _check_bounds(self, ptrs: np.ndarray, sizes: np.ndarray) -> None:
        self._bounds.check(ptrs, sizes)

    # -- streams and events ----------------------------------------------------------------
    def new_stream(self) -> Stream:
        s = HostStream(self, name=f"kvasync-host-{len(self._streams)}")
        self._streams.append(s)
        return s

    def new_event(self, timing: bool = True) -> Event:
        return HostEvent()

    def compute_stream(self, override: Any | None) -> Stream | None:
        if override is None:
            return None  # host writes are synchronous: nothing is pending
        if not isinstance(override, HostStream):
            raise InvalidTransferError(
                f"the host backend's compute stream must be a HostStream, got {type(override)}"
            )
        return override

    # -- copies ----------------------------------------------------------------------------
    def inject_fault(self, error: BaseException | None = None) -> None:
        """Test hook: the next copy this backend executes fails with `error`."""
        self._fail_next.append(error or TransferFailedError("injected device fault"))

    def resolve_path(
        self, path: str, direction: Direction, plan: TransferPlan, host_pinned: bool,
        urgent: bool = False, other_busy: bool = False, layered: bool = False,
    ) -> str:
        if path == "staged":
            check_stageable(plan, direction, self._ring(direction).slab_bytes)
            return path
        if path == "pitched":
            check_pitchable(plan)
            return path
        if path != "auto":  # "memmove", as asked
            return "memmove"
        chosen = preferred(self.preference(direction), plan, urgent, layered, lambda p: (
            p == "memmove" or (p == "staged" and stageable(
                lambda: self._ring(direction).slab_bytes, plan, direction == "d2h"))))
        return chosen or "memmove"

    def compute_load(self) -> ComputeLoad:
        """NumPy matmuls in a thread (`HostMatmulLoad`), not yet started."""
        return HostMatmulLoad()

    def _ring(self, direction: str) -> _HostRing:
        ring = self._rings.get(direction)
        if ring is not None:
            return ring
        with self._ring_lock:
            ring = self._rings.get(direction)
            if ring is None:
                ring = _HostRing(self.staging_bytes)
                for buf in ring.buffers:
                    self._add_range(buf.ptr, buf.ptr + buf.nbytes)
                self._rings[direction] = ring
            return ring

    def enqueue_copy(
        self, stream: Stream, plan: TransferPlan, direction: Direction, path: str
    ) -> None:
        if path not in ("memmove", "staged", "pitched", "auto"):
            raise InvalidTransferError(f"host backend has no copy path {path!r}")
        assert isinstance(stream, HostStream)
        if path == "staged" and plan.staged is None:
            prepare_staged(plan, direction, self._ring(direction).slab_bytes)
        if plan.num_descriptors == 0:
            return
        fault = self._fail_next.pop(0) if self._fail_next else None
        if path == "staged":
            stream.enqueue(self._execute_staged, plan, self._ring(direction), fault)
        elif path == "pitched":
            check_pitchable(plan)
            stream.enqueue(self._execute_pitched, plan, fault)
        else:
            stream.enqueue(self._execute, plan, fault)
        self.counts[path if path in ("staged", "pitched") else "memmove"] += 1

    def _execute_staged(self, plan: TransferPlan, ring: _HostRing,
                        fault: BaseException | None) -> None:
        """Pack, then copy runs (stores); copy runs, then unpack (loads), slab by slab
        through the ring's buffers, with the very program the CUDA path runs."""
        program: StagedProgram = plan.staged
        if fault is not None:
            raise fault
        with ring.lock:  # the buffers are shared by every stream of the direction
            for i, slab in enumerate(program.slabs):
                buf = ring.buffers[i % len(ring.buffers)]
                ks, kd, kz = kernel_plan(program, slab, plan.table, buf.ptr).coalesced()
                rs, rd, rz = slab_descriptors(program, slab, buf.ptr)
                steps = [(ks, kd, kz), (rs, rd, rz)]
                for s, d, z in steps if program.gpu_to_cpu else steps[::-1]:
                    self._check_bounds(s, z)
                    self._check_bounds(d, z)
                    for a, b, n in zip(s.tolist(), d.tolist(), z.tolist()):
                        _memmove(b, a, n)

    def _execute_pitched(self, plan: TransferPlan, fault: BaseException | None) -> None:
        """The 2-D copies the CUDA path hands the copy engines, line by line."""
        src, dst, sizes = pitched_lines(build_pitched(plan))
        if fault is not None:
            raise fault
        self._check_bounds(src, sizes)
        self._check_bounds(dst, sizes)
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            _memmove(d, s, n)

    def _execute(self, plan: TransferPlan, fault: BaseException | None) -> None:
        src, dst, sizes = plan.coalesced()
        if fault is not None:
            raise fault
        self._check_bounds(src, sizes)
        self._check_bounds(dst, sizes)
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            _memmove(d, s, n)

    def close(self) -> None:
        # streams leave the list only once closed: a close interrupted half-way (Ctrl-C)
        # is finished by the next one instead of leaking the rest of the threads
        while self._streams:
            self._streams[0].close()
            self._streams.pop(0)
        # in-flight staged copies hold their ring (a stream thread ran them to the end)
        self._rings.clear()

    @property
    def live_threads(self) -> int:
        return sum(1 for s in self._streams if s.alive)

    def __repr__(self) -> str:
        return f"<HostBackend paths={self.paths} streams={len(self._streams)}>"
