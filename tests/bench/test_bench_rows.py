"""The bare-rows reference's host side: where an offloader's rows are, checked byte by byte
against each KV tensor's own view (no GPU: the host backend's memory has the same layout)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvasync as kv
from kvasync.bench.rows import host_rows


def _offloader(tensors: int, page: int, chunks: int) -> kv.Offloader:
    gpu = [np.zeros((chunks, page), np.uint8) for _ in range(tensors)]
    return kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), chunks, backend="host")


@settings(max_examples=30, deadline=None)
@given(tensors=st.integers(1, 5), page=st.sampled_from([64, 256, 4096]),
       data=st.data())
def test_each_row_is_every_tensors_chunk_side_by_side(tensors: int, page: int,
                                                     data: st.DataObject) -> None:
    chunks = 6
    off = _offloader(tensors, page, chunks)
    try:
        rng = np.random.default_rng(tensors * page)
        for v in off.cpu_tensors:
            v[:] = rng.integers(0, 256, v.shape, dtype=np.uint8)
        ids = data.draw(st.lists(st.integers(0, chunks - 1), max_size=chunks, unique=True))
        found = host_rows(off.cpu_tensors, ids)
        assert found is not None
        addrs, row = found
        assert row == tensors * page and addrs.dtype == np.uint64 and len(addrs) == len(ids)
        for addr, c in zip(addrs.tolist(), ids):
            got = np.frombuffer(ctypes.string_at(addr, row), np.uint8)
            want = np.concatenate([v[c] for v in off.cpu_tensors])
            np.testing.assert_array_equal(got, want)
    finally:
        off.close()


def test_rows_that_are_not_one_run_are_refused() -> None:
    buf = np.zeros((4, 3, 64), np.uint8)
    assert host_rows([buf[:, i] for i in range(3)], [0]) is not None  # side by side
    assert host_rows([buf[:, i] for i in (0, 2)], [0]) is None  # a gap in the row
    assert host_rows([buf[:, i] for i in (1, 0, 2)], [0]) is None  # out of order
    assert host_rows([buf[:, i, ::2] for i in range(3)], [0]) is None  # strided pages
    assert host_rows([], [0]) is None
    with pytest.raises(ValueError, match=r"chunk ids must lie in \[0, 4\)"):
        host_rows([buf[:, i] for i in range(3)], [4])
