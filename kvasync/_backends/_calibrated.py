"""What a calibration beside compute needs from a backend, and what it leaves there.

`Offloader.calibrate` times each copy path alone and beside a compute loop the backend
provides (`Backend.compute_load`: a matmul loop on the device, or NumPy matmuls in a thread
on the host backend) and leaves, per direction where it changes "auto", the path to prefer
and the page size it measured (`Preference`). A backend's "auto" rules then ask `preferred`
(on CUDA after the urgent and pitched rules). Why
measure beside compute: a server's copies run beside its model's kernels, and a path that
is fastest alone (an SM copy kernel) can cost the model a third of its rate
(docs/performance.md, section interference).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .._errors import CalibrationError

if TYPE_CHECKING:
    from .._program import TransferPlan

__all__ = ["ComputeLoad", "HostMatmulLoad", "Preference", "preferred", "work_in_window"]

T = TypeVar("T")

#: a preference covers plans whose mean descriptor is within this factor of its page size
PAGE_SPAN = 2.0


@dataclass(frozen=True)
class Preference:
    """The path "auto" takes in one direction (`path`), measured at `page_bytes` pages, for
    transfers of at least `min_bytes` (below it a transfer's fixed cost decides)."""

    path: str
    page_bytes: int
    min_bytes: int


def preferred(pref: Preference | None, plan: TransferPlan, urgent: bool, layered: bool,
              can_take: Callable[[str], bool]) -> str | None:
    """`pref.path` for `plan` where the preference covers it: not urgent, not one layer of a
    layer-wise load, at least `min_bytes`, descriptors near the measured page size, and
    `can_take(path)` (a staged path needs host rows); None: the backend's own rules."""
    if pref is None or urgent or layered:
        return None
    nbytes, count = plan.nbytes, plan.num_descriptors
    if count == 0 or nbytes < pref.min_bytes:
        return None
    mean = nbytes / count
    if not pref.page_bytes / PAGE_SPAN <= mean <= pref.page_bytes * PAGE_SPAN:
        return None
    return pref.path if can_take(pref.path) else None


def work_in_window(ends: Sequence[float], w0: float, w1: float) -> float:
    """Units of work done inside [w0, w1], where unit k ran from ends[k-1] to ends[k]
    (times on one clock; a unit straddling an edge counts by its share inside)."""
    work = 0.0
    for s, e in zip(ends, ends[1:]):
        if e > s:
            work += max(0.0, min(e, w1) - max(s, w0)) / (e - s)
    return work


class ComputeLoad(ABC):
    """A compute loop kept busy by a feeder thread from `start()` to `close()`.

    `side` is what transfers measured beside it pass as ``stream=`` so they never wait for
    the loop (None: the backend's default). `rate(during)` runs `during()` and returns the
    loop's work per second while it ran, with what `during()` returned. A loop that fails
    or does no work raises CalibrationError from `start()` or `rate()`: a calibration must not
    rank paths by a load that was not running.
    """

    side: Any = None
    #: seconds `start()` waits for the loop's first units of work
    START_S = 30.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="kvasync-compute-load",
                                        daemon=True)
        self._thread.start()
        deadline = time.perf_counter() + self.START_S
        while len(self._ends()) < 3:
            self._check()
            if time.perf_counter() > deadline:
                raise CalibrationError(f"the compute loop did no work in {self.START_S:g} s")
            time.sleep(0.001)

    def close(self) -> None:
        """Stop the feeder and wait for it (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            if self._thread.is_alive():
                raise CalibrationError("the compute loop did not stop within 60 s")
            self._thread = None

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by start() / rate(), never lost
            self._error = exc

    def _check(self) -> None:
        """CalibrationError (from the loop's own error) where the loop is not running."""
        if self._error is not None:
            raise CalibrationError(f"the compute loop failed: {self._error}") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise CalibrationError("the compute loop is not running")

    @abstractmethod
    def _run(self) -> None:
        """The feeder thread: run units of work until `_stop` is set."""

    @abstractmethod
    def _ends(self) -> list[float]:
        """End times of the units finished so far (a copy), on the clock of `_mark`."""

    @abstractmethod
    def _mark(self) -> Callable[[], float]:
        """Mark now on the loop's clock; the returned call gives the mark's time once the
        work it may trail (a device's queue) has run."""

    def rate(self, during: Callable[[], T]) -> tuple[float, T]:
        """(units per second while `during()` ran, what it returned)."""
        self._check()
        first = self._mark()
        try:
            result = during()
        finally:
            last = self._mark()
        self._check()
        w0, w1 = first(), last()
        work = work_in_window(self._ends(), w0, w1)
        if work <= 0 or w1 <= w0:
            raise CalibrationError("the compute loop did no work in a measuring window")
        return work / (w1 - w0), result


class HostMatmulLoad(ComputeLoad):
    """NumPy float32 matmuls of `n` x `n` in a thread (BLAS releases the GIL): the host
    backend's stand-in for a model, competing with the host copies for cores and memory."""

    def __init__(self, n: int = 384) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self._a = rng.standard_normal((n, n), dtype=np.float32)
        self._b = rng.standard_normal((n, n), dtype=np.float32)
        self._c = np.empty((n, n), dtype=np.float32)
        self._done: list[float] = []

    def _run(self) -> None:
        self._done.append(time.perf_counter())
        while not self._stop.is_set():
            np.matmul(self._a, self._b, out=self._c)
            self._done.append(time.perf_counter())

    def _ends(self) -> list[float]:
        return list(self._done)

    def _mark(self) -> Callable[[], float]:
        now = time.perf_counter()
        return lambda: now
