"""The guard's one-gather read of torch's own fields (`_torch_words.raw_tensors`) answers "no
change" only when torch's ``data_ptr()`` and ``nbytes()`` give what they gave when the
layout was built, through every way a tensor can give up or change its memory; then the
guard asks torch, which decides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvasync as kv
from kvasync._arrays import array_info
from kvasync._memory import MemoryGuard
from kvasync._torch_words import raw_tensors, tensor_fields

torch = pytest.importorskip("torch")


def _base() -> Any:
    return torch.zeros((8, 256), dtype=torch.uint8)


def _alias_other_dtype(x: Any) -> None:
    """Same storage, same offset in elements, another dtype: data_ptr() moves."""
    y = x.untyped_storage()
    alias = torch.empty(0, dtype=torch.int16)
    alias.set_(y, x.storage_offset(), (16,))
    x.data = alias


def _same_bytes_other_dtype(x: Any) -> None:
    """Another dtype over the same bytes (data_ptr() unchanged): torch allows it."""
    alias = torch.empty(0, dtype=torch.int16)
    alias.set_(x.untyped_storage(), x.storage_offset() // 2, (16,))
    x.data = alias


def _write(x: Any) -> None:
    """An in-place write, where the storage still holds the tensor (torch writes through a
    freed storage's null pointer otherwise)."""
    end = (x.storage_offset() + x.numel()) * x.element_size()
    if x.untyped_storage().nbytes() >= end:
        x.fill_(3)


def _grow(x: Any) -> None:
    """A storage resized bigger (torch crashes resizing one in shared memory: not asked)."""
    if not x.is_shared():
        x.untyped_storage().resize_(1 << 16)


#: each change, and whether data_ptr() / nbytes() of what the guard holds change with it
CHANGES: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "nothing": (lambda x: None, False),
    "set_ new storage": (lambda x: x.set_(torch.zeros(16, dtype=torch.uint8)), True),
    "set_ same place": (lambda x: x.set_(x.untyped_storage(), x.storage_offset(), x.shape,
                                         x.stride()), False),
    "set_ other offset": (lambda x: x.set_(x.untyped_storage(), x.storage_offset() + 2,
                                           (8,)), True),
    "storage freed": (lambda x: x.untyped_storage().resize_(0), True),
    "storage grown": (lambda x: _grow(x), True),
    ".data = new": (lambda x: setattr(x, "data", torch.zeros(16, dtype=torch.uint8)), True),
    ".data = other dtype": (_alias_other_dtype, True),
    ".data = same bytes": (_same_bytes_other_dtype, False),
    "swap_tensors": (lambda x: torch.utils.swap_tensors(x, torch.zeros_like(x)), True),
    "share_memory_": (lambda x: x.share_memory_(), True),
    "in-place write": (lambda x: _write(x), False),
    "transpose_": (lambda x: x.t_() if x.dim() == 2 else None, False),
    "resize_ to none": (lambda x: x.resize_(0), True),
    "as_strided_ to none": (lambda x: x.as_strided_((0, 8), (8, 1)), True),
    ".data = none": (lambda x: setattr(x, "data", x[:0]), True),
}


def test_the_fields_are_found() -> None:
    assert tensor_fields(torch) is not None, "this torch hides its fields: the slow guard"


def _views() -> list[Any]:
    """Views at offsets (the K and V halves of one buffer) and whole tensors."""
    buf = _base()
    return [buf[:4], buf[4:], _base()[2:], _base()]


@pytest.mark.parametrize("which", [1, 2])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_the_gather_misses_is_one_torch_allows(change: str, which: int) -> None:
    """Each change to a view that shares its storage (1) or one with its own (2)."""
    xs = _views()
    g = MemoryGuard([array_info(x) for x in xs])
    assert g._unchanged is not None and g._unchanged()
    ptrs = [x.data_ptr() for x in xs]
    sizes = [s.nbytes() for s in g._storages]
    act, moves = CHANGES[change]
    act(xs[which])
    assert ([x.data_ptr() for x in xs] != ptrs
            or [s.nbytes() for s in g._storages] != sizes) is moves
    if moves:
        assert g._unchanged is not None and not g._unchanged()
        # a storage two views share is named after the first of them
        with pytest.raises(kv.InvalidTransferError, match=f"KV tensor [0{which}]"):
            g.check()
    else:
        g.check()  # an allowed change: torch's answer stands
        assert g._unchanged is None or change in ("nothing", "in-place write",
                                                 "transpose_", "set_ same place")


#: share_memory_ followed by another change of the same storage crashes torch itself
CHAINABLE = sorted(set(CHANGES) - {"share_memory_"})


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(CHAINABLE)),
                      max_size=4, unique_by=lambda step: step[0]))
def test_the_gather_never_passes_what_torch_refuses(steps: list[tuple[int, str]]) -> None:
    """After any changes to the tensors (two views of one buffer among them): the gather's
    "unchanged" implies torch's own answer is unchanged, and the guard raises exactly when
    torch's answer changed. One change per tensor: some chains on one tensor crash torch."""
    xs = _views()
    g = MemoryGuard([array_info(x) for x in xs])
    fast = g._unchanged
    assert fast is not None
    ptrs = [x.data_ptr() for x in xs]
    sizes = [s.nbytes() for s in g._storages]
    for i, change in steps:
        try:
            CHANGES[change][0](xs[i])
        except RuntimeError:  # torch refuses some changes to some views: nothing changed
            continue
    exact = ([x.data_ptr() for x in xs] == ptrs
             and [s.nbytes() for s in g._storages] == sizes)
    if fast():
        assert exact
    if exact:
        g.check()
    else:
        with pytest.raises(kv.InvalidTransferError):
            g.check()


def test_a_reader_refuses_what_it_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fields, or a tensor whose data_ptr() the fields do not give: no reader, and the
    guard asks torch every time."""
    import dataclasses

    import kvasync._torch_words as words

    x = _base()[3:]
    assert raw_tensors(torch, [x], [x.untyped_storage()]) is not None
    found = tensor_fields(torch)
    assert found is not None
    wrong = dataclasses.replace(found, impl_offset=found.impl_numel)  # another word
    monkeypatch.setattr(words, "_FIELDS", [wrong])
    assert raw_tensors(torch, [x], [x.untyped_storage()]) is None
    monkeypatch.setattr(words, "_FIELDS", [None])
    assert raw_tensors(torch, [x], [x.untyped_storage()]) is None
    g = MemoryGuard([array_info(x)])
    assert g._unchanged is None
    x.set_(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(kv.InvalidTransferError, match="moved"):
        g.check()
