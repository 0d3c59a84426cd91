"""`Offloader.calibrate()`: paths timed alone and beside a compute load, ranked, preferred.

The host backend runs the whole calibration (NumPy matmuls in a thread as its compute load);
the ranking and the rule that applies a preference are checked against plain cases.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvasync as kv
from kvasync import _calibrate
from kvasync._backends._calibrated import (
    HostMatmulLoad,
    Preference,
    preferred,
    work_in_window,
)
from kvasync._calibrate import rank

PAGE = 16 << 10
M = kv.PathMeasurement


@pytest.fixture(autouse=True)
def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_calibrate, "TRANSFER_BYTES", 1 << 20)  # CI: 2 MiB of scratch


def _offloader(tensors: int = 8, blocks: int = 48, **kw: object) -> kv.Offloader:
    rng = np.random.default_rng(1)
    views = [rng.integers(0, 255, (blocks, PAGE), dtype=np.uint8) for _ in range(tensors)]
    return kv.Offloader(kv.KVCacheLayout.from_tensors(views), num_cpu_chunks=blocks,
                        backend="host", **kw)  # type: ignore[arg-type]


def _library_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kvasync")}


# -- the ranking ------------------------------------------------------------------------------
def test_rank_takes_the_most_bytes_beside_among_paths_keeping_the_compute() -> None:
    rows = [M("d2h", "kernel", 50.0, 40.0, 0.60), M("d2h", "dma", 26.0, 25.0, 0.99),
            M("d2h", "staged", 52.0, 45.0, 0.98), M("h2d", "kernel", 50.0, 48.0, 0.97),
            M("h2d", "staged", 51.0, 30.0, 0.99)]
    assert rank(rows, 0.97) == {"d2h": "staged", "h2d": "kernel"}
    assert rank(rows, 0.985) == {"d2h": "dma", "h2d": "staged"}


def test_rank_breaks_a_near_tie_by_the_rate_alone_then_copy_engines_first() -> None:
    rows = [M("d2h", "dma", 40.0, 44.5, 1.0), M("d2h", "staged", 50.0, 45.0, 1.0)]
    assert rank(rows, 0.97) == {"d2h": "staged"}  # 44.5 is within 2% of 45
    rows = [M("d2h", "kernel", 50.0, 45.0, 1.0), M("d2h", "staged", 50.0, 45.0, 1.0)]
    assert rank(rows, 0.97) == {"d2h": "staged"}
    rows = [M("d2h", "dma", 60.0, 40.0, 1.0), M("d2h", "staged", 50.0, 45.0, 1.0)]
    assert rank(rows, 0.97) == {"d2h": "staged"}  # 40 is not near 45


def test_rank_passes_over_a_path_that_keeps_the_compute_by_barely_moving() -> None:
    """An H100's calibration at 4 KiB loads: DMA kept the matmul by moving 14% of the link."""
    rows = [M("h2d", "staged", 93.0, 67.0, 0.92), M("h2d", "dma", 13.0, 14.0, 1.01),
            M("h2d", "kernel", 55.0, 41.0, 0.87)]
    assert rank(rows, 0.97) == {"h2d": "staged"}
    assert rank(rows[1:], 0.97) == {"h2d": "kernel"}  # 14 < half of 41
    assert rank(rows[1:2], 0.97) == {"h2d": "dma"}  # alone, it is the fastest


@pytest.mark.parametrize(("rows", "held", "want"), [
    # H100 runs: 16 KiB loads, kernel a point ahead of staged on both: staged stays
    ([M("h2d", "staged", 96.0, 66.0, 0.90), M("h2d", "kernel", 90.0, 68.0, 0.91)],
     "staged", "staged"),
    # 64 KiB loads: DMA moves twice the link at a higher kept share
    ([M("h2d", "staged", 96.0, 46.0, 0.90), M("h2d", "dma", 97.0, 97.0, 0.95)],
     "staged", "dma"),
    # 64 KiB stores: DMA moves 16% more at the same kept share
    ([M("d2h", "staged", 95.0, 73.0, 0.98), M("d2h", "dma", 98.0, 85.0, 0.98)],
     "staged", "dma"),
    # 16 KiB stores: DMA keeps 3 points more but moves a quarter less: staged stays
    ([M("d2h", "staged", 52.0, 40.3, 0.96), M("d2h", "dma", 23.4, 30.0, 0.99)],
     "staged", "staged"),
    # kept 6 points more at the same GB/s is a clear win
    ([M("d2h", "kernel", 50.0, 40.0, 0.90), M("d2h", "staged", 50.0, 40.0, 0.96)],
     "kernel", "staged"),
    # an incumbent below the floor, or not measured, does not stay
    ([M("h2d", "staged", 93.0, 67.0, 0.92), M("h2d", "dma", 13.0, 14.0, 1.01)],
     "dma", "staged"),
    ([M("h2d", "staged", 93.0, 67.0, 0.92)], "pitched", "staged"),
])
def test_rank_keeps_the_incumbent_unless_clearly_beaten(
        rows: list[kv.PathMeasurement], held: str, want: str) -> None:
    direction = rows[0].direction
    assert rank(rows, 0.97, {direction: held}) == {direction: want}


def test_rank_without_a_path_keeping_the_compute_takes_the_one_keeping_most() -> None:
    rows = [M("h2d", "kernel", 50.0, 49.0, 0.50), M("h2d", "dma", 30.0, 25.0, 0.90)]
    assert rank(rows, 0.97) == {"h2d": "dma"}
    # kept 0.90 against 0.89 is a tie there: the more bytes beside, then alone, win
    rows = [M("h2d", "kernel", 47.0, 34.0, 0.90), M("h2d", "staged", 48.0, 34.3, 0.89),
            M("h2d", "dma", 5.0, 4.0, 0.99)]
    assert rank(rows, 0.97) == {"h2d": "staged"}
    rows[1] = M("h2d", "staged", 48.0, 20.0, 0.89)
    assert rank(rows, 0.97) == {"h2d": "kernel"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["d2h", "h2d"]),
                          st.sampled_from(["kernel", "dma", "staged", "memmove"]),
                          st.floats(0, 100), st.floats(0, 100), st.floats(0, 1.5)),
                min_size=1, max_size=12, unique_by=lambda r: (r[0], r[1])),
       st.floats(0.5, 1.0), st.sampled_from(["kernel", "dma", "staged", "memmove"]))
def test_rank_matches_a_plain_oracle(rows: list[tuple[str, str, float, float, float]],
                                     keep: float, held: str) -> None:
    measured = [M(*r) for r in rows]
    # with an incumbent: it stays, or the bare ranking's winner clearly beats it
    bare = rank(measured, keep)
    for direction, path in rank(measured, keep, {"d2h": held, "h2d": held}).items():
        if path != bare[direction]:
            assert path == held
            win = next(m for m in measured if (m.direction, m.path) == (direction, bare[direction]))
            inc = next(m for m in measured if (m.direction, m.path) == (direction, held))
            assert not (win.kept >= inc.kept - 0.02 and win.gbps_beside >= inc.gbps_beside * 0.98
                        and (win.gbps_beside >= inc.gbps_beside * 1.1
                             or win.kept >= inc.kept + 0.05))
    got = bare
    for direction in {r[0] for r in rows}:
        mine = [m for m in measured if m.direction == direction]
        pick = next(m for m in mine if m.path == got[direction])
        fastest = max(m.gbps_beside for m in mine)
        assert pick.gbps_beside >= 0.5 * fastest  # never one that barely moves
        mine = [m for m in mine if m.gbps_beside >= 0.5 * fastest]
        good = [m for m in mine if m.kept >= keep and m.gbps_beside > 0]
        if not good:  # nothing keeps the compute: the ones keeping (about) the most
            good = [m for m in mine if m.kept >= max(x.kept for x in mine) - 0.02]
        assert pick in good
        best = max(m.gbps_beside for m in good)
        assert pick.gbps_beside >= best * 0.98
        # no other good path both moves more beside (past the tie) or ties and beats it alone
        for m in good:
            assert not (m.gbps_beside >= best * 0.98 and m.gbps_alone > pick.gbps_alone), m
    assert set(got) == {r[0] for r in rows}


# -- where a preference applies ------------------------------------------------------------------
class _Plan:
    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes, self.num_descriptors = nbytes, count


@pytest.mark.parametrize(("nbytes", "count", "urgent", "layered", "takes", "want"), [
    (4 << 20, 256, False, False, True, "staged"),     # 16 KiB pages, 4 MiB
    (1 << 20, 64, False, False, True, None),          # below min_bytes
    (4 << 20, 256, True, False, True, None),          # urgent
    (4 << 20, 256, False, True, True, None),          # one layer of a layer-wise load
    (4 << 20, 256, False, False, False, None),        # the path cannot take the plan
    (4 << 20, 1024, False, False, True, None),        # 4 KiB pages: too far from 16 KiB
    (4 << 20, 128, False, False, True, "staged"),     # 32 KiB pages: within 2x
    (4 << 20, 32, False, False, True, None),          # 128 KiB pages
    (0, 0, False, False, True, None),                 # empty
])
def test_a_preference_covers_big_transfers_of_pages_near_its_size(
        nbytes: int, count: int, urgent: bool, layered: bool, takes: bool,
        want: str | None) -> None:
    pref = Preference("staged", PAGE, 2 << 20)
    plan = _Plan(nbytes, count)
    assert preferred(pref, plan, urgent, layered, lambda p: takes) == want  # type: ignore[arg-type]
    assert preferred(None, plan, urgent, layered, lambda p: True) is None  # type: ignore[arg-type]


def test_work_in_window_counts_straddling_units_by_their_share() -> None:
    ends = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert work_in_window(ends, 0.0, 4.0) == 4.0
    assert work_in_window(ends, 0.5, 2.5) == pytest.approx(2.0)
    assert work_in_window(ends, 5.0, 6.0) == 0.0
    assert work_in_window([0.0], 0.0, 1.0) == 0.0


# -- the whole calibration on the host backend -------------------------------------------------
def test_calibrate_measures_every_path_both_ways_and_auto_follows_its_choice() -> None:
    before = _library_threads()
    with _offloader() as off:
        gpu = [np.array(t.obj, copy=True) for t in (x.info for x in off.layout.tensors)]
        host = [np.array(v, copy=True) for v in off.cpu_tensors]
        cal = off.calibrate(seconds=0.05)
        # the offloader's own KV cache and host copy are untouched
        for t, want in zip(off.layout.tensors, gpu):
            assert np.array_equal(t.info.obj, want)
        for v, want in zip(off.cpu_tensors, host):
            assert np.array_equal(v, want)
        assert {(m.direction, m.path) for m in cal.measurements} == {
            (d, p) for d in ("d2h", "h2d") for p in ("memmove", "staged")}
        for m in cal.measurements:
            assert m.gbps_alone > 0 and m.gbps_beside > 0, m
            assert 0 < m.kept < 3 and math.isfinite(m.kept), m
        assert cal.incumbent == {"d2h": "memmove", "h2d": "memmove"}
        assert cal.choice == rank(cal.measurements, 0.97, cal.incumbent)
        assert (cal.page_bytes, cal.tensors, cal.keep) == (PAGE, 8, 0.97)
        assert cal.transfer_bytes == 1 << 20 and cal.seconds > 0
        assert "<- auto" in cal.table() and cal.table().count("\n") == 5
        for direction in ("d2h", "h2d"):  # a preference only where it changes auto
            path = cal.choice[direction]
            assert off.backend.preference(direction) == (  # type: ignore[arg-type]
                None if path == "memmove" else Preference(path, PAGE, _calibrate.MIN_BYTES))
        # auto takes the choice for a big transfer, memmove for a small one
        ids = list(range(40))  # 40 x 8 x 16 KiB = 5 MiB
        for direction, call in (("d2h", off.store), ("h2d", off.load)):
            counts = dict(off.backend.counts)  # type: ignore[attr-defined]
            call(gpu_blocks=ids, cpu_chunks=ids).wait(10)
            call(gpu_blocks=[1], cpu_chunks=[1]).wait(10)
            ran = {k: v - counts[k] for k, v in off.backend.counts.items()}  # type: ignore[attr-defined]
            expected = {"memmove": 1, "staged": 0, "pitched": 0}
            expected[cal.choice[direction]] += 1
            assert ran == expected, (direction, cal.choice)
        assert np.array_equal(off.layout.tensors[3].info.obj[7], gpu[3][7])
    assert _library_threads() <= before


def test_a_staged_preference_moves_the_right_bytes_and_small_transfers_stay() -> None:
    with _offloader() as off:
        off.backend.prefer({d: Preference("staged", PAGE, 2 << 20) for d in ("d2h", "h2d")})
        src = [np.array(t.info.obj, copy=True) for t in off.layout.tensors]
        ids = list(range(20, 40))
        off.store(gpu_blocks=ids, cpu_chunks=list(range(20))).wait(10)
        off.load(cpu_chunks=list(range(20)), gpu_blocks=list(range(20))).wait(10)
        assert off.backend.counts["staged"] == 2  # type: ignore[attr-defined]
        for t, s in zip(off.layout.tensors, src):
            assert np.array_equal(t.info.obj[:20], s[20:40])
            assert np.array_equal(t.info.obj[20:], s[20:])
        off.store(gpu_blocks=ids, cpu_chunks=ids, urgent=True).wait(10)
        assert off.backend.counts["staged"] == 2  # type: ignore[attr-defined]


def test_without_host_rows_staged_is_neither_measured_nor_taken() -> None:
    rng = np.random.default_rng(2)
    views = [rng.integers(0, 255, (32, PAGE), dtype=np.uint8) for _ in range(4)]
    host = [np.zeros((32, PAGE), np.uint8) for _ in range(4)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(views), backend="host",
                      host_tensors=host) as off:
        cal = off.calibrate(seconds=0.02, apply=False)
        assert {m.path for m in cal.measurements} == {"memmove"}
        assert cal.choice == {"d2h": "memmove", "h2d": "memmove"}
        assert off.backend.preference("d2h") is None  # apply=False leaves none
        off.backend.prefer({"d2h": Preference("staged", PAGE, 1 << 20)})
        off.store(gpu_blocks=list(range(32)), cpu_chunks=list(range(32))).wait(10)
        assert off.backend.counts["staged"] == 0  # type: ignore[attr-defined]
        assert np.array_equal(host[2], views[2])


def test_an_explicit_path_is_never_overridden_by_a_preference() -> None:
    with _offloader() as off, _offloader(copy_path="memmove") as fixed:
        for o in (off, fixed):
            o.backend.prefer({"d2h": Preference("staged", PAGE, 1 << 20)})
        ids = list(range(40))
        off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove").wait(10)
        fixed.store(gpu_blocks=ids, cpu_chunks=ids).wait(10)
        for o in (off, fixed):
            assert o.backend.counts == {"memmove": 1, "staged": 0, "pitched": 0}  # type: ignore[attr-defined]


class _FailingLoad(HostMatmulLoad):
    """Runs `units` matmuls, then fails (or, with `error` None, just stops)."""

    def __init__(self, units: int, error: BaseException | None) -> None:
        super().__init__(n=64)
        self.units, self.error = units, error

    def _run(self) -> None:
        self._done.append(time.perf_counter())
        for _ in range(self.units):
            time.sleep(0.001)
            self._done.append(time.perf_counter())
        if self.error is not None:
            raise self.error
        self._stop.wait()  # alive, but doing no work


@pytest.mark.parametrize(("units", "error", "match"), [
    (0, MemoryError("out of memory in the loop"), "failed: out of memory"),
    (5, RuntimeError("cuBLAS error"), "failed: cuBLAS error"),
    (5, None, "did no work in a measuring window"),
])
def test_a_failing_or_idle_compute_load_chooses_nothing_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch, units: int, error: BaseException | None,
        match: str) -> None:
    from kvasync._backends._host import HostBackend

    monkeypatch.setattr(HostBackend, "compute_load", lambda self: _FailingLoad(units, error))
    before = _library_threads()
    with _offloader() as off:
        with pytest.raises(kv.CalibrationError, match=match) as info:
            off.calibrate(seconds=0.02)
        if error is not None:
            assert info.value.__cause__ is error
        assert off.backend.preference("d2h") is None and off.backend.preference("h2d") is None
        off.store(gpu_blocks=[1], cpu_chunks=[1]).wait(10)  # the offloader still works
    assert _library_threads() <= before


@pytest.mark.parametrize(("kw", "match"), [
    ({"seconds": 0}, "seconds"), ({"seconds": -1.0}, "seconds"),
    ({"seconds": float("nan")}, "seconds"), ({"seconds": True}, "seconds"),
    ({"seconds": "1"}, "seconds"), ({"seconds": 11}, "seconds"),
    ({"keep": 0}, "keep"), ({"keep": 1.5}, "keep"), ({"keep": None}, "keep"),
])
def test_bad_arguments_are_refused_before_anything_runs(kw: dict[str, object],
                                                        match: str) -> None:
    with _offloader() as off:
        with pytest.raises(kv.InvalidTransferError, match=match):
            off.calibrate(**kw)  # type: ignore[arg-type]
        assert off.backend.preference("d2h") is None


def test_a_closed_offloader_refuses_to_calibrate() -> None:
    off = _offloader()
    off.close()
    with pytest.raises(kv.OffloaderClosedError):
        off.calibrate()


@pytest.mark.asyncio
async def test_calibrate_runs_from_a_coroutine_as_a_notebook_cell_does() -> None:
    """Jupyter runs a cell's plain calls on its event loop's thread: the calibration's own
    waits must work there, and the offloader serves awaits afterwards."""
    async with _offloader() as off:
        cal = off.calibrate(seconds=0.02)
        assert set(cal.choice) == {"d2h", "h2d"}
        ids = list(range(20))
        result = await off.store(gpu_blocks=ids, cpu_chunks=ids)
        assert result.success and result.bytes == 20 * 8 * PAGE


def test_an_unknown_incumbent_is_noted_and_the_ranking_goes_without_one() -> None:
    class _Broken:
        host_pinned = True

        class backend:
            @staticmethod
            def resolve_path(*args: object) -> str:
                raise RuntimeError("no rules here")

        class _submitter:
            @staticmethod
            def plan(*args: object) -> None:
                return None

    notes: list[str] = []
    assert _calibrate._incumbent(_Broken(), ([0], [0]), notes) == {}
    assert len(notes) == 1 and "no rules here" in notes[0]
    rows = [M("h2d", "staged", 96.0, 66.0, 0.90), M("h2d", "kernel", 90.0, 68.0, 0.91)]
    assert rank(rows, 0.97, {}) == rank(rows, 0.97)


def _pitched_height(tensors: list[np.ndarray], chunks: int, gpu: list[int],
                    cpu: list[int]) -> float:
    """Lines per 2-D copy of a store of `gpu` -> `cpu` on an offloader over `tensors`."""
    from kvasync._program import mean_height

    off = kv.Offloader(kv.KVCacheLayout.from_tensors(tensors), num_cpu_chunks=chunks)
    try:
        return mean_height(off._submitter.plan("d2h", gpu, cpu, None, None))
    finally:
        off.close()


@pytest.mark.parametrize("count", [1, 2, 3, 8, 9, 64])
def test_the_scratch_order_keeps_a_pool_out_of_the_pitched_rule(count: int) -> None:
    """Slices of one pool are one 2-D copy per block; in the scratch's order at most two
    tensors are, so the scratch's fixed rules stand for plans the pitched rule leaves."""
    from kvasync._backends._cuda_policy import PITCHED_MIN_HEIGHT

    pool = np.zeros((count, 8, 4096), np.uint8)
    views = list(pool)
    order = _calibrate.unevenly_spaced(views)
    assert sorted(id(v) for v in order) == sorted(id(v) for v in views)
    heights = [_pitched_height(tensors, 8, [1, 5, 2], [0, 3, 4]) for tensors in (views, order)]
    assert heights[0] == count
    assert heights[1] <= 2 < PITCHED_MIN_HEIGHT


def test_a_calibration_keeps_its_scratch_out_of_the_pitched_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where the allocator lays the scratch arrays out evenly spaced (here: slices of
    one pool), the scratch offloader's transfers have no pitched form of more than 2 lines."""
    from kvasync._program import mean_height

    pool: list[np.ndarray] = []
    slices: list[np.ndarray] = []
    real_np = np

    class _OnePool:  # `np` for _calibrate: zeros() hands out consecutive slices of a pool
        def __getattr__(self, name: str) -> object:
            return getattr(real_np, name)

        def zeros(self, shape: tuple[int, int], dtype: object) -> np.ndarray:
            if not pool:
                pool.append(real_np.zeros((64, *shape), dtype))
            slices.append(pool[0][len(slices)])
            return slices[-1]

    heights: list[float] = []
    real_incumbent = _calibrate._incumbent

    def spy(scratch: kv.Offloader, ids: tuple[object, object], notes: list[str]
            ) -> dict[str, str]:
        heights.append(mean_height(scratch._submitter.plan("d2h", *ids, None, None)))
        return real_incumbent(scratch, ids, notes)

    monkeypatch.setattr(_calibrate, "np", _OnePool())
    monkeypatch.setattr(_calibrate, "_incumbent", spy)
    with _offloader() as off:
        off.calibrate(seconds=0.02, apply=False)
    assert len(slices) == 8 and all(s.base is pool[0] for s in slices)
    assert _pitched_height(slices, 16, [1, 2], [3, 4]) == 8  # in pool order: pitched
    assert len(heights) == 1 and heights[0] <= 2
