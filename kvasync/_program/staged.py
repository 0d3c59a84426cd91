"""The staged copy program: whole host rows through a bounded staging buffer.

Why: a CPU chunk's host row holds every KV tensor's sub-blocks side by side, so a transfer
of scattered GPU pages is, on the host side, a few long runs (a whole row per fully covered
chunk, several rows per run of consecutive chunk ids). The copy engines move long runs at
the link's ceiling with one descriptor each and leave the SMs to the model; only the GPU
side is scattered, and a kernel gathers (stores) or scatters (loads) it through a staging
buffer in device memory at HBM speed, far above the link.

A `StagedProgram` is computed once per plan, when the plan is enqueued, and consumed by a
backend without calling back (a big transfer is enqueued in pieces, each with its own
program, so its first slab starts after a small piece's host work; `staged_rows` answers
whether a plan can be staged without building anything):

- the distinct chunks the plan touches are ranked by id; rank r lives in staging row
  ``r % rows_per_slab`` of slab ``r // rows_per_slab`` (a slab is one staging buffer); a
  staging row holds only the part of a host row the plan's ref sets can cover (one layer's
  tensors, one group's: `row_window`), so a layer of a layer-wise load fills a buffer;
- each slab's `segments` are the plan's segments restricted to its chunks, with the host
  slot rewritten to the staging slot ``row * blocks_per_chunk + sub_block``: the pack or
  unpack kernel copies them with a staging `RefTable` (`staging_table`);
- each slab's runs (staging offset, host address, bytes) cover exactly the bytes its
  segments copy, merged where contiguous on both sides: a partial chunk (a group's skipped
  first sub-blocks, its short last chunk, a writer rotation's filter, a group that owns
  only part of a row) writes nothing outside its covered sub-ranges.

Host work is O(blocks + runs), not O(blocks x tensors): the per-chunk coverage pattern of
each ref set is computed once per (refs, covered sub-blocks) and cached on the table
(`rows.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._errors import InvalidTransferError
from .plan import Segment, TransferPlan
from .rows import (
    MAX_FACTOR,
    RowSide,
    coalesce_runs,
    coverage_pattern,
    row_side,
    row_window,
    staging_table,
)
from .table import U64, RefTable

__all__ = ["Slab", "StagedProgram", "build_staged", "check_stageable", "kernel_plan",
           "prepare_staged", "slab_descriptors", "stageable", "staged_rows"]


@dataclass(frozen=True)
class Slab:
    """What one staging buffer carries: kernel segments and host runs."""

    segments: tuple[Segment, ...]
    stage_off: np.ndarray  # uint64 run offsets in the staging buffer
    host_ptr: np.ndarray  # uint64 run addresses in host memory
    sizes: np.ndarray  # uint64 run bytes
    nbytes: int  # bytes the kernel copies
    num_descriptors: int  # (slot, fragment) copies of the kernel


@dataclass(frozen=True)
class StagedProgram:
    """A staged transfer: slabs in order, each fitting one staging buffer."""

    slabs: tuple[Slab, ...]
    rows: RowSide
    rows_per_slab: int
    gpu_to_cpu: bool

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slabs)


#: requests of at most this many slots are staged in plain Python: NumPy's per-call
#: overhead was most of a small store()'s host cost (a 10-block, two-group request took
#: ~0.5 ms through the NumPy path)
_SMALL = 64
#: ...except one segment (one group) of one block per chunk, which NumPy builds in ~40-50 us
#: at any size up to 64 slots, where Python costs ~1.5-2.5 us a slot (64 x 64 tensors:
#: 110-160 us); several segments or sub-blocks take NumPy's slower mask path (106-134 us)
_SMALL_FLAT = 16


def _build_consecutive(plan: TransferPlan, seg: Segment, rows: RowSide, rps: int,
                       gpu_to_cpu: bool) -> StagedProgram | None:
    """One segment of one-block chunks with consecutive ids covering whole rows: one run,
    staging row = chunk - first chunk. None for anything else."""
    table = plan.table
    slots = seg.dst_slots if gpu_to_cpu else seg.src_slots
    n = len(slots)
    lo, hi = int(slots.min()), int(slots.max())
    if hi - lo != n - 1 or rows.span != rows.row_stride:
        return None
    pst, psz = coverage_pattern(table, rows, seg.refs, 1, gpu_to_cpu)
    if len(pst) != 1 or int(psz[0]) != rows.span or (n > 1 and len(np.unique(slots)) != n):
        return None
    staged = (slots - U64(lo)).astype(U64)
    kseg = (Segment(seg.refs, seg.src_slots, staged) if gpu_to_cpu
            else Segment(seg.refs, staged, seg.dst_slots))
    one = Slab((kseg,), np.zeros(1, dtype=U64),
               np.array([rows.base + lo * rows.row_stride], dtype=U64),
               np.array([n * rows.span], dtype=U64),
               n * int(table.bytes_per_block[seg.refs].sum()),
               n * int(table.frag_count[seg.refs].sum()))
    return StagedProgram((one,), rows, rps, gpu_to_cpu)


def _build_python(plan: TransferPlan, segs: list[Segment], rows: RowSide, rps: int,
                  gpu_to_cpu: bool) -> StagedProgram:
    """`build_staged` in Python ints for a few slots (same program as the NumPy path)."""
    table = plan.table
    bpc = rows.factor
    hosts = [(s.dst_slots if gpu_to_cpu else s.src_slots).tolist() for s in segs]
    uniq = sorted({h // bpc for hs in hosts for h in hs})
    rank = {c: r for r, c in enumerate(uniq)}
    nslabs = -(-len(uniq) // rps)
    per_slab: list[list[Segment]] = [[] for _ in range(nslabs)]
    kbytes = [0] * nslabs
    kcount = [0] * nslabs
    masks: dict[tuple[int, bytes], int] = {}
    refs_of: dict[bytes, np.ndarray] = {}
    for seg, hs in zip(segs, hosts):
        key = seg.refs.tobytes()
        refs_of[key] = seg.refs
        per_block = int(table.bytes_per_block[seg.refs].sum())
        per_frags = int(table.frag_count[seg.refs].sum())
        gpu = (seg.src_slots if gpu_to_cpu else seg.dst_slots).tolist()
        by_slab: dict[int, tuple[list[int], list[int]]] = {}
        for g, h in zip(gpu, hs):
            c, j = divmod(h, bpc)
            r = rank[c]
            lists = by_slab.setdefault(r // rps, ([], []))
            lists[0].append(g)
            lists[1].append((r % rps) * bpc + j)
            masks[(r, key)] = masks.get((r, key), 0) | (1 << j)
        for k in sorted(by_slab):
            ga = np.array(by_slab[k][0], dtype=U64)
            sa = np.array(by_slab[k][1], dtype=U64)
            per_slab[k].append(Segment(seg.refs, ga, sa) if gpu_to_cpu
                               else Segment(seg.refs, sa, ga))
            kbytes[k] += len(ga) * per_block
            kcount[k] += len(ga) * per_frags
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(nslabs)]
    # one pattern per (ref set, mask), not per chunk: the table's cache keys on the refs'
    # bytes (~1 us a lookup at 128 tensors), most of this builder's cost per chunk
    pats: dict[tuple[bytes, int], list[tuple[int, int]]] = {}
    for (r, key), mask in masks.items():
        pat = pats.get((key, mask))
        if pat is None:
            pst, psz = coverage_pattern(table, rows, refs_of[key], mask, gpu_to_cpu)
            pat = pats[(key, mask)] = list(zip(pst.tolist(), psz.tolist()))
        srow = (r % rps) * rows.span
        hrow = rows.base + uniq[r] * rows.row_stride
        runs[r // rps].extend((hrow + a, srow + a, z) for a, z in pat)
    slabs: list[Slab] = []
    for k in range(nslabs):
        merged: list[list[int]] = []
        for h, st, z in sorted(runs[k]):
            last = merged[-1] if merged else None
            if last is not None and last[0] + last[2] == h and last[1] + last[2] == st:
                last[2] += z
            else:
                merged.append([h, st, z])
        slabs.append(Slab(tuple(per_slab[k]), np.array([m[1] for m in merged], dtype=U64),
                          np.array([m[0] for m in merged], dtype=U64),
                          np.array([m[2] for m in merged], dtype=U64), kbytes[k], kcount[k]))
    return StagedProgram(tuple(slabs), rows, rps, gpu_to_cpu)


def staged_rows(plan: TransferPlan, gpu_to_cpu: bool, slab_bytes: int) -> RowSide | None:
    """The host rows `plan` would be staged through (narrowed to the part its refs can
    cover), or None where it cannot be staged (host memory not in rows, that part of a row
    larger than a buffer of `slab_bytes`, more than
    `MAX_FACTOR` blocks per chunk, or a raw descriptor plan). Cheap: a path choice asks it
    before the program is built, which for a big transfer happens piece by piece."""
    table = plan.table
    if table is None or (not plan.segments and plan.num_descriptors):
        return None
    rows = row_side(table, gpu_to_cpu)
    if rows is None or rows.factor > MAX_FACTOR:
        return None
    segs = [s for s in plan.segments if len(s.src_slots)]
    if segs:  # the part of the rows the plan's refs can cover (`row_window`)
        refs = (segs[0].refs if len(segs) == 1
                else np.unique(np.concatenate([s.refs for s in segs])))
        rows = row_window(table, rows, refs, gpu_to_cpu)
    if segs and int(slab_bytes) // rows.span < 1:  # a plan moving nothing needs no buffer
        return None
    return rows


def stageable(slab_bytes: Callable[[], int], plan: TransferPlan, gpu_to_cpu: bool) -> bool:
    """Whether "auto" may stage `plan`: a backend's check, with `slab_bytes()` its staging
    buffer (allocated at first use: InvalidTransferError where it cannot be, and then the
    answer is no)."""
    try:
        slab = slab_bytes()
    except InvalidTransferError:
        return False
    return staged_rows(plan, gpu_to_cpu, slab) is not None


def build_staged(plan: TransferPlan, gpu_to_cpu: bool, slab_bytes: int) -> StagedProgram | None:
    """The staged program of `plan` with staging buffers of `slab_bytes`, or None where the
    plan cannot be staged (`staged_rows`)."""
    rows = staged_rows(plan, gpu_to_cpu, slab_bytes)
    if rows is None:
        return None
    table = plan.table
    assert table is not None
    rps = int(slab_bytes) // rows.span
    segs = [s for s in plan.segments if len(s.src_slots)]
    if not segs:
        return StagedProgram((), rows, rps, gpu_to_cpu)
    slots = sum(len(s.src_slots) for s in segs)
    if slots <= _SMALL:
        flat = len(segs) == 1 and rows.factor == 1
        if flat and len(segs[0].src_slots) <= rps:
            whole = _build_consecutive(plan, segs[0], rows, rps, gpu_to_cpu)
            if whole is not None:
                return whole
        if not flat or slots <= _SMALL_FLAT:
            return _build_python(plan, segs, rows, rps, gpu_to_cpu)
    bpc = rows.factor
    host = [s.dst_slots if gpu_to_cpu else s.src_slots for s in segs]
    allh = np.concatenate(host) if len(host) > 1 else host[0]
    f = U64(bpc)
    chunk = allh // f if bpc > 1 else allh
    sub = (allh % f).astype(np.int64) if bpc > 1 else None
    uniq, rank = np.unique(chunk, return_inverse=True)
    rank = rank.reshape(-1).astype(np.int64)
    nslabs = -(-len(uniq) // rps)
    slab_of = rank // rps
    row_in = rank % rps
    staged = (row_in * bpc + sub).astype(U64) if sub is not None else row_in.astype(U64)

    # kernel segments per slab
    per_slab: list[list[Segment]] = [[] for _ in range(nslabs)]
    kbytes = [0] * nslabs
    kcount = [0] * nslabs
    parts: dict[bytes, int] = {}
    part_refs: list[np.ndarray] = []
    seg_part = []
    pos = 0
    for seg, h in zip(segs, host):
        n = len(h)
        key = seg.refs.tobytes()
        if key not in parts:
            parts[key] = len(part_refs)
            part_refs.append(seg.refs)
        seg_part.append(parts[key])
        per_block = int(table.bytes_per_block[seg.refs].sum())
        per_frags = int(table.frag_count[seg.refs].sum())
        sl = slab_of[pos : pos + n]
        st = staged[pos : pos + n]
        first, last = int(sl[0]), int(sl[-1])
        groups: list[tuple[int, np.ndarray | None]]
        if first == last and (n < 3 or bool((sl == first).all())):
            groups = [(first, None)]
        else:
            order = np.argsort(sl, kind="stable")
            bounds = np.searchsorted(sl[order], np.arange(nslabs + 1))
            groups = [(k, order[int(bounds[k]) : int(bounds[k + 1])]) for k in range(nslabs)
                      if bounds[k + 1] > bounds[k]]
        for k, idx in groups:
            gpu = seg.src_slots if gpu_to_cpu else seg.dst_slots
            g = gpu if idx is None else gpu[idx]
            s = st if idx is None else st[idx]
            per_slab[k].append(Segment(seg.refs, g, s) if gpu_to_cpu else Segment(seg.refs, s, g))
            kbytes[k] += len(g) * per_block
            kcount[k] += len(g) * per_frags
        pos += n

    # host runs: one coverage mask per (chunk rank, ref set)
    nparts = len(part_refs)
    so_l: list[np.ndarray] = []
    hp_l: list[np.ndarray] = []
    sz_l: list[np.ndarray] = []
    sl_l: list[np.ndarray] = []
    if nparts == 1 and sub is None:
        # the common request (one ref set, one block per chunk): every touched chunk is
        # covered by the same pattern, no masks to reduce
        urank = np.arange(len(uniq), dtype=np.int64)
        row_base = uniq.astype(U64) * U64(rows.row_stride) + U64(rows.base)
        stage_row = ((urank % rps) * rows.span).astype(U64)
        pst, psz = coverage_pattern(table, rows, part_refs[0], 1, gpu_to_cpu)
        if len(pst) == 1:
            so_l.append(stage_row + pst[0])
            hp_l.append(row_base + pst[0])
            sz_l.append(np.full(len(uniq), psz[0], dtype=U64))
            sl_l.append(urank // rps)
        else:
            so_l.append((stage_row[:, None] + pst[None, :]).ravel())
            hp_l.append((row_base[:, None] + pst[None, :]).ravel())
            sz_l.append(np.tile(psz, len(uniq)))
            sl_l.append(np.repeat(urank // rps, len(psz)))
    else:
        offs = np.cumsum([0] + [len(h) for h in host[:-1]]).tolist()
        keys = (np.concatenate([rank[a : a + len(h)] * nparts + p
                                for a, h, p in zip(offs, host, seg_part)])
                if nparts > 1 else rank)
        bits = (np.left_shift(U64(1), sub.astype(U64)) if sub is not None
                else np.ones(len(rank), dtype=U64))
        order = np.argsort(keys, kind="stable")
        ks = keys[order]
        starts = np.flatnonzero(np.concatenate(([True], ks[1:] != ks[:-1])))
        masks = np.bitwise_or.reduceat(bits[order], starts)
        ukeys = ks[starts]
        urank = ukeys // nparts
        upart = ukeys % nparts
        row_base = uniq[urank].astype(U64) * U64(rows.row_stride) + U64(rows.base)
        stage_row = ((urank % rps) * rows.span).astype(U64)
        combos = np.stack([upart.astype(U64), masks])
        uc, cinv = np.unique(combos, axis=1, return_inverse=True)
        cinv = cinv.reshape(-1)
        for c in range(uc.shape[1]):
            sel = np.flatnonzero(cinv == c) if uc.shape[1] > 1 else np.arange(len(ukeys))
            pst, psz = coverage_pattern(table, rows, part_refs[int(uc[0, c])], int(uc[1, c]),
                                gpu_to_cpu)
            so_l.append((stage_row[sel][:, None] + pst[None, :]).ravel())
            hp_l.append((row_base[sel][:, None] + pst[None, :]).ravel())
            sz_l.append(np.tile(psz, len(sel)))
            sl_l.append(np.repeat(urank[sel] // rps, len(psz)))
    if len(so_l) == 1:
        so, hp, sz, slab_ix = so_l[0], hp_l[0], sz_l[0].astype(U64, copy=False), sl_l[0]
    else:
        so, hp = np.concatenate(so_l), np.concatenate(hp_l)
        sz, slab_ix = np.concatenate(sz_l).astype(U64), np.concatenate(sl_l)
    slabs: list[Slab] = []
    # every slab's runs coalesced in one sort (by slab, then host address; a run never
    # joins another slab's): one sort per slab cost ~15 us each, most of a 256-block
    # program at 16 KiB pages
    group = np.asarray(slab_ix, dtype=np.int64) if nslabs > 1 else None
    so, hp, sz, group = coalesce_runs(so, hp, sz, group)
    cuts: list[int] = ([0, len(sz)] if group is None
                       else np.searchsorted(group, np.arange(nslabs + 1)).tolist())
    for k in range(nslabs):
        lo, hi = cuts[k], cuts[k + 1]
        r_so, r_hp, r_sz = so[lo:hi], hp[lo:hi], sz[lo:hi]
        # stores write each host byte once; a load may read one chunk into several blocks
        moved = int(r_sz.sum())
        assert moved == kbytes[k] if gpu_to_cpu else moved <= kbytes[k]
        slabs.append(Slab(tuple(per_slab[k]), r_so, r_hp, r_sz, kbytes[k], kcount[k]))
    return StagedProgram(tuple(slabs), rows, rps, gpu_to_cpu)


def check_stageable(plan: TransferPlan, direction: str, slab_bytes: int) -> None:
    """InvalidTransferError (before anything is enqueued) where `plan` cannot be staged."""
    if staged_rows(plan, direction == "d2h", slab_bytes) is None:
        raise InvalidTransferError(
            "copy path 'staged' needs host memory in chunk rows (the offloader's own or a "
            f"shared region's), at most {MAX_FACTOR} blocks per chunk and at most "
            f"{slab_bytes} B (one staging buffer) of a row covered by the request's tensors"
        )


def prepare_staged(plan: TransferPlan, direction: str, slab_bytes: int) -> StagedProgram:
    """Build `plan`'s staged program onto `plan.staged`; InvalidTransferError where the
    plan cannot be staged (`check_stageable`)."""
    check_stageable(plan, direction, slab_bytes)
    program = build_staged(plan, direction == "d2h", slab_bytes)
    assert program is not None
    plan.staged = program
    return program


def kernel_plan(program: StagedProgram, slab: Slab, table: RefTable, stage_ptr: int
                ) -> TransferPlan:
    """The pack (stores) or unpack (loads) copies of `slab` as a plan over the staging table
    of the buffer at `stage_ptr`."""
    stable = staging_table(table, program.rows, program.gpu_to_cpu, stage_ptr,
                           program.rows_per_slab)
    return TransferPlan(stable, list(slab.segments), slab.nbytes, slab.num_descriptors)


def slab_descriptors(program: StagedProgram, slab: Slab, stage_ptr: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, sizes) of a slab's copy-engine runs with the staging buffer at
    `stage_ptr` (stores: staging -> host; loads: host -> staging)."""
    stage = (slab.stage_off + U64(stage_ptr)).astype(U64)
    if program.gpu_to_cpu:
        return stage, slab.host_ptr, slab.sizes
    return slab.host_ptr, stage, slab.sizes
