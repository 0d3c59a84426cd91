"""The worker cases over the remote tier, checked against the local offloader.

Every case runs the same requests through a `RemoteOffloader` (rows in a pool process,
DRAM over NIXL/UCX loopback) and a local `Offloader` (the oracle the other suites check);
the device arrays must end byte-identical, and reading every chunk back must match too.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from remote_support import PoolProcess, needs_nixl

import kvasync as kv

pytestmark = [needs_nixl, pytest.mark.timeout(120)]

NUM_BLOCKS = 64
NUM_CHUNKS = 48


def _tensors(seed: int, pages: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (NUM_BLOCKS, p), dtype=np.uint8) for p in pages]


def _pair(pool: PoolProcess, pages: list[int], bpc: int, groups: list[list[kv.KVRef]] | None
          ) -> tuple[list[np.ndarray], list[np.ndarray], kv.Offloader,
                     kv.remote.RemoteOffloader]:
    from kvasync.remote import RemoteOffloader

    a, b = _tensors(1, pages), _tensors(1, pages)
    la = kv.KVCacheLayout([kv.KVTensor(t) for t in a], groups)
    lb = kv.KVCacheLayout([kv.KVTensor(t) for t in b], groups)
    local = kv.Offloader(la, NUM_CHUNKS, bpc, backend="host")
    remote = RemoteOffloader(lb, NUM_CHUNKS, bpc, peer=pool.address, timeout=20)
    return a, b, local, remote


async def _readback(local: kv.Offloader, remote: kv.remote.RemoteOffloader,
                    a: list[np.ndarray], b: list[np.ndarray], bpc: int, chunks: list[int]
                    ) -> None:
    """Load `chunks` whole (every group from its first sub-block) and compare both sides."""
    ngroups = len(local.layout.groups)
    for k in range(0, len(chunks), NUM_BLOCKS // bpc):
        part = chunks[k : k + NUM_BLOCKS // bpc]
        blocks = list(range(len(part) * bpc))
        ids_c = part * ngroups
        ids_b = blocks * ngroups
        sizes = [len(blocks)] * ngroups
        await local.load(cpu_chunks=ids_c, gpu_blocks=ids_b, group_sizes=sizes, block_indices=[0] * ngroups)
        await remote.load(cpu_chunks=ids_c, gpu_blocks=ids_b, group_sizes=sizes, block_indices=[0] * ngroups)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("page", [512, 4096])
@pytest.mark.asyncio
async def test_store_then_load_matches_local(pool: PoolProcess, bpc: int, page: int) -> None:
    a, b, local, remote = _pair(pool, [page] * 4, bpc, None)
    rng = np.random.default_rng(page + bpc)
    try:
        for rnd in range(4):
            chunks = rng.choice(NUM_CHUNKS, size=5, replace=False).tolist()
            skip = int(rng.integers(0, bpc))
            n = 5 * bpc - skip - int(rng.integers(0, bpc))
            blocks = rng.choice(NUM_BLOCKS, size=n, replace=False).tolist()
            r1 = await local.store(gpu_blocks=blocks, cpu_chunks=chunks, group_sizes=[n], block_indices=[skip])
            r2 = await remote.store(gpu_blocks=blocks, cpu_chunks=chunks, group_sizes=[n], block_indices=[skip])
            assert (r1.success, r1.bytes) == (r2.success, r2.bytes)
            # a load of other chunks into other blocks, mid-chunk as well
            chunks2 = rng.choice(NUM_CHUNKS, size=3, replace=False).tolist()
            m = 3 * bpc - skip
            blocks2 = rng.choice(NUM_BLOCKS, size=m, replace=False).tolist()
            r1 = await local.load(cpu_chunks=chunks2, gpu_blocks=blocks2, group_sizes=[m], block_indices=[skip])
            r2 = await remote.load(cpu_chunks=chunks2, gpu_blocks=blocks2, group_sizes=[m], block_indices=[skip])
            assert r1.bytes == r2.bytes
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y, f"round {rnd}")
        await _readback(local, remote, a, b, bpc, list(range(NUM_CHUNKS)))
    finally:
        local.close()
        remote.close()


@pytest.mark.asyncio
async def test_groups_with_skips_match_local(pool: PoolProcess) -> None:
    """Three KV-cache groups of two tensors, each group starting mid-chunk."""
    bpc = 4
    groups = [[kv.KVRef(2 * g), kv.KVRef(2 * g + 1)] for g in range(3)]
    a, b, local, remote = _pair(pool, [1024, 1024, 2048, 2048, 768, 768], bpc, groups)
    try:
        # group g: n_g blocks from sub-block skip_g; ids of every group in order
        sizes, skips = [6, 0, 9], [1, 0, 3]
        chunks: list[int] = []
        blocks: list[int] = []
        nxt = 0
        for n, s in zip(sizes, skips):
            used = -(-(n + s) // bpc) if n else 0
            chunks += list(range(nxt, nxt + used))
            blocks += list(range(10, 10 + n))
            nxt += used
        r1 = await local.store(gpu_blocks=blocks, cpu_chunks=chunks, group_sizes=sizes, block_indices=skips)
        r2 = await remote.store(gpu_blocks=blocks, cpu_chunks=chunks, group_sizes=sizes, block_indices=skips)
        assert r1.bytes == r2.bytes > 0
        for x in a + b:
            x[10:30] = 0
        r1 = await local.load(cpu_chunks=chunks, gpu_blocks=blocks, group_sizes=sizes, block_indices=skips)
        r2 = await remote.load(cpu_chunks=chunks, gpu_blocks=blocks, group_sizes=sizes, block_indices=skips)
        assert r1.bytes == r2.bytes
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        await _readback(local, remote, a, b, bpc, list(range(nxt)))
    finally:
        local.close()
        remote.close()


@pytest.mark.asyncio
async def test_conversation_round_trip_and_sync_wait(pool: PoolProcess) -> None:
    """Offload a conversation's blocks, overwrite them, restore them: every byte back;
    `wait()` works from sync code and results carry job ids and bytes."""
    from kvasync.remote import RemoteOffloader

    kvs = _tensors(7, [2048] * 8)
    want = [t.copy() for t in kvs]
    layout = kv.KVCacheLayout.from_tensors(kvs)
    with RemoteOffloader(layout, 32, 2, peer=pool.address) as off:
        res = off.store(gpu_blocks=list(range(40)), cpu_chunks=list(range(20)), job_id=77).wait(20)
        assert (res.job_id, res.success, res.bytes) == (77, True, 40 * 8 * 2048)
        for t in kvs:
            t[:40] = 0
        res = off.load(cpu_chunks=list(range(20)), gpu_blocks=list(range(40))).wait(20)
        assert res.bytes == 40 * 8 * 2048
        for t, w in zip(kvs, want):
            np.testing.assert_array_equal(t, w)
        await asyncio.sleep(0)
    res_after = off._resources()
    assert res_after["stream_threads"] == 0 and res_after["completion_threads"] == 0
