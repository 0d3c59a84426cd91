"""`progress()` of a big CUDA transfer advances piece by piece on every path, only through
the piece boundaries, and ends at (n, n)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvasync as kv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["kernel", "dma", "staged"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_progress_of_a_big_transfer_advances_through_piece_boundaries(
    path: str, direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from kvasync._lane_launch import LaneLaunch

    if path == "dma":  # whole 4 MiB blocks: let pieces be as few blocks as their bytes say
        monkeypatch.setattr(LaneLaunch, "MIN_PIECE_SLOTS", 1)
        monkeypatch.setattr(LaneLaunch, "MIN_FIRST_SLOTS", 1)

    # 1 GiB of 16 KiB pages; DMA moves 256 KiB pages: at 16 KiB its batch calls, on the
    # caller's thread, cost the host more time than the copies cost the link, so the
    # transfer has landed (nearly) whole by the time load()/store() returns
    tensors, page = 16, (256 << 10 if path == "dma" else 16 << 10)
    blocks = (1 << 30) // (tensors * page)
    pool = torch.randint(0, 256, (tensors, blocks, page), dtype=torch.uint8, device="cuda")
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([pool[i] for i in range(tensors)]),
                       num_cpu_chunks=blocks, backend="cuda", copy_path=path)
    try:
        rng = np.random.default_rng(5)
        g, c = rng.permutation(blocks), rng.permutation(blocks)
        if direction == "h2d":
            assert off.store(gpu_blocks=g, cpu_chunks=c).wait(60).success
        torch.cuda.synchronize()
        t = (off.store(gpu_blocks=g, cpu_chunks=c) if direction == "d2h"
             else off.load(cpu_chunks=c, gpu_blocks=g))
        seen = []
        deadline = time.monotonic() + 60
        while not t.done() and time.monotonic() < deadline:
            seen.append(t.progress().done)
        assert t.wait(60).success
        bounds = {landed for _, landed in t._marks} | {0}  # set by a deferred store's launch
        assert len(bounds) > 2, "a 1 GiB transfer is cut into several pieces"
        assert seen == sorted(seen) and set(seen) <= bounds
        assert any(0 < s < t.nbytes for s in seen), "no piece was seen landing before the end"
        assert t.progress() == (t.nbytes, t.nbytes)
    finally:
        off.close()
