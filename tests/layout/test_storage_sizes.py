"""The guard's one-gather read of torch storages' byte counts answers as ``nbytes()`` does,
through every resize, and the guard refuses a storage resized in place (same address,
fewer bytes), which the pointer check alone cannot see."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvasync as kv
from kvasync._arrays import array_info
from kvasync._memory import MemoryGuard
from kvasync._torch_words import Words, raw_sizes, storage_size_field

torch = pytest.importorskip("torch")


def test_the_size_field_is_found_and_tracks_a_resize() -> None:
    field = storage_size_field(torch)
    assert field is not None, "this torch's StorageImpl hides its byte count: slow guard"
    s = torch.UntypedStorage(512)
    words = np.asarray(Words(int(s._cdata) + field, 1))
    assert int(words[0]) == 512
    s.resize_(40)
    assert int(words[0]) == 40


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 4096), min_size=1, max_size=12),
       changes=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 4096)), max_size=6))
def test_one_gather_agrees_with_nbytes(sizes: list[int], changes: list[tuple[int, int]]) -> None:
    storages = [torch.UntypedStorage(n) for n in sizes]
    check = raw_sizes(torch, storages, sizes)
    assert check is not None and check()
    for i, n in changes:
        storages[i % len(storages)].resize_(n)
        assert check() == ([s.nbytes() for s in storages] == sizes)


def test_a_raw_reader_refuses_a_wrong_start() -> None:
    """Built against sizes the storages do not have, the reader is not used (None)."""
    s = torch.UntypedStorage(64)
    assert raw_sizes(torch, [s], [65]) is None


def test_resized_in_place_is_refused() -> None:
    x = torch.zeros((4, 256), dtype=torch.uint8)
    y = torch.zeros((4, 256), dtype=torch.uint8)
    with kv.Offloader(kv.KVCacheLayout.from_tensors([x, y]), 4, backend="host") as off:
        assert off.layout._guard._sizes_equal != off.layout._guard._sizes_equal_py
        s = y.untyped_storage()
        s.resize_(0)
        s.resize_(512)  # often at the old address: the pointers alone look unchanged
        assert off.layout._guard._sizes_equal() is False  # the gather itself sees it
        with pytest.raises(kv.InvalidTransferError, match="KV tensor 1: its storage was freed"):
            off.store(gpu_blocks=[0], cpu_chunks=[0])
        with pytest.raises(kv.InvalidTransferError, match="KV tensor 1: its storage was freed"):
            off.load(cpu_chunks=[0], gpu_blocks=[0])


def test_guard_without_the_field_still_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvasync._torch_words as words
    monkeypatch.setattr(words, "_SIZE_FIELD", [None])
    monkeypatch.setattr(words, "_FIELDS", [None])
    x = torch.zeros((4, 256), dtype=torch.uint8)
    g = MemoryGuard([array_info(x)])
    assert g._sizes_equal == g._sizes_equal_py
    g.check()
    x.untyped_storage().resize_(100)
    assert g._sizes_equal() is False  # the calls themselves see it, not the pointer check
    with pytest.raises(kv.InvalidTransferError, match="freed or resized"):
        g.check()
