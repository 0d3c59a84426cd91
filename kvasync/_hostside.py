"""The offloader's host side, built once: host memory, region or caller views, pinning, tables.

`build_host_side` allocates the host copy (or carves it out of a shared region), pins it
where the backend can, describes both sides' geometry and unrolls the two directions' ref
tables. It returns one frozen `HostSide`; the `Offloader` only wires it in. The host copy is
row-contiguous: one row per CPU chunk holding every KV tensor's `blocks_per_chunk`
sub-blocks side by side (see `_hostmem.row_offsets`), so the staged path moves whole rows.
Caller-owned `host_tensors` are one array per KV tensor instead, not row-contiguous: the
staged path is not offered for them.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ._arrays import array_info
from ._backends import Backend, Direction, HostMemory
from ._errors import InvalidTransferError
from ._hostmem import pin_chunks, row_offsets, unpin_chunks
from ._layout import KVCacheLayout
from ._memory import overlapping_pair
from ._program import RefTable, SideGeometry, build_ref_table
from ._region import SharedHostRegion

__all__ = ["HostSide", "build_host_side"]


@dataclass(frozen=True)
class HostSide:
    """What the offloader's host copy is made of, and the tables that address it."""

    #: one (num_cpu_chunks, blocks_per_chunk * sub-block) uint8 view per KV tensor; the
    #: lifecycle clears this very list before the memory under it is released
    views: list[np.ndarray]
    #: host memory the offloader allocated and owns (empty over a shared region)
    memory: list[HostMemory]
    #: the host copy is pinned (or the backend needs no pinning)
    pinned: bool
    #: bytes of one chunk of every KV tensor
    chunk_bytes: int
    #: the static ref table of each direction
    tables: dict[Direction, RefTable]


def build_host_side(
    layout: KVCacheLayout,
    backend: Backend,
    sub_bytes: Sequence[int],
    num_cpu_chunks: int,
    blocks_per_chunk: int,
    canonical: bool,
    host_region: Any | None,
    host_tensors: Sequence[Any] | None = None,
) -> HostSide:
    """Allocate (or carve from `host_region`) and pin the host copy, then build both
    directions' ref tables. `sub_bytes` is each tensor's host sub-block (its page, or its
    canonical page); InvalidTransferError where the memory does not fit or cannot be had."""
    pages = [s * blocks_per_chunk for s in sub_bytes]
    chunk_bytes = sum(pages)  # the caller's or a region's memory: what this rank uses of it
    memory: list[HostMemory] = []
    views: list[np.ndarray] = []
    if host_tensors is not None:
        views = caller_views(layout, host_tensors, pages, num_cpu_chunks)
        pinned, memory = pin_caller_views(backend, host_tensors, views)
    elif host_region is not None:
        views, undo = _region_views(host_region, pages, canonical, num_cpu_chunks)
        try:
            pinned = _pin_region(backend, host_region, views, memory)
            tables = _ref_tables(layout, backend, views, sub_bytes, blocks_per_chunk,
                                 canonical, False)
        except BaseException:  # refused after carving: the views go back to the region
            for mem in memory:
                mem.release()
            undo()
            raise
        _own(tables, memory, host_region, layout, host_tensors)
        return HostSide(views, memory, pinned, chunk_bytes, tables)
    else:
        # one row per chunk, every tensor's sub-blocks side by side (see row_offsets)
        offsets, row_bytes = row_offsets(layout, pages)
        chunk_bytes = row_bytes  # one row: every tensor's part, alignment included
        try:
            mem = backend.alloc_host(num_cpu_chunks * row_bytes, row_bytes)
        except OSError as exc:
            raise InvalidTransferError(
                f"cannot allocate {num_cpu_chunks * row_bytes} B of host memory "
                f"for num_cpu_chunks={num_cpu_chunks}: {exc}"
            ) from exc
        memory.append(mem)
        rows = mem.array[: num_cpu_chunks * row_bytes].reshape(-1, row_bytes)
        views = [rows[:, off : off + page] for off, page in zip(offsets, pages)]
        pinned = mem.pinned or backend.pin_functions() is None
    tables = _ref_tables(layout, backend, views, sub_bytes, blocks_per_chunk, canonical,
                         host_tensors is not None)
    _own(tables, memory, host_region, layout, host_tensors)
    return HostSide(views, memory, pinned, chunk_bytes, tables)


def _region_views(host_region: Any, pages: list[int], canonical: bool, num_cpu_chunks: int
                  ) -> tuple[list[np.ndarray], Callable[[], None]]:
    """`num_cpu_chunks` rows of the region's next view of each of `pages` bytes, and an
    undo that gives them back. A `SharedHostRegion` carves them all or none, after the row
    check, so a refused `Offloader` leaves its cursor alone; another object of the region
    protocol (``create_next_*_view``, ``pin``, ``is_pinned``) is asked view by view."""
    def rows(n: int) -> None:
        if n < num_cpu_chunks:
            raise InvalidTransferError(
                f"host_region has {n} rows, need num_cpu_chunks={num_cpu_chunks}")

    if isinstance(host_region, SharedHostRegion):
        rows(host_region.num_rows)
        carved, undo = host_region._carve(pages, canonical)
        return [v[:num_cpu_chunks] for v in carved], undo
    make = (host_region.create_next_canonical_view if canonical
            else host_region.create_next_worker_view)
    views = []
    for page in pages:
        view = make(page)
        if not isinstance(view, np.ndarray) and hasattr(view, "numpy"):  # vLLM's: torch int8
            view = view.detach().numpy()
        view = np.asarray(view).view(np.uint8)
        rows(view.shape[0])
        views.append(view[:num_cpu_chunks])
    return views, lambda: None


def _pin_region(backend: Backend, host_region: Any, views: list[np.ndarray],
                memory: list[HostMemory]) -> bool:
    """Pin a shared region once (where the backend pins) and register its views; whether
    the host copy is pinned (or needs no pinning). A region without ``pin`` that is not
    pinned yet (vLLM's, which its worker pins) has the span of rows under the views pinned
    here, in row-aligned chunks, and unpinned at close through `memory`."""
    pin = backend.pin_functions()
    if pin is not None and hasattr(host_region, "pin") and (
            isinstance(host_region, SharedHostRegion)  # pinned: returns after its barrier
            or not getattr(host_region, "is_pinned", False)):
        host_region.pin(*pin)
    elif pin is not None and not getattr(host_region, "is_pinned", False):
        page = mmap.PAGESIZE  # the driver registers whole pages
        lo = min(int(v.ctypes.data) for v in views) // page * page
        hi = max(int(v.ctypes.data) + (v.shape[0] - 1) * int(v.strides[0]) + v.shape[1]
                 for v in views)
        hi = -(-hi // page) * page
        addrs = pin_chunks(lo, hi - lo, int(views[0].strides[0]), *pin)
        if addrs is not None:
            memory.append(HostMemory(lo, hi - lo, views[0], True,
                                     partial(unpin_chunks, addrs, pin[1])))
    for v in views:
        backend.register_array(array_info(v))
    return bool(getattr(host_region, "is_pinned", False)) or pin is None or bool(memory)


def _ref_tables(layout: KVCacheLayout, backend: Backend, views: list[np.ndarray],
                sub_bytes: Sequence[int], blocks_per_chunk: int, canonical: bool,
                separate: bool) -> dict[Direction, RefTable]:
    """Both sides' geometry and each direction's ref table over the host `views` (`separate`:
    each view is its own allocation)."""
    gpu_geo = SideGeometry(
        base=[t.info.ptr for t in layout.tensors],
        row_stride=[
            t.info.row_stride if t.num_blocks > 1 else t.info.row_bytes for t in layout.tensors
        ],
        sub_stride=[0] * len(layout.tensors),
        num_rows=[t.num_blocks for t in layout.tensors],
        factor=1,
        alloc=backend.allocation_ids([t.info for t in layout.tensors]),
    )
    host_geo = SideGeometry(
        base=[int(v.ctypes.data) for v in views],
        row_stride=[int(v.strides[0]) for v in views],
        sub_stride=list(sub_bytes),
        num_rows=[int(v.shape[0]) for v in views],
        factor=blocks_per_chunk,
        # the offloader's rows and a region are one allocation, pinned in whole rows; caller
        # arrays are pinned one by one, so each is its own (even views of one buffer)
        alloc=list(range(len(views))) if separate else [0] * len(views),
    )
    return {
        "d2h": build_ref_table(layout, gpu_geo, host_geo, True, canonical),
        "h2d": build_ref_table(layout, gpu_geo, host_geo, False, canonical),
    }


def _own(tables: dict[Direction, RefTable], memory: list[HostMemory], host_region: Any | None,
         layout: KVCacheLayout, host_tensors: Sequence[Any] | None) -> None:
    """Every plan holds its table, and the table what its addresses point into: the host
    memory or region, the layout's tensors (and their torch storages), the caller's arrays."""
    for table in tables.values():
        table.owners += [*memory, *([host_region] if host_region is not None else []), layout,
                         *(host_tensors or [])]


def caller_views(
    layout: KVCacheLayout, host_tensors: Sequence[Any], pages: Sequence[int], num_cpu_chunks: int
) -> list[np.ndarray]:
    """A (num_cpu_chunks, page) uint8 view of each caller-owned host array, after checking
    them all: NumPy arrays or CPU torch tensors, writable, rows of exactly `page` contiguous
    bytes, enough rows, sharing no byte with each other or with a KV tensor."""
    if not isinstance(host_tensors, (list, tuple)) or len(host_tensors) != len(pages):
        raise InvalidTransferError(
            f"host_tensors must be a list of {len(pages)} arrays, one per KV tensor"
        )
    views: list[np.ndarray] = []
    for i, (x, page) in enumerate(zip(host_tensors, pages)):
        what = f"host_tensors[{i}]"
        info = array_info(x, what)
        if info.device != "cpu" or not (isinstance(x, np.ndarray) or info.kind == "torch"):
            raise InvalidTransferError(
                f"{what}: must be a NumPy array or a CPU torch tensor, got {info.device} "
                f"memory ({type(x).__name__})"
            )
        arr = x if isinstance(x, np.ndarray) else x.detach().numpy()
        if not info.writeable or not arr.flags.writeable:
            raise InvalidTransferError(f"{what}: read-only memory cannot take stores")
        if arr.ndim < 1 or arr.shape[0] < num_cpu_chunks:
            raise InvalidTransferError(
                f"{what}: has {arr.shape[0] if arr.ndim else 0} rows, need num_cpu_chunks="
                f"{num_cpu_chunks}"
            )
        inner = arr[0] if arr.ndim > 1 else arr[:1]
        if not inner.flags.c_contiguous or inner.nbytes != page:
            raise InvalidTransferError(
                f"{what}: each row must be {page} contiguous bytes (blocks_per_chunk x the "
                f"tensor's page), got rows of {inner.nbytes} B"
                + ("" if inner.flags.c_contiguous else ", not contiguous")
            )
        rows = arr[:num_cpu_chunks].reshape(num_cpu_chunks, -1)
        if not np.shares_memory(rows, arr):
            raise InvalidTransferError(f"{what}: its rows cannot be viewed without a copy")
        views.append(rows.view(np.uint8))
    infos = [t.info for t in layout.tensors] + [array_info(v) for v in views]
    pair = overlapping_pair(infos)
    if pair is not None:
        n = len(layout.tensors)
        a, b = (f"KV tensor {k}" if k < n else f"host_tensors[{k - n}]" for k in pair)
        raise InvalidTransferError(f"{a} and {b} share memory: a copy would overwrite itself")
    return views


def pin_caller_views(
    backend: Backend, host_tensors: Sequence[Any], views: Sequence[np.ndarray]
) -> tuple[bool, list[HostMemory]]:
    """Register the caller's arrays with the backend and, where it pins, pin those not pinned
    yet (a pinned torch tensor is left as it is). The memory stays the caller's: the returned
    `HostMemory` entries only unpin what was pinned here, at close."""
    pin = backend.pin_functions()
    memory: list[HostMemory] = []
    pinned = True
    for x, v in zip(host_tensors, views):
        backend.register_array(array_info(v))
        if pin is None or (hasattr(x, "is_pinned") and x.is_pinned()):
            continue
        ptr, stride = int(v.ctypes.data), int(v.strides[0])
        span = (v.shape[0] - 1) * stride + v.shape[1]
        addrs = pin_chunks(ptr, span, stride, *pin)
        if addrs is None:
            pinned = False
            continue
        memory.append(HostMemory(ptr, span, v, True, partial(unpin_chunks, addrs, pin[1])))
    return pinned, memory
