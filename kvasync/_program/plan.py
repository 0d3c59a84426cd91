"""A transfer's copy program: the structured plan, its descriptor expansion and pieces.

A `TransferPlan` keeps a request in structured form (per segment: the refs and the slot
ids of both sides), so a copy path may compute addresses itself; `flat()` expands it into
the flat (src pointer, dst pointer, size) descriptor arrays, ref-major, then block, then
fragment (vLLM's order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .table import U64, RefTable

__all__ = ["Segment", "TransferPlan", "coalesce"]

#: plans of at most this many descriptors are expanded in plain Python ints
_SMALL = 32


@dataclass
class Segment:
    """Refs of one group (sharing one writer rotation) and the slots they copy."""

    refs: np.ndarray  # int64 rows of the RefTable
    src_slots: np.ndarray  # uint64 [n]
    dst_slots: np.ndarray  # uint64 [n]


@dataclass
class TransferPlan:
    """Everything one transfer copies, structured; `flat()` gives the descriptor arrays."""

    table: RefTable
    segments: list[Segment]
    nbytes: int
    num_descriptors: int
    #: objects a copy path needs alive until the transfer completes (staging buffers)
    keepalive: list[Any] = field(default_factory=list)
    #: the staged program (`staged.StagedProgram`), computed by `resolve_path` before the
    #: transfer is enqueued when the "staged" path is chosen
    staged: Any = None
    _flat: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    _coalesced: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def raw(
        cls, table: RefTable, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
    ) -> TransferPlan:
        """A plan from explicit descriptors (test hook for fault injection; no validation)."""
        s = np.ascontiguousarray(src, dtype=U64)
        d = np.ascontiguousarray(dst, dtype=U64)
        z = np.ascontiguousarray(sizes, dtype=U64)
        plan = cls(table, [], int(z.sum()), len(z))
        plan._flat = (s, d, z)
        return plan

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src pointers, dst pointers, sizes) as contiguous uint64 arrays (cached)."""
        if self._flat is None:
            if self.num_descriptors <= _SMALL and self._all_simple():
                s, d, z = _expand_small(self.table, self.segments, self.num_descriptors)
                self._flat = (np.array(s, dtype=U64), np.array(d, dtype=U64),
                              np.array(z, dtype=U64))
            else:
                self._flat = _expand(self.table, self.segments, self.num_descriptors)
        return self._flat

    def runs(self) -> list[tuple[int, int, int]] | None:
        """`coalesced()` as (src, dst, size) Python ints for a plan of at most `_SMALL`
        whole-page descriptors, else None: a small DMA transfer then costs no NumPy call."""
        if (self._flat is not None or not self.segments or self.num_descriptors > _SMALL
                or not self._all_simple()):
            return None
        s, d, z = _expand_small(self.table, self.segments, self.num_descriptors)
        out: list[tuple[int, int, int]] = []
        cs, cd, cz = s[0], d[0], z[0]
        for a, b, n in zip(s[1:], d[1:], z[1:]):
            if a == cs + cz and b == cd + cz:
                cz += n
                continue
            out.append((cs, cd, cz))
            cs, cd, cz = a, b, n
        out.append((cs, cd, cz))
        return out

    def _all_simple(self) -> bool:
        if self.table.all_simple:
            return True
        simple = self.table.simple
        return all(bool(simple[r]) for seg in self.segments for r in seg.refs.tolist())

    def coalesced(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`flat()` with neighbours that are contiguous on both sides merged (cached)."""
        if self._coalesced is None:
            self._coalesced = coalesce(*self.flat())
        return self._coalesced

    def pieces(self, max_slots: int, first: int | None = None,
               growth: int = 4) -> list[TransferPlan]:
        """Split into plans of at most `max_slots` slots each (segment order kept).

        The scheduler enqueues big transfers piece by piece on one stream, so the device
        starts on the first piece while the host still prepares the next, and other
        streams' copies can interleave at piece boundaries. Pieces share `keepalive`.
        `first` (< `max_slots`) starts with a small piece and grows `growth` times per
        piece up to `max_slots`: the device starts after a short pack, and each later pack
        hides behind the copy of the piece before it.
        """
        total = sum(len(seg.src_slots) for seg in self.segments)
        if total <= min(max_slots, first or max_slots) or not self.segments:
            return [self]
        table = self.table
        out: list[TransferPlan] = []
        cur: list[Segment] = []
        nbytes = count = 0
        size = max(1, min(first, max_slots)) if first else max_slots
        room = size
        for seg in self.segments:
            # bytes and fragments per slot once per segment, not per piece: the lane splits
            # a big transfer before its first copy, and each NumPy sum costs a few us
            per_block = int(table.bytes_per_block[seg.refs].sum())
            per_frags = int(table.frag_count[seg.refs].sum())
            n = len(seg.src_slots)
            pos = 0
            while pos < n:
                take = min(room, n - pos)
                cur.append(Segment(seg.refs, seg.src_slots[pos : pos + take],
                                   seg.dst_slots[pos : pos + take]))
                nbytes += take * per_block
                count += take * per_frags
                pos += take
                room -= take
                if room == 0:
                    out.append(TransferPlan(table, cur, nbytes, count, keepalive=self.keepalive))
                    size = min(max(growth, 1) * size, max_slots)
                    cur, room, nbytes, count = [], size, 0, 0
        if cur:
            out.append(TransferPlan(table, cur, nbytes, count, keepalive=self.keepalive))
        return out


def _slot_ptrs(
    base: np.ndarray, row_stride: np.ndarray, sub: np.ndarray, slots: np.ndarray, factor: int
) -> np.ndarray:
    """(R, n) matrix of slot pointers for R refs over n slots."""
    if factor == 1:
        out: np.ndarray = base[:, None] + slots[None, :] * row_stride[:, None]
        return out
    f = U64(factor)
    out = (
        base[:, None]
        + (slots // f)[None, :] * row_stride[:, None]
        + (slots % f)[None, :] * sub[:, None]
    )
    return out


def _expand_small(
    table: RefTable, segments: Sequence[Segment], count: int
) -> tuple[list[int], list[int], list[int]]:
    """`_expand` in plain Python ints for a few whole-page descriptors (same order)."""
    sf, df = table.src.factor, table.dst.factor
    out_s: list[int] = []
    out_d: list[int] = []
    out_z: list[int] = []
    for seg in segments:
        ss, ds = seg.src_slots.tolist(), seg.dst_slots.tolist()
        for r in seg.refs.tolist():
            sb, srs, ssub = (int(table.src_base[r]), int(table.src_row_stride[r]),
                             int(table.src_sub_stride[r]))
            db, drs, dsub = (int(table.dst_base[r]), int(table.dst_row_stride[r]),
                             int(table.dst_sub_stride[r]))
            size = int(table.frag_size[int(table.frag_start[r])])
            for a, b in zip(ss, ds):
                out_s.append(sb + (a // sf) * srs + (a % sf) * ssub)
                out_d.append(db + (b // df) * drs + (b % df) * dsub)
                out_z.append(size)
    assert len(out_z) == count
    return out_s, out_d, out_z


def _expand(
    table: RefTable, segments: Sequence[Segment], count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out_s = np.empty(count, dtype=U64)
    out_d = np.empty(count, dtype=U64)
    out_z = np.empty(count, dtype=U64)
    pos = 0
    sf, df = table.src.factor, table.dst.factor
    for seg in segments:
        n = len(seg.src_slots)
        if n == 0:
            continue
        r = seg.refs
        ps = _slot_ptrs(
            table.src_base[r], table.src_row_stride[r], table.src_sub_stride[r], seg.src_slots, sf
        )
        pd = _slot_ptrs(
            table.dst_base[r], table.dst_row_stride[r], table.dst_sub_stride[r], seg.dst_slots, df
        )
        if bool(table.simple[r].all()):
            end = pos + len(r) * n
            out_s[pos:end] = ps.ravel()
            out_d[pos:end] = pd.ravel()
            out_z[pos:end] = np.repeat(table.frag_size[table.frag_start[r]], n)
            pos = end
            continue
        for i, row in enumerate(r):
            a = int(table.frag_start[row])
            k = int(table.frag_count[row])
            end = pos + n * k
            out_s[pos:end] = (ps[i][:, None] + table.frag_src[a : a + k][None, :]).ravel()
            out_d[pos:end] = (pd[i][:, None] + table.frag_dst[a : a + k][None, :]).ravel()
            out_z[pos:end] = np.tile(table.frag_size[a : a + k], n)
            pos = end
    assert pos == count, (pos, count)
    return out_s, out_d, out_z


def coalesce(
    src: np.ndarray, dst: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive descriptors that are contiguous in both source and destination."""
    n = len(sizes)
    if n <= 1:
        return src, dst, sizes
    ends_s = src[:-1] + sizes[:-1]
    ends_d = dst[:-1] + sizes[:-1]
    joins = (ends_s == src[1:]) & (ends_d == dst[1:])
    if not joins.any():
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts].copy(), dst[starts].copy(), np.add.reduceat(sizes, starts).astype(U64)

