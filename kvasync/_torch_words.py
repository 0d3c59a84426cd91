"""Reading torch's own bookkeeping words in one NumPy gather, for `_memory.MemoryGuard`.

Why: the guard runs on every submit, and a `store()` after a `wait()` finds the KV tensors'
objects cold in the CPU's caches. Asking torch (``data_ptr()``, ``nbytes()``) walks 128
tensors one dependent pointer chain at a time; a gather of fixed addresses lets the CPU
fetch them all at once. A lent H100 host spent ~30 us on 128 ``nbytes()`` calls after a
2 ms sleep where the gather of their sizes added nothing measurable; on a 2-core
development machine the guard of 128 tensors took 72 us inside a host-backend `store()`
with ``data_ptr()`` read one by one.

Every field is found by probing scratch objects (`storage_size_field`, `tensor_fields`):
a word counts only if it alone tracks each change made to it (a storage's data pointer:
the first word that does), and a reader is used only if it answers right for the arrays it
is built on. Otherwise the guard asks torch.
Every address a reader touches belongs to an object it holds (a Python tensor, a storage),
or to a tensor's insides once its Python object is seen to still point there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TensorFields", "Words", "raw_sizes", "raw_tensors", "storage_size_field",
           "tensor_fields"]


class Words:
    """`n` int64 words of this process's memory from `addr`, for `np.asarray` (NumPy reads
    only the words an index names; nothing is copied or touched when the view is made)."""

    def __init__(self, addr: int, n: int) -> None:
        self.__array_interface__ = {"data": (addr, True), "shape": (n,), "typestr": "<i8",
                                    "version": 3}


def _words(addr: int, n: int) -> np.ndarray:
    return np.asarray(Words(addr, n))


def _tracking(addr: int, n: int, want: int) -> list[int]:
    """The indices of the first `n` words at `addr` that hold `want`."""
    w = _words(addr, n)
    return [k for k in range(n) if int(w[k]) == want]


def _still(hits: list[int], addr: int, want: int) -> list[int]:
    w = _words(addr, max(hits, default=0) + 1)
    return [k for k in hits if int(w[k]) == want]


_SIZE_FIELD: list[int | None] = []  # the byte offset, once looked for


def storage_size_field(torch: Any) -> int | None:
    """Where a StorageImpl keeps its byte count (``size_bytes_``), found on a scratch storage
    by resizing it; None unless exactly one word tracks every resize."""
    if not _SIZE_FIELD:
        found: int | None = None
        try:
            probe = torch.UntypedStorage(4096)
            base = int(probe._cdata)
            # a StorageImpl holds at least a refcount, a DataPtr, the size, flags, the
            # allocator and a Python slot (>= 88 bytes): every word read here is inside it
            hits = [k for k in _tracking(base, 10, 4096) if k > 0]
            for n in (1000, 0, 777):
                probe.resize_(n)
                hits = _still(hits, base, n)
            found = 8 * hits[0] if len(hits) == 1 else None
        except Exception:
            found = None
        _SIZE_FIELD.append(found)
    return _SIZE_FIELD[0]


@dataclass(frozen=True)
class TensorFields:
    """Byte offsets of what a tensor's ``data_ptr()`` is computed from."""

    py_impl: int  # in the Python tensor object: its TensorImpl pointer (``_cdata``)
    impl_storage: int  # in a TensorImpl: its StorageImpl pointer
    impl_offset: int  # in a TensorImpl: the storage offset, in elements
    impl_dtype: int  # in a TensorImpl: the dtype's 16-bit index (bytes, not words)
    impl_numel: int  # in a TensorImpl: the element count (none: data_ptr() reads 0)
    storage_data: int  # in a StorageImpl: the data pointer
    storage_size: int  # in a StorageImpl: the byte count


_FIELDS: list[TensorFields | None] = []
_IMPL_WORDS = 22  # sizeof(TensorImpl) is 176 bytes in torch 2.13: every word read is in it


def _find_fields(torch: Any) -> TensorFields | None:
    u8 = torch.uint8
    size = storage_size_field(torch)
    a, b = torch.empty(8, dtype=u8), torch.empty(8, dtype=u8)
    py = _tracking(id(a), type(a).__basicsize__ // 8, int(a._cdata))
    torch.utils.swap_tensors(a, b)  # the Python objects trade insides
    py = _still(py, id(a), int(a._cdata))
    t = torch.empty(64, dtype=u8)
    impl = int(t._cdata)
    st = _tracking(impl, _IMPL_WORDS, int(t.untyped_storage()._cdata))
    kept = []
    for n in (64, 128):
        s = torch.empty(n, dtype=u8).untyped_storage()
        kept.append(s)
        t.set_(s)
        st = _still(st, impl, int(s._cdata))
    base = torch.empty(64, dtype=u8)
    v = base[5:]
    off = _tracking(int(v._cdata), _IMPL_WORDS, 5)
    for k in (7, 11):
        v.set_(base.untyped_storage(), k, (8,))
        off = _still(off, int(v._cdata), k)
    m = torch.empty((8, 8), dtype=u8)  # 2-D: no size word holds the element count
    numel = _tracking(int(m._cdata), _IMPL_WORDS, 64)
    for shape in ((4, 5), (0, 3), (3, 7)):
        m.resize_(shape)
        numel = _still(numel, int(m._cdata), shape[0] * shape[1])
    dts: set[int] | None = None  # a standard dtype's index is its ScalarType number
    for dtype, index in ((torch.int16, 2), (torch.float64, 7), (torch.bfloat16, 15)):
        x = torch.empty(4, dtype=dtype)
        u16 = _words(int(x._cdata), _IMPL_WORDS).view(np.uint16)
        found = {j for j in range(len(u16)) if int(u16[j]) == index}
        dts = found if dts is None else dts & found
    s = torch.UntypedStorage(4096)  # the first word that tracks it: the DataPtr's data (its
    # context often holds the same pointer)
    data = _tracking(int(s._cdata), 10, int(s.data_ptr()))
    for n in (8192, 100000, 50):
        s.resize_(n)
        data = _still(data, int(s._cdata), int(s.data_ptr()))
    if size is None or not data or not dts or len(dts) != 1 or any(
            len(h) != 1 for h in (py, st, off, numel)):
        return None
    return TensorFields(8 * py[0], 8 * st[0], 8 * off[0], 2 * dts.pop(), 8 * numel[0],
                        8 * data[0], size)


def tensor_fields(torch: Any) -> TensorFields | None:
    """The fields, found once per process; None where any is not found exactly."""
    if not _FIELDS:
        try:
            found = _find_fields(torch)
        except Exception:
            found = None
        _FIELDS.append(found)
    return _FIELDS[0]


def _span(addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A word view over every address and each one's index in it (None: one unaligned)."""
    lo = int(addrs.min())
    if (addrs % 8).any() or lo <= 0:
        return None
    return _words(lo, (int(addrs.max()) - lo) // 8 + 1), (addrs - lo) // 8


def raw_sizes(torch: Any, storages: list[Any], sizes: list[int]) -> Callable[[], bool] | None:
    """Every storage's byte count compared in one gather (the reader holds the storages, so
    they stay allocated), or None where the field cannot be found or does not read right."""
    field = storage_size_field(torch)
    if field is None or not storages:
        return None
    held = tuple(storages)
    try:
        span = _span(np.array([int(s._cdata) + field for s in held], dtype=np.int64))
        if span is None:
            return None
        words, idx = span
        want = np.array(sizes, dtype=np.int64).tobytes()
        if words.take(idx).tobytes() != want:
            return None
    except Exception:  # an address NumPy cannot take: the nbytes() calls instead
        return None

    def same(held: tuple[Any, ...] = held) -> bool:  # holds what it reads, whoever lets go
        return bool(words.take(idx).tobytes() == want)

    return same


def raw_tensors(torch: Any, tensors: Sequence[Any], storages: Sequence[Any]
                ) -> Callable[[], bool] | None:
    """True while no tensor's Python object, storage, storage offset, dtype or element count
    changed and no storage's data pointer or size changed (held: `storages`, every storage
    behind `tensors`): two gathers, the Python objects' first, so a tensor's insides are
    read only while its object still points at them (a thread that swaps a tensor's insides
    and frees them between the two gathers is read as of the first, as torch's own calls
    would be read a moment earlier). False means look closer (`MemoryGuard` asks torch);
    None where the fields are unknown or do not give each ``data_ptr()`` now."""
    f = tensor_fields(torch)
    if f is None or not tensors:
        return None
    held = (tuple(tensors), tuple(storages))
    try:
        by_key = {int(s._cdata): s for s in storages}
        impls = [int(t._cdata) for t in tensors]
        keys = [int(t.untyped_storage()._cdata) for t in tensors]
        for t, key in zip(tensors, keys):
            if int(by_key[key].data_ptr()) + t.storage_offset() * t.element_size() != int(
                    t.data_ptr()):
                return None
        first = [id(t) + f.py_impl for t in tensors]
        second = [a for i in impls for a in (i + f.impl_storage, i + f.impl_offset,
                                               i + f.impl_dtype // 8 * 8, i + f.impl_numel)]
        second += [a for k in by_key for a in (k + f.storage_data, k + f.storage_size)]
        span = _span(np.array(first + second, dtype=np.int64))
        if span is None:
            return None
        words, idx = span
        idx1, idx2 = idx[:len(first)], idx[len(first):]
        masks = np.full(len(second), 2**64 - 1, dtype=np.uint64)
        masks[2:4 * len(impls):4] = 0xFFFF << (8 * (f.impl_dtype % 8))
        masks = masks.view(np.int64)
        want1 = np.array(impls, dtype=np.int64).tobytes()
        if words.take(idx1).tobytes() != want1:
            return None
        # what torch says now, word by word (a dtype's word holds other fields: any value)
        now = [v for t, k in zip(tensors, keys)
               for v in (k, t.storage_offset(), None, t.numel())]
        now += [v for s in by_key.values() for v in (int(s.data_ptr()), int(s.nbytes()))]
        read = words.take(idx2)
        if any(v is not None and int(r) != v for r, v in zip(read.tolist(), now)):
            return None
        want2 = (read & masks).tobytes()
    except Exception:
        return None

    def same(held: tuple[Any, ...] = held) -> bool:  # holds what it reads, whoever lets go
        return bool(words.take(idx1).tobytes() == want1
                    and (words.take(idx2) & masks).tobytes() == want2)

    return same
