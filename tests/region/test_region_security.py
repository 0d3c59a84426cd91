"""The shared region's file against other users, other jobs and dead jobs.

Every state the name can be found in (another user's file, a file with group/other bits, a
symlink, a FIFO, a directory, a hard link, a file of the wrong size) is refused before a
byte is mapped, and the thing found there is left exactly as it was. Only the creator ever
removes the path. Files of dead jobs are found and removed by `remove_stale`; live jobs'
files never are. The messages are the ones docs/shared-region.md lists.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import region_procs as procs

import kvasync as kv
import kvasync._region as region_mod
import kvasync._region_file as regfile
from kvasync import SharedHostRegion, SharedRegionError, SharedRegionTimeoutError

PAGE = mmap.PAGESIZE
ROOT = Path(__file__).resolve().parents[2]
Names = Callable[[], str]

#: what each refusal says; docs/shared-region.md's table lists the same fragments
FRAGMENTS = {
    "symlink": "is a symbolic link",
    "mode": "group/other permission bits",
    "uid": "not by this process's uid",
    "access": "another user's file holds the name",
    "size": "needs exactly",
    "type": "is not a regular file",
    "links": "hard links",
    "creator": "creator failed",
    "token": "per-job token",
    "memory": "not enough memory for the region",
    "space": "free, the region",
    "directory": "writable by other users and not sticky",
    "directory owner": "owned by uid",
    "stale": "nobody holds",
    "timeout": "stayed at 0 B",
}


def path_of(name: str, directory: str = "/dev/shm") -> str:
    return os.path.join(directory, f"kvasync-{name}.shm")


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory on /dev/shm's tmpfs: `remove_stale` there sees only our files,
    not those of tests running concurrently in /dev/shm."""
    d = tempfile.mkdtemp(prefix="kvasync-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def plant(path: str, size: int, mode: int = 0o600, data: bytes = b"") -> os.stat_result:
    """A file at `path` that is not the region's: given size, mode and leading bytes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if data:
            os.pwrite(fd, data, 0)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return os.lstat(path)


def snapshot(path: str) -> tuple[int, int, int, int, bytes]:
    st = os.lstat(path)
    with open(path, "rb") as f:
        head = f.read(64)
    return st.st_ino, st.st_size, st.st_mode, st.st_uid, head


@pytest.fixture
def no_mmap(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fail the test if the region maps anything: refusals come before the first byte."""
    calls: list[int] = []
    real = mmap.mmap

    def counting(*a: object, **k: object) -> mmap.mmap:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(region_mod.mmap, "mmap", counting)
    return calls


def refuse(name: str, fragment: str, directory: str = "/dev/shm", **kw: object) -> None:
    """Open as rank 0 with a barrier: refused with `fragment`, the barrier still reached
    exactly once."""
    calls: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(SharedRegionError, match=re.escape(fragment)):
        SharedHostRegion(name, 2, PAGE, 0, 1, barrier=lambda: calls.append(1),
                         directory=directory, **kw)  # type: ignore[arg-type]
    assert calls == [1]
    assert time.monotonic() - t0 < 5  # refused at once, not after the join timeout


# -- what can be found at the name -----------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [0o666, 0o644, 0o640, 0o604, 0o620, 0o602, 0o700 | 0o010])
@pytest.mark.parametrize("size", [0, 2 * PAGE])
def test_group_or_other_bits_are_refused_and_the_file_left_alone(
    names: Names, no_mmap: list[int], mode: int, size: int
) -> None:
    name = names()
    plant(path_of(name), size, mode, b"not yours")
    before = snapshot(path_of(name))
    refuse(name, FRAGMENTS["mode"])
    assert snapshot(path_of(name)) == before
    assert no_mmap == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("target_exists", [True, False])
def test_a_symlink_at_the_name_is_refused_and_its_target_untouched(
    names: Names, tmp_path: Path, no_mmap: list[int], target_exists: bool
) -> None:
    name = names()
    target = tmp_path / "victim"
    if target_exists:
        target.write_bytes(b"precious" * 100)
    os.symlink(target, path_of(name))
    refuse(name, FRAGMENTS["symlink"])
    assert os.path.islink(path_of(name))  # not removed: not ours
    if target_exists:
        assert target.read_bytes() == b"precious" * 100
        assert target.stat().st_size == 800
    else:
        assert not target.exists()  # O_CREAT never went through the link
    assert no_mmap == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [3 * PAGE, 2 * PAGE + 1, PAGE, 1])
def test_a_file_of_the_wrong_size_is_refused_at_once(
    names: Names, no_mmap: list[int], size: int
) -> None:
    """Larger (a stale file, or a live job of the same name) or smaller but not 0 (0 is a
    creator still sizing): refused without waiting out the timeout."""
    name = names()
    plant(path_of(name), size, 0o600, b"other job")
    before = snapshot(path_of(name))
    refuse(name, FRAGMENTS["size"], timeout=30.0)
    assert snapshot(path_of(name)) == before
    assert no_mmap == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [0o600, 0o666])
def test_a_file_of_another_uid_is_refused(names: Names, no_mmap: list[int], mode: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a file of another uid needs root (CI runs as one uid)")
    name = names()
    plant(path_of(name), 2 * PAGE, mode, b"attacker")
    os.chown(path_of(name), 65534, 65534)
    before = snapshot(path_of(name))
    refuse(name, FRAGMENTS["uid"])
    assert snapshot(path_of(name)) == before
    assert no_mmap == []


@pytest.mark.timeout(30)
def test_a_file_this_uid_cannot_open_is_refused_with_the_documented_words(
    names: Names, monkeypatch: pytest.MonkeyPatch, no_mmap: list[int]
) -> None:
    """What a non-root process meets at a name another user holds with mode 0600: EACCES on
    open. (Root opens anything, so the open's answer is simulated; the uid check behind it
    is tested for real above.)"""
    name = names()
    plant(path_of(name), 2 * PAGE)
    real = os.open

    def denied(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        if path == path_of(name) and not flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", path)
        return real(path, flags, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", denied)
    refuse(name, FRAGMENTS["access"])
    assert no_mmap == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_a_directory_at_the_name_is_refused(
    names: Names, no_mmap: list[int], kind: str
) -> None:
    name = names()
    if kind == "fifo":
        os.mkfifo(path_of(name), 0o600)
    else:
        os.mkdir(path_of(name), 0o700)
    try:
        refuse(name, FRAGMENTS["type"])
        assert os.path.lexists(path_of(name))
    finally:
        if kind == "directory":
            os.rmdir(path_of(name))
    assert no_mmap == []


@pytest.mark.timeout(30)
def test_a_hard_link_at_the_name_is_refused(
    names: Names, shm_dir: str, no_mmap: list[int]
) -> None:
    """A hard link to another file of ours (e.g. another job's region) is ours, private and
    maybe even of the right size: the link count gives it away."""
    name = names()
    other = os.path.join(shm_dir, "other-region")
    plant(other, 2 * PAGE, 0o600, b"another job")
    os.link(other, path_of(name))
    refuse(name, FRAGMENTS["links"])
    with open(other, "rb") as f:
        assert f.read(11) == b"another job"
    assert no_mmap == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_the_creator_makes_the_file_0600_whatever_the_umask(names: Names, umask: int) -> None:
    name = names()
    old = os.umask(umask)
    try:
        creator = SharedHostRegion(name, 2, PAGE, 0, 2)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(creator.path).st_mode) == 0o600
    joiner = SharedHostRegion(name, 2, PAGE, 1, 2)  # a same-uid joiner can open it
    joiner.close()
    creator.close()


@pytest.mark.timeout(30)
def test_a_directory_others_can_write_without_the_sticky_bit_is_refused(
    names: Names, tmp_path: Path
) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    refuse(names(), FRAGMENTS["directory"], directory=str(d))
    assert os.listdir(d) == []
    os.chmod(d, 0o1777)  # sticky, like /dev/shm: nobody can rename or remove our file
    region = SharedHostRegion(names(), 2, PAGE, 0, 1, directory=str(d))
    assert region.is_creator
    region.close()
    assert os.listdir(d) == []


# -- names ----------------------------------------------------------------------------------


def test_new_name_carries_a_fresh_token_and_bad_names_are_refused(names: Names) -> None:
    a, b = SharedHostRegion.new_name("engine"), SharedHostRegion.new_name("engine")
    assert re.fullmatch(r"engine-[0-9a-f]{32}", a) and a != b
    assert kv.SharedHostRegion.new_name().startswith("job-")
    for bad in ("", "-x", ".x", "a/b", "x" * 168, 5):
        with pytest.raises(kv.InvalidTransferError, match="prefix"):
            SharedHostRegion.new_name(bad)  # type: ignore[arg-type]
    calls: list[int] = []
    with pytest.raises(kv.InvalidTransferError, match=FRAGMENTS["token"]):
        SharedHostRegion("engine-42", 2, PAGE, 0, 1, barrier=lambda: calls.append(1))
    assert calls == [1]
    # two jobs of one prefix never meet in one file
    one, two = (SharedHostRegion(names(), 2, PAGE, 0, 1) for _ in range(2))
    assert one.path != two.path and one.is_creator and two.is_creator
    one.close()
    two.close()


# -- the creator's checks ----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_creator_checks_memory_before_allocating(
    names: Names, monkeypatch: pytest.MonkeyPatch, no_mmap: list[int]
) -> None:
    sized: list[int] = []
    real = os.ftruncate
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: (sized.append(n), real(fd, n))[1])
    monkeypatch.setattr(regfile, "_available_memory", lambda: 4 * PAGE - 1)
    name = names()
    with pytest.raises(SharedRegionError, match=FRAGMENTS["memory"]):
        SharedHostRegion(name, 4, PAGE, 0, 1)
    assert sized == [] and no_mmap == []  # nothing allocated, nothing mapped
    assert not os.path.exists(path_of(name))
    monkeypatch.setattr(regfile, "_available_memory", lambda: None)  # unknown: no refusal
    region = SharedHostRegion(name, 4, PAGE, 0, 1)
    assert sized == [4 * PAGE]
    region.close()


def test_available_memory_is_read_from_the_host() -> None:
    avail = regfile._available_memory()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert avail is not None and 0 < avail <= total


# -- who removes what ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_opener_timing_out_on_another_jobs_file_does_not_unlink_it(shm_dir: str) -> None:
    """Job A's creator is slow to size its file; job B's rank 0 (with a barrier) joins the
    name, times out, and must leave A's file alone: A finishes and keeps using it."""
    name = SharedHostRegion.new_name("jobA")
    proceed, out, bout = procs.SPAWN.Event(), procs.SPAWN.Queue(), procs.SPAWN.Queue()
    a = procs.SPAWN.Process(target=procs.slow_creator,
                            args=(name, 2, PAGE, proceed, shm_dir, out))
    a.start()
    try:
        tag, ino = out.get(timeout=30)
        assert tag == "stalled"
        b = procs.SPAWN.Process(target=procs.opener,
                                args=(name, 2, PAGE, 0, 1, 0.3, shm_dir, bout))
        b.start()
        creator_b, err_b = bout.get(timeout=30)
        b.join(timeout=30)
        assert not creator_b and err_b is not None and FRAGMENTS["timeout"] in err_b
        assert os.stat(path_of(name, shm_dir)).st_ino == ino  # still A's file
    finally:
        proceed.set()
    tag, creator_a, ino_a, err_a = out.get(timeout=30)
    a.join(timeout=30)
    assert (tag, creator_a, ino_a, err_a) == ("done", True, ino, None)
    assert os.stat(path_of(name, shm_dir)).st_size == 2 * PAGE


@pytest.mark.timeout(60)
def test_an_opener_refused_by_another_live_job_leaves_it_working(shm_dir: str) -> None:
    """Job A holds a live region; job B opens the same name with another size: refused, and
    A's file and bytes are untouched."""
    name = SharedHostRegion.new_name("live")
    release, out, bout = procs.SPAWN.Event(), procs.SPAWN.Queue(), procs.SPAWN.Queue()
    a = procs.SPAWN.Process(target=procs.holder, args=(name, 2, PAGE, shm_dir, release, out))
    a.start()
    try:
        ino = out.get(timeout=30)
        b = procs.SPAWN.Process(target=procs.opener,
                                args=(name, 3, PAGE, 0, 1, 5.0, shm_dir, bout))
        b.start()
        creator_b, err_b = bout.get(timeout=30)
        b.join(timeout=30)
        assert not creator_b and FRAGMENTS["size"] in err_b
        assert os.stat(path_of(name, shm_dir)).st_ino == ino
        with open(path_of(name, shm_dir), "rb") as f:
            assert f.read() == b"\x77" * 2 * PAGE
    finally:
        release.set()
        a.join(timeout=30)


@pytest.mark.timeout(30)
def test_a_dead_jobs_full_size_file_is_refused_unless_kept_on_purpose(
    shm_dir: str,
) -> None:
    """A run killed before its barrier leaves its full-size file; a restart under the same
    name found it and every rank joined it: nobody removed it, and the new run read the
    dead run's bytes. A sized file nobody holds is refused, and removed by remove_stale;
    `keep_file=True` joins it (a region kept on purpose) and leaves it in place."""
    name = SharedHostRegion.new_name("stale")
    path = path_of(name, shm_dir)
    plant(path, 2 * PAGE, data=b"dead run")
    ino = os.stat(path).st_ino
    with pytest.raises(SharedRegionError, match="nobody holds"):
        SharedHostRegion(name, 2, PAGE, 0, 1, barrier=lambda: None, directory=shm_dir)
    assert os.stat(path).st_ino == ino  # refused, not removed
    kept = SharedHostRegion(name, 2, PAGE, 0, 1, barrier=lambda: None, keep_file=True,
                            directory=shm_dir)
    assert not kept.is_creator and bytes(kept.raw_view()[0, :8]) == b"dead run"
    kept.close()
    assert os.stat(path).st_ino == ino
    assert SharedHostRegion.remove_stale(shm_dir, min_age=0) == [path]
    fresh = SharedHostRegion(name, 2, PAGE, 0, 1, barrier=lambda: None, directory=shm_dir)
    assert fresh.is_creator and not os.path.exists(path)  # created, then the barrier
    fresh.close()


# -- stale files -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_remove_stale_removes_dead_jobs_files_only(shm_dir: str, tmp_path: Path) -> None:
    names = {k: SharedHostRegion.new_name(k) for k in ("dead", "live", "done", "fresh")}
    # one event each: setting an event a SIGKILLed waiter slept on blocks forever
    never, release, out = procs.SPAWN.Event(), procs.SPAWN.Event(), procs.SPAWN.Queue()
    dead = procs.SPAWN.Process(target=procs.holder,
                               args=(names["dead"], 2, PAGE, shm_dir, never, out))
    live = procs.SPAWN.Process(target=procs.holder,
                               args=(names["live"], 2, PAGE, shm_dir, release, out))
    dead.start()
    live.start()
    try:
        out.get(timeout=30)
        out.get(timeout=30)
        assert dead.pid is not None
        os.kill(dead.pid, signal.SIGKILL)  # no barrier, no close: its file stays behind
        dead.join(timeout=30)
        done = SharedHostRegion(names["done"], 1, PAGE, 0, 1, keep_file=True,
                                directory=shm_dir)
        done.close()  # closed, file kept: nobody holds it
        fresh = path_of(names["fresh"], shm_dir)
        plant(fresh, PAGE)
        os.utime(fresh, (time.time() + 3600,) * 2)  # "changed" in the future: too young
        # things that are not ours to judge
        target = tmp_path / "target"
        target.write_bytes(b"keep")
        os.symlink(target, os.path.join(shm_dir, "kvasync-link.shm"))
        plant(os.path.join(shm_dir, "unrelated.shm"), PAGE)
        if os.geteuid() == 0:
            plant(os.path.join(shm_dir, "kvasync-nobody.shm"), PAGE)
            os.chown(os.path.join(shm_dir, "kvasync-nobody.shm"), 65534, 65534)
        want = sorted(path_of(names[k], shm_dir) for k in ("dead", "done"))

        assert SharedHostRegion.remove_stale(shm_dir, min_age=0, dry_run=True) == want
        assert all(os.path.exists(p) for p in want)  # dry run: detected, not removed
        assert SharedHostRegion.remove_stale(shm_dir, min_age=0) == want
        assert not any(os.path.exists(p) for p in want)
        assert SharedHostRegion.remove_stale(shm_dir, min_age=0) == []
        left = sorted(os.listdir(shm_dir))
        assert os.path.basename(path_of(names["live"], shm_dir)) in left  # live: kept
        assert os.path.basename(fresh) in left
        assert "kvasync-link.shm" in left and target.read_bytes() == b"keep"
        assert "unrelated.shm" in left
        if os.geteuid() == 0:
            assert "kvasync-nobody.shm" in left
    finally:
        release.set()
        live.join(timeout=30)
    # the live job closed (keep_file): now it is stale too; a default min_age keeps it a while
    assert SharedHostRegion.remove_stale(shm_dir) == []
    assert SharedHostRegion.remove_stale(shm_dir, min_age=0) == [path_of(names["live"],
                                                                         shm_dir)]
    for bad in (-1, "1", True, float("nan")):
        with pytest.raises(kv.InvalidTransferError, match="min_age"):
            SharedHostRegion.remove_stale(shm_dir, min_age=bad)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_an_opener_racing_remove_stale_starts_over_on_a_fresh_file(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The opener finds the stale file, remove_stale takes and removes it before the
    opener's lock: the opener must not map the removed file but create a fresh one."""
    name = SharedHostRegion.new_name("race")
    path = path_of(name, shm_dir)
    plant(path, 2 * PAGE, data=b"stale")
    stale_ino = os.stat(path).st_ino
    real = regfile._lock_shared
    raced: list[list[str]] = []

    def lock_after_removal(fd: int) -> bool:
        if not raced:
            raced.append(SharedHostRegion.remove_stale(shm_dir, min_age=0))
        return real(fd)

    monkeypatch.setattr(regfile, "_lock_shared", lock_after_removal)
    # keep_file: an opener that would join a kept file (else the stale file is refused)
    region = SharedHostRegion(name, 2, PAGE, 0, 1, keep_file=True, directory=shm_dir)
    assert raced == [[path]]
    assert region.is_creator and os.stat(path).st_ino != stale_ino
    assert bytes(region.raw_view()[0, :5]) == b"\0" * 5
    region.close()
    os.unlink(path)


# -- the docs say what the code does -------------------------------------------------------------


def test_the_docs_list_every_refusal_and_import_the_public_name() -> None:
    doc = (ROOT / "docs" / "shared-region.md").read_text()
    for key, fragment in FRAGMENTS.items():
        assert f"`{fragment}`" in doc, key
    assert "once exported" not in doc and "kvasync._region" not in doc
    example = (ROOT / "examples" / "tensor_parallel.py").read_text()
    assert "once exported" not in example and "kvasync._region" not in example


def test_creator_failed_message_is_raised_verbatim(names: Names) -> None:
    """A joiner on a stub whose creator removes it gets the phrase the docs use."""
    name = names()
    plant(path_of(name), 0)
    threading_timer = __import__("threading").Timer(0.05, os.unlink, (path_of(name),))
    threading_timer.start()
    with pytest.raises(SharedRegionError, match=FRAGMENTS["creator"]) as info:
        SharedHostRegion(name, 2, PAGE, 1, 2, timeout=10)
    threading_timer.join()
    assert not isinstance(info.value, SharedRegionTimeoutError)
    assert str(info.value).startswith("creator failed: ")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_sticky_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """The sticky bit does not bind a directory's owner: another uid owning it could rename
    the creator's file aside, and the next rank would create a second one (two regions
    that each rank takes for the shared one)."""
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 65534, 65534)
    os.chmod(d, 0o1777)
    with pytest.raises(SharedRegionError, match="owned by uid 65534"):
        SharedHostRegion(SharedHostRegion.new_name("theirs"), 2, PAGE, 0, 1, directory=str(d))
    assert os.listdir(d) == []


def test_a_creator_failing_before_it_hands_over_its_file_removes_it(
        shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A creator failing between its O_EXCL create and the hand-over (flock refused, as on
    a file system without locks, or a Ctrl-C there) removes the 0-byte file it made, so a
    joiner is not left waiting on it."""
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(regfile, "fcntl", type("F", (), {
        "flock": staticmethod(no_locks), "LOCK_SH": fcntl.LOCK_SH, "LOCK_NB": fcntl.LOCK_NB}))
    name = SharedHostRegion.new_name("nolock")
    with pytest.raises(OSError, match="No locks"):
        SharedHostRegion(name, 2, PAGE, 0, 2, barrier=lambda: None, directory=shm_dir)
    assert not os.path.exists(path_of(name, shm_dir))


@pytest.mark.timeout(60)
def test_a_creator_whose_first_lock_meets_a_probe_keeps_its_file(
        shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exclusive lock held at the instant the creator takes its shared one (what
    `remove_stale(dry_run=True)` does while it looks) used to make the creator drop the
    file it had just made, rejoin it as a joiner and time out waiting for a size."""
    import fcntl

    name = SharedHostRegion.new_name("probe")
    path = path_of(name, shm_dir)
    real, probed = regfile._lock_shared, []

    def probed_once(fd: int) -> bool:
        if probed:
            return real(fd)
        probed.append(1)
        probe = os.open(path, os.O_RDONLY)
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            return real(fd)  # refused while the probe holds it
        finally:
            os.close(probe)

    monkeypatch.setattr(regfile, "_lock_shared", probed_once)
    region = SharedHostRegion(name, 2, PAGE, 0, 1, timeout=5.0, directory=shm_dir)
    assert region.is_creator and probed
    region.close()
    assert not os.path.exists(path)
