"""SharedHostRegion without a GPU (notes 6.3): views, cursors, sharing across mappings and
processes, the create/join/barrier/unlink protocol, population, pinning, close."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import mmap
import os
import signal
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import region_procs as procs

import kvasync as kv
import kvasync._region_file as regfile
import kvasync._region_pages as pages
from kvasync._hostmem import host_memory
from kvasync._region import (
    RegionOverflowError,
    SharedHostRegion,
    SharedRegionError,
    SharedRegionTimeoutError,
)

PAGE = mmap.PAGESIZE

Names = Callable[[], str]


def path_of(name: str) -> str:
    return f"/dev/shm/kvasync-{name}.shm"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- views --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_worker_view_shape_stride_and_slot(names: Names, world: int) -> None:
    name = names()
    regions = [SharedHostRegion(name, 4, world * PAGE, r, world) for r in range(world)]
    for r, region in enumerate(regions):
        view = region.create_next_worker_view(PAGE)
        assert view.shape == (4, PAGE)
        assert view.strides == (world * PAGE, 1)
        assert view.dtype == np.uint8
        assert view.ctypes.data == region.base_ptr + r * PAGE
        assert region.slot_bytes == PAGE
        del view
    for region in regions:
        region.close()


def test_worker_cursor_and_overflow_leave_cursor_unchanged(names: Names) -> None:
    region = SharedHostRegion(names(), 4, 4 * PAGE, 1, 2)  # slot = 2 pages
    base = region.base_ptr + 2 * PAGE
    with pytest.raises(RegionOverflowError, match="exceeds worker area end"):
        region.create_next_worker_view(2 * PAGE + 1)  # single overflow
    a = region.create_next_worker_view(PAGE)
    assert a.ctypes.data == base
    b = region.create_next_worker_view(PAGE)  # exactly to the slot end
    assert b.ctypes.data == base + PAGE
    with pytest.raises(kv.InvalidTransferError, match="exceeds worker area end"):
        region.create_next_worker_view(1)  # cumulative overflow by one byte
    del a, b
    region.close()

    region = SharedHostRegion(names(), 2, 2 * PAGE, 0, 1)
    region.create_next_worker_view(PAGE)
    with pytest.raises(RegionOverflowError):
        region.create_next_worker_view(PAGE + 1)
    c = region.create_next_worker_view(PAGE)  # the failed call did not move the cursor
    assert c.ctypes.data == region.base_ptr + PAGE
    for bad in (0, -1, 1.5, True):
        with pytest.raises(kv.InvalidTransferError):
            region.create_next_worker_view(bad)  # type: ignore[arg-type]
    del c
    region.close()


def test_canonical_views_are_the_same_bytes_for_every_rank(names: Names) -> None:
    name = names()
    regions = [SharedHostRegion(name, 3, 2 * PAGE, r, 4) for r in range(4)]
    for region in regions:
        v1 = region.create_next_canonical_view(1000)
        v2 = region.create_next_canonical_view(2 * PAGE - 1000)  # exactly the row end
        assert v1.ctypes.data == region.base_ptr
        assert v2.ctypes.data == region.base_ptr + 1000
        assert v1.strides == (2 * PAGE, 1) and v2.shape == (3, 2 * PAGE - 1000)
        with pytest.raises(RegionOverflowError, match="exceeds the row end"):
            region.create_next_canonical_view(1)
        with pytest.raises(kv.InvalidTransferError, match="overlap"):
            region.create_next_worker_view(8)  # no mixing of the two carvings
        del v1, v2
    a = regions[0].raw_view()
    b = regions[3].raw_view()
    a[2, 5] = 99
    assert b[2, 5] == 99
    del a, b
    for region in regions:
        region.close()
    worker = SharedHostRegion(names(), 1, PAGE, 0, 1)
    worker.create_next_worker_view(8)
    with pytest.raises(kv.InvalidTransferError, match="overlap"):
        worker.create_next_canonical_view(8)
    worker.close()
    unranked = SharedHostRegion(names(), 1, PAGE, None, 2)
    with pytest.raises(kv.InvalidTransferError, match="unranked"):
        unranked.create_next_worker_view(8)
    unranked.close()


@pytest.mark.parametrize("how", ["too many chunks", "overflow mid-carve", "after carving"])
def test_an_offloader_refused_over_a_region_carves_nothing(
        names: Names, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused `Offloader(host_region=...)` leaves the cursor where it was, however far it
    got, so a retry carves what every other rank carved: canonical views must agree."""
    import kvasync._hostside as hostside

    name = names()
    ranks = [SharedHostRegion(name, 4, PAGE, r, 2) for r in range(2)]
    gpu = [np.random.default_rng(i).integers(0, 256, (8, 32), dtype=np.uint8)
           for i in range(2)]

    def offloader(region: SharedHostRegion, chunks: int, tensors: list[np.ndarray],
                  ) -> kv.Offloader:
        layout = kv.KVCacheLayout(tensors, [[
            kv.KVRef(i, mapping=kv.PageMapping.identity(t.shape[1]))
            for i, t in enumerate(tensors)]])
        return kv.Offloader(layout, chunks, backend="host", host_region=region,
                            canonical=True)

    first = offloader(ranks[0], 4, gpu)
    if how == "too many chunks":
        with pytest.raises(kv.InvalidTransferError, match="4 rows"):
            offloader(ranks[1], 8, gpu)
    elif how == "overflow mid-carve":  # the first tensor's view fits, the second's not
        wide = [np.zeros((8, 32), np.uint8), np.zeros((8, PAGE), np.uint8)]
        with pytest.raises(RegionOverflowError):
            offloader(ranks[1], 4, wide)
    else:
        def refuse(*args: object) -> None:
            raise kv.InvalidTransferError("refused after carving")
        with monkeypatch.context() as m:
            m.setattr(hostside, "_ref_tables", refuse)
            with pytest.raises(kv.InvalidTransferError, match="after carving"):
                offloader(ranks[1], 4, gpu)
    mine = [np.zeros_like(g) for g in gpu]
    second = offloader(ranks[1], 4, mine)
    assert ([v.ctypes.data - ranks[1].base_ptr for v in second.cpu_tensors]
            == [v.ctypes.data - ranks[0].base_ptr for v in first.cpu_tensors] == [0, 32])
    first.store(gpu_blocks=[5], cpu_chunks=[2]).wait(5)  # rank 0 writes, rank 1 reads
    second.load(cpu_chunks=[2], gpu_blocks=[0]).wait(5)
    np.testing.assert_array_equal(mine[0][0], gpu[0][5])
    np.testing.assert_array_equal(mine[1][0], gpu[1][5])
    for off in (first, second):
        off.close()
    for region in ranks:
        region.close()


# -- data ---------------------------------------------------------------------------------------


def test_row_writes_land_in_the_raw_layout(names: Names) -> None:
    region = SharedHostRegion(names(), 4, 2 * PAGE, 0, 1)
    t0 = region.create_next_worker_view(PAGE)
    t1 = region.create_next_worker_view(PAGE)  # the next tensor: right after t0 in each row
    t0[2] = 7
    t1[2] = 8
    raw = region.raw_view().reshape(-1)
    assert (raw[4 * PAGE : 5 * PAGE] == 7).all()
    assert (raw[5 * PAGE : 6 * PAGE] == 8).all()
    assert np.count_nonzero(raw) == 2 * PAGE
    del t0, t1, raw
    region.close()


def test_two_regions_in_one_process_are_isolated(names: Names) -> None:
    a = SharedHostRegion(names(), 2, PAGE, 0, 1)
    b = SharedHostRegion(names(), 2, PAGE, 0, 1)
    va, vb = a.create_next_worker_view(PAGE), b.create_next_worker_view(PAGE)
    va[:] = 1
    assert (vb == 0).all()
    del va, vb
    a.close()
    b.close()


def test_threads_construct_concurrently_and_share_writes(names: Names) -> None:
    name = names()
    regions: list[SharedHostRegion | None] = [None] * 8
    errors: list[BaseException] = []
    go = threading.Event()

    def open_one(r: int) -> None:
        go.wait()
        try:
            regions[r] = SharedHostRegion(name, 4, 8 * PAGE, r, 8)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    assert errors == []
    opened = [r for r in regions if r is not None]
    assert sum(r.is_creator for r in opened) == 1
    assert all(r.total_size == 4 * 8 * PAGE for r in opened)
    creator = next(r for r in opened if r.is_creator)
    views = [r.create_next_worker_view(PAGE) for r in opened]
    for i, v in enumerate(views):
        v[:] = i + 1
    for other in opened:
        raw = other.raw_view()
        for row in range(4):
            for w in range(8):
                assert raw[row, w * PAGE] == w + 1
        del raw
    del views
    for r in opened:
        if r is not creator:
            r.close()
    assert os.path.exists(path_of(name))  # a joiner never removes the path
    creator.close()
    assert not os.path.exists(path_of(name))  # the creator does


def test_four_processes_race_to_create(names: Names) -> None:
    name = names()
    go, out = procs.SPAWN.Event(), procs.SPAWN.Queue()
    ps = [procs.SPAWN.Process(target=procs.race_writer, args=(name, r, 4, 3, 4 * PAGE, go, out))
          for r in range(4)]
    for p in ps:
        p.start()
    time.sleep(0.05)
    go.set()
    reports = sorted(out.get(timeout=20) for _ in ps)
    for p in ps:
        p.join(timeout=20)
    assert [e for _, _, e in reports] == [None] * 4
    assert sum(creator for _, creator, _ in reports) == 1
    raw = np.fromfile(path_of(name), dtype=np.uint8)  # keep_file: the file stays
    assert raw.size == 3 * 4 * PAGE
    for row in range(3):
        for w in range(4):
            start = (row * 4 + w) * PAGE
            assert (raw[start : start + PAGE] == w + 1).all()


def test_two_processes_with_a_real_barrier(names: Names) -> None:
    name = names()
    barrier, out = procs.SPAWN.Barrier(2), procs.SPAWN.Queue()
    ps = [procs.SPAWN.Process(target=procs.barrier_peer, args=(name, r, 3, 2 * PAGE, barrier, out))
          for r in range(2)]
    for p in ps:
        p.start()
    reports = sorted(out.get(timeout=20) for _ in ps)
    for p in ps:
        p.join(timeout=20)
    (r0, c0, e0, i0, s0, pop0), (r1, c1, e1, i1, s1, pop1) = reports
    assert c0 + c1 == 1  # one creator
    assert not e0 and not e1  # the path is gone once the barrier passed
    assert i0 == i1  # one inode shared by both
    assert s1 == 0x5C  # rank 1 read what rank 0 wrote
    assert pop0 == pop1 == "madvise"
    assert not os.path.exists(path_of(name))


def test_sigkill_leaks_nothing_and_restart_recreates(names: Names) -> None:
    name = names()
    barrier, out = procs.SPAWN.Barrier(2), procs.SPAWN.Queue()
    ps = [procs.SPAWN.Process(target=procs.sleeper, args=(name, r, 2, PAGE, barrier, out))
          for r in range(2)]
    for p in ps:
        p.start()
    pids = [out.get(timeout=20)[1] for _ in ps]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for p in ps:
        p.join(timeout=20)
        assert p.exitcode == -signal.SIGKILL
    assert not os.path.exists(path_of(name))
    region = SharedHostRegion(name, 2, PAGE, 0, 1)  # a restart starts from a fresh file
    assert region.is_creator
    assert (region.raw_view() == 0).all()
    region.close()


def test_creator_failure_does_not_wedge_the_joiner(names: Names) -> None:
    name = names()
    barrier, out = procs.SPAWN.Barrier(2), procs.SPAWN.Queue()
    ps = [procs.SPAWN.Process(target=procs.failing_peer, args=(name, r, 2, PAGE, barrier, out))
          for r in range(2)]
    for p in ps:
        p.start()
    reports = sorted(out.get(timeout=20) for _ in ps)
    for p in ps:
        p.join(timeout=20)
    (_, err0, calls0), (_, err1, calls1) = reports
    assert "free" in err0 and calls0 == 1
    assert "creator failed" in err1 and calls1 == 1  # both reached the barrier exactly once
    assert procs.shm_leftovers(name) == []


# -- the file, joining, population -----------------------------------------------------------


def test_file_stays_with_its_size_when_kept(names: Names) -> None:
    name = names()
    region = SharedHostRegion(name, 3, 2 * PAGE, 1, 2, keep_file=True)
    assert region.is_creator and region.name == name
    st = os.stat(region.path)
    assert st.st_size == region.total_size == 6 * PAGE
    assert st.st_mode & 0o777 == 0o600
    region.close()
    assert os.path.exists(path_of(name))


def _stub(name: str, size: int = 0) -> str:
    path = path_of(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return path


def test_join_waits_for_the_size(names: Names) -> None:
    name = names()
    path = _stub(name, 4 * PAGE)
    creator = os.open(path, os.O_RDONLY)  # a live creator holds its file (shared flock)
    fcntl.flock(creator, fcntl.LOCK_SH)
    t0 = time.monotonic()
    region = SharedHostRegion(name, 4, PAGE, 1, 2)  # big enough already
    assert time.monotonic() - t0 < 0.5 and not region.is_creator
    region.close()
    os.close(creator)
    os.unlink(path)

    name = names()
    path = _stub(name)
    grower = threading.Timer(0.05, lambda: os.truncate(path, 4 * PAGE))
    grower.start()
    t0 = time.monotonic()
    region = SharedHostRegion(name, 4, PAGE, 1, 2)
    assert 0.04 <= time.monotonic() - t0 < 2
    grower.join()
    region.close()


def test_join_timeout_and_creator_failure_are_clear(names: Names) -> None:
    name = names()
    _stub(name)
    fds = open_fds()
    with pytest.raises(SharedRegionTimeoutError, match="stayed at 0 B") as info:
        SharedHostRegion(name, 4, PAGE, 1, 2, timeout=0.1)
    assert isinstance(info.value, TimeoutError)
    assert open_fds() == fds

    name = names()
    path = _stub(name)
    threading.Timer(0.05, lambda: os.unlink(path)).start()
    with pytest.raises(SharedRegionError, match="creator failed"):
        SharedHostRegion(name, 4, PAGE, 1, 2, timeout=5)
    assert open_fds() == fds


@pytest.mark.parametrize("fail", ["space", "ftruncate"])
def test_creator_failure_unlinks_and_closes(
    names: Names, fail: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = names()
    seen: list[tuple[str, int]] = []
    if fail == "space":
        def free(directory: str) -> int:
            seen.append((directory, 0))
            return PAGE
        monkeypatch.setattr(regfile, "_free_bytes", free)
        expect: type[BaseException] = SharedRegionError
    else:
        def ftruncate(fd: int, size: int) -> None:
            seen.append(("ftruncate", size))
            raise OSError(errno.ENOSPC, "no space")
        monkeypatch.setattr(os, "ftruncate", ftruncate)
        expect = OSError
    fds = open_fds()
    with pytest.raises(expect) as info:
        SharedHostRegion(name, 4, PAGE, 1, 2)  # not the owner, but the creator
    if fail == "space":
        assert "free" in str(info.value) and seen == [("/dev/shm", 0)]
    else:
        assert seen == [("ftruncate", 4 * PAGE)]
    assert not os.path.exists(path_of(name))
    assert open_fds() == fds


def test_population_spans_ranked_and_unranked(names: Names, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(pages, "_madvise", lambda a, n, adv: calls.append((a, n)))
    region = SharedHostRegion(names(), 3, 2 * PAGE, 1, 2)
    assert [(a - region.base_ptr, n) for a, n in calls] == [
        (PAGE, PAGE), (3 * PAGE, PAGE), (5 * PAGE, PAGE)
    ]
    assert region.populated_with == "madvise"
    region.close()
    calls.clear()
    region = SharedHostRegion(names(), 3, 2 * PAGE, 0, 1)  # one rank: one call for it all
    assert [(a - region.base_ptr, n) for a, n in calls] == [(0, 6 * PAGE)]
    region.close()
    calls.clear()
    region = SharedHostRegion(names(), 3, 2 * PAGE, 0, 2, populate=False)
    assert calls == [] and region.populated_with is None
    region.close()


@pytest.mark.parametrize("rank", [1, None])
def test_einval_falls_back_to_touching_each_page(
    names: Names, monkeypatch: pytest.MonkeyPatch, rank: int | None
) -> None:
    def einval(addr: int, length: int, advice: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    touched: list[tuple[int, int]] = []
    real_touch = pages._touch

    def touch(addr: int, length: int) -> None:
        touched.append((addr, length))
        real_touch(addr, length)

    monkeypatch.setattr(pages, "_madvise", einval)
    monkeypatch.setattr(pages, "_touch", touch)
    region = SharedHostRegion(names(), 3, 2 * PAGE, rank, 2)
    assert region.populated_with == "touch"
    touched = [(a - region.base_ptr, n) for a, n in touched]
    if rank is None:
        assert touched == [(0, 6 * PAGE)]
    else:
        assert touched == [(PAGE, PAGE), (3 * PAGE, PAGE), (5 * PAGE, PAGE)]
    region.close()


def _resident_pages(addr: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (length // PAGE))()
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec)


def test_fallback_populates_every_page_and_keeps_peer_bytes(
    names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = names()
    first = SharedHostRegion(name, 8, PAGE, 0, 1, populate=False)
    assert first.allocated_bytes == 0
    first.raw_view()[5, 17] = 0xAB  # a peer's byte on a page the joiner will touch
    monkeypatch.setattr(pages, "_madvise",
                        lambda a, n, adv: (_ for _ in ()).throw(OSError(errno.EINVAL, "x")))
    second = SharedHostRegion(name, 8, PAGE, None, 1)
    assert second.populated_with == "touch"
    assert _resident_pages(second.base_ptr, second.total_size) == 8
    assert second.allocated_bytes == 8 * PAGE
    assert second.raw_view()[5, 17] == 0xAB
    second.close()
    first.close()


def test_real_madvise_populates(names: Names) -> None:
    region = SharedHostRegion(names(), 8, PAGE, None, 1)
    assert region.populated_with in ("madvise", "touch")  # touch only on kernels < 5.14
    assert region.allocated_bytes == 8 * PAGE
    region.close()


def test_other_madvise_errors_propagate_and_clean_up(
    names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(addr: int, length: int, advice: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(pages, "_madvise", eio)
    name = names()
    fds = open_fds()
    with pytest.raises(OSError) as info:
        SharedHostRegion(name, 2, PAGE, 1, 2)
    assert info.value.errno == errno.EIO
    assert not os.path.exists(path_of(name))  # the creator removed its file
    assert open_fds() == fds


# -- barrier and ownership -----------------------------------------------------------------------


def test_barrier_then_unlink_mapping_stays_usable(names: Names) -> None:
    name = names()
    during: list[bool] = []
    region = SharedHostRegion(name, 2, PAGE, 0, 1,
                              barrier=lambda: during.append(os.path.exists(path_of(name))))
    assert during == [True]
    assert not os.path.exists(path_of(name))
    view = region.create_next_worker_view(PAGE)
    view[1] = 3
    assert region.raw_view()[1, 0] == 3
    del view
    region.close()


def test_barrier_failure_removes_the_file_and_reraises(names: Names) -> None:
    name = names()

    def broken() -> None:
        raise RuntimeError("peer vanished")

    with pytest.raises(RuntimeError, match="peer vanished"):
        SharedHostRegion(name, 2, PAGE, 0, 1, barrier=broken)
    assert not os.path.exists(path_of(name))


@pytest.mark.parametrize("where", ["space", "populate", "mmap"])
def test_setup_failure_reaches_the_barrier_once_with_the_file_gone(
    names: Names, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    name = names()
    if where == "space":
        monkeypatch.setattr(regfile, "_free_bytes", lambda d: 0)
    elif where == "populate":
        def eio(addr: int, length: int, advice: int) -> None:
            raise OSError(errno.EIO, "I/O error")
        monkeypatch.setattr(pages, "_madvise", eio)
    else:
        def no_map(*a: object, **k: object) -> mmap.mmap:
            raise OSError(errno.ENOMEM, "cannot map")
        monkeypatch.setattr(mmap, "mmap", no_map)
    seen: list[bool] = []

    def barrier() -> None:
        seen.append(os.path.exists(path_of(name)))
        raise RuntimeError("barrier release failed too")  # the setup error must win

    with pytest.raises((SharedRegionError, OSError)) as info:
        SharedHostRegion(name, 2, PAGE, 0, 1, barrier=barrier)
    assert "barrier" not in str(info.value)
    assert seen == [False]


def test_only_the_creator_removes_the_path_whatever_the_ranks(names: Names) -> None:
    name = names()
    creator = SharedHostRegion(name, 1, PAGE, 1, 2)
    joiner = SharedHostRegion(name, 1, PAGE, 0, 2)  # rank 0, but not the creator
    assert creator.is_creator and not joiner.is_creator
    joiner.close()
    assert os.path.exists(path_of(name))
    creator.close()
    assert not os.path.exists(path_of(name))


def test_close_is_idempotent_and_unlinks_once(
    names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = names()
    region = SharedHostRegion(name, 2, PAGE, 0, 1)
    view = region.create_next_worker_view(PAGE)
    del view  # created and dropped: close can unmap
    unlinks: list[str] = []
    real = os.unlink

    def counting(path: str) -> None:
        unlinks.append(path)
        real(path)

    monkeypatch.setattr(os, "unlink", counting)
    fds = open_fds()
    region.close()
    region.close()
    assert unlinks == [path_of(name)]
    assert region.closed and region._mm is None
    assert open_fds() <= fds - 1 and region._file is not None and region._file.fd == -1
    # a newer region at the same path is never removed by an old one
    newer = SharedHostRegion(name, 2, PAGE, 1, 2)
    region._file._unlinked = False
    region._unlink()
    assert os.path.exists(path_of(name))
    newer.close()
    with pytest.raises(SharedRegionError, match="closed"):
        region.create_next_worker_view(8)
    with pytest.raises(SharedRegionError, match="closed"):
        region.base_ptr  # a stale address would reach unmapped memory


def test_close_with_a_live_view_keeps_the_view_valid(names: Names) -> None:
    region = SharedHostRegion(names(), 2, PAGE, 0, 1)
    view = region.create_next_worker_view(PAGE)
    view[1] = 9
    region.close()  # BufferError inside is handled: the mapping lives on with the view
    assert region.closed
    assert (view[1] == 9).all()
    view[0] = 1  # still mapped, still writable
    del view


def test_properties(names: Names) -> None:
    name = names()
    region = SharedHostRegion(name, 5, 3 * PAGE, 2, 3)
    assert (region.num_rows, region.row_stride, region.rank, region.world_size) == (5, 3 * PAGE,
                                                                                   2, 3)
    assert region.total_size == 15 * PAGE and region.path == path_of(name)
    assert region.base_ptr % PAGE == 0
    assert "rank 2/3" in repr(region)
    region.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(row_stride=PAGE + 1), "multiple of the page size"),
        (dict(row_stride=0), "row_stride"),
        (dict(num_rows=0), "num_rows"),
        (dict(rank=2), "rank"),
        (dict(world_size=0), "world_size"),
        (dict(name="../etc"), "name"),
        (dict(name="engine-42"), "per-job token"),
        (dict(name="x-" + "A" * 32), "per-job token"),
        (dict(name=None), "per-job token"),
        (dict(timeout=0), "timeout"),
        (dict(populate="all"), "populate"),
        (dict(populate=1), "populate"),
        (dict(directory=""), "directory"),
    ],
)
def test_bad_arguments(names: Names, kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = dict(name=names(), num_rows=2, row_stride=PAGE, rank=0,
                                   world_size=2)
    args.update(kwargs)
    calls: list[int] = []
    with pytest.raises(kv.InvalidTransferError, match=match):
        SharedHostRegion(**args, barrier=lambda: calls.append(1))  # type: ignore[arg-type]
    assert calls == [1]  # peers waiting at the barrier are released even for bad arguments


# -- pinning ------------------------------------------------------------------------------------


class FakeRuntime:
    """register/unregister that log calls and fail at a chosen chunk."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.calls = 0

    def register(self, ptr: int, size: int) -> bool:
        k, self.calls = self.calls, self.calls + 1
        if k == self.fail_at:
            return False
        self.registered.append((ptr, size))
        return True

    def unregister(self, ptr: int) -> bool:
        self.unregistered.append(ptr)
        return True


def test_pin_in_row_aligned_chunks_and_unpin_in_reverse(names: Names) -> None:
    region = SharedHostRegion(names(), 5, 3 * PAGE, 0, 1)
    rt = FakeRuntime()
    assert region.pin(rt.register, rt.unregister, cap=7 * PAGE)
    base = region.base_ptr
    assert [(p - base, n // PAGE) for p, n in rt.registered] == [(0, 6), (6 * PAGE, 6),
                                                                 (12 * PAGE, 3)]
    assert region.is_pinned
    assert region.pinned_addresses == [base, base + 6 * PAGE, base + 12 * PAGE]
    assert region.pin(rt.register, rt.unregister)  # already pinned: no second registration
    assert rt.calls == 3
    region.close()
    assert rt.unregistered == [base + 12 * PAGE, base + 6 * PAGE, base]
    assert not region.is_pinned and region.pinned_addresses == []
    region.close()
    assert len(rt.unregistered) == 3


@pytest.mark.parametrize("k", [0, 1, 2])
def test_pin_failure_at_chunk_k_rolls_back(names: Names, k: int) -> None:
    region = SharedHostRegion(names(), 5, 3 * PAGE, 0, 1)
    rt = FakeRuntime(fail_at=k)
    assert region.pin(rt.register, rt.unregister, cap=7 * PAGE) is False
    assert rt.calls == k + 1
    assert rt.unregistered == [p for p, _ in reversed(rt.registered)]
    assert len(rt.unregistered) == k
    assert not region.is_pinned and region.pinned_addresses == []
    region.close()
    assert len(rt.unregistered) == k  # nothing left to unregister


class MappedRuntime(FakeRuntime):
    """Also reads the first byte of each chunk as it is unregistered: that segfaults if the
    mapping under it is already gone, so an unregister after the unmap cannot pass."""

    def unregister(self, ptr: int) -> bool:
        ctypes.c_uint8.from_address(ptr).value
        return super().unregister(ptr)


def test_a_region_collected_unclosed_unpins_before_its_mapping_goes(names: Names) -> None:
    rt = MappedRuntime()
    region = SharedHostRegion(names(), 5, 3 * PAGE, 0, 1)
    assert region.pin(rt.register, rt.unregister, cap=7 * PAGE)
    chunks = region.pinned_addresses
    del region
    gc.collect()
    assert rt.unregistered == chunks[::-1]


@pytest.mark.parametrize("keep_view", [False, True])
def test_host_memory_collected_unreleased_unpins_before_the_unmap(keep_view: bool) -> None:
    rt = MappedRuntime()
    mem = host_memory(10 * PAGE, 2 * PAGE, rt.register, rt.unregister, cap=4 * PAGE)
    assert mem.pinned and len(rt.registered) == 3
    mem.array[:] = 7
    view = mem.array[PAGE:] if keep_view else None
    ptrs = [p for p, _ in rt.registered]
    del mem
    gc.collect()
    assert rt.unregistered == ptrs[::-1]
    if view is not None:
        assert int(view.sum()) == 7 * 9 * PAGE  # a live view keeps its pages mapped


def test_host_memory_release_unpins_once() -> None:
    rt = MappedRuntime()
    mem = host_memory(4 * PAGE, PAGE, rt.register, rt.unregister)
    mem.release()
    mem.release()
    del mem
    gc.collect()
    assert len(rt.unregistered) == 1


def test_a_row_larger_than_the_cap_is_registered_whole(names: Names) -> None:
    region = SharedHostRegion(names(), 2, 4 * PAGE, 0, 1)
    rt = FakeRuntime()
    assert region.pin(rt.register, rt.unregister, cap=PAGE)
    assert [n for _, n in rt.registered] == [4 * PAGE, 4 * PAGE]
    region.close()


@pytest.mark.parametrize("keep", [False, True])
def test_a_region_collected_unclosed_removes_its_file_unless_kept(names: Names,
                                                                    keep: bool) -> None:
    """Without a barrier the creator removes the path in close(); collected without one,
    it removes it too (it left the file behind), unless `keep_file`."""
    name = names()
    region = SharedHostRegion(name, 2, PAGE, 0, 1, keep_file=keep)
    assert region.is_creator and os.path.exists(path_of(name))
    del region
    gc.collect()
    assert os.path.exists(path_of(name)) == keep
    if keep:
        os.unlink(path_of(name))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_childs_exit_leaves_its_parents_region_file(names: Names) -> None:
    """A creator without a barrier keeps the path until close(); a child it forks that
    exits normally runs the collection hooks too, and must not remove the parent's file
    (a rank joining by name later would create a second, empty region)."""
    import subprocess
    import sys

    code = textwrap.dedent(f"""
        import os, sys
        from kvasync import SharedHostRegion
        region = SharedHostRegion({names()!r}, 4, {PAGE}, 0, 2)
        region.raw_view()[0, :4] = [1, 2, 3, 4]
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit and the finalizers run in the child
        os.waitpid(pid, 0)
        kept = os.path.exists(region.path)
        joiner = SharedHostRegion(region.name, 4, {PAGE}, 1, 2)
        print(kept, joiner.is_creator, list(map(int, joiner.raw_view()[0, :4])))
        joiner.close()
        region.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split("\n")[0] == "True False [1, 2, 3, 4]", out.stdout + out.stderr
