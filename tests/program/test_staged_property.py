"""Property tests: the staged program (pack/unpack segments + host runs) against the
plain-Python oracle, byte by byte, on row-contiguous host memory."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oracle import Side, byte_map, copies
from test_descriptors_property import BIG, oracle_refs, scenario

from kvasync._layout import KVCacheLayout, KVRef, KVTensor
from kvasync._program import (
    SideGeometry,
    StagedProgram,
    TransferPlan,
    build_plan,
    build_ref_table,
    build_staged,
    kernel_plan,
    slab_descriptors,
    split_plan,
)

STAGE = BIG * 64  # staging buffers: one per slab, far from everything else


def _setup(s: dict, data: st.DataObject) -> tuple:  # type: ignore[type-arg]
    n_t = len(s["pages"])
    tensors = [KVTensor(np.zeros((s["num_blocks"][t], s["pages"][t]), np.uint8))
               for t in range(n_t)]
    groups = [[KVRef(t, mapping=s["mappings"].get(t)) for t in g] for g in s["groups"]]
    layout = KVCacheLayout(tensors, groups)
    bpc = s["bpc"]
    sub = s["canon_pages"] if s["canonical"] else s["pages"]
    gpu_rows = [s["pages"][t] + s["row_pad"][t] for t in range(n_t)]
    # one host row per chunk: tensors side by side in a random order, with random gaps
    order = data.draw(st.permutations(list(range(n_t))))
    offsets = [0] * n_t
    pos = data.draw(st.integers(0, 3))
    for t in order:
        offsets[t] = pos
        pos += sub[t] * bpc + data.draw(st.integers(0, 2))
    row = pos + data.draw(st.integers(0, 5))
    base = BIG * 10 + 3
    gpu = SideGeometry([BIG * (t + 1) for t in range(n_t)], gpu_rows, [0] * n_t,
                       s["num_blocks"], 1)
    host = SideGeometry([base + offsets[t] for t in range(n_t)], [row] * n_t, list(sub),
                        [s["num_chunks"]] * n_t, bpc)
    table = build_ref_table(layout, gpu, host, s["store"], s["canonical"])
    o_refs = oracle_refs(s)
    expected = copies(o_refs, Side(gpu.base, gpu_rows, [0] * n_t),
                      Side(host.base, [row] * n_t, list(sub)), bpc, s["gpu"], s["cpu"],
                      s["gsizes"], s["bidx"], s["store"])
    return table, expected, row


def _compose(plan_table: object, program: object, store: bool) -> dict[int, int]:
    """dst byte -> src byte of the whole staged program (kernel, then runs, or reverse)."""
    kernel: dict[int, int] = {}
    runs: dict[int, int] = {}
    for k, slab in enumerate(program.slabs):  # type: ignore[attr-defined]
        stage = STAGE + k * BIG
        ks, kd, kz = kernel_plan(program, slab, plan_table, stage).flat()  # type: ignore[arg-type]
        kernel.update(byte_map(list(zip(ks.tolist(), kd.tolist(), kz.tolist()))))
        rs, rd, rz = slab_descriptors(program, slab, stage)  # type: ignore[arg-type]
        runs.update(byte_map(list(zip(rs.tolist(), rd.tolist(), rz.tolist()))))
        # every run lies inside its staging buffer
        side = rs if store else rd
        assert all(stage <= a and a + z <= stage + program.rows_per_slab * program.rows.span
                   for a, z in zip(side.tolist(), rz.tolist()))  # type: ignore[attr-defined]
    if store:  # gpu -> stage (kernel), stage -> host (runs)
        assert set(runs.values()) <= set(kernel), "a run reads staging bytes nobody packed"
        return {h: kernel[s] for h, s in runs.items()}
    # host -> stage (runs), stage -> gpu (kernel)
    assert set(kernel.values()) <= set(runs), "the unpack reads staging bytes no run filled"
    return {g: runs[s] for g, s in kernel.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_staged_program_matches_oracle(s: dict, data: st.DataObject) -> None:  # type: ignore[type-arg]
    table, expected, row = _setup(s, data)
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                      s["num_chunks"])
    span_rows = data.draw(st.integers(1, 4))
    # both builders: plain Python (what a request this small takes) and NumPy (what every
    # request over `_SMALL` slots takes), each against the oracle
    for program in _python_and_numpy(plan, s["store"], span_rows * max(row, 1)):
        assert program is not None
        assert program.nbytes == plan.nbytes
        got = _compose(table, program, s["store"])
        # exactly the oracle's bytes: nothing outside a partial chunk's covered sub-blocks
        assert got == byte_map(expected)
        # runs are maximal: no two runs of a slab are contiguous on both sides
        for slab in program.slabs:
            so, hp, sz = slab.stage_off, slab.host_ptr, slab.sizes
            order = np.argsort(hp)
            so, hp, sz = so[order], hp[order], sz[order]
            assert not ((so[:-1] + sz[:-1] == so[1:]) & (hp[:-1] + sz[:-1] == hp[1:])).any()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_staged_layer_split_matches_oracle(s: dict, data: st.DataObject) -> None:  # type: ignore[type-arg]
    """Each layer of a layer-wise load stages only its own tensors' part of the rows."""
    assume(not s["store"])
    table, expected, row = _setup(s, data)
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], False,
                      s["num_chunks"])
    merged: dict[int, int] = {}
    for part in split_plan(plan, s["layers"]):
        program = build_staged(part, False, 2 * max(row, 1))
        assert program is not None
        got = _compose(table, program, False)
        assert not set(got) & set(merged)
        merged.update(got)
    assert merged == byte_map(expected)


def test_full_consecutive_chunks_are_one_run() -> None:
    """Fully covered chunks with consecutive ids move as one run of whole rows."""
    n_t, page, bpc = 3, 32, 2
    tensors = [KVTensor(np.zeros((16, page), np.uint8)) for _ in range(n_t)]
    layout = KVCacheLayout(tensors)
    row = n_t * page * bpc
    gpu = SideGeometry([BIG * (t + 1) for t in range(n_t)], [page] * n_t, [0] * n_t,
                       [16] * n_t, 1)
    host = SideGeometry([BIG * 10 + t * page * bpc for t in range(n_t)], [row] * n_t,
                        [page] * n_t, [8] * n_t, bpc)
    table = build_ref_table(layout, gpu, host, True, False)
    plan = build_plan(table, [9, 1, 5, 3, 7, 2], [4, 5, 6], None, None, True, 8)
    program = build_staged(plan, True, 64 * row)
    assert program is not None and len(program.slabs) == 1
    slab = program.slabs[0]
    assert slab.host_ptr.tolist() == [BIG * 10 + 4 * row]
    assert slab.sizes.tolist() == [3 * row]
    # a group starting mid-chunk (skip 1) and ending mid-chunk covers only its sub-blocks
    plan = build_plan(table, [9, 1], [4, 5], None, [1], True, 8)
    program = build_staged(plan, True, 64 * row)
    assert program is not None
    runs = sorted(zip(program.slabs[0].host_ptr.tolist(), program.slabs[0].sizes.tolist()))
    base4, base5 = BIG * 10 + 4 * row, BIG * 10 + 5 * row
    # chunk 4 keeps sub-block 1 of each tensor, chunk 5 sub-block 0; the last tensor's
    # part of row 4 ends where row 5 (tensor 0, sub-block 0) starts: one run
    assert runs == [(base4 + 32, 32), (base4 + 96, 32), (base4 + 160, 64), (base5 + 64, 32),
                    (base5 + 128, 32)]


def _python_and_numpy(plan: TransferPlan, store: bool, slab: int
                      ) -> tuple[StagedProgram | None, StagedProgram | None]:
    """The program of `plan` built in plain Python (every small request) and by NumPy."""
    import kvasync._program.staged as staged_mod

    saved = staged_mod._SMALL, staged_mod._SMALL_FLAT
    try:
        staged_mod._SMALL_FLAT = staged_mod._SMALL
        python = build_staged(plan, store, slab)
        staged_mod._SMALL = -1
        return python, build_staged(plan, store, slab)
    finally:
        staged_mod._SMALL, staged_mod._SMALL_FLAT = saved


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5), st.integers(1, 24), st.booleans(), st.data())
def test_small_request_fast_path_matches_the_general_path(
    n_t: int, page: int, store: bool, data: st.DataObject
) -> None:
    """One group, one block per chunk, few ids: the plain-Python staging (including the
    one-run path for consecutive whole rows) gives the general path's bytes."""
    tensors = [KVTensor(np.zeros((16, page), np.uint8)) for _ in range(n_t)]
    layout = KVCacheLayout(tensors)
    gap = data.draw(st.integers(0, 2))
    row = n_t * page + gap
    gpu = SideGeometry([BIG * (t + 1) for t in range(n_t)], [page] * n_t, [0] * n_t,
                       [16] * n_t, 1)
    host = SideGeometry([BIG * 10 + t * page for t in range(n_t)], [row] * n_t,
                        [page] * n_t, [16] * n_t, 1)
    table = build_ref_table(layout, gpu, host, store, False)
    k = data.draw(st.integers(1, 8))
    if data.draw(st.booleans()):
        first = data.draw(st.integers(0, 16 - k))
        chunks = list(range(first, first + k))
    else:
        chunks = data.draw(st.lists(st.integers(0, 15), min_size=k, max_size=k,
                                    unique=store))
    blocks = data.draw(st.lists(st.integers(0, 15), min_size=k, max_size=k, unique=not store))
    plan = build_plan(table, blocks, chunks, None, None, store, 16)
    slab = data.draw(st.integers(1, 20)) * row
    fast, slow = _python_and_numpy(plan, store, slab)
    assert fast is not None and slow is not None
    assert _compose(table, fast, store) == _compose(table, slow, store)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_plain_python_staging_matches_the_numpy_path(s: dict, data: st.DataObject) -> None:  # type: ignore[type-arg]
    """Any small request (groups, skips, bpc 1-4, canonical rotation, several slabs): the
    plain-Python program moves exactly the NumPy path's bytes."""
    table, expected, row = _setup(s, data)
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                      s["num_chunks"])
    slab = data.draw(st.integers(1, 4)) * max(row, 1)
    fast, slow = _python_and_numpy(plan, s["store"], slab)
    assert fast is not None and slow is not None
    assert len(fast.slabs) == len(slow.slabs)
    assert _compose(table, fast, s["store"]) == _compose(table, slow, s["store"]) == byte_map(
        expected)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.sampled_from([1, 3, 4]), st.booleans(), st.data())
def test_a_layer_stages_only_its_part_of_the_rows(
    layers: int, bpc: int, store: bool, data: st.DataObject
) -> None:
    """A staging row holds only the part of a host row a layer's tensors cover: one layer
    of a K/V pair per layer fills a buffer with as many rows as fit that part (with
    whole-row staging rows it used 1/layers of each buffer), moving the oracle's bytes."""
    n_t, page, chunks = 2 * layers, 16, 12
    tensors = [KVTensor(np.zeros((chunks * bpc, page), np.uint8)) for _ in range(n_t)]
    layout = KVCacheLayout(tensors)
    row = n_t * page * bpc
    gpu = SideGeometry([BIG * (t + 1) for t in range(n_t)], [page] * n_t, [0] * n_t,
                       [chunks * bpc] * n_t, 1)
    host = SideGeometry([BIG * 10 + t * page * bpc for t in range(n_t)], [row] * n_t,
                        [page] * n_t, [chunks] * n_t, bpc)
    table = build_ref_table(layout, gpu, host, store, False)
    k = data.draw(st.integers(1, chunks))
    cpu = data.draw(st.lists(st.integers(0, chunks - 1), min_size=k, max_size=k, unique=True))
    blocks = data.draw(st.permutations(list(range(chunks * bpc))))[: k * bpc]
    plan = build_plan(table, blocks, cpu, None, None, store, chunks)
    spec = [[2 * i, 2 * i + 1] for i in range(layers)]
    part_bytes = 2 * page * bpc
    merged: dict[int, int] = {}
    for part in split_plan(plan, spec):
        program = build_staged(part, store, 3 * part_bytes)
        assert program is not None
        assert program.rows.span == part_bytes and program.rows_per_slab == 3
        assert len(program.slabs) == -(-k // 3)
        got = _compose(table, program, store)
        assert not set(got) & set(merged)
        merged.update(got)
    whole = build_staged(plan, store, 3 * row)
    assert whole is not None and whole.rows.span == row
    assert merged == _compose(table, whole, store)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_programs_of_different_tensor_sets_on_one_table_each_move_their_bytes(
    s: dict, data: st.DataObject  # type: ignore[type-arg]
) -> None:
    """Programs built one after another on one table with the same staging buffers, as an
    offloader builds them: each tensor subset's window gets its own staging table (two
    windows of one start and width may hold different tensors)."""
    table, expected, row = _setup(s, data)
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                      s["num_chunks"])
    n_t = len(s["pages"])
    for _ in range(3):
        sub = data.draw(st.sets(st.integers(0, n_t - 1), min_size=1))
        spec = [sorted(sub)] + ([sorted(set(range(n_t)) - sub)] if len(sub) < n_t else [])
        merged: dict[int, int] = {}
        for part in split_plan(plan, spec):
            program = build_staged(part, s["store"], 2 * max(row, 1))
            assert program is not None
            merged.update(_compose(table, program, s["store"]))
        assert merged == byte_map(expected), spec


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_pieces_of_a_plan_on_one_table_move_its_bytes(s: dict, data: st.DataObject) -> None:  # type: ignore[type-arg]
    """A big transfer's pieces (`TransferPlan.pieces`) staged one after another on one
    table: their segments' tensor sets differ (a writer rotation's filter, a group's last
    chunk), and together they move exactly the plan's bytes."""
    table, expected, row = _setup(s, data)
    plan = build_plan(table, s["gpu"], s["cpu"], s["gsizes"], s["bidx"], s["store"],
                      s["num_chunks"])
    rows_n = data.draw(st.integers(1, 3))
    for _ in range(2):
        most = data.draw(st.integers(1, 8))
        first = data.draw(st.none() | st.integers(1, most))
        merged: dict[int, int] = {}
        for piece in plan.pieces(most, first):
            program = build_staged(piece, s["store"], rows_n * max(row, 1))
            assert program is not None
            merged.update(_compose(table, program, s["store"]))
        assert merged == byte_map(expected)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 7, 128]), st.integers(65, 400), st.booleans(), st.data())
def test_runs_follow_chunk_ids_not_tensors(n_t: int, k: int, store: bool,
                                           data: st.DataObject) -> None:
    """Host work is runs, not pages: fully covered rows of distinct chunk ids (a request
    big enough for the NumPy builder) make one run per maximal set of consecutive ids in a
    slab, whatever the number of KV tensors."""
    page, num = 16, 512
    tensors = [KVTensor(np.zeros((num, page), np.uint8)) for _ in range(n_t)]
    table = build_ref_table(
        KVCacheLayout(tensors),
        SideGeometry([BIG * (t + 1) for t in range(n_t)], [page] * n_t, [0] * n_t,
                     [num] * n_t, 1),
        SideGeometry([BIG * 200 + t * page for t in range(n_t)], [n_t * page] * n_t,
                     [page] * n_t, [num] * n_t, 1),
        store, False)
    chunks = data.draw(st.lists(st.integers(0, num - 1), min_size=k, max_size=k, unique=True))
    blocks = data.draw(st.permutations(list(range(num))))[:k]
    rows_per_slab = data.draw(st.integers(1, 600))
    program = build_staged(build_plan(table, blocks, chunks, None, None, store, num), store,
                           rows_per_slab * n_t * page)
    assert program is not None
    ranked = sorted(chunks)
    for i, slab in enumerate(program.slabs):
        ids = ranked[i * rows_per_slab : (i + 1) * rows_per_slab]
        expected = 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))
        assert len(slab.sizes) == expected
        assert int(slab.sizes.sum()) == len(ids) * n_t * page
