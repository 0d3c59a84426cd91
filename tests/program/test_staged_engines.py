"""A staged slab's pack/unpack as 2-D copies (`pitched_pack`, the copy-engine form the CUDA
backend runs instead of the kernel): byte for byte the kernel's copies."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from oracle import byte_map
from test_descriptors_property import BIG, scenario
from test_pitched_property import _setup
from test_staged_property import STAGE

from kvasync._layout import KVCacheLayout, KVTensor
from kvasync._program import (
    SideGeometry,
    build_plan,
    build_ref_table,
    build_staged,
    kernel_plan,
    pitched_lines,
    pitched_pack,
)


def _flat(plan: object) -> dict[int, int]:
    s, d, z = plan.flat()  # type: ignore[attr-defined]
    return byte_map(list(zip(s.tolist(), d.tolist(), z.tolist())))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.booleans(), st.data())
def test_pitched_pack_moves_the_kernels_bytes(s: dict, pool: bool, data: st.DataObject) -> None:  # type: ignore[type-arg]
    """Every slab: the 2-D copies write exactly the bytes the kernel writes, from the same
    sources; only pages cut in parts (canonical layouts) have no such form."""
    assume(not (pool and s["canonical"]))  # a pool's slices are whole pages
    table, _ = _setup(s, data, pool)  # pool: tensors evenly spaced in one allocation
    row = (table.dst if s["store"] else table.src).row_stride[0]
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                      s["num_chunks"])
    program = build_staged(plan, s["store"], data.draw(st.integers(1, 4)) * max(row, 1))
    assume(program is not None)  # host memory not in rows (shuffled tensors, gaps)
    assert program is not None
    for k, slab in enumerate(program.slabs):
        stage = STAGE + k * BIG
        copies = pitched_pack(program, slab, table, stage, 1.0)
        kplan = kernel_plan(program, slab, table, stage)
        if copies is None:
            assert s["canonical"] and not all(
                bool(kplan.table.simple[seg.refs].all()) for seg in kplan.segments
                if len(seg.src_slots))
            continue
        event(f"tallest copy > 1: {int(copies.height.max(initial=1)) > 1}")
        src, dst, size = pitched_lines(copies)
        assert len(set(dst.tolist())) == len(dst)
        assert byte_map(list(zip(src.tolist(), dst.tolist(), size.tolist()))) == _flat(kplan)


MIB = 1 << 20


def test_a_pool_packs_one_copy_per_block_and_short_copies_stay_on_the_kernel() -> None:
    n_t, page, bpc = 3, 32, 2
    layout = KVCacheLayout([KVTensor(np.zeros((16, page), np.uint8)) for _ in range(n_t)])
    row = n_t * page * bpc

    def program_of(alloc: list[int]) -> tuple:  # type: ignore[type-arg]
        gpu = SideGeometry([BIG + t * MIB for t in range(n_t)], [page] * n_t, [0] * n_t,
                           [16] * n_t, 1, alloc)
        host = SideGeometry([BIG * 10 + t * page * bpc for t in range(n_t)], [row] * n_t,
                            [page] * n_t, [8] * n_t, bpc)
        table = build_ref_table(layout, gpu, host, True, False)
        plan = build_plan(table, [9, 1, 5, 3], [4, 6], None, None, True, 8)
        program = build_staged(plan, True, 64 * row)
        assert program is not None and len(program.slabs) == 1
        return program, table

    program, table = program_of([0] * n_t)  # one allocation: a block's 3 pages in one copy
    copies = pitched_pack(program, program.slabs[0], table, STAGE, 3.0)
    assert copies is not None
    assert copies.height.tolist() == [3] * 4
    assert copies.src_pitch.tolist() == [MIB] * 4  # GPU tensors 1 MiB apart
    assert copies.dst_pitch.tolist() == [page * bpc] * 4  # side by side in a staging row
    assert pitched_pack(program, program.slabs[0], table, STAGE, 3.5) is None
    assert pitched_pack(program, program.slabs[0], table, STAGE, 0) is None  # off
    program, table = program_of([])  # unknown allocations: one line per copy
    assert pitched_pack(program, program.slabs[0], table, STAGE, 2.0) is None
    copies = pitched_pack(program, program.slabs[0], table, STAGE, 1.0)
    assert copies is not None and copies.height.tolist() == [1] * 12
