"""The pool region's chunk rows as ref tables, and local staging buffers of those rows.

`pool_tables` gives the store and load `RefTable`s of a region at `base`: the host side is
the row-contiguous layout of an offloader's own host copy (one row per CPU chunk, every KV
tensor's `blocks_per_chunk` sub-blocks side by side, tensors ordered by KV-cache group).

A transfer staged through rows packs its pages into a staging buffer (stores) or unpacks
them from one (loads); NIXL moves the buffer's runs to or from the pool. Buffers are
allocated on first use, registered with NIXL once, and reused: a stream thread takes one
for the length of a transfer and gives it back, so concurrent transfers (stores and loads,
urgent lanes, several streams of a lane) never share one and no lock is held while NIXL
works. There are at most as many buffers as transfers ever ran at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._backends import Direction
from .._hostmem import host_memory, row_offsets
from .._layout import KVCacheLayout
from .._program import RefTable, SideGeometry, build_ref_table

__all__ = ["StagingRows", "pool_row_bytes", "pool_tables"]

PAGE = 4096


def _row_parts(layout: KVCacheLayout, bpc: int, canonical: bool
               ) -> tuple[list[int], list[int], int]:
    """(sub-block bytes per tensor, offsets in a row, row bytes)."""
    canon = layout.canonical_bytes_per_block() if canonical else None
    sub = canon if canon is not None else [t.page for t in layout.tensors]
    offsets, row_bytes = row_offsets(layout, [s * bpc for s in sub])
    return list(sub), offsets, row_bytes


def pool_row_bytes(layout: KVCacheLayout, blocks_per_chunk: int, canonical: bool) -> int:
    """Bytes of one chunk row of `layout` (a region holds num_cpu_chunks of them)."""
    return _row_parts(layout, blocks_per_chunk, canonical)[2]


def pool_tables(layout: KVCacheLayout, num_cpu_chunks: int, blocks_per_chunk: int,
                canonical: bool, base: int) -> dict[Direction, RefTable]:
    """The store ("d2h") and load ("h2d") ref tables between `layout`'s tensors and
    `num_cpu_chunks` chunk rows at address `base`."""
    sub, offsets, row_bytes = _row_parts(layout, blocks_per_chunk, canonical)
    gpu_geo = SideGeometry(
        base=[t.info.ptr for t in layout.tensors],
        row_stride=[t.info.row_stride if t.num_blocks > 1 else t.info.row_bytes
                    for t in layout.tensors],
        sub_stride=[0] * len(layout.tensors),
        num_rows=[t.num_blocks for t in layout.tensors],
        factor=1,
    )
    host_geo = SideGeometry(
        base=[base + off for off in offsets],
        row_stride=[row_bytes] * len(offsets),
        sub_stride=list(sub),
        num_rows=[num_cpu_chunks] * len(offsets),
        factor=blocks_per_chunk,
    )
    return {
        "d2h": build_ref_table(layout, gpu_geo, host_geo, True, canonical),
        "h2d": build_ref_table(layout, gpu_geo, host_geo, False, canonical),
    }


#: staging buffers a stuck request may still use, with their registrations: never freed
_RETIRED: list[tuple[Any, Any]] = []


class StagingRows:
    """Free list of `slab_bytes` host buffers; `register(ptr, nbytes)` is called once per
    new buffer (it returns the registration `deregister` later takes)."""

    def __init__(self, slab_bytes: int, register: Callable[[int, int], Any],
                 deregister: Callable[[Any], None]) -> None:
        self.slab_bytes = int(slab_bytes)
        self._register = register
        self._deregister = deregister
        self._free: list[Any] = []
        self._all: list[tuple[Any, Any]] = []
        self._retired = 0
        self._lock = threading.Lock()

    def take(self) -> Any:
        """A buffer (`.ptr`, `.nbytes`) for one transfer; give it back with `give`."""
        with self._lock:
            if self._free:
                return self._free.pop()
        mem = host_memory(self.slab_bytes, PAGE)
        try:
            reg = self._register(mem.ptr, mem.nbytes)
        except BaseException:
            mem.release()
            raise
        with self._lock:
            self._all.append((mem, reg))
        return mem

    def give(self, mem: Any) -> None:
        with self._lock:
            self._free.append(mem)

    def retire(self, mem: Any) -> None:
        """Never use `mem` again, nor unmap it or drop its registration: a request that
        NIXL could not release may still read or write it (kept for the process's life)."""
        with self._lock:
            kept = [(m, r) for m, r in self._all if m is mem]
            self._all = [(m, r) for m, r in self._all if m is not mem]
            self._retired += len(kept)
        _RETIRED.extend(kept)

    @property
    def count(self) -> int:
        """Buffers allocated so far (retired ones included)."""
        with self._lock:
            return len(self._all) + self._retired

    def close(self) -> None:
        """Deregister and free every buffer (call once no transfer runs)."""
        with self._lock:
            bufs, self._all, self._free = self._all, [], []
        for mem, reg in bufs:
            try:
                self._deregister(reg)
            finally:
                mem.release()
