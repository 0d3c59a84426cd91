"""Descriptors: from (block ids, chunk ids, groups) to (src pointer, dst pointer, size) arrays.

The pointer of slot `s` of a tensor on one side is::

    base + (s // factor) * row_stride + (s % factor) * sub_stride

where the GPU side has factor 1 (a slot is a block) and the host side has factor
`blocks_per_chunk` (slot ``c*bpc + j`` is sub-block j of chunk c; `sub_stride` is the
tensor's page, or its canonical page). All of it is 64-bit unsigned arithmetic.

Per group g with n blocks and logical start ``block_indices[g]`` the host side skips
``block_indices[g] % bpc`` sub-blocks of its first chunk and consumes
``ceil((n + skip) / bpc)`` chunks; groups consume both id lists in order and must use them
up exactly. A `TransferPlan` keeps this structured form (per segment: the refs and the slot
ids of both sides), so a copy path may compute addresses itself; `flat()` expands it into
the flat descriptor arrays, ref-major, then block, then fragment (vLLM's order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._errors import InvalidTransferError

if TYPE_CHECKING:
    from ._layout import KVCacheLayout

__all__ = [
    "IdArray",
    "Ids",
    "RefTable",
    "Segment",
    "SideGeometry",
    "TransferPlan",
    "build_plan",
    "build_ref_table",
    "coalesce",
]

U64 = np.uint64


@dataclass(frozen=True)
class SideGeometry:
    """Where each tensor's slots live on one side (GPU or host) of a direction."""

    base: list[int]
    row_stride: list[int]
    sub_stride: list[int]
    num_rows: list[int]
    factor: int


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
            groups_of_tensor.setdefault(ref.tensor_idx, []).append(g)
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
    #: the staged program (`_staged.StagedProgram`), computed by `resolve_path` before the
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

    def pieces(self, max_slots: int, first: int | None = None) -> list[TransferPlan]:
        """Split into plans of at most `max_slots` slots each (segment order kept).

        The scheduler enqueues big transfers piece by piece on one stream, so the device
        starts on the first piece while the host still prepares the next, and other
        streams' copies can interleave at piece boundaries. Pieces share `keepalive`.
        `first` (< `max_slots`) starts with a small piece and grows 4x per piece up to
        `max_slots`: the device starts after a short pack, and each later pack hides
        behind the copy of the piece before it.
        """
        total = sum(len(seg.src_slots) for seg in self.segments)
        if total <= max_slots or not self.segments:
            return [self]
        table = self.table
        out: list[TransferPlan] = []
        cur: list[Segment] = []
        size = max(1, min(first, max_slots)) if first else max_slots
        room = size
        for seg in self.segments:
            n = len(seg.src_slots)
            pos = 0
            while pos < n:
                take = min(room, n - pos)
                cur.append(Segment(seg.refs, seg.src_slots[pos : pos + take],
                                   seg.dst_slots[pos : pos + take]))
                pos += take
                room -= take
                if room == 0:
                    out.append(self._piece(table, cur))
                    size = min(4 * size, max_slots)
                    cur, room = [], size
        if cur:
            out.append(self._piece(table, cur))
        return out

    def _piece(self, table: RefTable, segs: list[Segment]) -> TransferPlan:
        nbytes = sum(len(s.src_slots) * int(table.bytes_per_block[s.refs].sum()) for s in segs)
        count = sum(len(s.src_slots) * int(table.frag_count[s.refs].sum()) for s in segs)
        return TransferPlan(table, segs, nbytes, count, keepalive=self.keepalive)



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


_INT64_MAX = int(np.iinfo(np.int64).max)


class IdArray(Protocol):
    """An array NumPy reads in one call (`__array__`): a NumPy array, a CPU torch tensor."""

    def __array__(self, *args: Any, **kwargs: Any) -> Any: ...


#: block or chunk ids: a list, tuple or range of ints, or a 1-D integer NumPy array or CPU
#: torch tensor
Ids = Sequence[int] | np.ndarray | IdArray

_IDS_EXPECTED = "a 1-D sequence of ints (list, tuple, range, NumPy array or CPU torch tensor)"


def _as_ids(x: Any, what: str, copy: bool = True) -> np.ndarray:
    """A 1-D int64 array of ids; rejects floats, bools, non-1-D and non-integer input.

    `copy=False` lets an int64 array through as is (no fresh 2 MB page-faulting copy for a
    262k-id request): for copy paths that consume the plan before `store()` returns."""
    if not hasattr(x, "__array__") and (
        not isinstance(x, Sequence) or isinstance(x, (str, bytes, bytearray))
    ):  # sets, dicts, generators, strings, None, scalars: say what came
        shown = f" {x!r}" if isinstance(x, (str, bytes, int, float)) else ""
        raise InvalidTransferError(
            f"{what}: expected {_IDS_EXPECTED}, got {type(x).__name__}{shown}"
        )
    try:
        arr = np.asarray(x)
    except Exception as exc:
        raise InvalidTransferError(
            f"{what}: cannot read ids from {type(x).__name__} ({exc})"
        ) from None
    if arr.ndim != 1:
        if arr.ndim == 0 or arr.size != 0:
            raise InvalidTransferError(
                f"{what}: expected {_IDS_EXPECTED}, got {type(x).__name__} of shape {arr.shape}"
            )
        arr = arr.reshape(0)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind not in "iu":  # 'b' (bool), 'f', 'U', 'O', ... are refused
        if type(x) in (list, tuple) and all(type(v) is int for v in x):  # beyond int64
            raise InvalidTransferError(f"{what}: id {max(x, key=abs)} out of range")
        raise InvalidTransferError(f"{what}: ids must be integers, got dtype {arr.dtype}")
    if type(x) in (list, tuple):
        # NumPy reads [3, True] as int64: a bool among ints is refused like [True] is
        types = frozenset(map(type, x))
        if bool in types or np.bool_ in types:
            raise InvalidTransferError(f"{what}: ids must be integers, got a bool among them")
    if kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
        raise InvalidTransferError(f"{what}: id {int(arr.max())} out of range")
    # one private copy where the plan may be read after the call returns (host backend): it
    # must not alias an array the caller may reuse; later steps take zero-copy views of it
    if not copy:
        return np.asarray(arr, dtype=np.int64)
    return np.array(arr, dtype=np.int64, copy=True)


def _check_unique(slots: np.ndarray, gpu_to_cpu: bool, where: str) -> None:
    """Reject a transfer that writes one destination slot twice (copies of one batch run in
    any order, so the result would be undefined)."""
    n = len(slots)
    if n <= 1:
        return
    if n <= 256:
        if len(set(slots.tolist())) == n:
            return
    else:
        # strictly increasing ids (e.g. freshly allocated chunks) are unique: one vector
        # compare (~0.2 ms per 262k ids) instead of the bitmap's random scatter (~1 ms); a
        # 64-id probe keeps the cost nil for unsorted requests
        head = slots[:64]
        if bool((head[1:] > head[:-1]).all()) and bool((slots[1:] > slots[:-1]).all()):
            return
        # np.unique's hash path is ~60x slower than this (NumPy 2); a bitmap is ~3x faster
        # than a sort when the ids are dense
        top = int(slots.max()) + 1
        if top <= 16 * n:
            seen = np.zeros(top, dtype=np.bool_)
            # int64 indices: numpy converts uint64 ones first (2x slower); ids are < 2^63
            seen[slots.view(np.int64) if slots.dtype == U64 else slots] = True
            if np.count_nonzero(seen) == n:
                return
        else:
            ordered = np.sort(slots)
            if not (ordered[1:] == ordered[:-1]).any():
                return
    vals, counts = np.unique(slots, return_counts=True)
    side = "cpu chunk slot" if gpu_to_cpu else "gpu block"
    raise InvalidTransferError(
        f"duplicate destination: {side} {int(vals[counts > 1][0])} ({where}) is written twice "
        "in one transfer"
    )


#: plans of at most this many descriptors are expanded in plain Python ints
_SMALL = 32
#: requests of at most this many ids are validated in plain Python (numpy's per-call
#: overhead is most of a small transfer's host cost)
_SMALL_IDS = 256


def _small_ids(x: Any) -> list[int] | None:
    """`x` as a list of Python ints if it is a short list of ints or a short 1-D integer
    array; None for anything else (the general path validates it and words the error)."""
    if type(x) is list:
        if not 0 < len(x) <= _SMALL_IDS:
            return None
        for v in x:
            if type(v) is not int:
                return None
        return x
    if type(x) is np.ndarray:
        if x.ndim != 1 or not 0 < x.size <= _SMALL_IDS or x.dtype.kind not in "iu":
            return None
        out: list[int] = x.tolist()
        return out
    return None


def _build_small(
    table: RefTable,
    gpu_blocks: Any,
    cpu_chunks: Any,
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    gpu_to_cpu: bool,
    num_cpu_chunks: int,
) -> TransferPlan | None:
    """The common request (one group, one chunk per block, up to `_SMALL_IDS` ids as a list
    or an integer array, no writer rotation) validated in plain Python. Returns None to take
    the general path (which also produces every error message)."""
    if (
        table.num_groups != 1
        or group_sizes is not None
        or block_indices is not None
        or table.dst.factor != 1
        or table.src.factor != 1
        or len(table.partitions[0]) != 1
        or table.partitions[0][0][1] != 1
    ):
        return None
    g = _small_ids(gpu_blocks)
    if g is None:
        return None
    c = _small_ids(cpu_chunks)
    if c is None or len(g) != len(c):
        return None
    if min(g) < 0 or max(g) >= table.max_gpu_block[0]:
        return None
    if min(c) < 0 or max(c) >= num_cpu_chunks:
        return None
    dst = c if gpu_to_cpu else g
    if len(dst) > 1 and len(set(dst)) != len(dst):
        return None
    rows = table.partitions[0][0][0]
    # private copies (the caller may reuse its arrays); validated non-negative above
    ga = gpu_blocks.astype(U64) if type(gpu_blocks) is np.ndarray else np.array(g, dtype=U64)
    ca = cpu_chunks.astype(U64) if type(cpu_chunks) is np.ndarray else np.array(c, dtype=U64)
    src_slots, dst_slots = (ga, ca) if gpu_to_cpu else (ca, ga)
    k = len(g)
    per_block, frags = table.partition_totals[0][0]
    return TransferPlan(table, [Segment(rows, src_slots, dst_slots)], k * per_block, k * frags)


def build_plan(
    table: RefTable,
    gpu_blocks: Any,
    cpu_chunks: Any,
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    gpu_to_cpu: bool,
    num_cpu_chunks: int,
    copy_ids: bool = True,
) -> TransferPlan:
    """Validate one request and build its plan; raises InvalidTransferError, writes nothing.

    `copy_ids=False`: the plan may alias the caller's id arrays (it must be used up before
    the caller can touch them again, i.e. within the submitting call)."""
    fast = _build_small(table, gpu_blocks, cpu_chunks, group_sizes, block_indices, gpu_to_cpu,
                        num_cpu_chunks)
    if fast is not None:
        return fast
    gpu = _as_ids(gpu_blocks, "gpu_blocks", copy_ids)
    cpu = _as_ids(cpu_chunks, "cpu_chunks", copy_ids)
    ng = table.num_groups
    if group_sizes is None:
        if ng != 1:
            raise InvalidTransferError(
                f"group_sizes is required: the layout has {ng} KV-cache groups"
            )
        gs = np.asarray([len(gpu)], dtype=np.int64)
    else:
        gs = _as_ids(group_sizes, "group_sizes")
    bi = np.zeros(ng, dtype=np.int64) if block_indices is None else _as_ids(
        block_indices, "block_indices"
    )
    if len(gs) != ng:
        raise InvalidTransferError(f"group_sizes has {len(gs)} entries, the layout has {ng} groups")
    if len(bi) != ng:
        raise InvalidTransferError(
            f"block_indices has {len(bi)} entries, the layout has {ng} groups"
        )
    if (gs < 0).any():
        raise InvalidTransferError(f"group_sizes must be >= 0, got {gs.tolist()}")
    if (bi < 0).any():
        raise InvalidTransferError(f"block_indices must be >= 0, got {bi.tolist()}")
    total = sum(gs.tolist())  # Python ints: an int64 sum could wrap around to len(gpu)
    if total != len(gpu):
        raise InvalidTransferError(
            f"sum(group_sizes) = {total} != len(gpu_blocks) = {len(gpu)}"
        )
    if len(cpu) and (int(cpu.min()) < 0 or int(cpu.max()) >= num_cpu_chunks):
        bad = int(cpu.min()) if int(cpu.min()) < 0 else int(cpu.max())
        raise InvalidTransferError(f"cpu chunk id {bad} out of range [0, {num_cpu_chunks})")
    host_side = table.dst if gpu_to_cpu else table.src
    bpc = host_side.factor
    skips = bi % bpc
    chunks_per_group = np.where(gs > 0, (gs + skips + bpc - 1) // bpc, 0)
    if int(chunks_per_group.sum()) != len(cpu):
        raise InvalidTransferError(
            f"the groups need {int(chunks_per_group.sum())} cpu chunks "
            f"({chunks_per_group.tolist()} with blocks_per_chunk={bpc}), got {len(cpu)}"
        )
    segments: list[Segment] = []
    dst_by_group: dict[int, np.ndarray] = {}
    nbytes = 0
    count = 0
    g_off = 0
    c_off = 0
    arange = np.arange(bpc, dtype=np.int64) if bpc > 1 else None
    for g in range(ng):
        n = int(gs[g])
        if n == 0:
            continue
        g_ids = gpu[g_off : g_off + n]
        nch = int(chunks_per_group[g])
        c_ids = cpu[c_off : c_off + nch]
        g_off += n
        c_off += nch
        limit = table.max_gpu_block[g]
        lo, hi = int(g_ids.min()), int(g_ids.max())
        if lo < 0 or hi >= limit:
            raise InvalidTransferError(
                f"gpu block id {lo if lo < 0 else hi} out of range [0, {limit}) in group {g}"
            )
        if arange is None:
            h_slots = c_ids
        else:
            skip = int(skips[g])
            h_slots = (c_ids[:, None] * bpc + arange[None, :]).ravel()[skip : skip + n]
        g_u = g_ids.view(U64)  # validated non-negative: the bits are the same
        h_u = h_slots.view(U64) if h_slots.flags.c_contiguous else h_slots.astype(U64)
        src_slots, dst_slots = (g_u, h_u) if gpu_to_cpu else (h_u, g_u)
        _check_unique(dst_slots, gpu_to_cpu, f"group {g}")
        dst_by_group[g] = dst_slots
        for rows, nw, wi in table.partitions[g]:
            if nw > 1:
                keep = (h_u % U64(nw)) == U64(wi)
                s_, d_ = src_slots[keep], dst_slots[keep]
            else:
                s_, d_ = src_slots, dst_slots
            k = len(s_)
            if k == 0:
                continue
            segments.append(Segment(rows, s_, d_))
            nbytes += k * int(table.bytes_per_block[rows].sum())
            count += k * int(table.frag_count[rows].sum())
    for t, groups in table.shared_tensors:
        parts = [dst_by_group[g] for g in groups if g in dst_by_group]
        if len(parts) > 1:
            _check_unique(np.concatenate(parts), gpu_to_cpu, f"tensor {t}")
    return TransferPlan(table, segments, nbytes, count)


def split_plan(plan: TransferPlan, layers: Sequence[Sequence[int]]) -> list[TransferPlan]:
    """Split `plan` into one plan per layer (a layer = a set of tensor indices), in order.

    Used for layer-wise loads: each layer completes (and signals) on its own, so attention
    on layer i can start while later layers still load. Each segment's refs are sorted by
    layer once (a stable sort keeps their order within a layer), so the cost does not grow
    with layers x segments of NumPy calls (32 layers of `np.isin` took ~2 ms).
    """
    table = plan.table
    n_layers = len(layers)
    top = max((int(t) for tensors in layers for t in tensors), default=-1)
    top = max(top, int(table.tensor_idx.max()) if len(table.tensor_idx) else -1)
    layer_of = np.full(top + 1, n_layers, dtype=np.int64)  # n_layers: in no layer
    for i, tensors in enumerate(layers):
        layer_of[np.asarray(list(tensors), dtype=np.int64)] = i
    per_layer: list[list[Segment]] = [[] for _ in range(n_layers)]
    sizes = [[0, 0] for _ in range(n_layers)]  # bytes, descriptor count
    zero = np.zeros(1, dtype=np.int64)
    for seg in plan.segments:
        lay = layer_of[table.tensor_idx[seg.refs]]
        order = np.argsort(lay, kind="stable")
        rows_sorted = seg.refs[order]
        bounds = np.searchsorted(lay[order], np.arange(n_layers + 1))
        bytes_cs = np.concatenate((zero, np.cumsum(table.bytes_per_block[rows_sorted])))
        frags_cs = np.concatenate((zero, np.cumsum(table.frag_count[rows_sorted])))
        k = len(seg.src_slots)
        for i in range(n_layers):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if lo == hi:
                continue
            per_layer[i].append(Segment(rows_sorted[lo:hi], seg.src_slots, seg.dst_slots))
            sizes[i][0] += k * int(bytes_cs[hi] - bytes_cs[lo])
            sizes[i][1] += k * int(frags_cs[hi] - frags_cs[lo])
    out = [TransferPlan(table, segs, nb, cnt) for segs, (nb, cnt) in zip(per_layer, sizes)]
    assert sum(p.nbytes for p in out) == plan.nbytes
    return out
