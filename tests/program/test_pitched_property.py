"""Property tests: the pitched program (one 2-D copy per block and run of refs) against the
plain-Python oracle, byte by byte, with tensors evenly spaced or not on either side."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oracle import Side, byte_map, copies
from test_descriptors_property import BIG, oracle_refs, scenario

from kvasync import InvalidTransferError
from kvasync._layout import KVCacheLayout, KVRef, KVTensor
from kvasync._program import RefTable, SideGeometry, build_plan, build_ref_table
from kvasync._program.pitched import (
    MAX_PITCH,
    build_pitched,
    check_pitchable,
    line_runs,
    mean_height,
    pitched_lines,
)


def _draw_allocs(n_t: int, pool: bool, data: st.DataObject) -> list[int]:
    kind = "one" if pool else data.draw(st.sampled_from(["one", "unknown", "some"]))
    if kind == "one":
        return [0] * n_t
    if kind == "unknown":
        return []
    return data.draw(st.lists(st.integers(0, 2), min_size=n_t, max_size=n_t))


def _setup(s: dict, data: st.DataObject, pool: bool = False) -> tuple:  # type: ignore[type-arg]
    """`pool`: the tensors are slices of one pool (equal pages and strides, evenly spaced),
    side by side in host rows in group order: the case that makes runs of many lines."""
    n_t = len(s["pages"])
    if pool or (not s["canonical"] and data.draw(st.booleans())):
        s.update(pages=[s["pages"][0]] * n_t, canon_pages=[s["pages"][0]] * n_t,
                 row_pad=[s["row_pad"][0]] * n_t, num_blocks=[max(s["num_blocks"])] * n_t)
    if pool:
        s.update(groups=[sorted(g) for g in s["groups"]])
    tensors = [KVTensor(np.zeros((s["num_blocks"][t], s["pages"][t]), np.uint8))
               for t in range(n_t)]
    groups = [[KVRef(t, mapping=s["mappings"].get(t)) for t in g] for g in s["groups"]]
    layout = KVCacheLayout(tensors, groups)
    bpc = s["bpc"]
    sub = s["canon_pages"] if s["canonical"] else s["pages"]
    gpu_rows = [s["pages"][t] + s["row_pad"][t] for t in range(n_t)]
    # GPU: tensors one pool's slices (evenly spaced) or scattered
    even = pool or data.draw(st.booleans())
    pitch = data.draw(st.sampled_from([4096, 1 << 20] if pool
                                      else [4096, MAX_PITCH, MAX_PITCH + 1]))
    gpu_base = ([BIG + t * pitch for t in range(n_t)] if even
                else [BIG * (1 + t) + data.draw(st.integers(0, 64)) for t in range(n_t)])
    # host: one row per chunk, tensors side by side in order (or shuffled) with gaps or not
    order = list(range(n_t)) if pool or data.draw(st.booleans()) else data.draw(
        st.permutations(list(range(n_t))))
    gaps = not pool and data.draw(st.booleans())
    offsets = [0] * n_t
    pos = 0
    for t in order:
        offsets[t] = pos
        pos += sub[t] * bpc + (data.draw(st.integers(0, 2)) if gaps else 0)
    row = pos + data.draw(st.integers(0, 5))
    base = BIG * 1000 + 3
    # allocations: one in a pool; else each side's one, unknown (each tensor its own) or
    # the tensors drawn into a few
    allocs = [_draw_allocs(n_t, pool, data) for _ in range(2)]
    gpu = SideGeometry(gpu_base, gpu_rows, [0] * n_t, s["num_blocks"], 1, allocs[0])
    host = SideGeometry([base + offsets[t] for t in range(n_t)], [row] * n_t, list(sub),
                        [s["num_chunks"]] * n_t, bpc, allocs[1])
    table = build_ref_table(layout, gpu, host, s["store"], s["canonical"])
    expected = copies(oracle_refs(s), Side(gpu.base, gpu_rows, [0] * n_t),
                      Side(host.base, [row] * n_t, list(sub)), bpc, s["gpu"], s["cpu"],
                      s["gsizes"], s["bidx"], s["store"])
    return table, expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_pitched_program_matches_oracle(s: dict, data: st.DataObject) -> None:  # type: ignore[type-arg]
    _check(s, data, False)


# the `assume` keeps only non-canonical scenarios with a group of several refs: some seeds
# draw 50 rejects before 10 keepers, which the filter health check failed on (a flaky CI)
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenario(), st.data())
def test_pitched_program_of_one_pool_matches_oracle(s: dict, data: st.DataObject) -> None:  # type: ignore[type-arg]
    """Evenly spaced tensors in row order: copies of several lines, pitches on both sides."""
    assume(not s["canonical"]
           and any(len(g) > 1 and n > 0 for g, n in zip(s["groups"], s["gsizes"])))
    heights = _check(s, data, True)
    assert max(heights) > 1  # the groups' refs are in pitch order: a run of several lines


def _check(s: dict, data: st.DataObject, pool: bool) -> list[int]:  # type: ignore[type-arg]
    table, expected = _setup(s, data, pool)
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                      s["num_chunks"])
    if not all(bool(table.simple[seg.refs].all()) for seg in plan.segments
               if len(seg.src_slots)):  # a canonical ref copies parts of pages
        with pytest.raises(InvalidTransferError, match="whole pages"):
            check_pitchable(plan)
        return []
    check_pitchable(plan)
    program = build_pitched(plan)
    assert program.nbytes == plan.nbytes
    src, dst, size = pitched_lines(program)
    # exactly the oracle's bytes, each destination byte written once
    assert len(set(dst.tolist())) == len(dst)
    assert byte_map(list(zip(src.tolist(), dst.tolist(), size.tolist()))) == byte_map(expected)
    # every pitch is a valid 2-D copy's: at least the width, at most MAX_PITCH
    many = program.height > 1
    assert (program.src_pitch[many] >= program.width[many]).all()
    assert (program.dst_pitch[many] >= program.width[many]).all()
    assert (program.src_pitch <= MAX_PITCH).all() and (program.dst_pitch <= MAX_PITCH).all()
    # runs are maximal: two neighbouring runs of a ref set never continue one another;
    # a run's lines lie in one allocation on each side
    for seg in plan.segments:
        runs = line_runs(table, seg.refs)
        assert runs is not None and sum(r.height for r in runs) == len(seg.refs)
        for r in runs:
            assert len({_allocs(table, int(x)) for x in seg.refs[r.start:r.start + r.height]}) == 1
        for a, b in zip(runs, runs[1:]):
            ra, rb = int(seg.refs[a.start + a.height - 1]), int(seg.refs[b.start])
            continues = (a.width == b.width
                         and int(table.src_base[rb]) - int(table.src_base[ra]) == a.src_pitch
                         and int(table.dst_base[rb]) - int(table.dst_base[ra]) == a.dst_pitch
                         and table.src_row_stride[ra] == table.src_row_stride[rb]
                         and table.dst_row_stride[ra] == table.dst_row_stride[rb]
                         and table.src_sub_stride[ra] == table.src_sub_stride[rb]
                         and table.dst_sub_stride[ra] == table.dst_sub_stride[rb]
                         and _allocs(table, ra) == _allocs(table, rb))
            assert not (continues and a.height > 1), (a, b)
    return [int(h) for h in program.height.tolist()]


def _allocs(table: RefTable, ref: int) -> tuple[int, int]:
    t = int(table.tensor_idx[ref])
    return (table.src.alloc[t] if table.src.alloc else -1 - t,
            table.dst.alloc[t] if table.dst.alloc else -1 - t)


def test_a_run_stops_where_an_allocation_ends() -> None:
    """Evenly spaced tensors of two GPU allocations (a caching allocator's neighbouring
    segments) are two runs: a 2-D copy across them is refused by the driver."""
    n_t, page, blocks, chunks = 8, 64, 16, 4
    layout = KVCacheLayout([KVTensor(np.zeros((blocks, page), np.uint8)) for _ in range(n_t)])
    gpu_alloc = [BIG if t < 5 else BIG + 5 * blocks * page for t in range(n_t)]
    gpu = SideGeometry([BIG + t * blocks * page for t in range(n_t)], [page] * n_t,
                       [0] * n_t, [blocks] * n_t, 1, gpu_alloc)
    host = SideGeometry([BIG * 10 + t * page for t in range(n_t)], [n_t * page] * n_t,
                        [page] * n_t, [chunks] * n_t, 1, [7] * n_t)
    for store in (True, False):
        table = build_ref_table(layout, gpu, host, store, False)
        plan = build_plan(table, [5, 3], [1, 2], None, [1], store, chunks)
        assert build_pitched(plan).height.tolist() == [5, 5, 3, 3]
        assert mean_height(plan) == 4


def test_one_pool_in_row_order_is_one_copy_per_block() -> None:
    """Tensors sliced from one pool and laid side by side in the host row: every block of a
    request is one 2-D copy of all the tensors' pages."""
    n_t, page, blocks, chunks, bpc = 8, 64, 16, 12, 2
    tensors = [KVTensor(np.zeros((blocks, page), np.uint8)) for _ in range(n_t)]
    layout = KVCacheLayout(tensors)
    row = n_t * page * bpc
    gpu = SideGeometry([BIG + t * blocks * page for t in range(n_t)], [page] * n_t,
                       [0] * n_t, [blocks] * n_t, 1, [1] * n_t)
    host = SideGeometry([BIG * 10 + t * page * bpc for t in range(n_t)], [row] * n_t,
                        [page] * n_t, [chunks] * n_t, bpc, [2] * n_t)
    for store in (True, False):
        table = build_ref_table(layout, gpu, host, store, False)
        plan = build_plan(table, [5, 3, 9], [4, 7], None, [1], store, chunks)
        program = build_pitched(plan)
        assert len(program) == 3 and program.height.tolist() == [n_t] * 3
        assert mean_height(plan) == n_t
        gpu_pitch, host_pitch = blocks * page, page * bpc
        assert program.src_pitch.tolist() == [gpu_pitch if store else host_pitch] * 3
        assert program.dst_pitch.tolist() == [host_pitch if store else gpu_pitch] * 3
        # block 5 -> sub-block 1 of chunk 4, block 3 -> sub-block 0 of chunk 7 ...
        host_ptrs = program.dst if store else program.src
        assert host_ptrs.tolist()[:2] == [BIG * 10 + 4 * row + page, BIG * 10 + 7 * row]
