"""Calibrating "auto" on an offloader's own page size, alone and beside a compute load.

`calibrate_offloader` builds a scratch offloader like the caller's (the same backend kind
and device, the same page size, up to `MAX_TENSORS` KV tensors, scratch memory of its own:
the caller's KV cache and host copy are never touched), times each copy path that can serve
the caller's plans alone and then beside the backend's compute load (`Backend.compute_load`:
a matmul loop on the GPU), ranks them (`rank`) and leaves each direction's winner, where it
differs from what "auto" takes by its fixed rules, in the caller's backend
(`Backend.prefer`, replacing earlier ones), where "auto" asks it (after the urgent and
pitched rules) for transfers of at least `MIN_BYTES` with pages near the measured size.

Why beside compute: a server's copies run beside its model's kernels. On the H200 an SM
copy kernel was the fastest path alone at 4-64 KiB pages and cut a concurrent bf16 matmul
to 63% of its rate; the copy engines alone keep the matmul but are driver-bound on small
pages; the staged path kept it at 96-101% while moving 59-77% of the link
(docs/performance.md). The ranking keeps the model first: among paths that keep at least
`keep` of the compute rate, the one moving the most bytes beside it wins (`rank` says what
happens where none does, drops paths that barely move, and keeps the fixed rules' path
unless clearly beaten).

Each path is timed for `seconds` per direction alone and again beside the load (the
`calibrate()` default is 0.4 s): 0.2 s windows measured staged loads' kept share 9 points
below what 0.4 and 0.6 s windows and the bench's interference section measured (H100).

Pitched copies are not measured: where a plan can take them, "auto" keeps choosing them
by their fixed rule, ahead of a calibration's choice (`_cuda_policy`), and the scratch
tensors are in an order where no three in a row are evenly spaced (`unevenly_spaced`), so
the scratch stands for the plans a preference reaches.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ._backends._calibrated import ComputeLoad, Preference
from ._errors import InvalidTransferError
from ._layout import KVCacheLayout
from ._program import row_side

if TYPE_CHECKING:
    from ._transfer import Transfer

__all__ = ["AutoCalibration", "PathMeasurement", "calibrate_offloader", "rank",
           "unevenly_spaced"]

#: KV tensors of the scratch layout at most (a transfer's descriptors grow with them)
MAX_TENSORS = 64
#: bytes per measured transfer, and transfers kept in flight (as the bench's interference)
TRANSFER_BYTES = 64 << 20
INFLIGHT = 4
#: scratch blocks per transfer's blocks: the measured transfers pick random blocks among them
SPREAD = 2
#: the smallest transfer a calibration's choice applies to: below it a transfer's fixed
#: host cost decides, and the backend's own rules stay
MIN_BYTES = 2 << 20
#: paths a calibration may choose, in tie order (copy engines first: they leave the SMs)
CANDIDATES = ("staged", "dma", "memmove", "kernel")
#: beside-compute rates within this share of the best count as a tie (then: rate alone)
TIE = 0.02
#: a path moving less than this share of the most any path moves beside the compute load
#: is no candidate: on an H100, DMA of 4 KiB loads kept the matmul at 101% by moving 14% of
#: the link, where staged moved 67% at 92%
FLOOR = 0.5
#: a winner replaces the incumbent path only if it moves this much more beside the compute,
#: or keeps `KEPT_MARGIN` more of it (and is no worse in the other): on one H100, two runs at
#: 16 KiB pages differed by 3-4 points in kept and chose differently under the bare ranking
MARGIN = 0.10
KEPT_MARGIN = 0.05
#: (direction, path)
Key = tuple[str, str]
_ONE_AT_A_TIME = threading.Lock()


@dataclass(frozen=True)
class PathMeasurement:
    """One copy path in one direction: GB/s alone and beside the compute load, and the
    compute load's rate beside it over its rate alone (`kept`)."""

    direction: str
    path: str
    gbps_alone: float
    gbps_beside: float
    kept: float


@dataclass(frozen=True)
class AutoCalibration:
    """What `Offloader.calibrate` measured and chose (`choice`: direction -> path)."""

    page_bytes: int
    tensors: int
    transfer_bytes: int
    keep: float
    measurements: tuple[PathMeasurement, ...]
    choice: dict[str, str]
    #: what "auto" took for the same transfers by its fixed rules, before the calibration
    incumbent: dict[str, str]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The measurements as a text table, the chosen path of each direction marked."""
        lines = [f"{'direction':9} {'path':8} {'alone GB/s':>10} {'beside GB/s':>11} "
                 f"{'compute kept':>12}"]
        for m in self.measurements:
            mark = "  <- auto" if self.choice.get(m.direction) == m.path else ""
            lines.append(f"{m.direction:9} {m.path:8} {m.gbps_alone:10.2f} "
                         f"{m.gbps_beside:11.2f} {m.kept:12.3f}{mark}")
        lines.append("auto before: " + ", ".join(f"{d} {p}" for d, p in self.incumbent.items()))
        return "\n".join(lines)


def rank(measurements: Sequence[PathMeasurement], keep: float,
         incumbent: dict[str, str] | None = None) -> dict[str, str]:
    """Per direction, the path "auto" should prefer. Paths moving less than `FLOOR` of the
    most GB/s any path moves beside the compute are out (they keep it by barely moving).
    Of the rest: among those keeping at least `keep` of the compute rate, the most GB/s
    beside it; where none keeps that much, among those keeping within `TIE` of the most
    kept, the same. Near-ties in GB/s beside (within `TIE`) go to the most GB/s alone, then
    to `CANDIDATES` order. The `incumbent` path of a direction (what "auto" takes without a
    calibration), where measured and not out, stays unless that winner clearly beats it
    (`_clearly_better`): two runs of one calibration differ by a few points."""
    order = {p: i for i, p in enumerate(CANDIDATES)}
    choice: dict[str, str] = {}
    for direction in dict.fromkeys(m.direction for m in measurements):
        rows = [m for m in measurements if m.direction == direction]
        fastest = max(m.gbps_beside for m in rows)
        rows = [m for m in rows if m.gbps_beside >= FLOOR * fastest]
        pool = [m for m in rows if m.kept >= keep and m.gbps_beside > 0]
        if not pool:
            most = max(m.kept for m in rows)
            pool = [m for m in rows if m.kept >= most - TIE]
        top = max(m.gbps_beside for m in pool)
        near = [m for m in pool if m.gbps_beside >= top * (1 - TIE)]
        best = max(near, key=lambda m: (m.gbps_alone, -order.get(m.path, 99)))
        held = (incumbent or {}).get(direction)
        inc = next((m for m in rows if m.path == held), None)
        choice[direction] = (inc if inc is not None and not _clearly_better(best, inc)
                             else best).path
    return choice


def _clearly_better(a: PathMeasurement, b: PathMeasurement) -> bool:
    """`a` is no worse than `b` beside the compute (GB/s and kept, within `TIE`) and better
    by `MARGIN` in GB/s or by `KEPT_MARGIN` in kept."""
    no_worse = a.kept >= b.kept - TIE and a.gbps_beside >= b.gbps_beside * (1 - TIE)
    return no_worse and (a.gbps_beside >= b.gbps_beside * (1 + MARGIN)
                         or a.kept >= b.kept + KEPT_MARGIN)


def check_arguments(seconds: Any, keep: Any) -> None:
    """`seconds` in (0, 10] and `keep` in (0, 1], as numbers."""
    for name, value, high in (("seconds", seconds, 10.0), ("keep", keep, 1.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 < value <= high:
            raise InvalidTransferError(
                f"{name} must be a number in (0, {high:g}], got {value!r}")


def calibrate_offloader(off: Any, make: Callable[..., Any], seconds: float, keep: float,
                        apply: bool) -> AutoCalibration:
    """The calibration of the offloader `off` (module docstring); `make` (its class)
    builds the scratch offloader."""
    check_arguments(seconds, keep)
    backend = off.backend
    if backend.name not in ("host", "cuda"):
        raise InvalidTransferError(
            f"calibrate() runs on the host and cuda backends, not {backend.name!r}")
    t_start = time.perf_counter()
    page = Counter(t.page for t in off.layout.tensors).most_common(1)[0][0]
    count = min(len(off.layout.tensors), MAX_TENSORS)
    per_transfer = max(1, TRANSFER_BYTES // (count * page))
    blocks = SPREAD * per_transfer
    rows = row_side(off._tables["d2h"], True) is not None
    paths = [p for p in CANDIDATES if p in backend.paths and (p != "staged" or rows)
             and (p != "kernel" or off.host_pinned)]  # the kernel reads pinned memory only
    load = backend.compute_load()
    if load is None:
        raise InvalidTransferError(f"the {backend.name} backend has no compute load")
    rng = np.random.default_rng(0)
    ids = [(rng.permutation(blocks)[:per_transfer], rng.permutation(blocks)[:per_transfer])
           for _ in range(4)]
    notes: list[str] = []
    with _ONE_AT_A_TIME:  # two compute loops would measure each other
        compute, alone, beside, incumbent = _measure(off, make, load, paths, ids, page,
                                                     count, blocks, seconds, notes)
    ref = statistics.mean(compute)
    measured = tuple(
        PathMeasurement(d, p, round(alone[d, p], 3), round(gbps, 3), round(rate / ref, 3))
        for (d, p), (rate, gbps) in beside.items())
    choice = rank(measured, keep, incumbent)
    if apply:  # only where the calibration changes what auto takes
        backend.prefer({d: Preference(p, page, MIN_BYTES) for d, p in choice.items()
                        if p != incumbent.get(d)})
    return AutoCalibration(page, count, per_transfer * count * page, keep, measured, choice,
                           incumbent, round(time.perf_counter() - t_start, 3), notes)


def _measure(off: Any, make: Callable[..., Any], load: ComputeLoad, paths: list[str],
             ids: list[tuple[Any, Any]], page: int, count: int, blocks: int, seconds: float,
             notes: list[str]) -> tuple[list[float], dict[Key, float],
                                        dict[Key, tuple[float, float]], dict[str, str]]:
    """(the load's rate alone before and after, GB/s per path alone, (the load's rate,
    GB/s) per path beside it, the path "auto" takes per direction by its fixed rules), on
    a scratch offloader `make` builds like `off`."""
    backend = off.backend
    old_switch = sys.getswitchinterval()
    scratch: Any = None
    try:
        scratch = make(KVCacheLayout.from_tensors(_scratch(backend, count, blocks, page)),
                       num_cpu_chunks=blocks, backend=backend.name,
                       staging_bytes=off.staging_bytes or None)
        incumbent = _incumbent(scratch, ids[0], notes)
        sys.setswitchinterval(min(old_switch, 0.0005))  # the load's feeder keeps its queue

        def gbps(d: str, p: str) -> float:
            assert scratch is not None
            return _gbps(scratch, d, p, ids, load.side, seconds, notes)

        alone = {(d, p): gbps(d, p) for d in ("d2h", "h2d") for p in paths}
        load.start()
        compute = [load.rate(lambda: time.sleep(seconds))[0]]
        beside = {(d, p): load.rate(partial(gbps, d, p))
                  for (d, p), rate in alone.items() if rate > 0}
        compute.append(load.rate(lambda: time.sleep(seconds))[0])
    finally:
        sys.setswitchinterval(old_switch)
        if scratch is not None:
            scratch.close()
        scratch = None  # its scratch arrays go before the load hands device memory back
        load.close()
    return compute, alone, beside, incumbent


def _incumbent(scratch: Any, ids: tuple[Any, Any], notes: list[str]) -> dict[str, str]:
    """Per direction, the path "auto" takes for a transfer of `ids` on `scratch` by its
    fixed rules (the backend's `resolve_path`); empty, with a note, where that fails: the
    ranking then goes without an incumbent."""
    try:
        return {d: scratch.backend.resolve_path(
            "auto", d, scratch._submitter.plan(d, *ids, None, None), scratch.host_pinned)
            for d in ("d2h", "h2d")}
    except Exception as exc:  # reported in the result, never hidden
        notes.append(f"the fixed rules' choice is unknown: {exc!r}")
        return {}


def _scratch(backend: Any, count: int, blocks: int, page: int) -> list[Any]:
    """`count` zeroed (blocks, page) byte arrays in the backend's device memory, in
    `unevenly_spaced` order."""
    if backend.name == "host":
        arrays = [np.zeros((blocks, page), np.uint8) for _ in range(count)]
    else:
        from ._backends._cudart import cupy

        cp = cupy()
        with cp.cuda.Device(backend.device_id):
            arrays = [cp.zeros((blocks, page), cp.uint8) for _ in range(count)]
    return unevenly_spaced(arrays)


def unevenly_spaced(arrays: list[Any]) -> list[Any]:
    """`arrays` with each pair swapped (1, 0, 3, 2, ...), so that no three in a row are
    evenly spaced even where an allocator placed them so.

    Why: "auto" sends evenly spaced tensors with big pages to "pitched" ahead of any
    calibration's choice, so a preference only reaches plans the pitched rule leaves; the
    scratch offloader stands for those, and its fixed rules' path (the incumbent) must be
    what "auto" takes for them.
    """
    out = list(arrays)
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def _gbps(off: Any, direction: str, path: str, ids: list[tuple[Any, Any]], side: Any,
          seconds: float, notes: list[str]) -> float:
    """GB/s of transfers of `ids` (cycled, `INFLIGHT` in flight, waiting on `side`) for at
    least `seconds` after one warm-up transfer; 0.0 where the path refuses them. (The
    bench's interference section runs the same loop of its own: the bench uses the public
    API only.)"""
    submit: Callable[..., Transfer] = off.store if direction == "d2h" else off.load

    def one(i: int) -> Transfer:
        gpu, cpu = ids[i % len(ids)]
        return submit(gpu_blocks=gpu, cpu_chunks=cpu, path=path, stream=side)

    try:
        one(0).wait(60)
    except InvalidTransferError as exc:
        notes.append(f"{direction} {path}: {exc}")
        return 0.0
    inflight: deque[Transfer] = deque()
    moved, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or i < INFLIGHT:
        inflight.append(one(i))
        i += 1
        if len(inflight) >= INFLIGHT:
            moved += inflight.popleft().wait(60).bytes
    while inflight:
        moved += inflight.popleft().wait(60).bytes
    return moved / (time.perf_counter() - t0) / 1e9
