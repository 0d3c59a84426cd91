"""The offloader's host side, built once: host memory or region views, pinning, ref tables.

`build_host_side` allocates the host copy (or carves it out of a shared region), pins it
where the backend can, describes both sides' geometry and unrolls the two directions' ref
tables. It returns one frozen `HostSide`; the `Offloader` only wires it in. The host copy is
row-contiguous: one row per CPU chunk holding every KV tensor's `blocks_per_chunk`
sub-blocks side by side (see `_hostmem.row_offsets`), so the staged path moves whole rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays import array_info
from ._backends import Backend, Direction, HostMemory
from ._errors import InvalidTransferError
from ._hostmem import row_offsets
from ._layout import KVCacheLayout
from ._program import RefTable, SideGeometry, build_ref_table

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
) -> HostSide:
    """Allocate (or carve from `host_region`) and pin the host copy, then build both
    directions' ref tables. `sub_bytes` is each tensor's host sub-block (its page, or its
    canonical page); InvalidTransferError where the memory does not fit or cannot be had."""
    pages = [s * blocks_per_chunk for s in sub_bytes]
    memory: list[HostMemory] = []
    views: list[np.ndarray] = []
    if host_region is not None:
        for page in pages:
            if canonical:
                view = host_region.create_next_canonical_view(page)
            else:
                view = host_region.create_next_worker_view(page)
            if view.shape[0] < num_cpu_chunks:
                raise InvalidTransferError(
                    f"host_region has {view.shape[0]} rows, need num_cpu_chunks="
                    f"{num_cpu_chunks}"
                )
            views.append(view[:num_cpu_chunks])
        pin = backend.pin_functions()
        if pin is not None and not host_region.is_pinned:
            host_region.pin(*pin)
        pinned = bool(host_region.is_pinned) or pin is None
        for v in views:
            backend.register_array(array_info(v))
    else:
        # one row per chunk, every tensor's sub-blocks side by side (see row_offsets)
        offsets, row_bytes = row_offsets(layout, pages)
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

    gpu_geo = SideGeometry(
        base=[t.info.ptr for t in layout.tensors],
        row_stride=[
            t.info.row_stride if t.num_blocks > 1 else t.info.row_bytes for t in layout.tensors
        ],
        sub_stride=[0] * len(layout.tensors),
        num_rows=[t.num_blocks for t in layout.tensors],
        factor=1,
    )
    host_geo = SideGeometry(
        base=[int(v.ctypes.data) for v in views],
        row_stride=[int(v.strides[0]) for v in views],
        sub_stride=list(sub_bytes),
        num_rows=[num_cpu_chunks] * len(views),
        factor=blocks_per_chunk,
    )
    tables: dict[Direction, RefTable] = {
        "d2h": build_ref_table(layout, gpu_geo, host_geo, True, canonical),
        "h2d": build_ref_table(layout, gpu_geo, host_geo, False, canonical),
    }
    for table in tables.values():
        # every plan holds its table, and the table what its addresses point into: the
        # layout's tensors (and their torch storages) too
        table.owners += [*memory, *([host_region] if host_region is not None else []), layout]
    return HostSide(views, memory, pinned, sum(pages), tables)
