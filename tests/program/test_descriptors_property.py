"""Property tests: the vectorised descriptor builder against the plain-Python oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import Ref, Side, byte_map, copies

import kvasync as kv
from kvasync._layout import CopyRun, KVCacheLayout, KVRef, KVTensor, PageMapping
from kvasync._program import (
    SideGeometry,
    build_plan,
    build_ref_table,
    coalesce,
    split_plan,
)

BIG = 1 << 40  # fake, widely spaced base addresses: the math must be 64-bit


@st.composite
def scenario(draw: st.DrawFn) -> dict:  # type: ignore[type-arg]
    bpc = draw(st.integers(1, 4))
    num_tensors = draw(st.integers(1, 4))
    canonical = draw(st.booleans())
    store = draw(st.booleans())
    pages = [draw(st.integers(1, 24)) for _ in range(num_tensors)]
    num_blocks = [draw(st.integers(4, 12)) for _ in range(num_tensors)]
    num_chunks = draw(st.integers(4, 12))
    # groups partition (a subset of) the tensors
    order = draw(st.permutations(list(range(num_tensors))))
    cuts = sorted(draw(st.lists(st.integers(0, num_tensors), min_size=0, max_size=2)))
    groups_t = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, num_tensors])]
    groups_t = [g for g in groups_t if g] or [list(order)]
    mappings: dict[int, PageMapping] = {}
    canon_pages = list(pages)
    if canonical:
        for t in range(num_tensors):
            # split the local page into 1..3 fragments placed in a bigger canonical page
            k = draw(st.integers(1, min(3, pages[t])))
            bounds = sorted(draw(st.lists(st.integers(1, pages[t] - 1), min_size=k - 1,
                                          max_size=k - 1, unique=True))) if pages[t] > 1 else []
            edges = [0, *bounds, pages[t]]
            frags = [(edges[i], edges[i + 1] - edges[i]) for i in range(len(edges) - 1)]
            gap = draw(st.integers(0, 5))
            runs, pos = [], gap
            for lo, size in draw(st.permutations(frags)):
                runs.append(CopyRun(lo, pos, size))
                pos += size + draw(st.integers(0, 3))
            nw = draw(st.integers(1, 3))
            mappings[t] = PageMapping(pos, pages[t], tuple(runs), nw, draw(st.integers(0, nw - 1)))
            canon_pages[t] = pos
    # request
    gsizes, bidx, gpu_ids, cpu_ids = [], [], [], []
    free_chunks = list(range(num_chunks))
    used_chunks = draw(st.permutations(free_chunks))
    cpos = 0
    for g in groups_t:
        limit = min(num_blocks[t] for t in g)
        start = draw(st.integers(0, 7))
        skip = start % bpc
        max_n = min(limit, (len(used_chunks) - cpos) * bpc - skip)
        n = draw(st.integers(0, max(0, max_n)))
        ids = draw(st.lists(st.integers(0, limit - 1), min_size=n, max_size=n, unique=not store))
        nchunks = -(-(n + skip) // bpc) if n else 0
        gsizes.append(n)
        bidx.append(start)
        gpu_ids += ids
        cpu_ids += list(used_chunks[cpos : cpos + nchunks])
        cpos += nchunks
    row_pad = [draw(st.integers(0, 3)) for _ in range(num_tensors)]
    # layers for a layer-wise split: a partition of the tensors into non-empty sets
    lorder = draw(st.permutations(list(range(num_tensors))))
    lcuts = sorted(set(draw(st.lists(st.integers(1, max(1, num_tensors - 1)), max_size=3))))
    lcuts = [c for c in lcuts if 0 < c < num_tensors]
    layers = [sorted(lorder[a:b]) for a, b in zip([0, *lcuts], [*lcuts, num_tensors])]
    return dict(layers=layers, bpc=bpc, pages=pages, num_blocks=num_blocks, num_chunks=num_chunks,
                groups=groups_t, canonical=canonical, mappings=mappings, canon_pages=canon_pages,
                store=store, gsizes=gsizes, bidx=bidx, gpu=gpu_ids, cpu=cpu_ids, row_pad=row_pad)


def oracle_refs(s: dict) -> list[list[Ref]]:  # type: ignore[type-arg]
    """The scenario's groups as the oracle's refs (fragments and writer rotation if
    canonical)."""
    return [
        [Ref(t, s["pages"][t],
             None if not s["canonical"] else
             [f for r in s["mappings"][t].runs for f in r.fragments()],
             s["mappings"][t].num_writers if s["canonical"] else 1,
             s["mappings"][t].writer_index if s["canonical"] else 0)
         for t in g]
        for g in s["groups"]
    ]


def _piece_oracle(total: int, most: int, first: int | None, growth: int) -> list[int]:
    """Slots per piece: `first` (default `most`), then `growth` times the last, at most
    `most`, the rest last; a plan no bigger than its first piece stays whole."""
    size = min(first, most) if first else most
    if total <= size:
        return [total]
    out: list[int] = []
    while total > 0:
        out.append(min(size, total))
        total -= out[-1]
        size = min(growth * size, most)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_plan_matches_oracle(s: dict) -> None:  # type: ignore[type-arg]
    n_t = len(s["pages"])
    tensors = [KVTensor(np.zeros((s["num_blocks"][t], s["pages"][t]), np.uint8)) for t in range(n_t)]
    groups = [[KVRef(t, mapping=s["mappings"].get(t)) for t in g] for g in s["groups"]]
    layout = KVCacheLayout(tensors, groups)
    bpc = s["bpc"]
    sub = s["canon_pages"] if s["canonical"] else s["pages"]
    gpu_rows = [s["pages"][t] + s["row_pad"][t] for t in range(n_t)]
    host_rows = [sub[t] * bpc + s["row_pad"][t] * 7 for t in range(n_t)]
    gpu = SideGeometry([BIG * (t + 1) for t in range(n_t)], gpu_rows, [0] * n_t,
                       s["num_blocks"], 1)
    host = SideGeometry([BIG * (t + 10) + 3 for t in range(n_t)], host_rows, list(sub),
                        [s["num_chunks"]] * n_t, bpc)
    table = build_ref_table(layout, gpu, host, s["store"], s["canonical"])
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                      s["num_chunks"])
    src, dst, sizes = plan.flat()
    got = list(zip(src.tolist(), dst.tolist(), sizes.tolist()))

    o_refs = oracle_refs(s)
    expected = copies(o_refs, Side(gpu.base, gpu_rows, [0] * n_t),
                      Side(host.base, host_rows, list(sub)), bpc, s["gpu"], s["cpu"],
                      s["gsizes"], s["bidx"], s["store"])
    assert got == expected
    assert plan.nbytes == sum(z for _, _, z in expected)
    assert plan.num_descriptors == len(expected)
    def tensor_at(geo: SideGeometry, addr: int) -> int:
        return next(i for i in range(n_t) if geo.base[i] <= addr < geo.base[i] + BIG // 2)

    # every descriptor lies inside its tensors (GPU block row / host chunk row)
    for a, b, z in got:
        for addr, geo, rows in ((a, gpu if s["store"] else host, None),
                                (b, host if s["store"] else gpu, None)):
            t = tensor_at(geo, addr)
            row = (addr - geo.base[t]) // geo.row_stride[t]
            assert row < geo.num_rows[t]
            off_in_row = addr - geo.base[t] - row * geo.row_stride[t]
            assert off_in_row + z <= (sub[t] * bpc if geo is host else s["pages"][t])
    # pieces of any size cover exactly the plan's descriptors (block-major across pieces)
    k = max(1, len(s["gpu"]) // 3)
    parts = plan.pieces(k)
    assert sum(p.nbytes for p in parts) == plan.nbytes
    assert [p.nbytes for p in parts] == [int(p.flat()[2].sum()) for p in parts]
    assert [p.num_descriptors for p in parts] == [len(p.flat()[2]) for p in parts]
    assert sorted(d for p in parts for d in zip(*(a.tolist() for a in p.flat()))) == sorted(got)
    assert all(p.keepalive is plan.keepalive for p in parts)
    # a ramp (small first piece, 4x growth) covers the same descriptors, slots in order
    ramp = plan.pieces(k, first=1)
    assert sorted(d for p in ramp for d in zip(*(a.tolist() for a in p.flat()))) == sorted(got)
    assert [x for p in ramp for sg in p.segments for x in sg.dst_slots.tolist()] == [
        x for sg in plan.segments for x in sg.dst_slots.tolist()]
    slots = [sum(len(sg.src_slots) for sg in p.segments) for p in ramp]
    if len(ramp) > 1:
        assert slots[0] == 1 and all(n <= k for n in slots)
        assert all(b <= 4 * a for a, b in zip(slots, slots[1:]))
    # every schedule (first piece, growth) cuts exactly the oracle's slot counts
    total = sum(len(sg.src_slots) for sg in plan.segments)
    for growth in (1, 2, 3, 4):
        for first in (None, 1, 2):
            cut = plan.pieces(k, first, growth)
            assert [sum(len(sg.src_slots) for sg in p.segments) for p in cut] == (
                _piece_oracle(total, k, first, growth))
            assert sum(p.nbytes for p in cut) == plan.nbytes
    # a layer-wise split: each layer copies exactly the descriptors of its tensors
    split = split_plan(plan, s["layers"])
    assert len(split) == len(s["layers"])
    for layer, part in zip(s["layers"], split):
        want = sorted(d for d in got if tensor_at(gpu, d[0] if s["store"] else d[1]) in layer)
        assert sorted(zip(*(a.tolist() for a in part.flat()))) == want
        assert part.nbytes == sum(z for _, _, z in want)
        assert part.num_descriptors == len(want)
    # coalescing copies exactly the same bytes
    cs, cd, cz = coalesce(src, dst, sizes)
    assert byte_map(list(zip(cs.tolist(), cd.tolist(), cz.tolist()))) == byte_map(expected)
    # the Python-int runs of small whole-page plans are exactly the coalesced descriptors
    fresh = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                       s["num_chunks"])
    runs = fresh.runs()
    small = bool(plan.segments) and plan.num_descriptors <= 32 and all(
        bool(table.simple[r]) for seg in plan.segments for r in seg.refs.tolist())
    assert (runs is not None) == small
    if runs is not None:
        assert runs == list(zip(cs.tolist(), cd.tolist(), cz.tolist()))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 6)), min_size=0, max_size=30))
def test_coalesce_merges_only_runs_contiguous_on_both_sides(spec: list[tuple[int, int]]) -> None:
    src, dst, pos_s, pos_d = [], [], 1000, 5000
    sizes = []
    for gap, size in spec:
        pos_s += (gap % 3 == 0 and 0) or gap
        pos_d += (gap % 2 == 0 and 0) or gap
        src.append(pos_s)
        dst.append(pos_d)
        sizes.append(size)
        pos_s += size
        pos_d += size
    s, d, z = (np.asarray(x, dtype=np.uint64) for x in (src, dst, sizes))
    cs, cd, cz = coalesce(s, d, z)
    assert int(cz.sum()) == sum(sizes)
    assert byte_map(list(zip(cs.tolist(), cd.tolist(), cz.tolist()))) == byte_map(
        list(zip(src, dst, sizes)))
    for i in range(len(cz) - 1):  # no two outputs could still be merged
        assert not (cs[i] + cz[i] == cs[i + 1] and cd[i] + cz[i] == cd[i + 1])


def test_64_bit_pointer_math_with_int32_ids_and_large_strides() -> None:
    """int32 ids times multi-GiB strides overflow in 32-bit; ours must not."""
    t = KVTensor(np.zeros((2, 8), np.uint8))
    layout = KVCacheLayout([t])
    stride = 3 * (1 << 32)
    gpu = SideGeometry([1 << 44], [stride], [0], [1 << 20], 1)
    host = SideGeometry([1 << 45], [stride], [8], [1 << 20], 1)
    table = build_ref_table(layout, gpu, host, True, False)
    table.max_gpu_block = [1 << 20]
    ids = np.array([70000], dtype=np.int32)
    plan = build_plan(table, ids, ids, None, None, True, 1 << 20)
    src, dst, _ = plan.flat()
    assert int(src[0]) == (1 << 44) + 70000 * stride
    assert int(dst[0]) == (1 << 45) + 70000 * stride


@given(
    st.integers(1, 3),
    st.lists(st.integers(-2, 40), min_size=0, max_size=40),
    st.lists(st.integers(-2, 40), min_size=0, max_size=40),
    st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_small_fast_path_equals_general_path(
    n_t: int, gpu_ids: list[int], cpu_ids: list[int], store: bool
) -> None:
    """Short Python lists take a plain-Python path; it must agree with the numpy one,
    including which requests are refused."""
    from kvasync._errors import InvalidTransferError

    tensors = [KVTensor(np.zeros((32, 8 + t), np.uint8)) for t in range(n_t)]
    layout = KVCacheLayout(tensors)
    gpu = SideGeometry([BIG * (t + 1) for t in range(n_t)], [8 + t + 4 for t in range(n_t)],
                       [0] * n_t, [32] * n_t, 1)
    host = SideGeometry([BIG * (t + 9) for t in range(n_t)], [8 + t for t in range(n_t)],
                        [8 + t for t in range(n_t)], [36] * n_t, 1)
    table = build_ref_table(layout, gpu, host, store, False)

    def run(a: object, b: object) -> object:
        try:
            p = build_plan(table, a, b, None, None, store, 36)
        except InvalidTransferError as exc:
            return type(exc)
        return [x.tolist() for x in p.flat()], p.nbytes, p.num_descriptors

    fast = run(list(gpu_ids), list(cpu_ids))
    fast_arrays = run(np.asarray(gpu_ids, dtype=np.int64), np.asarray(cpu_ids, dtype=np.int64))
    general = run(tuple(gpu_ids), tuple(cpu_ids))  # tuples always take the numpy path
    assert fast == general
    assert fast_arrays == general


@given(st.lists(st.integers(0, 5000), min_size=257, max_size=700), st.booleans(),
       st.booleans())
def test_duplicate_check_agrees_with_a_set(ids: list[int], ordered: bool, dup: bool) -> None:
    """The large-request duplicate check (sorted shortcut, bitmap, sort) against a set."""
    from kvasync._program.build import _check_unique

    if ordered:
        ids = sorted(set(ids))
        if dup and len(ids) > 1:
            ids.insert(len(ids) // 2, ids[len(ids) // 2])  # sorted, not strictly increasing
    arr = np.asarray(ids, dtype=np.uint64)
    unique = len(set(ids)) == len(ids)
    if unique:
        _check_unique(arr, True, "t")
    else:
        with pytest.raises(kv.InvalidTransferError, match="duplicate destination"):
            _check_unique(arr, True, "t")
