"""The bare-rows reference's host side: where an offloader's rows are, checked byte by byte
against each KV tensor's own view (no GPU: the host backend's memory has the same layout),
how they merge into runs and batch calls (against plain-Python oracles), and the copy calls."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvasync as kv
from kvasync._backends import _cudart
from kvasync._backends._cuda_staged import StagedPath
from kvasync.bench.context import row_copier
from kvasync.bench.rows import BATCH_BYTES, batches, host_rows, row_runs


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


def _runs_oracle(addrs: list[int], row: int) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for a in sorted(set(addrs)):
        if runs and runs[-1][0] + runs[-1][1] == a:
            runs[-1][1] += row
        else:
            runs.append([a, row])
    return [(a, n) for a, n in runs]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 60), max_size=40, unique=True),
       row=st.sampled_from([1, 4096, 3 << 20]), base=st.integers(0, 1 << 40))
def test_row_runs_rank_and_merge_like_the_oracle(ids: list[int], row: int, base: int) -> None:
    addrs = [base + i * row for i in ids]
    starts, sizes = row_runs(np.array(addrs, dtype=np.uint64), row)
    assert starts.dtype == sizes.dtype == np.uint64
    assert list(zip(starts.tolist(), sizes.tolist())) == _runs_oracle(addrs, row)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 3 * BATCH_BYTES), min_size=1, max_size=30))
def test_batches_cover_each_run_once_by_its_window(sizes: list[int]) -> None:
    offsets, bounds = batches(np.array(sizes, dtype=np.uint64))
    assert offsets.tolist() == [sum(sizes[:k]) for k in range(len(sizes))]
    assert bounds[0] == 0 and bounds[-1] == len(sizes) and bounds == sorted(set(bounds))
    for lo, hi in zip(bounds, bounds[1:]):
        window = {int(o) // BATCH_BYTES for o in offsets[lo:hi]}
        assert len(window) == 1  # one call's runs start in one window
    if len(bounds) > 2:  # and windows never repeat across calls
        firsts = [int(offsets[lo]) // BATCH_BYTES for lo in bounds[:-1]]
        assert firsts == sorted(set(firsts))


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> None:
        self.calls.append(args)


def test_row_copier_is_the_staged_paths_own_row_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """`context.row_copier` runs the staged path's slab copy (`StagedPath._dma`) of the
    offloader's backend, with its batch call, on the stream at the given address."""
    batch, each = _Recorder(), _Recorder()
    monkeypatch.setattr(_cudart, "memcpy_runs", lambda runs, stream: each(list(runs), stream))
    staged = StagedPath(3, None, None, None)  # type: ignore[arg-type]  # _dma needs none
    off: Any = SimpleNamespace(backend=SimpleNamespace(_staged=staged, _batch=batch))
    src, dst = np.array([1, 2], np.uint64), np.array([10, 20], np.uint64)
    sizes = np.array([5, 6], np.uint64)
    row_copier(off)(src, dst, sizes, 99, True)  # a store: device 3 -> host
    assert len(batch.calls) == 1 and batch.calls[0][3:] == (99, 1, 3, -1) and not each.calls
    row_copier(off)(src, dst, sizes, 99, False)  # a load: host -> device 3, any order
    assert batch.calls[1][3:] == (99, 3, -1, 3)
    row_copier(off, use_batch=False)(src, dst, sizes, 7, False)  # one copy per run
    row_copier(off)(src[:1], dst[:1], sizes[:1], 7, True)  # a lone run: so too
    assert each.calls == [([(1, 10, 5), (2, 20, 6)], 7), ([(1, 10, 5)], 7)]
    assert len(batch.calls) == 2
