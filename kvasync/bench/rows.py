"""The copy engines alone on a transfer's own host rows: the bound under any row-copy path.

The host side of a staged transfer is its chunks' rows (every KV tensor's page side by side),
one copy-engine descriptor each; with random chunk ids they are scattered across the host
copy. `bare_row_seconds` moves the same rows, ranked by chunk id and merged where chunk ids
are consecutive as the staged program does (`row_runs`), between the offloader's host memory
and one contiguous device buffer with bare DMA (the staged path's own slab row copy, called
once per `BATCH_BYTES` of runs: `context.row_copier`), enqueued behind a spin so that no
host work is timed: no pack or unpack kernel, no program, no events between slabs. That is
the copy engines' rate on these rows with nothing else in the way; the `pipeline` section
reports it as path ``ref-rows`` beside the staged path held the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .common import MiB

__all__ = ["BATCH_BYTES", "RowCopy", "bare_row_seconds", "batches", "host_rows", "row_runs"]

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


def row_runs(addrs: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, bytes) of each host run, uint64: the rows at `addrs` in address order (chunk
    order), merged where one ends where the next begins."""
    a = np.unique(np.asarray(addrs, dtype=np.uint64))
    if a.size == 0:
        return a, a.copy()
    breaks = np.flatnonzero(np.diff(a) != np.uint64(row_bytes)) + 1
    first = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((first, [a.size])))
    return a[first], counts.astype(np.uint64) * np.uint64(row_bytes)


def batches(sizes: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(each run's offset in the device buffer, the run indices where batch calls begin and
    end): a batch holds the runs that start in one `BATCH_BYTES` window of the buffer."""
    sizes = np.asarray(sizes, dtype=np.uint64)
    offsets = (np.cumsum(sizes) - sizes).astype(np.uint64)
    windows = np.arange(0, int(sizes.sum()) + BATCH_BYTES, BATCH_BYTES, dtype=np.uint64)
    cuts = np.searchsorted(offsets, windows).tolist()
    return offsets, sorted(set(cuts) | {0, int(sizes.size)})


#: copies runs (src, dst, sizes: uint64 arrays; the stream's address; True for d2h) and
#: returns without waiting: `context.row_copier`, the staged path's own
RowCopy = Callable[[np.ndarray, np.ndarray, np.ndarray, int, bool], None]


def bare_row_seconds(cp: Any, starts: np.ndarray, sizes: np.ndarray, dev_ptr: int,
                     direction: str, stream_ptr: int, hold: Callable[[], None],
                     reps: int, copy: RowCopy) -> list[float]:
    """Event seconds of `reps` bare copies (after one warm-up) of the host runs `starts`,
    `sizes` (`row_runs`) to consecutive bytes of the device buffer at `dev_ptr` ("h2d") or
    back ("d2h"), on the stream at `stream_ptr`, each rep behind `hold()` (which enqueues a
    spin there, so every call is made before the device starts). Wraps
    `cudaEventRecord`, `copy` per `BATCH_BYTES` of runs (at least one run),
    `cudaEventRecord`, `cudaEventSynchronize`."""
    sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
    if not sizes.size:
        return []
    offsets, bounds = batches(sizes)
    dev = np.uint64(dev_ptr) + offsets
    host = np.ascontiguousarray(starts, dtype=np.uint64)
    store = direction == "d2h"
    src, dst = (dev, host) if store else (host, dev)
    out: list[float] = []
    for rep in range(reps + 1):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        hold()
        cp.cuda.runtime.eventRecord(start.ptr, stream_ptr)
        for lo, hi in zip(bounds, bounds[1:]):
            copy(src[lo:hi], dst[lo:hi], sizes[lo:hi], stream_ptr, store)
        cp.cuda.runtime.eventRecord(end.ptr, stream_ptr)
        end.synchronize()
        if rep:
            out.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return out
