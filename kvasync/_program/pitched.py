"""The pitched copy program: one block's page of many KV tensors in one 2-D copy.

Why: where the KV tensors of a ref set lie a constant distance apart on the GPU (slices of
one pool, as an engine allocates them) and side by side in a host row, the pages of one
block form a 2-D array on both sides: ``height`` lines of ``width`` bytes, ``src_pitch``
apart at the source and ``dst_pitch`` apart at the destination. One `cudaMemcpy2DAsync`
moves them on a copy engine: no kernel takes SMs from the model, no staging buffer bounds
what is in flight, and the driver sees one call per block instead of one per page.

`line_runs` splits a ref set into such runs of refs once per table (cached on it);
`build_pitched` turns a plan into the copies, O(slots x runs) in NumPy. `pitched_lines`
expands a program back into (src, dst, size) lines: what a copy must equal (the tests'
oracle is the plan's own descriptors) and what the host backend moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._errors import InvalidTransferError
from .plan import TransferPlan
from .table import U64, RefTable

__all__ = ["MAX_PITCH", "LineRun", "PitchedProgram", "build_pitched", "check_pitchable",
           "line_runs", "mean_height", "pitched_lines"]

#: the largest pitch a 2-D copy takes (`cudaDevAttrMaxPitch` is 2^31 - 1 on current GPUs):
#: tensors further apart are separate runs
MAX_PITCH = (1 << 31) - 1


@dataclass(frozen=True)
class LineRun:
    """Refs ``refs[start : start + height]`` of a ref set as the lines of one 2-D copy."""

    start: int
    height: int
    width: int
    src_pitch: int
    dst_pitch: int


@dataclass(frozen=True)
class PitchedProgram:
    """The 2-D copies of a transfer: copy i moves `height[i]` lines of `width[i]` bytes
    from ``src[i] + k * src_pitch[i]`` to ``dst[i] + k * dst_pitch[i]``."""

    src: np.ndarray  # uint64 [N]
    dst: np.ndarray
    src_pitch: np.ndarray
    dst_pitch: np.ndarray
    width: np.ndarray
    height: np.ndarray

    @property
    def nbytes(self) -> int:
        return int((self.width * self.height).sum())

    def __len__(self) -> int:
        return len(self.src)


def line_runs(table: RefTable, refs: np.ndarray) -> tuple[LineRun, ...] | None:
    """`refs` (in their order) as maximal runs of lines, or None where a ref is not one
    whole-page copy (fragments, canonical pages: the lines of a copy are equal). A run
    grows while the next ref has the run's width and strides, lies one pitch further on
    both sides (pitches positive, at least the width, at most `MAX_PITCH`) and in the same
    allocation on both sides (`SideGeometry.alloc`). Cached per ref set."""
    key = ("lines", refs.tobytes())
    cache = table.cache
    if key in cache:
        found: tuple[LineRun, ...] | None = cache[key]
        return found
    rs = refs.tolist()
    out: tuple[LineRun, ...] | None = None
    if all(bool(table.simple[r]) for r in rs):
        width = [int(table.frag_size[int(table.frag_start[r])]) for r in rs]
        shape = [(int(table.src_row_stride[r]), int(table.src_sub_stride[r]),
                  int(table.dst_row_stride[r]), int(table.dst_sub_stride[r])) for r in rs]
        sb = [int(table.src_base[r]) for r in rs]
        db = [int(table.dst_base[r]) for r in rs]
        alloc = [_alloc(table, r) for r in rs]
        runs: list[LineRun] = []
        i = 0
        while i < len(rs):
            w, j = width[i], i + 1
            sp = sb[j] - sb[i] if j < len(rs) else w
            dp = db[j] - db[i] if j < len(rs) else w
            if not (w <= sp <= MAX_PITCH and w <= dp <= MAX_PITCH):
                sp = dp = w
            else:
                while (j < len(rs) and width[j] == w and shape[j] == shape[i]
                       and sb[j] - sb[j - 1] == sp and db[j] - db[j - 1] == dp
                       and alloc[j] == alloc[i]):
                    j += 1
                if j - i == 1:
                    sp = dp = w
            runs.append(LineRun(i, j - i, w, sp, dp))
            i = j
        out = tuple(runs)
    if len(cache) < 4096:
        cache[key] = out
    return out


def _alloc(table: RefTable, ref: int) -> tuple[int, int]:
    """The (source, destination) allocation ids of `ref`'s tensor."""
    t = int(table.tensor_idx[ref])  # no ids: each tensor is an allocation of its own
    return (table.src.alloc[t] if table.src.alloc else -1 - t,
            table.dst.alloc[t] if table.dst.alloc else -1 - t)


def check_pitchable(plan: TransferPlan) -> None:
    """Raise InvalidTransferError (nothing enqueued) where `plan` has no pitched form."""
    if plan.table is None or (not plan.segments and plan.num_descriptors):
        raise InvalidTransferError("copy path 'pitched' needs a plan of the layout's refs")
    for seg in plan.segments:
        if len(seg.src_slots) and line_runs(plan.table, seg.refs) is None:
            raise InvalidTransferError(
                "copy path 'pitched' moves whole pages only; this layout's refs copy parts "
                "of pages (canonical pages or fragments): use 'staged', 'kernel' or 'dma'")


def mean_height(plan: TransferPlan) -> float:
    """Lines per copy of `plan`'s pitched form (0 where it has none): cheap, from the
    cached runs, for a path choice."""
    lines = copies = 0
    for seg in plan.segments:
        n = len(seg.src_slots)
        if not n:
            continue
        runs = line_runs(plan.table, seg.refs)
        if runs is None:
            return 0.0
        lines += n * len(seg.refs)
        copies += n * len(runs)
    return lines / copies if copies else 0.0


def _slot_offsets(slots: np.ndarray, row_stride: int, sub: int, factor: int) -> np.ndarray:
    if factor == 1:
        out: np.ndarray = slots * U64(row_stride)
        return out
    f = U64(factor)
    out = (slots // f) * U64(row_stride) + (slots % f) * U64(sub)
    return out


def build_pitched(plan: TransferPlan) -> PitchedProgram:
    """The 2-D copies of `plan` (check with `check_pitchable` first), segment by segment,
    run by run, slot by slot."""
    table = plan.table
    sf, df = table.src.factor, table.dst.factor
    parts: list[tuple[np.ndarray, ...]] = []
    for seg in plan.segments:
        n = len(seg.src_slots)
        if not n:
            continue
        runs = line_runs(table, seg.refs)
        assert runs is not None, "check_pitchable first"
        src_slots = seg.src_slots.astype(U64, copy=False)
        dst_slots = seg.dst_slots.astype(U64, copy=False)
        for run in runs:
            r = int(seg.refs[run.start])
            s = U64(int(table.src_base[r])) + _slot_offsets(
                src_slots, int(table.src_row_stride[r]), int(table.src_sub_stride[r]), sf)
            d = U64(int(table.dst_base[r])) + _slot_offsets(
                dst_slots, int(table.dst_row_stride[r]), int(table.dst_sub_stride[r]), df)
            parts.append((s, d, np.full(n, run.src_pitch, dtype=U64),
                          np.full(n, run.dst_pitch, dtype=U64), np.full(n, run.width, dtype=U64),
                          np.full(n, run.height, dtype=U64)))
    if not parts:
        empty = np.zeros(0, dtype=U64)
        return PitchedProgram(empty, empty, empty, empty, empty, empty)
    cols = [np.concatenate([p[k] for p in parts]).astype(U64) for k in range(6)]
    return PitchedProgram(*cols)


def pitched_lines(program: PitchedProgram) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every line of `program` as (src, dst, size) arrays, copy by copy."""
    h = program.height.astype(np.int64)
    if not len(h):
        empty = np.zeros(0, dtype=U64)
        return empty, empty, empty
    total = int(h.sum())
    first = np.repeat(np.cumsum(h) - h, h)
    k = (np.arange(total, dtype=np.int64) - first).astype(U64)
    src = np.repeat(program.src, h) + k * np.repeat(program.src_pitch, h)
    dst = np.repeat(program.dst, h) + k * np.repeat(program.dst_pitch, h)
    return src.astype(U64), dst.astype(U64), np.repeat(program.width, h).astype(U64)
