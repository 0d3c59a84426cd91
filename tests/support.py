"""Helpers shared by the test modules (a unique name: tests/gpu has a conftest too)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

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


def record_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[float]:
    """Wrap the method `owner.name` so that it still runs and each call's end time is
    appended to the returned list."""
    seen: list[float] = []
    real = getattr(owner, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return real(self, *args, **kwargs)
        finally:
            seen.append(time.perf_counter())

    monkeypatch.setattr(owner, name, wrapped)
    return seen


class BusyLoop:
    """A task that keeps the running event loop busy, as a loaded server's would: Python for
    `slice_s` at a time, `sleep(0)` between; `turns` counts its slices."""

    def __init__(self, slice_s: float = 0.001) -> None:
        self.slice_s = slice_s
        self.turns = 0
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while not self._stop:
            end = time.perf_counter() + self.slice_s
            while time.perf_counter() < end:
                pass
            self.turns += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> BusyLoop:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        if self._task is not None:
            await self._task
