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


@pytest.mark.asyncio
async def test_vram_transfers_post_the_pages_own_descriptors() -> None:
    """VRAM moves straight from the tensors' pages (no local staging rows on CUDA): one NIXL
    request per transfer, no staging buffer allocated."""
    from kvasync.remote import RemoteOffloader

    kvs = _tensors(4, 64, 16384)
    with pool_process(256 << 20) as pool:
        async with RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), 32,
                                   peer=pool.address) as off:
            await off.store(gpu_blocks=[1, 5, 9], cpu_chunks=[0, 1, 2])
            assert off.backend.requests_posted == 1
            assert off.backend.staging_buffers == 0


def test_layerwise_refuses_a_cuda_compute_stream_before_enqueue() -> None:
    from kvasync.remote import RemoteOffloader

    kvs = _tensors(4, 64, 4096)
    with pool_process(256 << 20) as pool, RemoteOffloader(
            kv.KVCacheLayout.from_tensors(kvs), 32, peer=pool.address) as off:
        with pytest.raises(kv.InvalidTransferError, match="CUDA compute stream"):
            off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0])
        assert all(q.last_transfer is None for q in off._queues.values())
        assert off.backend.requests_posted == 0


@pytest.mark.asyncio
async def test_layerwise_into_vram_with_a_host_compute_stream() -> None:
    """With a kvasync HostStream as the compute stream, layers land in VRAM in order."""
    from kvasync._backends._host import HostStream
    from kvasync.remote import RemoteOffloader

    kvs = _tensors(4, 64, 4096)
    want = [t.clone() for t in kvs]
    compute = HostStream(name="remote-gpu-layers")
    with pool_process(256 << 20) as pool:
        async with RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), 32,
                                   peer=pool.address) as off:
            blocks, chunks = [2, 3, 40], [7, 8, 9]
            await off.store(gpu_blocks=blocks, cpu_chunks=chunks)
            for t in kvs:
                t[blocks] = 0
            torch_sync()
            lt = off.load_layerwise(cpu_chunks=chunks, gpu_blocks=blocks,
                                    layers=[[2, 3], [0, 1]], stream=compute)
            r = await lt
            assert r.bytes == 3 * 4 * 4096
            assert [t.done() for t in lt.layers] == [True, True]
            for t, w in zip(kvs, want):
                assert bool((t == w).all())
    compute.close()


def torch_sync() -> None:
    import torch

    torch.cuda.synchronize()
