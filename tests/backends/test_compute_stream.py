"""The CUDA backend's reading of a caller's compute stream, without a GPU: a stream of
another device is refused before anything is enqueued, whatever kind of object it is (an
event of ours recorded on it would fail, and with it the whole direction)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

import kvasync as kv


def _backend() -> Any:
    pytest.importorskip("cupy")
    from kvasync._backends._cuda import CudaBackend

    be = object.__new__(CudaBackend)  # compute_stream reads only these
    be.device_id, be.tensor_kind = 0, "torch"
    return be


class _Proto:
    """A `__cuda_stream__` object that says its device as cuda.core's streams do."""

    def __init__(self, device: int) -> None:
        self.device = SimpleNamespace(device_id=device)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0x9ABC)


def _cupy_stream(ptr: int, device: int) -> Any:
    cupy = pytest.importorskip("cupy")
    with warnings.catch_warnings():  # deprecated in CuPy 14, the one that takes a device
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, device_id=device)


def test_streams_of_another_device_are_refused_whatever_their_kind() -> None:
    cupy = pytest.importorskip("cupy")
    be = _backend()
    others = [SimpleNamespace(cuda_stream=0x1234, device=SimpleNamespace(index=1)),  # torch
              _cupy_stream(0x5678, 1), _Proto(1)]
    for stream in others:
        with pytest.raises(kv.InvalidTransferError, match="CUDA device 1"):
            be.compute_stream(stream)
    mine = [SimpleNamespace(cuda_stream=0x1234, device=SimpleNamespace(index=0)),
            _cupy_stream(0x5678, 0), _Proto(0)]
    assert [be.compute_stream(s).ptr for s in mine] == [0x1234, 0x5678, 0x9ABC]
    unknown = cupy.cuda.Stream.from_external(_Proto(0))  # CuPy's device_id: -1
    assert be.compute_stream(unknown).ptr == 0x9ABC
