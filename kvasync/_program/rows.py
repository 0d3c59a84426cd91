"""The host side of a table as chunk rows, for the staged program.

A CPU chunk's host row holds every KV tensor's sub-blocks side by side. `row_side` finds
that row form of a table (or says there is none), `row_window` narrows it to the part of
the rows a ref set can cover (a layer, a group), `staging_table` moves the host side onto
a staging buffer of such rows, and `coverage_pattern` gives the bytes a ref set covers
in one row. Each is computed once per table (per buffer, per pattern) and cached on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .table import U64, RefTable, SideGeometry

__all__ = ["MAX_FACTOR", "RowSide", "coalesce_runs", "coverage_pattern", "row_side",
           "row_window", "staging_table"]

#: sub-blocks per chunk the coverage masks can describe (one bit each)
MAX_FACTOR = 64


@dataclass(frozen=True)
class RowSide:
    """The host side of a table as rows: ref r's slot s lies at ``base + (s // factor) *
    row_stride + offsets[r] + (s % factor) * sub[r]``; each row's used bytes fit in `span`."""

    base: int
    row_stride: int
    span: int
    offsets: np.ndarray  # uint64 [R]
    sub: np.ndarray  # uint64 [R]
    frag_off: np.ndarray  # uint64 [F]: fragment offsets on the host side
    factor: int


def row_side(table: RefTable, gpu_to_cpu: bool) -> RowSide | None:
    """The row form of `table`'s host side, or None where the host memory is not rows
    (refs with different row strides, or parts of a row overlapping the next row)."""
    key = ("rows", gpu_to_cpu)
    cache = table.cache
    if key in cache:
        found: RowSide | None = cache[key]
        return found
    if gpu_to_cpu:
        base, stride, sub, frag, side = (table.dst_base, table.dst_row_stride,
                                         table.dst_sub_stride, table.frag_dst, table.dst)
    else:
        base, stride, sub, frag, side = (table.src_base, table.src_row_stride,
                                         table.src_sub_stride, table.frag_src, table.src)
    out: RowSide | None = None
    if len(base) and len(np.unique(stride)) == 1:
        lo = int(base.min())
        offsets = (base - U64(lo)).astype(U64)
        ends = []
        for r in range(len(base)):
            a, k = int(table.frag_start[r]), int(table.frag_count[r])
            last = max((int(frag[f]) + int(table.frag_size[f]) for f in range(a, a + k)),
                       default=0)
            ends.append(int(offsets[r]) + (side.factor - 1) * int(sub[r]) + last)
        span = max(max(ends), 1)
        row = int(stride[0])
        if span <= row or (len(set(side.num_rows)) == 1 and side.num_rows[0] <= 1):
            out = RowSide(lo, row, span, offsets, sub.astype(U64), frag.astype(U64),
                          side.factor)
    cache[key] = out
    return out


def row_window(table: RefTable, rows: RowSide, refs: np.ndarray, gpu_to_cpu: bool) -> RowSide:
    """`rows` narrowed to the part of every row that `refs` can cover: a staging row then
    holds only that part. One layer of a layer-wise load (2 of 64 tensors) staged through
    whole-row staging rows filled 1/32 of each buffer, and its many small slabs cost the
    host ~3 ms per layer. Refs outside the window keep offset 0 (never addressed through
    it). `rows` itself where the window is the whole span; cached per (side, refs)."""
    key = ("win", gpu_to_cpu, refs.tobytes())
    hit: RowSide | None = table.cache.get(key)
    if hit is not None:
        return hit
    lo, hi = rows.span, 0
    for r in refs.tolist():
        a, k = int(table.frag_start[r]), int(table.frag_count[r])
        last = max((int(rows.frag_off[f]) + int(table.frag_size[f]) for f in range(a, a + k)),
                   default=0)
        off = int(rows.offsets[r])
        lo = min(lo, off)
        hi = max(hi, off + (rows.factor - 1) * int(rows.sub[r]) + last)
    out = rows
    if 0 <= lo < hi and hi - lo < rows.span:
        inside = np.zeros(len(rows.offsets), dtype=bool)
        inside[refs] = True
        offsets = np.where(inside, rows.offsets.astype(np.int64) - lo, 0).astype(U64)
        out = replace(rows, base=rows.base + lo, span=hi - lo, offsets=offsets)
    if len(table.cache) < 4096:
        table.cache[key] = out
    return out


def staging_table(table: RefTable, rows: RowSide, gpu_to_cpu: bool, stage_ptr: int,
                  rows_per_slab: int) -> RefTable:
    """`table` with its host side moved onto a staging buffer at `stage_ptr` (rows of
    `rows.span` bytes): what the pack/unpack kernel reads. Cached per buffer address."""
    # every offset: two windows of one base and span may hold different refs (a ref
    # outside a window sits at offset 0)
    key = ("stage", gpu_to_cpu, stage_ptr, rows_per_slab, rows.base, rows.span,
           rows.offsets.tobytes())
    hit: RefTable | None = table.cache.get(key)
    if hit is not None:
        return hit
    n = len(table.tensor_idx)
    bases = (rows.offsets + U64(stage_ptr)).astype(U64)
    strides = np.full(n, rows.span, dtype=U64)
    old = table.dst if gpu_to_cpu else table.src
    geo = SideGeometry(base=list(old.base), row_stride=[rows.span] * len(old.base),
                       sub_stride=list(old.sub_stride),
                       num_rows=[rows_per_slab] * len(old.base), factor=old.factor)
    if gpu_to_cpu:
        out = replace(table, dst=geo, dst_base=bases, dst_row_stride=strides, owners=[],
                      cache={})
    else:
        out = replace(table, src=geo, src_base=bases, src_row_stride=strides, owners=[],
                      cache={})
    table.cache[key] = out
    return out


def coverage_pattern(table: RefTable, rows: RowSide, refs: np.ndarray, mask: int, gpu_to_cpu: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """(starts, sizes) in a row image of the bytes `refs` cover in the sub-blocks of
    `mask`, merged where adjacent; cached per (refs, mask)."""
    key = ("pat", gpu_to_cpu, rows.base, refs.tobytes(), mask)
    hit: tuple[np.ndarray, np.ndarray] | None = table.cache.get(key)
    if hit is not None:
        return hit
    subs = [j for j in range(rows.factor) if mask >> j & 1]
    spans: list[tuple[int, int]] = []
    for r in refs.tolist():
        a, k = int(table.frag_start[r]), int(table.frag_count[r])
        off, sub = int(rows.offsets[r]), int(rows.sub[r])
        for f in range(a, a + k):
            size = int(table.frag_size[f])
            if size == 0:
                continue
            start = off + int(rows.frag_off[f])
            spans.extend((start + j * sub, size) for j in subs)
    spans.sort()
    merged: list[list[int]] = []
    for start, size in spans:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            end = max(merged[-1][0] + merged[-1][1], start + size)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([start, size])
    out = (np.asarray([m[0] for m in merged], dtype=U64),
           np.asarray([m[1] for m in merged], dtype=U64))
    if len(table.cache) < 4096:
        table.cache[key] = out
    return out


def coalesce_runs(so: np.ndarray, hp: np.ndarray, sz: np.ndarray,
                  group: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Sort runs by host address (by `group`, then host address, when given) and merge
    those contiguous on both sides (and of one group); `group` comes back sorted and merged
    alike (None stays None)."""
    if len(sz) > 1:
        order = (np.argsort(hp, kind="stable") if group is None
                 else np.lexsort((hp, group)))
        so, hp, sz = so[order], hp[order], sz[order]
        joins = (so[:-1] + sz[:-1] == so[1:]) & (hp[:-1] + sz[:-1] == hp[1:])
        if group is not None:
            group = group[order]
            joins &= group[:-1] == group[1:]
        if joins.any():
            starts = np.flatnonzero(np.concatenate(([True], ~joins)))
            so, hp = so[starts], hp[starts]
            sz = np.add.reduceat(sz, starts).astype(U64)
            group = None if group is None else group[starts]
    return so, hp, sz, group
