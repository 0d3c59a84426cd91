"""Pages of a shared region: which ones an opener pre-faults, how, and coordinated pinning.

Kept apart from `kvasync._region` (views, lifecycle) because these are plain functions of the
geometry: `(rank, world_size, num_rows, row_stride)` decide the spans, and the OS calls are
module-level so tests can replace them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref
from collections.abc import Callable
from functools import partial
from typing import Literal

import numpy as np

from ._hostmem import Register, Unregister, pin_chunks, unpin_chunks, unpin_on_collect

__all__ = ["MADV_POPULATE_WRITE", "RegionPins", "pin_coordinated", "pin_slice", "populate",
           "populate_spans"]

#: Linux >= 5.14: fault pages in for writing without touching their contents
MADV_POPULATE_WRITE = 23

PAGE = mmap.PAGESIZE

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


def _touch(addr: int, length: int) -> None:
    """Read and write back one byte per page (``|= 0``): faults the page in for writing and
    keeps whatever a peer already wrote there. A raw view, not one of the mapping's buffer:
    a traceback that keeps this frame alive must not keep the mapping from closing."""
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
    pages = raw[::PAGE]
    np.bitwise_or(pages, 0, out=pages)


def populate_spans(
    mode: Literal["slot", "creator"],
    creator: bool,
    rank: int | None,
    world: int,
    num_rows: int,
    row_stride: int,
) -> list[tuple[int, int]]:
    """(offset, length) page-aligned spans an opener pre-faults, contiguous ones merged.

    "slot": a ranked opener faults only its slot of each row; together the ranks fault the
    whole file, and each pays for its share in parallel (unranked: everything). "creator":
    the creator faults everything, once, however many openers map the file; joiners nothing.
    """
    total = num_rows * row_stride
    if mode == "creator":
        return [(0, total)] if creator else []
    if rank is None or world == 1:
        return [(0, total)]
    slot = row_stride // world
    lo = rank * slot
    hi = lo + slot if rank < world - 1 else row_stride
    lo = lo // PAGE * PAGE
    hi = -(-hi // PAGE) * PAGE
    spans: list[tuple[int, int]] = []
    for row in range(num_rows):
        start = row * row_stride + lo
        if spans and spans[-1][0] + spans[-1][1] == start:
            spans[-1] = (spans[-1][0], spans[-1][1] + hi - lo)
        else:
            spans.append((start, hi - lo))
    return spans


def populate(ptr: int, spans: list[tuple[int, int]]) -> str | None:
    """Fault `spans` of the mapping at `ptr` in now, so the first transfers do not pay for
    page faults; how ("madvise" or "touch"), or None when there was nothing to do.

    MADV_POPULATE_WRITE does it without touching the data; on kernels without it (EINVAL)
    `_touch` does. Other errors (EIO, EFAULT, ENOMEM) propagate.
    """
    if not spans:
        return None
    use_madvise = True
    for i, (off, length) in enumerate(spans):
        if use_madvise:
            try:
                _madvise(ptr + off, length, MADV_POPULATE_WRITE)
                continue
            except OSError as exc:
                if exc.errno != errno.EINVAL or i > 0:
                    raise
                use_madvise = False
        _touch(ptr + off, length)
    return "madvise" if use_madvise else "touch"


def pin_slice(rank: int | None, world: int, num_rows: int) -> tuple[int, int]:
    """Rows ``[first, end)`` an opener pins before the barrier of a coordinated pin."""
    if rank is None:
        return 0, 0
    return rank * num_rows // world, (rank + 1) * num_rows // world


def pin_coordinated(
    ptr: int,
    num_rows: int,
    row_stride: int,
    first_rows: tuple[int, int],
    register: Register,
    unregister: Unregister,
    cap: int,
    barrier: Callable[[], object],
) -> list[int] | None:
    """Register rows `first_rows`, call `barrier` once (whatever happened), then the other
    rows; the chunk addresses in registration order, or None after rolling back."""

    def rows(first: int, end: int) -> list[int] | None:
        if end <= first:
            return []
        return pin_chunks(ptr + first * row_stride, (end - first) * row_stride, row_stride,
                          register, unregister, cap)

    lo, hi = first_rows
    try:
        mine = rows(lo, hi)
    except BaseException:
        try:
            barrier()  # peers never hang, even when our slice raised
        except BaseException:
            pass  # the original error wins
        raise
    try:
        barrier()  # peers never hang, even when our slice failed
    except BaseException:
        if mine:
            unpin_chunks(mine, unregister)
        raise
    if mine is None:
        return None
    done = list(mine)
    for first, end in ((0, lo), (hi, num_rows)):
        more = rows(first, end)
        if more is None:
            unpin_chunks(done, unregister)
            return None
        done += more
    return done


class RegionPins:
    """The chunks of one region's mapping that are registered (page-locked), in order.

    `pin` registers them once (whole, or coordinated through a barrier); `release`
    unregisters them in reverse, once, and so does the owner's collection if it is never
    closed. The region calls both under its lock.
    """

    def __init__(self) -> None:
        self.addresses: list[int] = []
        self.pinned = False
        # unregisters the pinned chunks if close() is never called, before the unmap
        self._unpinner: weakref.finalize[[], object] | None = None

    def pin(self, owner: object, ptr: int, num_rows: int, row_stride: int,
            first_slice: tuple[int, int], register: Register, unregister: Unregister,
            cap: int, barrier: Callable[[], object] | None) -> bool:
        """Register `num_rows` rows of `row_stride` bytes at `ptr` (see
        `SharedHostRegion.pin`); False if that failed and nothing stays registered."""
        if self.pinned:
            if barrier is not None:
                barrier()  # once per call, as every rank's: a peer retrying waits for it
            return True
        if barrier is None:
            addrs = pin_chunks(ptr, num_rows * row_stride, row_stride, register, unregister,
                               cap)
        else:
            addrs = pin_coordinated(ptr, num_rows, row_stride, first_slice, register,
                                    unregister, cap, barrier)
        if addrs is None:
            return False
        self.addresses = addrs
        self._unpinner = unpin_on_collect(owner, partial(unpin_chunks, addrs, unregister))
        self.pinned = True
        return True

    def release(self) -> None:
        unpinner, self._unpinner = self._unpinner, None
        if unpinner is not None:
            unpinner()  # unregisters the chunks in reverse, once
        self.addresses = []
        self.pinned = False
