"""The staged path over KV tensors sliced from one pool, end to end through the offloader:
many slabs, a group starting and ending mid-chunk, sentinels around the covered bytes."""

from __future__ import annotations

import numpy as np
import pytest
from support import Mem

import kvasync as kv

CASES = [pytest.param("host", id="host"),
         pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", CASES)
@pytest.mark.parametrize("bpc", [1, 2])
async def test_pool_slices_stage_exactly(backend: str, bpc: int) -> None:
    """16 KV tensors sliced from one pool, many slabs (1 MiB of staging), a group starting
    and ending mid-chunk: the host rows get exactly the covered sub-blocks, the load exactly
    its GPU blocks; the sentinel bytes around them stay."""
    mem = Mem(backend)
    n_t, blocks, page, chunks = 16, 96, 4096, 64
    pool = mem.rand_u8((n_t, blocks, page), seed=140)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([pool[i] for i in range(n_t)]), chunks,
                       bpc, backend=backend, copy_path="staged", staging_bytes=1 << 20)
    sentinel = [np.full(np.asarray(v).shape, 0x5A, np.uint8) for v in off.cpu_tensors]
    for v, s in zip(off.cpu_tensors, sentinel):
        v[:] = s
    want = mem.to_numpy(pool).copy()
    rng = np.random.default_rng(bpc)
    skip = bpc - 1  # bpc 2: the group starts at sub-block 1 and ends at sub-block 0
    ids = rng.permutation(blocks)[: 40 * bpc - 2 * skip].tolist()
    cpu = rng.permutation(chunks)[:40].tolist()
    assert (await off.store(gpu_blocks=ids, cpu_chunks=cpu, block_indices=[skip])).success
    for t in range(n_t):
        exp = sentinel[t].copy().reshape(chunks, bpc, page)
        for k, g in enumerate(ids):
            exp[cpu[(k + skip) // bpc], (k + skip) % bpc] = want[t, g]
        np.testing.assert_array_equal(np.asarray(off.cpu_tensors[t]).reshape(chunks, bpc, page),
                                      exp)
    back = rng.permutation(blocks)[: len(ids)].tolist()
    pool[:] = 0
    assert (await off.load(cpu_chunks=cpu, gpu_blocks=back, block_indices=[skip])).success
    got = mem.to_numpy(pool)
    np.testing.assert_array_equal(got[:, back], want[:, ids])
    assert not got[:, np.setdiff1d(np.arange(blocks), back)].any()
    await off.aclose()
