"""The staged path with its pack and unpack as 2-D copies (the copy engines on CUDA; the
same lines by `memmove` on the host backend), end to end through the offloader."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import Mem

import kvasync as kv

CASES = [pytest.param("host", id="host"),
         pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
#: the threshold that turns the 2-D pack on (`StagedPath.PACK_LINES` on CUDA)
ON = 8.0


def _switch(off: kv.Offloader, on: bool) -> Any:
    """Turn the 2-D pack on or off; returns a reader of (2-D packs, kernel packs) so far
    (pieces on CUDA, slabs on the host backend)."""
    backend: Any = off.backend
    target = getattr(backend, "_staged", backend)
    target.engine_min_height = ON if on else 0.0
    if target is backend:  # host: slabs packed by 2-D lines (the kernel's count unknown)
        return lambda: (backend.engine_slabs, None)
    return lambda: (target.packed_by["engines"], target.packed_by["kernel"])


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", CASES)
@pytest.mark.parametrize("engines", [True, False])
@pytest.mark.parametrize("bpc", [1, 2])
async def test_pool_slices_pack_by_2d_copies_exactly(backend: str, engines: bool,
                                                     bpc: int) -> None:
    """16 KV tensors sliced from one pool: each slab's pack and unpack run as 2-D copies
    (switched on) or the kernel's copies (the default). Many slabs (1 MiB of staging), a
    group starting and ending mid-chunk: the host rows get exactly the covered sub-blocks,
    the load exactly its GPU blocks; the sentinel bytes around them stay."""
    mem = Mem(backend)
    n_t, blocks, page, chunks = 16, 96, 4096, 64
    pool = mem.rand_u8((n_t, blocks, page), seed=140)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([pool[i] for i in range(n_t)]), chunks,
                       bpc, backend=backend, copy_path="staged", staging_bytes=1 << 20)
    packs = _switch(off, engines)
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
    by_2d, by_kernel = packs()
    assert (by_2d > 0) == engines
    if backend == "cuda":
        assert (by_kernel > 0) == (not engines)
    await off.aclose()
