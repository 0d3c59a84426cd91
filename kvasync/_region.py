"""One host region shared by the tensor-parallel ranks of an engine.

Without sharing, every rank process allocates its own host copy: host memory grows with the
TP degree and data that several ranks hold byte-identically (the MLA latent, GQA heads when
tp > kv heads) is stored once per rank. A `SharedHostRegion` is one file in /dev/shm that
every rank maps `MAP_SHARED`; the offloader takes its views as the host tensors.

A region is `num_rows` rows of `row_stride` bytes (one row per CPU chunk). Two ways to carve
a row (docs/shared-region.md has the picture):

* worker views: rank r owns ``[r*slot, (r+1)*slot)`` of each row (``slot = row_stride //
  world_size``) and carves consecutive per-tensor sub-slots from it; private, per-TP layout;
* canonical views: every rank gets the same bytes from the row start; each rank writes only
  its disjoint fragments of the parallelism-free page (see `kvasync._mappings`).

Lifecycle: the first opener creates the file (exclusive create, mode 0600, free-space check,
ftruncate); the others join and wait for the size. An optional barrier, called once by every
opener, marks the point after which the unlink owner removes the path: the mappings stay
valid and no exit path, SIGKILL included, leaks the file.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Literal

import numpy as np

from ._errors import (
    InvalidTransferError,
    RegionOverflowError,
    SharedRegionError,
    SharedRegionTimeoutError,
)
from ._hostmem import (
    MAX_REGISTER_CHUNK_BYTES,
    Register,
    Unregister,
    pin_chunks,
    unpin_chunks,
    unpin_on_collect,
)

__all__ = [
    "MADV_POPULATE_WRITE",
    "RegionOverflowError",
    "SharedHostRegion",
    "SharedRegionError",
    "SharedRegionTimeoutError",
]

log = logging.getLogger("kvasync")

#: Linux >= 5.14: fault pages in for writing without touching their contents
MADV_POPULATE_WRITE = 23

PAGE = mmap.PAGESIZE

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")


# -- small OS wrappers, module-level so tests can replace them --------------------------------

_libc: ctypes.CDLL | None = None


def _madvise(addr: int, length: int, advice: int) -> None:
    """madvise(2) through ctypes, which drops the GIL for the call (population can take
    seconds on a big region, and other threads of the rank must keep running)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(addr, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({addr:#x}, {length}, {advice}): {os.strerror(err)}")


def _free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in `directory`'s file system."""
    st = os.statvfs(directory)
    return int(st.f_bavail) * int(st.f_frsize)


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


class SharedHostRegion:
    """A /dev/shm file of ``num_rows x row_stride`` bytes mapped by every TP rank.

    `rank` is this process's TP rank (None: an unranked opener, e.g. a scheduler-side
    reader, that makes no worker views and populates the whole region). `barrier`, when
    given, is called exactly once by every opener, after mapping (and also when setup
    failed, so peers never hang); after it the unlink owner removes the path. Without a
    barrier the owner unlinks on `close()`. `unlink_owner` defaults to ``rank == 0``;
    exactly one opener per path should own it.
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        row_stride: int,
        rank: int | None,
        world_size: int,
        *,
        barrier: Callable[[], object] | None = None,
        timeout: float = 30.0,
        directory: str = "/dev/shm",
        populate: bool = True,
        unlink_owner: bool | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._name, self._path, self._owner = "", "", False
        self._num_rows = self._row_stride = self._world = self._total = 0
        self._rank: int | None = None
        self._fd = -1
        # closes the fd if close() is never called (the mapping closes itself on collection)
        self._fd_closer: weakref.finalize[[int], SharedHostRegion] | None = None
        # unregisters the pinned chunks if close() is never called, before the unmap
        self._unpinner: weakref.finalize[[], object] | None = None
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of our file
        self._creator = False
        self._unlinked = False
        self._mm: mmap.mmap | None = None
        self._base: np.ndarray | None = None
        self._ptr = 0
        self._closed = False
        self._mode: Literal["worker", "canonical"] | None = None
        self._cursor = 0
        self._pinned: list[int] = []
        self._is_pinned = False
        self.populated_with: str | None = None  # "madvise", "touch" or None (not populated)

        error: BaseException | None = None
        try:  # even bad arguments reach the barrier below, so peers never hang
            self._configure(name, num_rows, row_stride, rank, world_size, timeout, directory,
                            unlink_owner)
            self._open(timeout, directory)
            self._map()
            if populate:
                self._populate()
        except BaseException as exc:
            error = exc
            # peers must not wedge on a stub: remove the path before the barrier if we made it
            if self._creator or self._owner:
                self._unlink()
        if barrier is not None:
            try:
                barrier()
            except BaseException as exc:
                if error is None:
                    error = exc
                else:  # the setup error is the one worth reporting
                    log.warning("kvasync: region %s: barrier failed after setup error: %r",
                                self._path, exc)
        if error is not None:
            if self._creator or self._owner:
                self._unlink()
            self._closed = True
            self._release()
            raise error
        if barrier is not None and (self._owner or self._creator):
            # every opener has mapped the file: nothing can leak from here on. The creator
            # unlinks too, in case the owner failed and this file is a re-creation.
            self._unlink()

    # -- setup ---------------------------------------------------------------------------------
    def _configure(
        self,
        name: str,
        num_rows: int,
        row_stride: int,
        rank: int | None,
        world_size: int,
        timeout: float,
        directory: str,
        unlink_owner: bool | None,
    ) -> None:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise InvalidTransferError(
                f"region name {name!r} must be 1-200 characters of [A-Za-z0-9._-], not "
                "starting with '.' or '-'"
            )
        for what, value, low in (
            ("num_rows", num_rows, 1),
            ("row_stride", row_stride, PAGE),
            ("world_size", world_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise InvalidTransferError(f"{what} must be an int >= {low}, got {value!r}")
        if row_stride % PAGE:
            raise InvalidTransferError(
                f"row_stride {row_stride} must be a multiple of the page size ({PAGE} B) so "
                "every row starts on a page (pinning seams, population, O_DIRECT tiers)"
            )
        if rank is not None and (
            isinstance(rank, bool) or not isinstance(rank, (int, np.integer))
            or not 0 <= rank < world_size
        ):
            raise InvalidTransferError(f"rank must be None or in [0, {world_size}), got {rank!r}")
        if not timeout > 0:
            raise InvalidTransferError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._name = name
        self._num_rows = int(num_rows)
        self._row_stride = int(row_stride)
        self._rank = None if rank is None else int(rank)
        self._world = int(world_size)
        self._total = self._num_rows * self._row_stride
        self._path = os.path.join(directory, f"kvasync-{name}.shm")
        self._owner = (self._rank == 0) if unlink_owner is None else bool(unlink_owner)

    def _open(self, timeout: float, directory: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._fd = os.open(
                    self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
                )
                self._creator = True
                break
            except FileExistsError:
                pass
            try:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
                break
            except FileNotFoundError:
                # the creator failed and unlinked between our two opens: try to create again
                if time.monotonic() > deadline:
                    raise SharedRegionTimeoutError(
                        f"{self._path} kept appearing and disappearing for {timeout} s"
                    ) from None
        self._fd_closer = weakref.finalize(self, os.close, self._fd)
        st = os.fstat(self._fd)
        self._ident = (st.st_dev, st.st_ino)
        if self._creator:
            free = _free_bytes(directory)
            if free < self._total:
                raise SharedRegionError(
                    f"{directory} has {_gib(free)} free, the region {self._path} needs "
                    f"{_gib(self._total)} ({self._num_rows} rows x {self._row_stride} B); "
                    "enlarge /dev/shm (e.g. docker --shm-size) or use fewer CPU chunks"
                )
            os.ftruncate(self._fd, self._total)
        else:
            self._wait_for_size(deadline, timeout)

    def _wait_for_size(self, deadline: float, timeout: float) -> None:
        """Poll until the creator has sized the file; fail fast if it gave up."""
        delay = 0.001
        while True:
            st = os.fstat(self._fd)
            if st.st_size >= self._total:
                return
            if st.st_nlink == 0:
                raise SharedRegionError(
                    f"the creator of {self._path} failed (the file was unlinked before it "
                    "reached its size); see the creator's error"
                )
            if time.monotonic() > deadline:
                raise SharedRegionTimeoutError(
                    f"{self._path} stayed at {st.st_size} B for {timeout} s, the region needs "
                    f"{self._total} B; the creator is stuck or died, or a stale file of "
                    "another size is in the way (remove it)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _map(self) -> None:
        self._mm = mmap.mmap(
            self._fd, self._total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self._base = np.frombuffer(self._mm, dtype=np.uint8, count=self._total)
        self._ptr = int(self._base.ctypes.data)

    def _populate_spans(self) -> list[tuple[int, int]]:
        """(offset, length) page-aligned spans this opener pre-faults, contiguous ones merged.

        A ranked opener faults only its slot of each row: together the ranks fault the whole
        file, and each pays for its share in parallel.
        """
        if self._rank is None or self._world == 1:
            return [(0, self._total)]
        slot = self._row_stride // self._world
        lo = self._rank * slot
        hi = lo + slot if self._rank < self._world - 1 else self._row_stride
        lo = lo // PAGE * PAGE
        hi = -(-hi // PAGE) * PAGE
        spans: list[tuple[int, int]] = []
        for row in range(self._num_rows):
            start = row * self._row_stride + lo
            if spans and spans[-1][0] + spans[-1][1] == start:
                spans[-1] = (spans[-1][0], spans[-1][1] + hi - lo)
            else:
                spans.append((start, hi - lo))
        return spans

    def _populate(self) -> None:
        """Fault the pages in now so the first transfers do not pay for page faults.

        MADV_POPULATE_WRITE does it without touching the data; on kernels without it
        (EINVAL) one byte per page is read and written back (``|= 0``), which keeps bytes a
        peer already wrote. Other errors (EIO, EFAULT, ENOMEM) propagate.
        """
        spans = self._populate_spans()
        use_madvise = True
        for i, (off, length) in enumerate(spans):
            if use_madvise:
                try:
                    _madvise(self._ptr + off, length, MADV_POPULATE_WRITE)
                    continue
                except OSError as exc:
                    if exc.errno != errno.EINVAL or i > 0:
                        raise
                    use_madvise = False
            self._touch(off, length)
        self.populated_with = "madvise" if use_madvise else "touch"

    def _touch(self, off: int, length: int) -> None:
        assert self._base is not None
        pages = self._base[off : off + length : PAGE]
        np.bitwise_or(pages, 0, out=pages)

    # -- views ---------------------------------------------------------------------------------
    def _check_open(self) -> np.ndarray:
        if self._closed or self._base is None:
            raise SharedRegionError(f"the region {self._path} is closed")
        return self._base

    def _view(self, offset: int, page_bytes: int) -> np.ndarray:
        base = self._check_open()
        view: np.ndarray = np.lib.stride_tricks.as_strided(
            base[offset:],
            shape=(self._num_rows, page_bytes),
            strides=(self._row_stride, 1),
            writeable=True,
        )
        return view

    @staticmethod
    def _page_arg(page_bytes: int) -> int:
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, (int, np.integer)):
            raise InvalidTransferError(f"page_bytes must be an int, got {page_bytes!r}")
        if page_bytes <= 0:
            raise InvalidTransferError(f"page_bytes must be > 0, got {page_bytes}")
        return int(page_bytes)

    def _claim(self, mode: Literal["worker", "canonical"]) -> None:
        if self._mode is not None and self._mode != mode:
            raise InvalidTransferError(
                f"the region is already carved into {self._mode} views; worker and canonical "
                "views of one region would overlap"
            )

    def create_next_worker_view(self, page_bytes: int) -> np.ndarray:
        """The next sub-slot of this rank's slot of every row: ``(num_rows, page_bytes)``
        uint8 with row stride `row_stride`. Overflow raises and leaves the cursor alone."""
        page = self._page_arg(page_bytes)
        with self._lock:
            self._check_open()
            if self._rank is None:
                raise InvalidTransferError("an unranked region (rank=None) has no worker area")
            self._claim("worker")
            slot = self.slot_bytes
            if self._cursor + page > slot:
                raise RegionOverflowError(
                    f"worker view of {page} B at offset {self._cursor} exceeds worker area end "
                    f"(slot of rank {self._rank} is {slot} B = row_stride {self._row_stride} "
                    f"// world_size {self._world})"
                )
            view = self._view(self._rank * slot + self._cursor, page)
            self._cursor += page
            self._mode = "worker"
            return view

    def create_next_canonical_view(self, page_bytes: int) -> np.ndarray:
        """The next `page_bytes` of every row from the row start, the same bytes for every
        rank (each rank makes the same calls in the same order, so the cursors agree)."""
        page = self._page_arg(page_bytes)
        with self._lock:
            self._check_open()
            self._claim("canonical")
            if self._cursor + page > self._row_stride:
                raise RegionOverflowError(
                    f"canonical view of {page} B at offset {self._cursor} exceeds the row end "
                    f"(row_stride {self._row_stride} B)"
                )
            view = self._view(self._cursor, page)
            self._cursor += page
            self._mode = "canonical"
            return view

    def raw_view(self) -> np.ndarray:
        """The whole region as ``(num_rows, row_stride)`` uint8, zero-copy (for secondary
        tiers that persist rows, and for tests that read the raw layout)."""
        with self._lock:
            return self._check_open().reshape(self._num_rows, self._row_stride)

    # -- pinning -------------------------------------------------------------------------------
    def pin(
        self, register: Register, unregister: Unregister, cap: int = MAX_REGISTER_CHUNK_BYTES
    ) -> bool:
        """Page-lock the region in row-aligned chunks of at most `cap` bytes.

        Rows never straddle two registrations, so no descriptor does either. If any chunk
        fails, the ones that succeeded are unregistered in reverse and the region stays
        pageable (False): pinning only buys bandwidth, pageable transfers still work.
        """
        with self._lock:
            self._check_open()
            if self._is_pinned:
                return True
            addrs = pin_chunks(self._ptr, self._total, self._row_stride, register, unregister,
                               cap)
            if addrs is None:
                return False
            self._pinned = addrs
            self._unpinner = unpin_on_collect(self, partial(unpin_chunks, addrs, unregister))
            self._is_pinned = True
            return True

    @property
    def is_pinned(self) -> bool:
        return self._is_pinned

    @property
    def pinned_addresses(self) -> list[int]:
        """Base address of every registered chunk, in registration order."""
        return list(self._pinned)

    # -- teardown ------------------------------------------------------------------------------
    def _unlink(self) -> None:
        """Remove the path if it still names our file (never a newer region's file)."""
        if self._unlinked or self._ident is None:
            return  # already done, or we never opened a file: nothing of ours to remove
        self._unlinked = True
        try:
            st = os.stat(self._path)
            if self._ident is not None and (st.st_dev, st.st_ino) != self._ident:
                return
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def _release(self) -> None:
        unpinner, self._unpinner = self._unpinner, None
        if unpinner is not None:
            unpinner()  # unregisters self._pinned in reverse, once
        self._pinned = []
        self._is_pinned = False
        self._base = None  # drop our export before closing the mapping
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # views handed out are still alive: the mapping stays valid for them and is
                # unmapped when the last one is collected, never left dangling
                log.debug("kvasync: region %s still has live views; unmapped on collection",
                          self._path)
        if self._fd_closer is not None:
            self._fd_closer()  # closes the fd exactly once
            self._fd_closer = None
        self._fd = -1

    def close(self) -> None:
        """Unpin (chunks in reverse), unmap, close the file, and unlink if we own the path
        and nobody has yet. Safe to call twice; live views keep their pages mapped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release()
            if self._owner:
                self._unlink()

    def __enter__(self) -> SharedHostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- properties ----------------------------------------------------------------------------
    @property
    def base_ptr(self) -> int:
        return self._ptr

    @property
    def total_size(self) -> int:
        return self._total

    @property
    def row_stride(self) -> int:
        return self._row_stride

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def rank(self) -> int | None:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def path(self) -> str:
        return self._path

    @property
    def slot_bytes(self) -> int:
        """Bytes of each row that a rank's worker views carve from."""
        return self._row_stride // self._world

    @property
    def is_creator(self) -> bool:
        return self._creator

    @property
    def is_unlink_owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the backing file that hold memory now (st_blocks): what the region
        really costs the host, however many ranks map it."""
        with self._lock:
            if self._fd < 0:
                raise SharedRegionError(f"the region {self._path} is closed")
            return int(os.fstat(self._fd).st_blocks) * 512

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("pinned" if self._is_pinned else "open")
        return (
            f"<SharedHostRegion {self._path} {self._num_rows} x {self._row_stride} B "
            f"rank {self._rank}/{self._world} {state}>"
        )
