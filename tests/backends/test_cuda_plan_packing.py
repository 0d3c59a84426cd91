"""The CUDA kernels' host-side packing, checked without a GPU (runs in CI).

The table kernel decodes (segment, ref, slot, piece) units from a packed job; here a
Python replay of that decode (`emulate_table`) must copy exactly the bytes `plan.flat()`
describes, for direct and canonical layouts, several groups, bpc > 1 and writer rotation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvasync as kv
from kvasync._backends._cuda_kernels import (
    emulate_table,
    pack_job,
    pack_table,
    split_descriptors,
)
from kvasync._program import build_plan


def _bytes(descs: list[tuple[int, int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for s, d, n in descs:
        for i in range(n):
            assert d + i not in out, "destination byte written twice"
            out[d + i] = s + i
    return out


def _offloader(canonical: bool, bpc: int, pages: list[int]) -> kv.Offloader:
    tensors = [np.zeros((12, p), np.uint8) for p in pages]
    if canonical:
        half = pages[0] // 2
        mapping = kv.PageMapping(
            2 * pages[0], pages[0],
            (kv.CopyRun(0, 64, 16, half // 16, 16, 32), kv.CopyRun(half, 64 + 2 * half + 1, half)),
            num_writers=2, writer_index=1,
        )
        groups = [[kv.KVRef(0, mapping=mapping)],
                  [kv.KVRef(i, mapping=kv.PageMapping.identity(pages[i]))
                   for i in range(1, len(pages))]]
    else:
        groups = [[kv.KVRef(0)], [kv.KVRef(i) for i in range(1, len(pages))]]
    layout = kv.KVCacheLayout([kv.KVTensor(t) for t in tensors], groups)
    return kv.Offloader(layout, 16, bpc, backend="host", canonical=canonical)


@pytest.mark.parametrize("canonical", [False, True])
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("piece", [64, 1 << 16])
def test_table_decode_copies_what_flat_describes(
    canonical: bool, bpc: int, store: bool, piece: int
) -> None:
    off = _offloader(canonical, bpc, [256, 96, 200])
    rng = np.random.default_rng(bpc + 7 * canonical + 13 * store)
    n0, n1 = 5, 4
    gpu = rng.choice(12, n0, replace=False).tolist() + rng.choice(12, n1, replace=False).tolist()
    c0 = -(-(n0 + 1 % bpc) // bpc)
    c1 = -(-n1 // bpc)
    chunks = rng.choice(16, c0 + c1, replace=False).tolist()
    table = off._tables["d2h" if store else "h2d"]
    plan = build_plan(table, gpu, chunks, [n0, n1], [1, 0], store, 16)
    packed = pack_table(table, piece)
    job = pack_job(plan.segments, packed.pieces)
    got = list(emulate_table(packed, job, piece))
    src, dst, sizes = plan.flat()
    want = list(zip(src.tolist(), dst.tolist(), sizes.tolist()))
    assert _bytes(got) == _bytes(want)
    assert all(n <= piece for _, _, n in got)
    off.close()


def test_empty_segments_pack_to_no_units() -> None:
    off = _offloader(False, 1, [256, 96])
    table = off._tables["d2h"]
    plan = build_plan(table, [], [], [0, 0], None, True, 16)
    job = pack_job(plan.segments, pack_table(table).pieces)
    assert job.total_units == 0 and job.num_segs == 0
    off.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 300)), min_size=1, max_size=5),
       st.lists(st.integers(1, 1 << 22), min_size=1, max_size=40))
def test_a_job_counts_its_largest_segment_for_the_kernels_32_bit_units(
        shape: list[tuple[int, int]], pieces: list[int]) -> None:
    """The kernel counts one segment's units (refs x slots x the refs' most pieces) in 32
    bits: the job says whether each fits, against a plain-Python count."""
    from kvasync._program.plan import Segment

    pc = np.asarray(pieces, dtype=np.int64)
    segs, want = [], 0
    for k, (r, n) in enumerate(shape):
        refs = (np.arange(r, dtype=np.int64) * (k + 1)) % len(pieces)
        slots = np.arange(n, dtype=np.uint64)
        segs.append(Segment(refs, slots, slots))
        want = max(want, r * n * max(pieces[i] for i in refs.tolist()))
    job = pack_job(segs, pc)
    assert job.max_seg_units == want
    assert job.fits_32 == (want < 1 << 32)
    assert job.total_units >= want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=20), st.sampled_from([7, 64, 4096]))
def test_split_descriptors_keeps_every_byte(sizes: list[int], piece: int) -> None:
    z = np.asarray(sizes, dtype=np.uint64)
    s = np.cumsum(np.concatenate(([0], z[:-1]))).astype(np.uint64) + np.uint64(10_000)
    d = s + np.uint64(1 << 30)
    ps, pd, pz = split_descriptors(s, d, z, piece)
    assert int(pz.max()) <= max(piece, 1)
    assert int(pz.sum()) == int(z.sum())
    want = _bytes(list(zip(s.tolist(), d.tolist(), z.tolist())))
    assert _bytes(list(zip(ps.tolist(), pd.tolist(), pz.tolist()))) == want
