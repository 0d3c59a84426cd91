"""On the GPU, beside a task that keeps the event loop busy with Python (1 ms at a time,
yielding with sleep(0)): awaited deferred stores and split loads still launch within a few
of its turns (the loop lends its thread to the launcher) and land byte for byte."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._lane_launch import LaneLaunch

pytestmark = pytest.mark.gpu


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_busy_loop_still_launches_and_lands_deferred_transfers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    launched: list[float] = []
    real = LaneLaunch._launch

    def timed(self: Any, job: Any, raise_refusal: bool = False) -> Any:
        rec = real(self, job, raise_refusal)
        launched.append(time.perf_counter())
        return rec

    monkeypatch.setattr(LaneLaunch, "_launch", timed)
    lends: list[float] = []
    real_lend = LaneLaunch._lend_loop

    def counted(self: Any, loop: asyncio.AbstractEventLoop) -> None:
        lends.append(time.perf_counter())
        real_lend(self, loop)

    monkeypatch.setattr(LaneLaunch, "_lend_loop", counted)
    page, blocks, tensors = 16384, 512, 32
    rng = np.random.default_rng(5)
    gpu = [torch.from_numpy(rng.integers(0, 256, (blocks, page), dtype=np.uint8)).cuda()
           for _ in range(tensors)]
    want = [g.cpu().numpy() for g in gpu]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       copy_path="staged")
    stop = False
    turns = 0

    async def busy() -> None:
        nonlocal turns
        while not stop:
            _spin(0.001)
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(busy())
    await asyncio.sleep(0.01)
    try:
        ids = rng.permutation(blocks)[:400]  # 200 MiB: a deferred store, a split load
        launched.clear()
        before = turns
        t = off.store(gpu_blocks=ids, cpu_chunks=ids)
        r = await t
        assert r.success and launched and lends
        assert turns - before < 300, turns - before
        for k in range(tensors):
            np.testing.assert_array_equal(off.cpu_tensors[k][ids], want[k][ids])
        for g in gpu:
            g.zero_()
        torch.cuda.synchronize()
        before, lent = turns, len(lends)
        launched.clear()
        r = await off.load(cpu_chunks=ids, gpu_blocks=ids)  # its later pieces: the launcher's
        assert r.success and turns - before < 300, turns - before
        assert launched and len(lends) > lent  # the split load's rest was lent for
        for k in range(tensors):
            np.testing.assert_array_equal(gpu[k][ids].cpu().numpy(), want[k][ids])
    finally:
        stop = True
        await task
        off.close()
