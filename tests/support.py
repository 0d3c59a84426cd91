"""Helpers shared by the test modules (a unique name: tests/gpu has a conftest too)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvasync._backends._host import HostStream


class Mem:
    """Makes 'device' arrays for a backend case and reads them back as numpy."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def rand_u8(self, shape: tuple[int, ...], seed: int) -> Any:
        rng = np.random.default_rng(seed)
        host = rng.integers(0, 256, size=shape, dtype=np.uint8)
        if self.backend == "cuda":
            import torch

            return torch.from_numpy(host).cuda()
        return host

    def to_numpy(self, x: Any) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x.copy()
        t = x.detach()
        if t.is_cuda:
            import torch

            torch.cuda.synchronize()
            t = t.cpu()
        return np.ascontiguousarray(t.numpy()).copy()


class Gate:
    """A host 'compute stream' held until `open()`: transfers given it queue up behind it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.stream = HostStream(name="test-gate")
        self.stream.enqueue(self.event.wait)

    def open(self) -> None:
        self.event.set()
