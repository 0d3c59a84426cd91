"""Cross-rank coordination of a shared region's pages: coordinated pinning (each rank its
slice of the rows, one barrier, then the rest) and creator-only population.

Ranks are threads, each with its own `SharedHostRegion` of one file (each maps it at its own
address, as separate processes would); the pin functions are injected fakes that log.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import numpy as np
import pytest

import kvasync as kv
import kvasync._region_pages as pages
from kvasync import SharedHostRegion
from kvasync._backends._host import HostBackend

PAGE = mmap.PAGESIZE
Names = Callable[[], str]


class Log:
    """One event log shared by all ranks, in the order things happened."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, int, int, int]] = []  # (what, rank, addr, size)

    def add(self, what: str, rank: int, addr: int = 0, size: int = 0) -> None:
        with self.lock:
            self.events.append((what, rank, addr, size))


class RankRuntime:
    """register/unregister of one rank: logged, failing at chosen registration calls."""

    def __init__(self, log: Log, rank: int, fail_at: int | None = None) -> None:
        self.log, self.rank, self.fail_at = log, rank, fail_at
        self.calls = 0
        self.live: dict[int, int] = {}

    def register(self, ptr: int, size: int) -> bool:
        k, self.calls = self.calls, self.calls + 1
        if k == self.fail_at:
            return False
        self.live[ptr] = size
        self.log.add("reg", self.rank, ptr, size)
        return True

    def unregister(self, ptr: int) -> bool:
        del self.live[ptr]
        self.log.add("unreg", self.rank, ptr)
        return True


def gated(log: Log, world: int) -> Callable[[int], Callable[[], object]]:
    """Per-rank barriers over one threading.Barrier, each logging its rank on entry."""
    gate = threading.Barrier(world)

    def barrier_of(rank: int) -> Callable[[], object]:
        def barrier() -> None:
            log.add("barrier", rank)
            gate.wait(20)
        return barrier

    return barrier_of


def run_ranks(fn: Callable[[int], object], world: int) -> list[object]:
    results: list[object] = [None] * world

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def rows_of(region: SharedHostRegion, events: list[tuple[str, int, int, int]],
            rank: int) -> list[tuple[int, int]]:
    """(first row, row count) of each registration of `rank`, in order."""
    s = region.row_stride
    return [((a - region.base_ptr) // s, n // s) for w, r, a, n in events
            if w == "reg" and r == rank]


class Ranks:
    """`world` ranks of one region file (rows of one page each, not populated), one log and
    per-rank barriers; `pin` pins every rank's region at once, coordinated, a row a chunk."""

    def __init__(self, names: Names, world: int, rows: int) -> None:
        self.world = world
        self.log = Log()
        self.barrier_of = gated(self.log, world)
        name = names()
        self.regions = [SharedHostRegion(name, rows, PAGE, r, world, populate=False)
                        for r in range(world)]

    def pin(self, rts: list[RankRuntime]) -> list[object]:
        return run_ranks(lambda r: self.regions[r].pin(
            rts[r].register, rts[r].unregister, cap=PAGE, barrier=self.barrier_of(r)),
            self.world)

    def barriers(self) -> list[int]:
        """The ranks that reached the barrier, one entry per arrival, sorted."""
        return sorted(e[1] for e in self.log.events if e[0] == "barrier")

    def close(self) -> None:
        for region in self.regions:
            region.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "rows", "cap_rows"), [(4, 8, 1), (4, 10, 3), (3, 2, 4),
                                                          (1, 5, 2)])
def test_each_rank_pins_its_slice_then_one_barrier_then_the_rest(
    names: Names, world: int, rows: int, cap_rows: int
) -> None:
    stride = 2 * PAGE
    log = Log()
    barrier_of = gated(log, world)
    name = names()
    regions = [SharedHostRegion(name, rows, stride, r, world, populate=False,
                                pin_barrier=barrier_of(r)) for r in range(world)]
    rts = [RankRuntime(log, r) for r in range(world)]
    results = run_ranks(lambda r: regions[r].pin(rts[r].register, rts[r].unregister,
                                                 cap=cap_rows * stride), world)
    assert results == [True] * world
    ev = log.events
    at = {e[1]: i for i, e in enumerate(ev) if e[0] == "barrier"}
    assert sorted(at) == list(range(world))
    assert sum(e[0] == "barrier" for e in ev) == world  # exactly once per rank
    last_barrier = max(at.values())
    for r, region in enumerate(regions):
        lo, hi = region.pin_slice()
        assert (lo, hi) == (r * rows // world, (r + 1) * rows // world)
        mine = rows_of(region, ev[: at[r]], r)
        rest = rows_of(region, ev[last_barrier:], r)  # only once every rank is at the barrier
        assert rows_of(region, ev, r) == mine + rest
        covered = [row for first, n in mine for row in range(first, first + n)]
        assert covered == list(range(lo, hi))  # the slice, all of it, before any barrier
        covered += [row for first, n in rest for row in range(first, first + n)]
        assert sorted(covered) == list(range(rows))  # then every other row, once
        assert all(n <= max(cap_rows, 1) for _, n in mine + rest)  # row-aligned, capped
        assert region.is_pinned
        assert region.pinned_addresses == [a for w, rr, a, _ in ev if w == "reg" and rr == r]
    for r, region in enumerate(regions):
        addrs = region.pinned_addresses
        region.close()
        assert [a for w, rr, a, _ in log.events if w == "unreg" and rr == r] == addrs[::-1]
        assert rts[r].live == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["slice", "rest"])
def test_a_failing_rank_rolls_back_and_its_peers_do_not_hang(names: Names, phase: str) -> None:
    ranks = Ranks(names, 3, 6)
    # rank 1 fails its first registration (its slice) or its third (the rest; cap = 1 row,
    # slice = 2 rows, so calls 0 and 1 are the slice)
    rts = [RankRuntime(ranks.log, r, fail_at=(0 if phase == "slice" else 2) if r == 1 else None)
           for r in range(3)]
    regions = ranks.regions
    assert ranks.pin(rts) == [True, False, True]
    # the failing rank still met its peers, once
    assert ranks.barriers() == [0, 1, 2]
    assert rts[1].live == {} and not regions[1].is_pinned
    assert regions[1].pinned_addresses == []
    assert regions[0].is_pinned and regions[2].is_pinned
    ranks.close()
    assert all(rt.live == {} for rt in rts)


class RaisingRuntime(RankRuntime):
    """A register that raises at call `fail_at` (a Ctrl-C inside the driver's call)."""

    def register(self, ptr: int, size: int) -> bool:
        if self.calls == self.fail_at:
            self.calls += 1
            raise KeyboardInterrupt("in the driver")
        return super().register(ptr, size)


@pytest.mark.timeout(60)
def test_a_rank_whose_register_raises_rolls_back_and_still_meets_its_peers(
        names: Names) -> None:
    """Rank 1's second registration raises: its first chunk is unregistered, it reaches
    the barrier once (its peers do not hang) and the exception reaches its caller."""
    ranks = Ranks(names, 2, 4)
    rts = [RankRuntime(ranks.log, 0), RaisingRuntime(ranks.log, 1, fail_at=1)]
    results = ranks.pin(rts)
    assert results[0] is True and isinstance(results[1], KeyboardInterrupt)
    assert ranks.barriers() == [0, 1]
    assert rts[1].live == {} and not ranks.regions[1].is_pinned
    ranks.close()
    assert all(rt.live == {} for rt in rts)


@pytest.mark.timeout(60)
def test_pinning_a_pinned_region_again_still_meets_the_peers(names: Names) -> None:
    """After a coordinated pin where rank 1 failed, both ranks pin again: rank 0 (pinned
    already) still calls the barrier once, so rank 1 does not wait on it alone."""
    ranks = Ranks(names, 2, 4)
    rts = [RankRuntime(ranks.log, 0), RankRuntime(ranks.log, 1, fail_at=0)]
    assert ranks.pin(rts) == [True, False]
    assert ranks.pin(rts) == [True, True]  # rank 1's retry: calls 1 onward succeed
    assert ranks.barriers() == [0, 0, 1, 1]
    ranks.close()
    assert all(rt.live == {} for rt in rts)


@pytest.mark.timeout(30)
def test_a_broken_barrier_unpins_the_slice_and_raises(names: Names) -> None:
    log = Log()
    rt = RankRuntime(log, 0)
    region = SharedHostRegion(names(), 4, PAGE, 0, 2, populate=False)

    def broken() -> None:
        raise threading.BrokenBarrierError

    with pytest.raises(threading.BrokenBarrierError):
        region.pin(rt.register, rt.unregister, barrier=broken)
    assert [e[0] for e in log.events] == ["reg", "unreg"]  # rows 0-1 pinned, then rolled back
    assert rt.live == {} and not region.is_pinned
    assert region.pin(rt.register, rt.unregister)  # uncoordinated: the whole region at once
    assert rows_of(region, log.events, 0)[-1] == (0, 4)
    region.close()


@pytest.mark.timeout(30)
def test_an_unranked_opener_pins_everything_after_the_barrier(names: Names) -> None:
    log = Log()
    rt = RankRuntime(log, 0)
    region = SharedHostRegion(names(), 4, PAGE, None, 2, populate=False,
                              pin_barrier=lambda: log.add("barrier", -1))
    assert region.pin_slice() == (0, 0)
    assert region.pin(rt.register, rt.unregister)
    assert [e[0] for e in log.events] == ["barrier", "reg"]
    region.close()


class PinningHostBackend(HostBackend):
    """The host backend plus pin functions, as the CUDA backend has: the Offloader pins the
    region it is given, with the region's pin_barrier."""

    def __init__(self, rt: RankRuntime) -> None:
        super().__init__()
        self.rt = rt

    def pin_functions(self) -> tuple[Callable[[int, int], bool], Callable[[int], bool]]:
        return self.rt.register, self.rt.unregister


@pytest.mark.timeout(60)
def test_offloaders_of_every_rank_pin_their_region_together(names: Names) -> None:
    """The drop-in path: each rank hands its region to an Offloader, which pins it through
    the backend's pin functions; pin_barrier coordinates the ranks with no other call."""
    world, blocks, page = 2, 4, PAGE
    log = Log()
    barrier_of = gated(log, world)
    name = names()
    regions = [SharedHostRegion(name, blocks, world * page, r, world, populate=False,
                                pin_barrier=barrier_of(r)) for r in range(world)]
    rts = [RankRuntime(log, r) for r in range(world)]
    kvs = [np.random.default_rng(r).integers(0, 256, (blocks, page), dtype=np.uint8)
           for r in range(world)]

    def rank(r: int) -> kv.Offloader:
        layout = kv.KVCacheLayout.from_tensors([kvs[r]])
        return kv.Offloader(layout, blocks, 1, backend=PinningHostBackend(rts[r]),
                            host_region=regions[r])

    offs = run_ranks(rank, world)
    assert all(isinstance(o, kv.Offloader) for o in offs)
    at = {e[1]: i for i, e in enumerate(log.events) if e[0] == "barrier"}
    assert sorted(at) == list(range(world))
    for r, region in enumerate(regions):
        assert region.is_pinned
        lo, hi = region.pin_slice()
        assert rows_of(region, log.events[: at[r]], r) == [(lo, hi - lo)]
        rest = [(0, lo)] if lo else [(hi, blocks - hi)]
        assert rows_of(region, log.events[max(at.values()):], r) == rest
    for r, off in enumerate(offs):
        assert isinstance(off, kv.Offloader)
        off.store(gpu_blocks=list(range(blocks)), cpu_chunks=list(range(blocks))).wait(10)
        np.testing.assert_array_equal(off.cpu_tensors[0], kvs[r])
        off.close()
    assert all(rt.live == {} for rt in rts)  # closing the offloader unpinned its region


# -- population ----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_creator_populates_the_whole_file_once_and_joiners_nothing(
    names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(pages, "_madvise", lambda a, n, adv: calls.append((a, n)))
    name = names()
    regions = [SharedHostRegion(name, 3, 4 * PAGE, r, 4, populate="creator") for r in range(4)]
    creator = next(r for r in regions if r.is_creator)
    assert calls == [(creator.base_ptr, 12 * PAGE)]
    assert [r.populated_with for r in regions] == [
        "madvise" if r is creator else None for r in regions
    ]
    calls.clear()
    unranked = SharedHostRegion(name, 3, 4 * PAGE, None, 4, populate="creator")
    assert calls == [] and unranked.populated_with is None  # a joiner, even unranked
    unranked.close()
    for r in regions:
        r.close()
    calls.clear()
    slot = SharedHostRegion(names(), 2, 2 * PAGE, 1, 2, populate="slot")
    assert [(a - slot.base_ptr, n) for a, n in calls] == [(PAGE, PAGE), (3 * PAGE, PAGE)]
    slot.close()


@pytest.mark.timeout(30)
def test_creator_population_really_faults_every_page(names: Names) -> None:
    name = names()
    creator = SharedHostRegion(name, 8, PAGE, 0, 2, populate="creator")
    joiner = SharedHostRegion(name, 8, PAGE, 1, 2, populate="creator")
    assert creator.populated_with in ("madvise", "touch")
    assert creator.allocated_bytes == 8 * PAGE  # the creator's one pass allocated it all
    joiner.close()
    creator.close()
