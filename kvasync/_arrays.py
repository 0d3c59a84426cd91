"""Reading raw pointers, byte strides and devices off torch, CuPy and NumPy arrays.

kvasync never copies or converts a caller's tensor: it reads its address and byte strides
once and keeps a reference so the memory outlives every transfer that touches it (`_memory`
checks at submit time that it still owns that memory). Neither torch nor CuPy is imported
here; arrays are recognised by the protocols they implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._errors import InvalidTransferError

__all__ = ["ArrayInfo", "allocation_of", "array_info", "is_array", "move_to_front", "select"]

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class ArrayInfo:
    """Address, geometry (strides in bytes) and device of one array, plus the array itself."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    device: Device
    device_id: int
    kind: str
    obj: Any
    dtype: str = ""
    #: False for memory that must never be written (a NumPy view of a `bytes` object)
    writeable: bool = True

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    def inner_dense(self, skip: int | None = None) -> bool:
        """True when the dims after the first (other than `skip`), in some order of their
        strides, are densely packed with positive strides: then one dim-0 row is one byte
        range starting at its first element (C order, or a permuted view such as vLLM's HND
        over NHD)."""
        dims = sorted((st, sz) for d, (sz, st) in enumerate(zip(self.shape, self.strides))
                      if d != 0 and d != skip and sz != 1)
        expected = self.itemsize
        for stride, size in dims:
            if stride != expected:
                return False
            expected *= size
        return True

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (product of the inner dims times the item size)."""
        n = self.itemsize
        for s in self.shape[1:]:
            n *= s
        return n

    @property
    def row_stride(self) -> int:
        return self.strides[0] if self.shape else 0

    def rows(self) -> tuple[int, int, int, int]:
        """(first address, bytes per row, row stride, rows): the bytes this array covers."""
        n = self.shape[0] if self.shape else 1
        stride = self.row_stride if n > 1 else self.row_bytes
        return self.ptr, self.row_bytes, stride, n

    @property
    def end(self) -> int:
        """One past the last byte this array covers (its first address where it has no rows)."""
        ptr, row, stride, n = self.rows()
        return ptr + (n - 1) * stride + row if n else ptr

    def describe(self) -> str:
        """`dtype (shape) device` for messages and reprs."""
        dev = "cpu" if self.device == "cpu" else f"cuda:{self.device_id}"
        return f"{self.kind} {self.dtype} {self.shape} on {dev}"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def is_array(x: Any) -> bool:
    """True for one array object (torch tensor, NumPy/CuPy array, array-interface object),
    as opposed to a list of them."""
    return (
        (_is_torch(x) and hasattr(x, "data_ptr"))
        or isinstance(x, np.ndarray)
        or hasattr(x, "__cuda_array_interface__")
        or hasattr(x, "__array_interface__")
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def array_info(x: Any, what: str = "tensor") -> ArrayInfo:
    """Describe `x` (torch tensor, CuPy array, NumPy array or any array-interface object)."""
    if _is_torch(x) and hasattr(x, "data_ptr"):
        if getattr(x, "is_sparse", False) or x.layout.__repr__() != "torch.strided":
            raise InvalidTransferError(f"{what}: only strided (dense) torch tensors are supported")
        if x.device.type not in ("cpu", "cuda"):
            raise InvalidTransferError(f"{what}: torch device {x.device} is not supported")
        es = x.element_size()
        device: Device = "cuda" if x.device.type == "cuda" else "cpu"
        return ArrayInfo(
            ptr=int(x.data_ptr()),
            shape=tuple(int(s) for s in x.shape),
            strides=tuple(int(s) * es for s in x.stride()),
            itemsize=es,
            device=device,
            device_id=int(x.device.index or 0) if device == "cuda" else -1,
            kind="torch",
            obj=x,
            dtype=_dtype_name(x.dtype),
        )
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:  # copying its bytes would copy references without counting
            raise InvalidTransferError(
                f"{what}: a NumPy array of dtype {x.dtype} holds Python objects, not bytes"
            )
        return ArrayInfo(
            ptr=int(x.ctypes.data),
            shape=tuple(int(s) for s in x.shape),
            strides=tuple(int(s) for s in x.strides),
            itemsize=int(x.itemsize),
            device="cpu",
            device_id=-1,
            kind="numpy",
            obj=x,
            dtype=str(x.dtype),
            writeable=bool(x.flags.writeable),
        )
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(int(s) for s in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
        strides = cai.get("strides")
        if strides is None:
            strides = _c_strides(shape, itemsize)
        dev = getattr(x, "device", None)
        dev_id = int(getattr(dev, "id", 0) or 0)
        return ArrayInfo(
            ptr=int(cai["data"][0]),
            shape=shape,
            strides=tuple(int(s) for s in strides),
            itemsize=itemsize,
            device="cuda",
            device_id=dev_id,
            kind=type(x).__module__.split(".")[0],
            obj=x,
            dtype=str(np.dtype(cai["typestr"])),
            writeable=not bool(cai["data"][1]),
        )
    if hasattr(x, "__array_interface__"):
        return array_info(np.asarray(x), what)
    hint = ""
    if isinstance(x, (bytes, bytearray, memoryview)):
        hint = (" (a buffer has no block dimension: wrap it, e.g. "
                "np.frombuffer(buf, np.uint8).reshape(num_blocks, page_bytes))")
    raise InvalidTransferError(
        f"{what}: expected a torch tensor, CuPy array or NumPy array, got "
        f"{type(x).__name__}{hint}"
    )


def stream_device(stream: Any) -> int | None:
    """The CUDA device of a caller's stream object, where it says: CuPy's ``device_id``,
    torch's ``device.index``, cuda.core's ``device.device_id``; None where it does not
    (the stream is taken as it is)."""
    dev = getattr(stream, "device_id", None)
    if dev is None:
        where = getattr(stream, "device", None)
        dev = getattr(where, "index", None)
        if dev is None:
            dev = getattr(where, "device_id", None)
    if isinstance(dev, bool) or not isinstance(dev, (int, np.integer)) or dev < 0:
        return None  # CuPy says -1 for a stream whose device it was not told
    return int(dev)


def allocation_of(info: ArrayInfo) -> int:
    """An id of the memory allocation `info`'s array lies in, from the array itself: a
    torch storage's start, a CuPy memory's start, the id of a NumPy array's root buffer;
    the array's own address (an allocation of its own) where nothing tells. Equal ids:
    one allocation (arrays in one torch storage, one CuPy allocation or one buffer)."""
    x = info.obj
    if info.kind == "torch":
        return int(x.untyped_storage().data_ptr())
    if info.kind == "numpy":
        while isinstance(x, np.ndarray) and x.base is not None:
            x = x.base
        while isinstance(x, memoryview):
            x = x.obj
        return int(x.ctypes.data) if isinstance(x, np.ndarray) else id(x)
    mem = getattr(getattr(x, "data", None), "mem", None)  # CuPy: MemoryPointer.mem
    ptr = getattr(mem, "ptr", None)
    return int(ptr) if isinstance(ptr, int) else info.ptr


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def move_to_front(x: Any, dim: int) -> Any:
    """A view of `x` with dim `dim` first, the others in order (no copy)."""
    order = [dim, *(d for d in range(len(x.shape)) if d != dim)]
    if _is_torch(x):
        return x.permute(*order)
    if not hasattr(x, "transpose"):
        raise InvalidTransferError(
            f"block_dim needs a torch tensor, NumPy or CuPy array, got {type(x).__name__}"
        )
    return x.transpose(order)


def select(x: Any, dim: int, index: int) -> Any:
    """The view ``x[..., index, ...]`` along `dim` (no copy)."""
    if _is_torch(x):
        return x.select(dim, index)
    return x[(slice(None),) * dim + (index,)]
