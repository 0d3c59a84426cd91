"""The static ref table of one direction: every (group, ref) row and its fragments.

The pointer of slot `s` of a tensor on one side is::

    base + (s // factor) * row_stride + (s % factor) * sub_stride

where the GPU side has factor 1 (a slot is a block) and the host side has factor
`blocks_per_chunk` (slot ``c*bpc + j`` is sub-block j of chunk c; `sub_stride` is the
tensor's page, or its canonical page). All of it is 64-bit unsigned arithmetic. A table is
built once per offloader and direction; every plan points into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .._layout import KVCacheLayout

__all__ = ["U64", "RefTable", "SideGeometry", "build_ref_table"]

U64 = np.uint64


@dataclass(frozen=True)
class SideGeometry:
    """Where each tensor's slots live on one side (GPU or host) of a direction."""

    base: list[int]
    row_stride: list[int]
    sub_stride: list[int]
    num_rows: list[int]
    factor: int
    #: which allocation each tensor lies in (equal ids: one allocation; empty: each its
    #: own). A 2-D copy's lines must not cross allocations (`cudaMemcpy2DAsync` rejects it)
    alloc: list[int] = field(default_factory=list)


@dataclass
class RefTable:
    """Static per-direction table: one row per (group, ref), plus their fragments.

    Fragment offsets are relative to the slot pointer on each side. Store tables of a
    canonical layout carry the writer rotation of each ref.
    """

    src: SideGeometry
    dst: SideGeometry
    tensor_idx: np.ndarray  # int64 [R]
    group_of: np.ndarray  # int64 [R]
    src_base: np.ndarray  # uint64 [R]
    src_row_stride: np.ndarray
    src_sub_stride: np.ndarray
    dst_base: np.ndarray
    dst_row_stride: np.ndarray
    dst_sub_stride: np.ndarray
    frag_start: np.ndarray  # int64 [R]
    frag_count: np.ndarray  # int64 [R]
    frag_src: np.ndarray  # uint64 [F]
    frag_dst: np.ndarray  # uint64 [F]
    frag_size: np.ndarray  # uint64 [F]
    bytes_per_block: np.ndarray  # int64 [R]: sum of the ref's fragment sizes
    #: per group: list of (ref rows, num_writers, writer_index) partitions
    partitions: list[list[tuple[np.ndarray, int, int]]]
    #: per group, per partition: (bytes per block, fragments per block) over its refs
    partition_totals: list[list[tuple[int, int]]]
    #: refs whose only fragment is offset 0 on both sides (whole-page copies)
    simple: np.ndarray  # bool [R]
    num_groups: int
    #: tensors referenced by several groups, with those groups (cross-group duplicate check)
    shared_tensors: list[tuple[int, list[int]]]
    max_gpu_block: list[int] = field(default_factory=list)
    #: what the host addresses point into (host memory, a shared region): every plan holds
    #: its table, so memory in use by a transfer in flight is never unpinned or unmapped
    owners: list[Any] = field(default_factory=list, compare=False, repr=False)
    #: derived forms computed once per table by the copy paths (row geometry, staging
    #: tables, coverage patterns); never part of a plan's meaning
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def all_simple(self) -> bool:
        """Every ref is a whole-page copy (cached: asked on every small transfer)."""
        return bool(self.simple.all())

    @cached_property
    def slots_fit_32(self) -> bool:
        """Every slot id of both sides fits in 32 bits (the table kernel's index math)."""
        return all(max(side.num_rows, default=0) * side.factor < 1 << 32
                   for side in (self.src, self.dst))


def build_ref_table(
    layout: KVCacheLayout,
    gpu: SideGeometry,
    host: SideGeometry,
    gpu_to_cpu: bool,
    canonical: bool,
) -> RefTable:
    """Unroll every ref's pages (or canonical runs) into the static table of one direction."""
    src, dst = (gpu, host) if gpu_to_cpu else (host, gpu)
    rows_t: list[int] = []
    rows_g: list[int] = []
    f_start: list[int] = []
    f_count: list[int] = []
    fs: list[int] = []
    fd: list[int] = []
    fz: list[int] = []
    per_block: list[int] = []
    writers: list[tuple[int, int]] = []
    for g, refs in enumerate(layout.groups):
        for ref in refs:
            assert ref.page_size_bytes is not None
            rows_t.append(ref.tensor_idx)
            rows_g.append(g)
            f_start.append(len(fz))
            off = ref.offset_bytes  # where the ref's bytes start in a block (and host sub-slot)
            if canonical:
                assert ref.mapping is not None
                frags = [(lo + off, co, size)
                         for run in ref.mapping.runs for lo, co, size in run.fragments()]
                writers.append(
                    (ref.mapping.num_writers, ref.mapping.writer_index) if gpu_to_cpu else (1, 0)
                )
            else:
                frags = [(off, off, ref.page_size_bytes)]
                writers.append((1, 0))
            for local, canon, size in frags:
                s_off, d_off = (local, canon) if gpu_to_cpu else (canon, local)
                fs.append(s_off)
                fd.append(d_off)
                fz.append(size)
            f_count.append(len(frags))
            per_block.append(sum(f[2] for f in frags))
    t = np.asarray(rows_t, dtype=np.int64)
    fstart = np.asarray(f_start, dtype=np.int64)
    fcount = np.asarray(f_count, dtype=np.int64)
    frag_src = np.asarray(fs, dtype=U64)
    frag_dst = np.asarray(fd, dtype=U64)
    simple = (fcount == 1) & (frag_src[fstart] == 0) & (frag_dst[fstart] == 0)
    partitions: list[list[tuple[np.ndarray, int, int]]] = []
    groups_of_tensor: dict[int, list[int]] = {}
    for g, refs in enumerate(layout.groups):
        for ref in refs:
            gs = groups_of_tensor.setdefault(ref.tensor_idx, [])
            if g not in gs:  # once per group: two refs of one group (a tensor's K and V
                gs.append(g)  # halves) write one slot, checked within the group
    row = 0
    for refs in layout.groups:
        # consecutive refs sharing a writer rotation form one partition (keeps ref order)
        runs: list[tuple[tuple[int, int], list[int]]] = []
        for _ in refs:
            if runs and runs[-1][0] == writers[row]:
                runs[-1][1].append(row)
            else:
                runs.append((writers[row], [row]))
            row += 1
        partitions.append(
            [(np.asarray(rows, dtype=np.int64), nw, wi) for (nw, wi), rows in runs]
        )

    def col(values: list[int]) -> np.ndarray:
        return np.asarray([values[i] for i in rows_t], dtype=U64)

    return RefTable(
        src=src,
        dst=dst,
        tensor_idx=t,
        group_of=np.asarray(rows_g, dtype=np.int64),
        src_base=col(src.base),
        src_row_stride=col(src.row_stride),
        src_sub_stride=col(src.sub_stride),
        dst_base=col(dst.base),
        dst_row_stride=col(dst.row_stride),
        dst_sub_stride=col(dst.sub_stride),
        frag_start=fstart,
        frag_count=fcount,
        frag_src=frag_src,
        frag_dst=frag_dst,
        frag_size=np.asarray(fz, dtype=U64),
        bytes_per_block=np.asarray(per_block, dtype=np.int64),
        partitions=partitions,
        partition_totals=[
            [(int(np.asarray(per_block, dtype=np.int64)[rows].sum()), int(fcount[rows].sum()))
             for rows, _, _ in parts]
            for parts in partitions
        ],
        simple=simple,
        num_groups=len(layout.groups),
        shared_tensors=[(t, gs) for t, gs in groups_of_tensor.items() if len(gs) > 1],
        max_gpu_block=[min(gpu.num_rows[r.tensor_idx] for r in refs) if refs else 0
                       for refs in layout.groups],
    )
