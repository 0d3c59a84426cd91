"""On the GPU, beside a task that keeps the event loop busy with Python (1 ms at a time,
yielding with sleep(0)): awaited deferred stores and split loads still launch within a few
of its turns (the loop lends its thread to the launcher) and land byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from support import BusyLoop, record_calls

import kvasync as kv
from kvasync._lane_launch import LaneLaunch

pytestmark = pytest.mark.gpu


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_busy_loop_still_launches_and_lands_deferred_transfers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    launched = record_calls(monkeypatch, LaneLaunch, "_launch")
    lends = record_calls(monkeypatch, LaneLaunch, "_lend_loop")
    page, blocks, tensors = 16384, 512, 32
    rng = np.random.default_rng(5)
    gpu = [torch.from_numpy(rng.integers(0, 256, (blocks, page), dtype=np.uint8)).cuda()
           for _ in range(tensors)]
    want = [g.cpu().numpy() for g in gpu]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       copy_path="staged")
    try:
        async with BusyLoop() as busy:
            ids = rng.permutation(blocks)[:400]  # 200 MiB: a deferred store, a split load
            launched.clear()
            before = busy.turns
            r = await off.store(gpu_blocks=ids, cpu_chunks=ids)
            assert r.success and launched and lends
            assert busy.turns - before < 300, busy.turns - before
            for k in range(tensors):
                np.testing.assert_array_equal(off.cpu_tensors[k][ids], want[k][ids])
            for g in gpu:
                g.zero_()
            torch.cuda.synchronize()
            before, lent = busy.turns, len(lends)
            launched.clear()
            r = await off.load(cpu_chunks=ids, gpu_blocks=ids)  # later pieces: the launcher's
            assert r.success and busy.turns - before < 300, busy.turns - before
            assert launched and len(lends) > lent  # the split load's rest was lent for
            for k in range(tensors):
                np.testing.assert_array_equal(gpu[k][ids].cpu().numpy(), want[k][ids])
    finally:
        off.close()
