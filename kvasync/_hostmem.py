"""Host memory: page-aligned anonymous mappings and chunked, row-aligned pinning.

Why mmap and not a pinned allocator: torch's pinned allocator rounds to powers of two (a
2.08 GiB pool costs 4 GiB), and one huge cudaHostAlloc takes seconds. An anonymous mapping
costs what it holds; pinning it with cudaHostRegister is done in chunks that end on row
boundaries (so no block straddles two registrations) and are at most 64 GiB (driver limit),
rolled back in reverse order if any chunk fails.
"""

from __future__ import annotations

import errno
import logging
import mmap
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._backends._base import HostMemory

if TYPE_CHECKING:
    from ._layout import KVCacheLayout

__all__ = ["MAX_REGISTER_CHUNK_BYTES", "alloc_mmap", "pin_chunks", "row_offsets",
           "unpin_chunks", "unpin_on_collect"]

log = logging.getLogger("kvasync")

MAX_REGISTER_CHUNK_BYTES = 64 * 1024**3

Register = Callable[[int, int], bool]
Unregister = Callable[[int], bool]


#: every tensor's part of a host row starts on this boundary (vector loads and stores of
#: the staging kernels; KV pages are multiples of it in practice, so rows stay gap-free)
ROW_ALIGN = 16


def row_offsets(layout: KVCacheLayout, pages: Sequence[int]) -> tuple[list[int], int]:
    """(offset of each tensor's part in a host row, row bytes) for the row-contiguous host
    layout: one row per CPU chunk holding every tensor's `pages[t]` bytes (its
    blocks_per_chunk sub-blocks) side by side, tensors ordered by KV-cache group (first use
    in group, then ref order), so each group's part of a row is one contiguous run.
    Tensors no group uses come last."""
    order: list[int] = []
    seen: set[int] = set()
    for refs in layout.groups:
        for ref in refs:
            if ref.tensor_idx not in seen:
                seen.add(ref.tensor_idx)
                order.append(ref.tensor_idx)
    order += [t for t in range(len(pages)) if t not in seen]
    offsets = [0] * len(pages)
    pos = 0
    for t in order:
        pos = -(-pos // ROW_ALIGN) * ROW_ALIGN
        offsets[t] = pos
        pos += int(pages[t])
    return offsets, max(-(-pos // ROW_ALIGN) * ROW_ALIGN, ROW_ALIGN)


def alloc_mmap(nbytes: int) -> tuple[mmap.mmap, np.ndarray, int]:
    """An anonymous private mapping of `nbytes` (>= 1 page) as a uint8 array and its address."""
    size = max(int(nbytes), 1)
    size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OverflowError, ValueError) as exc:  # beyond any address space: as out of memory
        raise OSError(errno.ENOMEM, f"cannot map {size} B: {exc}") from exc
    arr = np.frombuffer(mm, dtype=np.uint8, count=size)
    return mm, arr, int(arr.ctypes.data)


def pin_chunks(
    ptr: int,
    nbytes: int,
    row_bytes: int,
    register: Register,
    unregister: Unregister,
    cap: int = MAX_REGISTER_CHUNK_BYTES,
) -> list[int] | None:
    """Register [ptr, ptr+nbytes) in row-aligned chunks of at most `cap` bytes.

    Returns the registered chunk addresses, or None (after unregistering, in reverse, every
    chunk that did succeed) when one registration fails. A single row larger than `cap` is
    registered whole.
    """
    rows_per_chunk = max(cap // max(row_bytes, 1), 1)
    chunk = rows_per_chunk * max(row_bytes, 1)
    done: list[int] = []
    for off in range(0, nbytes, chunk):
        size = min(chunk, nbytes - off)
        try:
            ok = register(ptr + off, size)
        except BaseException:  # a raising register (a Ctrl-C in the driver): roll back too
            unpin_chunks(done, unregister)
            raise
        if ok:
            done.append(ptr + off)
            continue
        log.warning(
            "kvasync: pinning host memory failed at %.2f of %.2f GB; rolling back %d chunk(s), "
            "the memory stays pageable (only DMA copy paths will be used)",
            off / 1e9,
            nbytes / 1e9,
            len(done),
        )
        unpin_chunks(done, unregister)
        return None
    return done


def unpin_chunks(addresses: list[int], unregister: Unregister) -> None:
    """Unregister chunk addresses in reverse order (a failure is logged, not raised)."""
    for addr in reversed(addresses):
        if not unregister(addr):
            log.warning("kvasync: unregistering host memory at %#x failed", addr)
    addresses.clear()


def host_memory(
    nbytes: int,
    row_bytes: int,
    register: Register | None = None,
    unregister: Unregister | None = None,
    cap: int = MAX_REGISTER_CHUNK_BYTES,
) -> HostMemory:
    """Allocate a mapping and, when `register` is given, pin it in chunks."""
    mm, arr, ptr = alloc_mmap(nbytes)
    pinned: list[int] | None = None
    if register is not None and unregister is not None:
        pinned = pin_chunks(ptr, len(arr), row_bytes, register, unregister, cap)

    def release() -> None:
        if pinned and unregister is not None:
            unpin_chunks(pinned, unregister)
        try:
            mm.close()
        except BufferError:
            # views handed out still exist; the mapping is freed when they are collected
            pass

    mem = HostMemory(ptr, len(arr), arr, pinned is not None)
    mem._release = unpin_on_collect(mem, release)
    return mem


def unpin_on_collect(owner: object, release: Callable[[], object]) -> weakref.finalize[[], object]:
    """`release` as a once-only callable that also runs when `owner` is collected unreleased.

    An owner dropped without being closed (a test that failed half-way, a notebook cell run
    again) would otherwise leave its chunks registered while the mapping under them is
    unmapped: the driver keeps the stale pinned pages, a later mapping at the same address
    cannot be registered ("already registered"), and DMA to that address lands in the stale
    pages. The finalizer runs while the owner still holds its mapping (weakref callbacks run
    before its attributes are cleared), so chunks are always unregistered before the unmap.
    Not at interpreter exit: the process's pages go away with it.
    """
    fin = weakref.finalize(owner, release)
    fin.atexit = False
    return fin
