"""The lane predicts a transfer's end from its own path's learned rate, counted from when its
enqueue began: a prediction late by more than the waiters' polling window leaves a
completion to a thread wake."""

from __future__ import annotations

import numpy as np
import pytest

import kvasync as kv

PAGE, BLOCKS = 64 << 10, 32  # 2 MiB of one tensor per full transfer


@pytest.mark.timeout(60)
def test_each_path_teaches_its_own_rate_and_predicts_with_it() -> None:
    rng = np.random.default_rng(1)
    gpu = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1)
    lane = off._queues[("d2h", False)]
    ids = list(range(BLOCKS))
    try:
        assert lane.path_rate == {}
        off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove").wait(30)
        assert set(lane.path_rate) == {"memmove"}
        off.store(gpu_blocks=ids, cpu_chunks=ids, path="staged").wait(30)
        assert set(lane.path_rate) == {"memmove", "staged"}
        # a made-up rate per path shows up in the predicted end of the next transfer
        lane.path_rate["memmove"] = 1e15
        lane.path_rate["staged"] = 1e6  # 2 MiB at 1 MB/s: ~2 s
        fast = off.store(gpu_blocks=ids, cpu_chunks=ids, path="memmove")
        fast.wait(30)
        slow = off.store(gpu_blocks=ids, cpu_chunks=ids, path="staged")
        assert slow._eta - fast._eta > 1.5
        slow.wait(30)
    finally:
        off.close()


@pytest.mark.timeout(60)
def test_small_transfers_teach_nothing() -> None:
    gpu = [np.zeros((BLOCKS, 4096), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), BLOCKS, 1)
    try:
        off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1], path="memmove").wait(30)
        assert off._queues[("d2h", False)].path_rate == {}
    finally:
        off.close()
