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
from collections.abc import Callable
from typing import Literal

import numpy as np

from ._errors import (
    RegionOverflowError,
    SharedRegionError,
    SharedRegionTimeoutError,
)
from ._hostmem import MAX_REGISTER_CHUNK_BYTES, Register, Unregister
from ._region_file import RegionFile, new_name
from ._region_geometry import Populate, RegionGeometry, ViewCarver, region_geometry
from ._region_pages import MADV_POPULATE_WRITE, RegionPins, pin_slice, populate, populate_spans
from ._region_stale import remove_stale

__all__ = [
    "MADV_POPULATE_WRITE",
    "RegionOverflowError",
    "SharedHostRegion",
    "SharedRegionError",
    "SharedRegionTimeoutError",
]

log = logging.getLogger("kvasync")


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
        self, name: str, num_rows: int, row_stride: int, rank: int | None, world_size: int, *,
        barrier: Callable[[], object] | None = None, timeout: float = 30.0,
        directory: str = "/dev/shm", populate: Populate = True, keep_file: bool = False,
        pin_barrier: Callable[[], object] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._geo = RegionGeometry()  # the checked arguments, once they are
        self._file: RegionFile | None = None
        self._keep = bool(keep_file)
        self._pin_barrier = pin_barrier
        self._mm: mmap.mmap | None = None
        self._base: np.ndarray | None = None
        self._ptr = 0
        self._closed = False
        self._views = ViewCarver()
        self._pins = RegionPins()
        self.populated_with: str | None = None  # "madvise", "touch" or None (not populated)

        error: BaseException | None = None
        try:  # even bad arguments reach the barrier below, so peers never hang
            self._geo, mode = region_geometry(name, num_rows, row_stride, rank, world_size,
                                              timeout, directory, populate)
            self._file = RegionFile(directory, name, self._geo.total, self._keep)
            self._file.open(timeout, f"{self._geo.num_rows} rows x {self._geo.row_stride} B")
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
                    log.warning("kvasync: region %s: the barrier failed too: %r", self.path, exc)
        if error is not None:
            self._unlink()
            self._closed = True
            self._release()
            raise error
        if barrier is not None and not self._keep:
            self._unlink()  # every opener has mapped the file: nothing can leak from here on

    # -- setup ---------------------------------------------------------------------------------
    def _map(self) -> None:
        assert self._file is not None
        self._mm = mmap.mmap(
            self._file.fd, self._geo.total, flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        self._base = np.frombuffer(self._mm, dtype=np.uint8, count=self._geo.total)
        self._ptr = int(self._base.ctypes.data)

    def _populate(self, mode: Literal["slot", "creator"]) -> None:
        geo = self._geo
        spans = populate_spans(mode, self.is_creator, geo.rank, geo.world, geo.num_rows,
                               geo.row_stride)
        self.populated_with = populate(self._ptr, spans)

    # -- views ---------------------------------------------------------------------------------
    def _check_open(self) -> np.ndarray:
        if self._closed or self._base is None:
            raise SharedRegionError(f"the region {self.path} is closed")
        return self._base

    def create_next_worker_view(self, page_bytes: int) -> np.ndarray:
        """The next sub-slot of this rank's slot of every row: ``(num_rows, page_bytes)``
        uint8 with row stride `row_stride`. Overflow raises and leaves the cursor alone."""
        return self._carve([page_bytes], False)[0][0]

    def create_next_canonical_view(self, page_bytes: int) -> np.ndarray:
        """The next `page_bytes` of every row from the row start, the same bytes for every
        rank (each rank makes the same calls in the same order, so the cursors agree)."""
        return self._carve([page_bytes], True)[0][0]

    def _carve(self, pages: list[int], canonical: bool
               ) -> tuple[list[np.ndarray], Callable[[], None]]:
        """The next view of each of `pages` bytes, all or none, and their undo
        (`ViewCarver.carve`): a refused `Offloader` carves nothing."""
        with self._lock:
            return self._views.carve(self._check_open(), self._geo, pages, canonical,
                                     self._lock)

    def raw_view(self) -> np.ndarray:
        """The whole region as ``(num_rows, row_stride)`` uint8, zero-copy (for secondary
        tiers that persist rows, and for tests that read the raw layout)."""
        with self._lock:
            return self._check_open().reshape(self._geo.num_rows, self._geo.row_stride)

    # -- pinning -------------------------------------------------------------------------------
    def pin(
        self, register: Register, unregister: Unregister, cap: int = MAX_REGISTER_CHUNK_BYTES,
        *, barrier: Callable[[], object] | None = None,
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
            return self._pins.pin(self, self._ptr, self._geo.num_rows, self._geo.row_stride,
                                  self.pin_slice(), register, unregister, cap, barrier)

    def pin_slice(self) -> tuple[int, int]:
        """Rows ``[first, end)`` this opener pins before the barrier of a coordinated pin."""
        return pin_slice(self._geo.rank, self._geo.world, self._geo.num_rows)

    @property
    def is_pinned(self) -> bool:
        return self._pins.pinned

    @property
    def pinned_addresses(self) -> list[int]:
        """Base address of every registered chunk, in registration order."""
        return list(self._pins.addresses)

    # -- teardown ------------------------------------------------------------------------------
    def _unlink(self) -> None:
        """Remove the path if this opener created the file and the path still names it."""
        if self._file is not None:
            self._file.unlink()

    def _release(self) -> None:
        self._pins.release()
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
        return self._geo.name

    @property
    def base_ptr(self) -> int:
        with self._lock:  # SharedRegionError once closed: the address would be stale
            return int(self._check_open().ctypes.data)

    @property
    def total_size(self) -> int:
        return self._geo.total

    @property
    def row_stride(self) -> int:
        return self._geo.row_stride

    @property
    def num_rows(self) -> int:
        return self._geo.num_rows

    @property
    def rank(self) -> int | None:
        return self._geo.rank

    @property
    def world_size(self) -> int:
        return self._geo.world

    @property
    def path(self) -> str:
        return "" if self._file is None else self._file.path

    @property
    def slot_bytes(self) -> int:
        """Bytes of each row that a rank's worker views carve from."""
        return self._geo.slot_bytes

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
        state = "closed" if self._closed else ("pinned" if self._pins.pinned else "open")
        return (
            f"<SharedHostRegion {self.path} {self._geo.num_rows} x {self._geo.row_stride} B "
            f"rank {self._geo.rank}/{self._geo.world} {state}>"
        )
