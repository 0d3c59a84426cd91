"""Reading raw pointers, byte strides and devices off torch, CuPy and NumPy arrays.

kvasync never copies or converts a caller's tensor: it reads its address and byte strides
once and keeps a reference so the memory outlives every transfer that touches it. Neither
torch nor CuPy is imported here; arrays are recognised by the protocols they implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._errors import InvalidTransferError

__all__ = ["ArrayInfo", "array_info"]

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

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    def inner_contiguous(self) -> bool:
        """True when every dim after the first is C-contiguous (a row is one byte range)."""
        expected = self.itemsize
        for size, stride in zip(reversed(self.shape[1:]), reversed(self.strides[1:])):
            if size != 1 and stride != expected:
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


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def array_info(x: Any, what: str = "tensor") -> ArrayInfo:
    """Describe `x` (torch tensor, CuPy array, NumPy array or any array-interface object)."""
    if _is_torch(x):
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
        )
    if isinstance(x, np.ndarray):
        return ArrayInfo(
            ptr=int(x.ctypes.data),
            shape=tuple(int(s) for s in x.shape),
            strides=tuple(int(s) for s in x.strides),
            itemsize=int(x.itemsize),
            device="cpu",
            device_id=-1,
            kind="numpy",
            obj=x,
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
        )
    if hasattr(x, "__array_interface__"):
        return array_info(np.asarray(x), what)
    raise InvalidTransferError(
        f"{what}: expected a torch tensor, CuPy array or NumPy array, got {type(x).__name__}"
    )


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))
