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

Lifecycle: the first opener creates the file, the others join it once it is vetted (our own
private regular file of exactly the region's size; `kvasync._region_file` has the rules) and
sized. An optional barrier, called once by every opener, marks the point after which the
creator removes the path: the mappings stay valid and no exit path, SIGKILL included, leaks
the file. Names carry a per-job token (`SharedHostRegion.new_name`).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
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
from ._region_file import RegionFile, check_name, new_name, remove_stale
from ._region_pages import (
    MADV_POPULATE_WRITE,
    pin_coordinated,
    pin_slice,
    populate,
    populate_spans,
)

__all__ = [
    "MADV_POPULATE_WRITE",
    "RegionOverflowError",
    "SharedHostRegion",
    "SharedRegionError",
    "SharedRegionTimeoutError",
]

log = logging.getLogger("kvasync")

PAGE = mmap.PAGESIZE

Populate = bool | Literal["slot", "creator"]


class SharedHostRegion:
    """A /dev/shm file of ``num_rows x row_stride`` bytes mapped by every TP rank.

    `name` comes from `new_name` (one process makes it, every rank passes it in). `rank` is
    this process's TP rank (None: an unranked opener, e.g. a scheduler-side reader, that
    makes no worker views). `barrier`, when given, is called exactly once by every opener,
    after mapping (and also when setup failed, so peers never hang); after it the creator
    removes the path. Without a barrier the creator removes it on `close()`; `keep_file`
    leaves it for openers that join later (remove it with `remove_stale`). `populate`:
    True or ``"slot"``, each opener pre-faults its own slot of each row; ``"creator"``, the
    creator pre-faults the whole file and joiners nothing; False, nobody. `pin_barrier` is
    the barrier `pin` coordinates with (see `pin`).
    """

    new_name = staticmethod(new_name)
    remove_stale = staticmethod(remove_stale)

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
        populate: Populate = True,
        keep_file: bool = False,
        pin_barrier: Callable[[], object] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._name = ""
        self._file: RegionFile | None = None
        self._num_rows = self._row_stride = self._world = self._total = 0
        self._rank: int | None = None
        self._keep = bool(keep_file)
        self._pin_barrier = pin_barrier
        # unregisters the pinned chunks if close() is never called, before the unmap
        self._unpinner: weakref.finalize[[], object] | None = None
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
            mode = self._configure(name, num_rows, row_stride, rank, world_size, timeout,
                                   directory, populate)
            self._file = RegionFile(directory, self._name, self._total)
            self._file.open(timeout, f"{self._num_rows} rows x {self._row_stride} B")
            self._map()
            if mode:
                self._populate(mode)
        except BaseException as exc:
            error = exc
            # peers must not wedge on a stub: remove the path before the barrier if we made it
            self._unlink()
        if barrier is not None:
            try:
                barrier()
            except BaseException as exc:
                if error is None:
                    error = exc
                else:  # the setup error is the one worth reporting
                    log.warning("kvasync: region %s: barrier failed after setup error: %r",
                                self.path, exc)
        if error is not None:
            self._unlink()
            self._closed = True
            self._release()
            raise error
        if barrier is not None and not self._keep:
            self._unlink()  # every opener has mapped the file: nothing can leak from here on

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
        populate: Populate,
    ) -> Literal["slot", "creator"] | None:
        check_name(name)
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
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidTransferError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not isinstance(directory, str) or not directory:
            raise InvalidTransferError(f"directory must be a path, got {directory!r}")
        if not (isinstance(populate, bool) or (isinstance(populate, str)
                and populate in ("slot", "creator"))):
            raise InvalidTransferError(
                f"populate must be True, False, 'slot' or 'creator', got {populate!r}"
            )
        self._name = name
        self._num_rows = int(num_rows)
        self._row_stride = int(row_stride)
        self._rank = None if rank is None else int(rank)
        self._world = int(world_size)
        self._total = self._num_rows * self._row_stride
        if populate is False:
            return None
        return "creator" if populate == "creator" else "slot"

    def _map(self) -> None:
        assert self._file is not None
        self._mm = mmap.mmap(
            self._file.fd, self._total, flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        self._base = np.frombuffer(self._mm, dtype=np.uint8, count=self._total)
        self._ptr = int(self._base.ctypes.data)

    def _populate(self, mode: Literal["slot", "creator"]) -> None:
        spans = populate_spans(mode, self.is_creator, self._rank, self._world, self._num_rows,
                               self._row_stride)
        self.populated_with = populate(self._ptr, spans)

    # -- views ---------------------------------------------------------------------------------
    def _check_open(self) -> np.ndarray:
        if self._closed or self._base is None:
            raise SharedRegionError(f"the region {self.path} is closed")
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
        self,
        register: Register,
        unregister: Unregister,
        cap: int = MAX_REGISTER_CHUNK_BYTES,
        *,
        barrier: Callable[[], object] | None = None,
    ) -> bool:
        """Page-lock the region in row-aligned chunks of at most `cap` bytes.

        Rows never straddle two registrations, so no descriptor does either. If any chunk
        fails, the ones that succeeded are unregistered in reverse and the region stays
        pageable (False): pinning only buys bandwidth, pageable transfers still work.

        With a barrier (`barrier`, else the region's `pin_barrier`) every opener pins its own
        slice of the rows first (rank r of w: rows ``[r*n//w, (r+1)*n//w)``; unranked: none),
        calls the barrier exactly once (also when its slice failed), then pins the rest. The
        first touch of each page (fault, and the kernel's move of the page to where it may be
        pinned long-term) is thus paid once, by one rank, in parallel; no two ranks race to
        move the same pages, and the later registrations find them in place. Each process
        still registers the whole region: a registration serves only its own process.
        """
        barrier = self._pin_barrier if barrier is None else barrier
        with self._lock:
            self._check_open()
            if self._is_pinned:
                return True
            if barrier is None:
                addrs = pin_chunks(self._ptr, self._total, self._row_stride, register,
                                   unregister, cap)
            else:
                addrs = pin_coordinated(self._ptr, self._num_rows, self._row_stride,
                                        self.pin_slice(), register, unregister, cap, barrier)
            if addrs is None:
                return False
            self._pinned = addrs
            self._unpinner = unpin_on_collect(self, partial(unpin_chunks, addrs, unregister))
            self._is_pinned = True
            return True

    def pin_slice(self) -> tuple[int, int]:
        """Rows ``[first, end)`` this opener pins before the barrier of a coordinated pin."""
        return pin_slice(self._rank, self._world, self._num_rows)

    @property
    def is_pinned(self) -> bool:
        return self._is_pinned

    @property
    def pinned_addresses(self) -> list[int]:
        """Base address of every registered chunk, in registration order."""
        return list(self._pinned)

    # -- teardown ------------------------------------------------------------------------------
    def _unlink(self) -> None:
        """Remove the path if this opener created the file and the path still names it."""
        if self._file is not None:
            self._file.unlink()

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
                          self.path)
        if self._file is not None:
            self._file.close()

    def close(self) -> None:
        """Unpin (chunks in reverse), unmap, close the file, and remove the path if this
        opener created it and it is still there (unless `keep_file`). Safe to call twice;
        live views keep their pages mapped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release()
            if not self._keep:
                self._unlink()

    def __enter__(self) -> SharedHostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- properties ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

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
        return "" if self._file is None else self._file.path

    @property
    def slot_bytes(self) -> int:
        """Bytes of each row that a rank's worker views carve from."""
        return self._row_stride // self._world

    @property
    def is_creator(self) -> bool:
        return self._file is not None and self._file.creator

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the backing file that hold memory now (st_blocks): what the region
        really costs the host, however many ranks map it."""
        with self._lock:
            if self._file is None or self._file.fd < 0:
                raise SharedRegionError(f"the region {self.path} is closed")
            return int(os.fstat(self._file.fd).st_blocks) * 512

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("pinned" if self._is_pinned else "open")
        return (
            f"<SharedHostRegion {self.path} {self._num_rows} x {self._row_stride} B "
            f"rank {self._rank}/{self._world} {state}>"
        )
