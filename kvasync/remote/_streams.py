"""The NIXL backend's streams: a `HostStream` that can also wait on a CUDA compute stream.

A transfer of CUDA tensors waits on the compute stream that wrote them: `_TorchCompute`
records a blocking-sync CUDA event there (a `_DeviceMark`), and the `_NixlStream` thread
waits for it before the copies queued behind.
"""

from __future__ import annotations

import time
from typing import Any

from .._backends._base import Event, Stream
from .._backends._host import HostEvent, HostStream, _Mark
from .._errors import InvalidTransferError

__all__ = ["_DeviceMark", "_NixlStream", "_TorchCompute"]


class _DeviceMark(_Mark):
    """A recording on a CUDA compute stream: complete once its CUDA event completed."""

    __slots__ = ("device_event",)

    def __init__(self, device_event: Any) -> None:
        super().__init__(done=False)
        self.device_event = device_event


class _TorchCompute(Stream):
    """A torch CUDA stream as the compute stream a transfer waits on: `record` records a
    blocking-sync CUDA event there, which the NIXL stream's thread waits for."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def record(self, event: Event) -> None:
        import torch

        assert isinstance(event, HostEvent)
        ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        ev.record(self.stream)
        event._mark = _DeviceMark(ev)

    def wait_event(self, event: Event) -> None:
        raise InvalidTransferError("a compute stream cannot wait on a remote transfer's event")


def _wait_device(mark: _DeviceMark) -> None:
    mark.device_event.synchronize()
    mark.time = time.perf_counter()
    mark.flag.set()


class _NixlStream(HostStream):
    """A `HostStream` that can also wait on a CUDA compute stream's recording."""

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, HostEvent)
        mark = event._mark
        if isinstance(mark, _DeviceMark):
            self.enqueue(_wait_device, mark)
        else:
            super().wait_event(event)
