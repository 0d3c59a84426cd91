"""The file behind a `SharedHostRegion`: named, created, joined and removed safely.

The file holds every KV byte of the engine, in a directory (/dev/shm) that every local user
can write to. Rules, each one closing a way in (docs/shared-region.md has the threat model):

* names end in a per-job random token (`new_name`), so nobody can create a job's name ahead
  of it, and two jobs never share a file by accident;
* the creator uses ``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600;
* a joiner opens with ``O_NOFOLLOW`` and, before mapping a byte, refuses anything but a
  regular file with one link, owned by its own uid, without group/other permission bits,
  of exactly the region's size (0 only while the creator is still sizing it);
* only the creator removes the path, and only while the path still names its inode;
* every opener holds a shared `flock` on the file until it closes, so a file nobody holds
  belongs to a dead job, and `remove_stale` can tell it from a live one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import time
import weakref

from ._errors import InvalidTransferError, SharedRegionError, SharedRegionTimeoutError
from ._threadstate import fork_generation, forked_since

__all__ = ["FILE_PREFIX", "FILE_SUFFIX", "RegionFile", "check_name", "ident", "new_name"]

FILE_PREFIX, FILE_SUFFIX = "kvasync-", ".shm"

#: hex digits of the per-job token (128 bits)
TOKEN_HEX = 32

_PREFIX_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,166}")
_NAME_RE = re.compile(rf"({_PREFIX_RE.pattern})-[0-9a-f]{{{TOKEN_HEX}}}")

#: never follow a link at the name, never block on a FIFO planted there
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def new_name(prefix: str = "job") -> str:
    """A region name for one job: `prefix`, a dash and 32 random hex digits."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise InvalidTransferError(
            f"name prefix {prefix!r} must be 1-167 characters of [A-Za-z0-9._-], not starting "
            "with '.' or '-'"
        )
    return f"{prefix}-{secrets.token_hex(TOKEN_HEX // 2)}"


def check_name(name: object) -> str:
    """`name` if it is ``<prefix>-<32 hex digits>``; InvalidTransferError otherwise."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidTransferError(
            f"region name {name!r} carries no per-job token: it must be '<prefix>-<32 hex "
            "digits>'; make one with SharedHostRegion.new_name(prefix) on one process and "
            "hand it to the others (a fixed name can be created first by another local user, "
            "or be joined by another job of yours)"
        )
    return name


def path_for(directory: str, name: str) -> str:
    return os.path.join(directory, f"{FILE_PREFIX}{name}{FILE_SUFFIX}")


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


# -- memory checks, module-level so tests can replace them ------------------------------------


def _free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in `directory`'s file system."""
    st = os.statvfs(directory)
    return int(st.f_bavail) * int(st.f_frsize)


def _cgroup_headroom() -> int | None:
    """memory.max minus memory.current of this process's cgroup (v2) and of its ancestors,
    the smallest; None when no limit is set or cgroup v2 is not mounted."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if rel is None:
        return None
    best: int | None = None
    path = os.path.normpath(os.path.join("/sys/fs/cgroup", rel.lstrip("/")))
    while path.startswith("/sys/fs/cgroup"):
        try:
            with open(os.path.join(path, "memory.max")) as f:
                limit = f.read().strip()
            with open(os.path.join(path, "memory.current")) as f:
                used = int(f.read().strip())
            if limit != "max":
                room = max(int(limit) - used, 0)
                best = room if best is None else min(best, room)
        except (OSError, ValueError):
            pass
        if path == "/sys/fs/cgroup":
            break
        path = os.path.dirname(path)
    return best


def _available_memory() -> int | None:
    """Bytes of memory a new shared mapping can still get: MemAvailable, capped by the
    cgroup's headroom (shmem pages are charged to the cgroup that faults them)."""
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    room = _cgroup_headroom()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def check_capacity(directory: str, path: str, total: int, shape: str) -> None:
    """Refuse, before a byte is allocated, a region the file system or the memory cannot
    hold (a tmpfs that runs out later turns page faults into SIGBUS)."""
    free = _free_bytes(directory)
    if free < total:
        raise SharedRegionError(
            f"{directory} has {_gib(free)} free, the region {path} needs {_gib(total)} "
            f"({shape}); enlarge /dev/shm (e.g. docker --shm-size) or use fewer CPU chunks"
        )
    avail = _available_memory()
    if avail is not None and avail < total:
        raise SharedRegionError(
            f"not enough memory for the region {path}: it needs {_gib(total)} ({shape}), "
            f"{_gib(avail)} is available (MemAvailable, or the cgroup's memory.max minus its "
            "usage); free memory or use fewer CPU chunks"
        )


def _check_directory(directory: str) -> None:
    """Others must not be able to rename or remove our file: the directory is ours, not
    writable by others, or sticky (/dev/shm is mode 1777)."""
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise SharedRegionError(f"region directory {directory}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SharedRegionError(f"region directory {directory} is not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise SharedRegionError(
            f"region directory {directory} is writable by other users and not sticky: they "
            "could replace the region file; use /dev/shm or a directory of your own"
        )
    if st.st_uid not in (0, os.geteuid()):  # the sticky bit does not bind its owner
        raise SharedRegionError(
            f"region directory {directory} is owned by uid {st.st_uid}, who could rename "
            "or remove the region file; use /dev/shm or a directory of your own"
        )


# -- one opener's file ---------------------------------------------------------------------------


def _try_create(path: str) -> int | None:
    try:
        fd = os.open(path, _OPEN | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return None
    try:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask removed
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _try_open(path: str) -> int | None:
    try:
        return os.open(path, _OPEN)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SharedRegionError(
                f"{path} is a symbolic link; refusing to follow it (the KV cache would land "
                "in its target)"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise SharedRegionError(
                f"{path} cannot be opened ({exc.strerror}): another user's file holds the "
                "name; refusing to use it"
            ) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):
            raise SharedRegionError(f"{path} is not a regular file; refusing to use it") from None
        raise


def _lock_shared(fd: int) -> bool:
    """Mark the file in use; False while `remove_stale` holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _unheld_full(fd: int, total: int) -> bool:
    """Whether the file is sized and no opener holds it: a live creator holds its shared
    lock from before it sizes the file until it closes (or the barrier removes the path)."""
    if os.fstat(fd).st_size != total:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _vet(fd: int, path: str, total: int) -> os.stat_result:
    """Refuse anything but our own private regular file of size 0 or `total`."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SharedRegionError(f"{path} is not a regular file; refusing to use it")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise SharedRegionError(
            f"{path} is owned by uid {st.st_uid}, not by this process's uid {uid}; refusing "
            "to map it (its owner could read the KV cache)"
        )
    if st.st_mode & 0o077:
        raise SharedRegionError(
            f"{path} has mode {st.st_mode & 0o777:#o}: group/other permission bits would let "
            "other users read the KV cache; refusing to map it"
        )
    if st.st_nlink > 1:
        raise SharedRegionError(
            f"{path} has {st.st_nlink} hard links, a region file has one; refusing to map it"
        )
    if st.st_size not in (0, total):
        raise SharedRegionError(
            f"{path} has {st.st_size} B, the region needs exactly {total} B: another job's "
            "file or a stale one holds the name (SharedHostRegion.remove_stale removes files "
            "of dead jobs)"
        )
    return st


def ident(st: os.stat_result) -> tuple[int, int]:
    """A file's identity: (st_dev, st_ino)."""
    return st.st_dev, st.st_ino


def _unlink_if(path: str, want: tuple[int, int]) -> None:
    """Remove `path` if it still names the file `want` (st_dev, st_ino), never another."""
    try:
        if ident(os.lstat(path)) == want:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _collected(fd: int, path: str, unlink: tuple[int, int] | None, generation: int) -> None:
    if unlink is not None and not forked_since(generation):  # ours, not kept (a forked
        _unlink_if(path, unlink)  # child's exit runs this too: the file is its parent's)
    os.close(fd)


class RegionFile:
    """One opener's descriptor of the region file, and whether it created the file."""

    def __init__(self, directory: str, name: str, total: int, keep: bool = False) -> None:
        self.directory = directory
        self.keep = keep  # a creator's file stays when it is collected unclosed
        self.path = path_for(directory, name)
        self.total = total
        self.fd = -1
        self.creator = False
        self.ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we opened
        self._unlinked = False
        # closes the fd (and removes a creator's path) if close() is never called
        self._closer: weakref.finalize[..., RegionFile] | None = None

    def open(self, timeout: float, shape: str) -> None:
        """Create the file, or join it once it is vetted and sized. On return the file is
        ours, private and exactly `total` bytes; nothing has been mapped yet."""
        _check_directory(self.directory)
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            fd = _try_create(self.path)
            creator = fd is not None
            if fd is None:
                fd = _try_open(self.path)
            if fd is not None:
                try:
                    if not creator:
                        _vet(fd, self.path, self.total)
                        if not self.keep and _unheld_full(fd, self.total):
                            raise SharedRegionError(
                                f"{self.path} is a full-size region file nobody holds: a "
                                "dead job's (SharedHostRegion.remove_stale removes it); "
                                "pass keep_file=True to join a region kept on purpose")
                    locked = _lock_shared(fd)
                    while (creator and not locked and os.fstat(fd).st_nlink > 0
                           and time.monotonic() < deadline):  # a probe holds our new file
                        time.sleep(0.001)
                        locked = _lock_shared(fd)
                    if locked and os.fstat(fd).st_nlink > 0:
                        break
                except BaseException:
                    if creator:  # ours, 0 bytes: joiners would wait on it for nothing
                        _unlink_if(self.path, ident(os.fstat(fd)))
                    os.close(fd)
                    raise
                # removed before we locked it (a failed creator, or remove_stale): start over
                os.close(fd)
            if time.monotonic() > deadline:
                raise SharedRegionTimeoutError(
                    f"{self.path} kept appearing and disappearing for {timeout} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        self.fd, self.creator = fd, creator
        self.ident = ident(os.fstat(fd))
        self._closer = weakref.finalize(self, _collected, fd, self.path,
                                        self.ident if creator and not self.keep else None,
                                        fork_generation())
        if creator:
            check_capacity(self.directory, self.path, self.total, shape)
            os.ftruncate(fd, self.total)
        else:
            self._wait_for_size(deadline, timeout)

    def _wait_for_size(self, deadline: float, timeout: float) -> None:
        """Poll until the creator has sized the file; fail fast if it gave up."""
        delay = 0.001
        while True:
            if os.fstat(self.fd).st_nlink == 0:
                raise SharedRegionError(
                    f"creator failed: {self.path} was unlinked before this opener could use "
                    "it; see the creator's error"
                )
            st = _vet(self.fd, self.path, self.total)
            if st.st_size == self.total:
                return
            if time.monotonic() > deadline:
                raise SharedRegionTimeoutError(
                    f"{self.path} stayed at {st.st_size} B for {timeout} s, the region needs "
                    f"{self.total} B: its creator is stuck or died (SharedHostRegion."
                    "remove_stale removes files of dead jobs)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def unlink(self) -> None:
        """Remove the path if we created the file and the path still names it (never a
        file of another job or a newer region)."""
        if self.creator and not self._unlinked and self.ident is not None:
            self._unlinked = True
            _unlink_if(self.path, self.ident)

    def close(self) -> None:
        """Close our descriptor once (a mapping keeps its own until it is unmapped)."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()
        self.fd = -1
