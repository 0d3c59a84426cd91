"""The copy engines alone on a transfer's own host rows: the bound under any row-copy path.

The host side of a staged transfer is its chunks' rows (every KV tensor's page side by side),
one copy-engine descriptor each; with random chunk ids they are scattered across the host
copy. `bare_row_seconds` moves the same rows between the offloader's host memory and one
contiguous device buffer with bare batched DMA (`cuMemcpyBatchAsync`, one call per
`BATCH_BYTES`; one `cudaMemcpyAsync` per row where the driver lacks the batch call),
enqueued behind a spin so that no host work is timed: no pack or unpack kernel, no program,
no events between slabs. What it moves is as fast as the copy engines take these rows; the
`pipeline` section reports it as path ``ref-rows`` beside the staged path held the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .common import MiB

__all__ = ["BATCH_BYTES", "RowCopy", "bare_row_seconds", "host_rows"]

#: bytes of rows per batch call (a staging slab of the default ring)
BATCH_BYTES = 16 * MiB


def host_rows(views: Sequence[np.ndarray], chunks: Any) -> tuple[np.ndarray, int] | None:
    """(host address of each of `chunks`' rows as uint64, bytes per row) in the host copy
    whose per-tensor views are `views` (an offloader's `cpu_tensors`); None unless a row is
    one contiguous run of every tensor's part side by side, in the views' order."""
    if not views:
        return None
    first = views[0]
    if first.ndim != 2 or first.itemsize != 1 or (first.shape[1] > 1 and first.strides[1] != 1):
        return None
    part = int(first.shape[1])
    row = part * len(views)
    base = int(first.ctypes.data)
    if first.shape[0] > 1 and first.strides[0] != row:
        return None
    for i, view in enumerate(views):
        if (view.shape != first.shape or view.strides != first.strides
                or int(view.ctypes.data) != base + i * part):
            return None
    ids = np.asarray(chunks, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= first.shape[0]):
        raise ValueError(f"chunk ids must lie in [0, {first.shape[0]})")
    return np.uint64(base) + ids.astype(np.uint64) * np.uint64(row), row


#: copies rows (src, dst, sizes: uint64 arrays; the stream's address; True for d2h) and
#: returns without waiting: `Context.bare_rows` passes kvasync's own batch call
RowCopy = Callable[[np.ndarray, np.ndarray, np.ndarray, int, bool], None]


def bare_row_seconds(cp: Any, addrs: np.ndarray, row_bytes: int, dev_ptr: int,
                     direction: str, stream_ptr: int, hold: Callable[[], None],
                     reps: int, copy: RowCopy) -> list[float]:
    """Event seconds of `reps` bare row copies (after one warm-up): the rows at `addrs`
    (`host_rows`) to consecutive rows of the device buffer at `dev_ptr` ("h2d") or back
    ("d2h"), on the stream at `stream_ptr`, each rep behind `hold()` (which enqueues a
    spin there, so every call is made before the device starts). Wraps
    `cudaEventRecord`, `copy` per `BATCH_BYTES` of rows, `cudaEventRecord`,
    `cudaEventSynchronize`."""
    n = len(addrs)
    dev = np.uint64(dev_ptr) + np.arange(n, dtype=np.uint64) * np.uint64(row_bytes)
    store = direction == "d2h"
    src, dst = (dev, addrs) if store else (addrs, dev)
    src = np.ascontiguousarray(src, dtype=np.uint64)
    dst = np.ascontiguousarray(dst, dtype=np.uint64)
    sizes = np.full(n, row_bytes, dtype=np.uint64)
    per = max(1, BATCH_BYTES // max(row_bytes, 1))
    stream = cp.cuda.ExternalStream(stream_ptr)
    out: list[float] = []
    for rep in range(reps + 1):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        hold()
        start.record(stream)
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            copy(src[lo:hi], dst[lo:hi], sizes[lo:hi], stream_ptr, store)
        end.record(stream)
        end.synchronize()
        if rep:
            out.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return out
