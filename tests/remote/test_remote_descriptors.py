"""The remote tier's NIXL descriptors are the copy program's runs over the pool's chunk
rows, checked against a plain-Python oracle (rows_oracle.py). Pure NumPy: no NIXL, no pool
(the region's address is made up; nothing is copied)."""

from __future__ import annotations

import numpy as np
import pytest
import rows_oracle

import kvasync as kv
from kvasync._hostmem import row_offsets
from kvasync._program import build_plan, split_plan
from kvasync.remote._descriptors import (
    merged_plan,
    page_descriptors,
    remote_program,
    run_descriptors,
)
from kvasync.remote._rows import pool_row_bytes, pool_tables

BASE = 1 << 40  # a made-up pool region address
NUM_BLOCKS = 32


def _layout(pages: list[int], groups: list[list[int]] | None) -> kv.KVCacheLayout:
    kvs = [np.zeros((NUM_BLOCKS, p), dtype=np.uint8) for p in pages]
    refs = None if groups is None else [[kv.KVRef(t) for t in g] for g in groups]
    return kv.KVCacheLayout([kv.KVTensor(t) for t in kvs], refs)


def _program_runs(layout: kv.KVCacheLayout, chunks: int, bpc: int, direction: str,
                  req: dict, slab_bytes: int) -> list[list[tuple[int, int, int]]]:
    table = pool_tables(layout, chunks, bpc, False, BASE)[direction]
    plan = build_plan(table, req["gpu_blocks"], req["cpu_chunks"], req["group_sizes"],
                      req["block_indices"], direction == "d2h", chunks, True)
    program = remote_program([plan], direction, slab_bytes)  # type: ignore[arg-type]
    assert program is not None
    out = []
    for i in range(len(program.slabs)):
        local, remote, sizes = run_descriptors(program, i, 0)
        out.append(sorted(zip(local.tolist(), remote.tolist(), sizes.tolist()),
                          key=lambda r: r[1]))
    return out


def _random_case(seed: int) -> tuple[list[int], list[list[int]], int, int, str, dict, int]:
    rng = np.random.default_rng(seed)
    ntensors = int(rng.integers(1, 6))
    pages = [int(rng.choice([16, 24, 48, 64, 100, 128])) for _ in range(ntensors)]
    perm = rng.permutation(ntensors).tolist()
    ngroups = int(rng.integers(1, ntensors + 1))
    cuts = sorted(rng.choice(range(1, ntensors), size=ngroups - 1, replace=False).tolist()) \
        if ngroups > 1 else []
    groups = [perm[a:b] for a, b in zip([0, *cuts], [*cuts, ntensors])]
    bpc = int(rng.choice([1, 2, 3, 4]))
    chunks = 24
    direction = str(rng.choice(["d2h", "h2d"]))
    # chunk ids: runs of consecutive ids at random starts, distinct over the request
    pool_ids = list(range(chunks))
    ids: list[int] = []
    sizes, skips, blocks = [], [], []
    for _ in groups:
        n = int(rng.integers(0, 3 * bpc + 1))
        skip = int(rng.integers(0, bpc))
        used = -(-(n + skip) // bpc) if n else 0
        free = [c for c in pool_ids if c not in ids]
        if used > len(free):
            n, used = 0, 0
        if used:
            start = int(rng.integers(0, len(free)))
            picked = (free[start:] + free[:start])[:used] if rng.random() < 0.6 else \
                rng.choice(free, size=used, replace=False).tolist()
            ids += [int(c) for c in picked]
        sizes.append(n)
        skips.append(skip + bpc * int(rng.integers(0, 3)))  # block_indices: any logical start
        blocks += rng.choice(NUM_BLOCKS, size=n, replace=False).tolist()
    req = {"gpu_blocks": blocks, "cpu_chunks": ids, "group_sizes": sizes,
           "block_indices": skips}
    layout = _layout(pages, groups)
    offsets, _ = row_offsets(layout, [p * bpc for p in pages])
    span = max(offsets[t] + bpc * pages[t] for t in range(ntensors))
    slab_bytes = span * int(rng.choice([1, 2, 3, 64]))
    return pages, groups, bpc, chunks, direction, req, slab_bytes


@pytest.mark.parametrize("seed", range(150))
def test_descriptors_equal_the_oracles_runs(seed: int) -> None:
    pages, groups, bpc, chunks, direction, req, slab_bytes = _random_case(seed)
    if not any(req["group_sizes"]):
        return
    layout = _layout(pages, groups)
    row = pool_row_bytes(layout, bpc, False)
    offsets, _ = row_offsets(layout, [p * bpc for p in pages])
    # a staging row holds the part of a pool row the request's groups can cover
    used = [t for g, n in zip(groups, req["group_sizes"]) if n for t in g]
    lo = min(offsets[t] for t in used)
    span = max(offsets[t] + bpc * pages[t] for t in used) - lo
    want = rows_oracle.runs(groups, pages, offsets, row, BASE, bpc, req["cpu_chunks"],
                            req["group_sizes"], req["block_indices"], span,
                            slab_bytes // span, lo)
    got = _program_runs(layout, chunks, bpc, direction, req, slab_bytes)
    assert got == want


def test_full_chunks_are_one_descriptor_per_run_of_rows_not_per_page() -> None:
    """64 KV tensors, one block per chunk, chunks 3-7 and 10-12: two descriptors (one per
    run of consecutive chunk ids), where the tensors' own pages are 64 x 8."""
    layout = _layout([256] * 64, None)
    req = {"gpu_blocks": [9, 2, 30, 4, 17, 5, 1, 0], "cpu_chunks": [3, 4, 5, 6, 7, 10, 11, 12],
           "group_sizes": None, "block_indices": None}
    row = pool_row_bytes(layout, 1, False)
    assert row == 64 * 256
    for direction in ("d2h", "h2d"):
        got = _program_runs(layout, 16, 1, direction, req, 16 << 20)
        assert got == [[(0, BASE + 3 * row, 5 * row), (5 * row, BASE + 10 * row, 3 * row)]]
        table = pool_tables(layout, 16, 1, False, BASE)[direction]
        plan = build_plan(table, req["gpu_blocks"], req["cpu_chunks"], None, None,
                          direction == "d2h", 16, True)
        assert len(page_descriptors([plan], direction)[2]) == 64 * 8  # what NIXL got before


def test_partial_chunks_move_only_their_covered_sub_blocks() -> None:
    """4 blocks per chunk, a group starting at sub-block 1 and ending at sub-block 2 of the
    next chunk: per tensor, the covered sub-ranges only, joined across the row boundary."""
    bpc, page = 4, 64
    layout = _layout([page, page], None)
    row = pool_row_bytes(layout, bpc, False)
    assert row == 2 * bpc * page
    req = {"gpu_blocks": [5, 6, 7, 8, 9, 10], "cpu_chunks": [2, 3], "group_sizes": [6],
           "block_indices": [1]}
    got = _program_runs(layout, 8, bpc, "d2h", req, 1 << 20)
    t1 = bpc * page  # tensor 1's part of a row
    assert got == [[
        (page, BASE + 2 * row + page, 3 * page),                 # chunk 2, tensor 0: subs 1-3
        (t1 + page, BASE + 2 * row + t1 + page, 3 * page + 3 * page),  # chunk 2 t1 + chunk 3 t0
        (row + t1, BASE + 3 * row + t1, 3 * page),               # chunk 3, tensor 1: subs 0-2
    ]]


def test_staging_buffers_split_runs_and_pieces_merge() -> None:
    """A buffer of 2 rows splits 5 consecutive chunks into runs of 2, 2, 1; the scheduler's
    pieces of one transfer are one program."""
    layout = _layout([128] * 4, None)
    row = pool_row_bytes(layout, 1, False)
    req = {"gpu_blocks": list(range(5)), "cpu_chunks": list(range(5)), "group_sizes": None,
           "block_indices": None}
    got = _program_runs(layout, 8, 1, "h2d", req, 2 * row)
    assert got == [[(0, BASE, 2 * row)], [(0, BASE + 2 * row, 2 * row)], [(0, BASE + 4 * row, row)]]
    table = pool_tables(layout, 8, 1, False, BASE)["d2h"]
    plan = build_plan(table, list(range(5)), list(range(5)), None, None, True, 8, True)
    pieces = plan.pieces(2)
    assert len(pieces) == 3
    merged = merged_plan(pieces)
    assert merged is not None and merged.nbytes == plan.nbytes
    program = remote_program(pieces, "d2h", 1 << 20)
    assert program is not None and len(program.slabs) == 1
    assert run_descriptors(program, 0, 0)[2].tolist() == [5 * row]


def test_layers_are_runs_of_their_own_tensors() -> None:
    """A layer-wise load's layer moves its tensors' part of each row: with the layer's
    tensors side by side in the row, one run per chunk run."""
    layout = _layout([64] * 4, None)
    row = pool_row_bytes(layout, 1, False)
    table = pool_tables(layout, 8, 1, False, BASE)["h2d"]
    plan = build_plan(table, [0, 1, 2], [4, 5, 6], None, None, False, 8, True)
    layers = split_plan(plan, [[0, 1], [2, 3]])
    for i, part in enumerate(layers):
        program = remote_program([part], "h2d", 1 << 20)
        assert program is not None
        local, remote, sizes = run_descriptors(program, 0, 0)
        assert remote.tolist() == [BASE + c * row + i * 128 for c in (4, 5, 6)]
        assert sizes.tolist() == [128] * 3


def test_raw_plans_keep_their_own_descriptors() -> None:
    from kvasync._program import TransferPlan

    layout = _layout([64], None)
    table = pool_tables(layout, 4, 1, False, BASE)["d2h"]
    one = np.array([64], dtype=np.uint64)
    raw = TransferPlan.raw(table, one, one, one)
    assert merged_plan([raw]) is None and remote_program([raw], "d2h", 1 << 20) is None
