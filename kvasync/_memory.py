"""Which memory a layout's arrays cover, and whether they still own it.

`rows_overlap` / `overlapping_pair`: two tensors of a layout must not share a byte (a load
would write it twice, in no defined order); interleaved views (K and V halves, layers of one
buffer) share none although their extents meet. `MemoryGuard`: a torch tensor's storage can
be freed or replaced in place after its address was read (``untyped_storage().resize_(0)``,
``set_``, ``share_memory_``); the guard notices at submit time, before a copy could land in
freed memory, and keeps what copies already queued need alive.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._arrays import ArrayInfo
from ._errors import InvalidTransferError
from ._torch_words import raw_sizes, raw_tensors

__all__ = ["MemoryGuard", "overlapping_pair", "rows_overlap"]


def rows_overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    """Whether two sets of equally spaced byte rows, ``(first, size, stride, count)`` as
    `ArrayInfo.rows` gives them (rows of one set do not overlap), share a byte.

    Exact: interleaved views of one buffer (the K and V halves of vLLM blocks, the layers of
    a cross-layer allocation) do not overlap although their extents do.
    """
    (pa, ra, sa, na), (pb, rb, sb, nb) = a, b
    if ra == 0 or rb == 0:
        return False
    if pa + (na - 1) * sa + ra <= pb or pb + (nb - 1) * sb + rb <= pa:
        return False  # disjoint extents
    if na == 1 and nb > 1:
        (pa, ra, sa, na), (pb, rb, sb, nb) = (pb, rb, sb, nb), (pa, ra, sa, na)
    if nb == 1 or sa == sb:
        # row i of `a` meets row j of `b` iff k = i - j puts [k*s, k*s + ra) across
        # [d, d + rb), d = pb - pa; some (i, j) in range has that k iff -(nb-1) <= k <= na-1
        s = sa if na > 1 else 1
        d = pb - pa
        k_lo = (d - ra) // s + 1
        k_hi = -(-(d + rb) // s) - 1
        return max(k_lo, 1 - nb) <= min(k_hi, na - 1)
    # different strides (unusual): test every row of `a` against the only row of `b` that can
    # meet it, the last one starting before that row ends
    starts = pa + np.arange(na, dtype=np.int64) * sa
    j = np.minimum((starts + ra - 1 - pb) // sb, nb - 1)
    hit = (j >= 0) & (pb + j * sb + rb > starts)
    return bool(hit.any())


def overlapping_pair(infos: Sequence[ArrayInfo]) -> tuple[int, int] | None:
    """Indices (i < j) of two arrays that share a byte, or None: a sweep over the arrays
    sorted by address, testing only those whose extents meet."""
    spans = sorted((info.rows(), i) for i, info in enumerate(infos))
    for k, (a, i) in enumerate(spans):
        end = infos[i].end
        for b, j in spans[k + 1:]:
            if b[0] >= end:
                break
            if rows_overlap(a, b):
                return (min(i, j), max(i, j))
    return None


class MemoryGuard:
    """A check, cheap enough for every submit, that arrays still own the memory their
    addresses were read from.

    torch: each tensor's ``data_ptr()`` and the byte size of each of their storages (the
    storage objects are kept, so a tensor moved to other memory by ``set_`` leaves its old
    memory alive for copies already queued). Where `_torch_words` finds torch's fields, one
    gather first shows that nothing those answers come from changed; only a change asks
    torch, which then decides (and the gather is not used again). CuPy: ``data.ptr``.
    NumPy: nothing per call; a weak reference to every array of the owner chain makes NumPy
    refuse to resize them in place (even with ``refcheck=False``); a torch storage behind a
    NumPy array (``.numpy()``) cannot be resized (torch refuses) and is kept by that array.
    `keepalive` lists what queued transfers must hold.
    """

    def __init__(self, infos: Sequence[ArrayInfo]) -> None:
        self.keepalive: list[Any] = []
        self._names: list[int] = []  # array index of each tensor check
        self._tensors: list[Any] = []
        self._ptrs: list[int] = []
        self._st_names: list[int] = []
        self._storages: list[Any] = []
        self._st_bytes: list[int] = []
        self._cupy: list[tuple[int, Any, int]] = []
        self._weak: list[weakref.ref[Any]] = []
        self._held: list[Any] = []  # every storage behind a tensor, once
        seen: set[int] = set()
        for i, info in enumerate(infos):
            obj = info.obj
            self.keepalive.append(obj)
            if info.kind == "torch":
                self._names.append(i)
                self._tensors.append(obj)
                self._ptrs.append(int(obj.data_ptr()))
                self._add_storage(i, obj.untyped_storage(), seen)
            elif info.kind == "numpy":
                base: Any = obj
                while isinstance(base, np.ndarray):
                    self._weak.append(weakref.ref(base))
                    base = base.base
            elif info.kind == "cupy":
                self._cupy.append((i, obj, info.ptr))
        torch = sys.modules.get("torch")  # loaded if any array is a torch tensor
        self._data_ptr: Callable[[Any], int] = _no_torch
        self._nbytes: Callable[[Any], int] = _no_torch
        self._ptrs_equal: Callable[[], bool] = self._ptrs_equal_py
        self._sizes_equal: Callable[[], bool] = self._sizes_equal_py
        #: True while nothing changed (one gather); None: ask torch every time
        self._unchanged: Callable[[], bool] | None = None
        if torch is not None:
            self._data_ptr = torch.Tensor.data_ptr
            self._nbytes = torch.UntypedStorage.nbytes
            self._ptrs_equal = self._batched(torch) or self._ptrs_equal_py
            self._sizes_equal = raw_sizes(torch, self._storages, self._st_bytes) or (
                self._sizes_equal_py)
            self._unchanged = raw_tensors(torch, self._tensors, self._held)

    def _add_storage(self, i: int, storage: Any, seen: set[int]) -> None:
        key = int(storage._cdata)  # the storage itself, whatever wrapper object we got
        if key in seen:
            return
        seen.add(key)
        self.keepalive.append(storage)
        self._held.append(storage)
        if not storage.resizable():  # from NumPy, DLPack...: its size cannot change
            return
        self._st_names.append(i)
        self._storages.append(storage)
        self._st_bytes.append(int(storage.nbytes()))

    def _ptrs_equal_py(self) -> bool:
        return list(map(self._data_ptr, self._tensors)) == self._ptrs

    def _sizes_equal_py(self) -> bool:
        return list(map(self._nbytes, self._storages)) == self._st_bytes

    def _batched(self, torch: Any) -> Callable[[], bool] | None:
        """torch's one-call comparison of many tensors' data pointers (CUDA builds have it;
        its CUDA-graph trees check their inputs with it), if it answers both ways right."""
        fn = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
        if fn is None or not self._tensors:
            return None
        idx = list(range(len(self._tensors)))
        wrong = [self._ptrs[0] + 1, *self._ptrs[1:]]
        try:
            tensors, ptrs = self._tensors, self._ptrs
            if fn(tensors, ptrs, idx) is True and fn(tensors, wrong, idx) is False:
                return lambda: bool(fn(tensors, ptrs, idx))
        except Exception:
            pass
        return None

    def check(self, what: str = "KV tensor") -> None:
        """Raise InvalidTransferError if any array lost, resized or moved its memory."""
        if not (self._tensors or self._cupy):  # NumPy only: nothing can move
            return
        try:
            ok = self._torch_ok() and all(int(a.data.ptr) == p for _, a, p in self._cupy)
        except Exception:
            ok = False
        if not ok:
            self._fail(what)

    def _torch_ok(self) -> bool:
        if not self._tensors or (self._unchanged is not None and self._unchanged()):
            return True
        ok = self._ptrs_equal() and (not self._storages or self._sizes_equal())
        if ok:  # a change torch allows (a new dtype view, .data = an alias): ask it from now
            self._unchanged = None
        return ok

    def _fail(self, what: str) -> None:
        """Name the first array that changed (the slow path of `check`)."""
        for i, s, n in zip(self._st_names, self._storages, self._st_bytes):
            size = _read(lambda s=s: s.nbytes())
            ptr = _read(lambda s=s: s.data_ptr())
            if size != n:
                raise InvalidTransferError(
                    f"{what} {i}: its storage was freed or resized ({size} B at {_hex(ptr)} "
                    f"now, {n} B when the layout was built); nothing was enqueued. {_REBUILD}"
                )
        for i, t, p in zip(self._names, self._tensors, self._ptrs):
            now = _read(lambda t=t: t.data_ptr())
            if now != p:
                raise InvalidTransferError(
                    f"{what} {i} moved: data_ptr() is {_hex(now)} now, {p:#x} when the layout "
                    "was built (set_, .data =, share_memory_ or a storage resize replaced its "
                    f"memory); nothing was enqueued. {_REBUILD}"
                )
        for i, a, p in self._cupy:
            now = _read(lambda a=a: a.data.ptr)
            if now != p:
                raise InvalidTransferError(
                    f"{what} {i} moved: data.ptr is {_hex(now)} now, {p:#x} when the layout "
                    f"was built; nothing was enqueued. {_REBUILD}"
                )
        raise InvalidTransferError(f"{what}: its memory cannot be read; nothing was enqueued")


_REBUILD = "Build a new KVCacheLayout and Offloader over the tensors as they are now."


def _no_torch(x: Any) -> int:
    raise TypeError("torch is not loaded")


def _read(fn: Any) -> int | None:
    try:
        return int(fn())
    except Exception:
        return None


def _hex(v: int | None) -> str:
    return "unreadable" if v is None else f"{v:#x}"
