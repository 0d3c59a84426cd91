"""Derived PageMappings: the oracle values of notes 1.6 / 6.2 / 6.5, byte round trips against
an independent numpy encoding of each page layout, and the fail-closed list."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvasync as kv
from kvasync._mappings import (
    derive_page_mapping,
    head_shard,
    mla_page_mapping,
    private_page_mapping,
    verify_tiling,
)

Run = kv.CopyRun


def nhd(tp: int, rank: int, heads: int = 8, packed: bool = False, layout: str = "NHD",
        hb: int = 64, bs: int = 4) -> kv.PageMapping:
    return derive_page_mapping(layout=layout, num_kv_heads=heads, head_bytes=hb,  # type: ignore[arg-type]
                               block_size=bs, tp_size=tp, tp_rank=rank, kv_packed=packed)


# -- oracle values (notes 1.6) -------------------------------------------------------------------


def test_nhd_tp4_rank2() -> None:
    m = nhd(4, 2)
    assert m.canonical_page_size_bytes == 4096 and m.local_page_size_bytes == 1024
    assert m.runs == (Run(0, 256, 128, 4, 128, 512), Run(512, 2304, 128, 4, 128, 512))
    assert m.num_writers == 1 and m.writer_index == 0 and m.parallelism_agnostic
    frags = [f for r in m.runs for f in r.fragments()]
    assert [lo for lo, _, _ in frags] == list(range(0, 1024, 128))
    assert [co for _, co, _ in frags] == [256, 768, 1280, 1792, 2304, 2816, 3328, 3840]
    assert {s for _, _, s in frags} == {128}


def test_packed_layouts() -> None:
    m = nhd(4, 2, packed=True)
    assert m.canonical_page_size_bytes == 4096 and m.local_page_size_bytes == 1024
    assert [co for r in m.runs for _, co, _ in r.fragments()] == [512, 1536, 2560, 3584]
    assert {s for r in m.runs for _, _, s in r.fragments()} == {256}
    m = nhd(4, 1, packed=True, layout="HND")
    assert m.runs == (Run(0, 1024, 1024),)


@pytest.mark.parametrize(("layout", "packed"), list(itertools.product(["NHD", "HND"], [False, True])))
def test_single_rank_coalesces_to_one_whole_page_run(layout: str, packed: bool) -> None:
    m = nhd(1, 0, heads=2, packed=packed, layout=layout)
    assert m.runs == (Run(0, 0, 1024),)
    assert m == kv.PageMapping.identity(1024)


def test_gqa_replication_rotates_writers() -> None:
    m2, m3 = nhd(4, 2, heads=2), nhd(4, 3, heads=2)
    assert m2.runs == m3.runs  # ranks 2 and 3 hold the same head
    assert (m2.num_writers, m2.writer_index, m3.writer_index) == (2, 0, 1)
    assert m2.is_writer(0) and not m3.is_writer(0)  # block 0 by rank 2
    assert m3.is_writer(1) and not m2.is_writer(1)  # block 1 by rank 3
    assert head_shard(2, 4, 2) == (1, 1, 2, 0)


def test_mla_canonical_is_local_and_writers_alternate() -> None:
    ms = [mla_page_mapping(256, 2, r) for r in range(2)]
    for r, m in enumerate(ms):
        assert m.canonical_page_size_bytes == m.local_page_size_bytes == 256
        assert m.runs == (Run(0, 0, 256),)
        assert (m.num_writers, m.writer_index) == (2, r)
    assert [ms[0].is_writer(b) for b in range(4)] == [True, False, True, False]
    verify_tiling(ms)


# -- the copy plans of notes 6.2 -----------------------------------------------------------------


def test_tp2_ranks_of_the_gpu_roundtrip_case() -> None:
    """6.2.5: two TP2 ranks with 1024 B pages, canonical 2048 B."""
    for r in range(2):
        m = nhd(2, r, heads=4)
        assert m.canonical_page_size_bytes == 2048 and m.local_page_size_bytes == 1024
        assert m.runs == (Run(0, r * 128, 128, 4, 128, 256),
                          Run(512, 1024 + r * 128, 128, 4, 128, 256))


def test_writer_rotation_over_the_page_id_example() -> None:
    """6.2.3: page ids of chunks [3, 7, 9], bpc 4, count 10, skip 2; 2 writers, index 1."""
    m = nhd(4, 3, heads=2)
    ids = [14, 15, 28, 29, 30, 31, 36, 37, 38, 39]
    assert [m.is_writer(i) for i in ids] == [i % 2 == 1 for i in ids]


def test_opaque_fallback() -> None:
    m = private_page_mapping(1024, 4, 2)
    assert m.runs == (Run(0, 2048, 1024),)
    assert m.canonical_page_size_bytes == 4096 and not m.parallelism_agnostic
    verify_tiling([private_page_mapping(1024, 4, r) for r in range(4)])


# -- byte round trips against an independent encoding -----------------------------------------


def encode(kvh: np.ndarray, layout: str, packed: bool) -> np.ndarray:
    """One block's page bytes from logical (2 [K/V], tokens, heads, hb) data."""
    if layout == "NHD":
        arr = kvh.transpose(1, 2, 0, 3) if packed else kvh  # (t, h, kv, hb) / (kv, t, h, hb)
    else:
        arr = kvh.transpose(2, 1, 0, 3) if packed else kvh.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(arr).reshape(-1)


def scatter(m: kv.PageMapping, local: np.ndarray, canon: np.ndarray) -> None:
    for run in m.runs:
        for lo, co, size in run.fragments():
            canon[co : co + size] = local[lo : lo + size]


def gather(m: kv.PageMapping, canon: np.ndarray) -> np.ndarray:
    out = np.zeros(m.local_page_size_bytes, dtype=np.uint8)
    for run in m.runs:
        for lo, co, size in run.fragments():
            out[lo : lo + size] = canon[co : co + size]
    return out


CASES = [
    (layout, packed, heads, tp)
    for layout in ("NHD", "HND")
    for packed in (False, True)
    for heads, tp in [(8, 1), (8, 2), (8, 4), (8, 8), (2, 4), (2, 8), (1, 4), (4, 16)]
]


@pytest.mark.parametrize(("layout", "packed", "heads", "tp"), CASES)
def test_store_then_load_under_another_tp_is_exact(
    layout: str, packed: bool, heads: int, tp: int
) -> None:
    """Every writer of page id p scatters its local page; the canonical bytes equal the full
    page encoding; a reader of any other TP degree gathers exactly its own local page."""
    hb, bs = 16, 4
    rng = np.random.default_rng(heads * 100 + tp)
    full = rng.integers(0, 256, size=(2, bs, heads, hb), dtype=np.uint8)
    truth = encode(full, layout, packed)
    mappings = [nhd(tp, r, heads, packed, layout, hb, bs) for r in range(tp)]
    verify_tiling(mappings)
    for page_id in range(2):  # two blocks: replicas rotate
        canon = np.zeros(truth.size, dtype=np.uint8)
        writers = 0
        for r, m in enumerate(mappings):
            first, local, _, _ = head_shard(heads, tp, r)
            page = encode(full[:, :, first : first + local], layout, packed)
            assert page.size == m.local_page_size_bytes
            if m.is_writer(page_id):
                scatter(m, page, canon)
                writers += 1
        np.testing.assert_array_equal(canon, truth)
        assert writers == min(tp, heads)  # replicated bytes are written once
        for reader_tp in (1, 2, 4, 8):
            if reader_tp > heads and reader_tp % heads:
                continue
            for r in range(reader_tp):
                first, local, _, _ = head_shard(heads, reader_tp, r)
                m = nhd(reader_tp, r, heads, packed, layout, hb, bs)
                want = encode(full[:, :, first : first + local], layout, packed)
                np.testing.assert_array_equal(gather(m, canon), want)


def test_every_rank_covers_its_local_page_once() -> None:
    for layout, packed, heads, tp in CASES:
        for r in range(tp):
            m = nhd(tp, r, heads, packed, layout)
            covered = sorted((lo, s) for run in m.runs for lo, _, s in run.fragments())
            pos = 0
            for lo, s in covered:
                assert lo == pos
                pos += s
            assert pos == m.local_page_size_bytes


# -- fail closed (notes 6.5) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_kv_heads=6, tp_size=4), "do not split evenly"),
        (dict(num_kv_heads=4, tp_size=6), "not a multiple"),
        (dict(num_kv_heads=3, tp_size=2), "do not split evenly"),
        (dict(layout="NDH"), "not 'NHD' or 'HND'"),
        (dict(layout="nhd"), "not 'NHD' or 'HND'"),
        (dict(head_bytes=0), "head_bytes"),
        (dict(block_size=-4), "block_size"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(tp_size=0), "tp_size"),
        (dict(tp_rank=4), "tp_rank"),
        (dict(tp_rank=-1), "tp_rank"),
        (dict(tp_rank=True), "tp_rank"),
        (dict(head_bytes=64.0), "head_bytes"),
        (dict(local_kv_heads=4), "local KV heads"),
        (dict(kv_packed=1), "kv_packed"),
    ],
)
def test_uncertifiable_layouts_are_refused(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = dict(layout="NHD", num_kv_heads=8, head_bytes=64, block_size=4,
                                   tp_size=4, tp_rank=0)
    args.update(kwargs)
    with pytest.raises(kv.InvalidTransferError, match=match):
        derive_page_mapping(**args)  # type: ignore[arg-type]


def test_local_heads_cross_check_accepts_the_right_count() -> None:
    m = derive_page_mapping(layout="HND", num_kv_heads=8, head_bytes=64, block_size=4,
                            tp_size=4, tp_rank=3, local_kv_heads=2)
    assert m.local_page_size_bytes == 1024


@pytest.mark.parametrize(("args", "match"), [((0, 2, 0), "page_bytes"), ((256, 2, 2), "tp_rank")])
def test_mla_refuses_bad_arguments(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(kv.InvalidTransferError, match=match):
        mla_page_mapping(*args)


def test_verify_tiling_catches_gaps_overlaps_and_bad_rotation() -> None:
    ranks = [nhd(4, r) for r in range(4)]
    verify_tiling(ranks)
    with pytest.raises(kv.InvalidTransferError, match="written by no rank"):
        verify_tiling(ranks[:3])
    with pytest.raises(kv.InvalidTransferError, match="written twice"):
        verify_tiling([*ranks, ranks[0]])
    with pytest.raises(kv.InvalidTransferError, match="disagree"):
        verify_tiling([ranks[0], nhd(2, 1, heads=4)])
    with pytest.raises(kv.InvalidTransferError, match="got none"):
        verify_tiling([])
    # replicas that both claim writer index 0: page 0 written twice, page 1 by nobody
    a = kv.PageMapping(256, 256, (Run(0, 0, 256),), num_writers=2, writer_index=0)
    with pytest.raises(kv.InvalidTransferError, match="written twice for page id 0"):
        verify_tiling([a, a])
    b = kv.PageMapping(256, 256, (Run(0, 0, 256),), num_writers=2, writer_index=1)
    verify_tiling([a, b])
    # a trailing gap: the fragments stop short of the canonical page end
    short = kv.PageMapping(512, 256, (Run(0, 0, 256),))
    with pytest.raises(kv.InvalidTransferError, match=r"\[256, 512\)"):
        verify_tiling([short])
