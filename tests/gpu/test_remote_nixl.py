"""The remote tier from GPU memory: VRAM <-> a pool process's DRAM through NIXL (UCX)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "remote"))

from remote_support import needs_nixl, pool_process

import kvasync as kv

pytestmark = [pytest.mark.gpu, needs_nixl, pytest.mark.timeout(180)]


def _tensors(n: int, blocks: int, page: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randint(0, 256, (blocks, page), dtype=torch.uint8, device="cuda",
                          generator=g) for _ in range(n)]


@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.asyncio
async def test_vram_round_trip_matches(bpc: int) -> None:
    from kvasync.remote import RemoteOffloader

    kvs = _tensors(4, 512, 16384)
    want = [t.clone() for t in kvs]
    with pool_process(1 << 30) as pool:
        async with RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), 64, bpc,
                                   peer=pool.address) as off:
            blocks = list(range(3, 3 + 64 * bpc - 1))  # the last chunk partial (bpc > 1)
            chunks = list(range(-(-len(blocks) // bpc)))
            r = await off.store(gpu_blocks=blocks, cpu_chunks=chunks)
            assert r.success and r.bytes == len(blocks) * 4 * 16384
            for t in kvs:
                t[blocks] = 0  # exactly the stored blocks: the load must bring them back
            await off.load(cpu_chunks=chunks, gpu_blocks=blocks)
            for t, w in zip(kvs, want):
                assert bool((t == w).all())


@pytest.mark.asyncio
async def test_store_waits_for_the_compute_stream() -> None:
    """A store submitted right after a kernel wrote a block (on the current stream) moves
    what the kernel wrote, and a load lands before later work on that stream reads it."""
    import torch

    from kvasync.remote import RemoteOffloader

    kvs = _tensors(2, 64, 65536)
    with pool_process(256 << 20) as pool:
        async with RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), 64,
                                   peer=pool.address) as off:
            torch.cuda._sleep(50_000_000)  # keep the stream busy, then write
            for t in kvs:
                t[5].fill_(42)
            await off.store(gpu_blocks=[5], cpu_chunks=[0])
            await off.load(cpu_chunks=[0], gpu_blocks=[6])
            for t in kvs:
                assert bool((t[6] == 42).all())


@pytest.mark.asyncio
async def test_many_awaiters_fifo_from_vram() -> None:
    from kvasync.remote import RemoteOffloader

    kvs = _tensors(2, 128, 4096)
    with pool_process(256 << 20) as pool:
        async with RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), 64,
                                   peer=pool.address) as off:
            ts = [off.store(gpu_blocks=[i], cpu_chunks=[0]) for i in range(32)]
            got = await asyncio.gather(*ts)
            assert [r.job_id for r in got] == [t.job_id for t in ts]
            await off.load(cpu_chunks=[0], gpu_blocks=[100])
            for t in kvs:
                assert bool((t[100] == t[31]).all())
            assert np.isfinite(got[-1].seconds)
