"""The "pitched" copy path end to end: one 2-D copy per block over a pool's evenly spaced
tensors, checked byte for byte against a reference path on a twin offloader (host:
"memmove"; CUDA: "dma"), with groups, mid-chunk starts, several blocks per chunk and
layer-wise loads; a layout it cannot move is refused before anything is enqueued."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support import Mem

import kvasync as kv
from kvasync._program import mean_height

CASES = [pytest.param("host", id="host"),
         pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
REFERENCE = {"host": "memmove", "cuda": "dma"}
T, BLOCKS, PAGE, CHUNKS = 8, 32, 256, 24


def _twins(backend: str, bpc: int, seed: int) -> tuple[kv.Offloader, kv.Offloader, Any, Any]:
    """Two offloaders over identical pools (T tensors sliced from one array each), groups
    {0..3} and {4..7}."""
    mem = Mem(backend)
    pools = [mem.rand_u8((T, BLOCKS, PAGE), seed=seed) for _ in range(2)]
    groups = [[kv.KVRef(t) for t in range(4)], [kv.KVRef(t) for t in range(4, T)]]
    offs = [kv.Offloader(kv.KVCacheLayout([kv.KVTensor(p[t]) for t in range(T)], groups),
                         CHUNKS, bpc, backend=backend) for p in pools]
    return offs[0], offs[1], pools[0], pools[1]


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", CASES)
@pytest.mark.parametrize("bpc", [1, 2])
async def test_pitched_moves_what_the_reference_path_moves(backend: str, bpc: int) -> None:
    off, ref, pool, ref_pool = _twins(backend, bpc, seed=40 + bpc)
    mem = Mem(backend)
    rng = np.random.default_rng(bpc)
    for round_ in range(3):
        # group 0: 5 blocks from logical block 1 (mid-chunk when bpc > 1), group 1: 3 blocks
        gpu = rng.choice(BLOCKS, 8, replace=False).tolist()
        n0 = -(-(5 + 1 % bpc) // bpc)
        n1 = -(-3 // bpc)
        cpu = rng.choice(CHUNKS, n0 + n1, replace=False).tolist()
        kw = dict(gpu_blocks=gpu, cpu_chunks=cpu, group_sizes=[5, 3], block_indices=[1, 0])
        got = await off.store(**kw, path="pitched")
        await ref.store(**kw, path=REFERENCE[backend])
        assert got.success and got.bytes == 8 * 4 * PAGE
        for a, b in zip(off.cpu_tensors, ref.cpu_tensors):
            np.testing.assert_array_equal(a, b)
        # and back into other blocks
        back = rng.choice(BLOCKS, 8, replace=False).tolist()
        kw = dict(cpu_chunks=cpu, gpu_blocks=back, group_sizes=[5, 3], block_indices=[1, 0])
        await off.load(**kw, path="pitched")
        await ref.load(**kw, path=REFERENCE[backend])
        np.testing.assert_array_equal(mem.to_numpy(pool), mem.to_numpy(ref_pool), str(round_))
    assert off.backend.counts["pitched"] == 6
    await off.aclose()
    await ref.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", CASES)
async def test_a_block_of_a_group_is_one_copy_of_all_its_tensors(backend: str) -> None:
    off, ref, pool, _ = _twins(backend, 1, seed=50)
    plan = off._submitter.plan("d2h", [3, 9], [0, 1], [1, 1], None)
    assert mean_height(plan) == 4  # each group's 4 tensors in one copy per block
    await off.aclose()
    await ref.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", CASES)
async def test_layerwise_pitched_loads_signal_each_layer(backend: str) -> None:
    off, ref, pool, ref_pool = _twins(backend, 1, seed=60)
    mem = Mem(backend)
    ids = list(range(6))
    await off.store(gpu_blocks=ids, cpu_chunks=ids, group_sizes=[6, 0])
    await ref.store(gpu_blocks=ids, cpu_chunks=ids, group_sizes=[6, 0])
    layers = [[0, 1], [2, 3], [4, 5], [6, 7]]
    t = off.load_layerwise(cpu_chunks=ids, gpu_blocks=list(range(10, 16)), layers=layers,
                           group_sizes=[6, 0], path="pitched")
    for i in range(len(layers)):
        assert (await t.layers[i]).success
    await ref.load(cpu_chunks=ids, gpu_blocks=list(range(10, 16)), group_sizes=[6, 0],
                   path=REFERENCE[backend])
    np.testing.assert_array_equal(mem.to_numpy(pool), mem.to_numpy(ref_pool))
    await off.aclose()
    await ref.aclose()


@pytest.mark.parametrize("backend", CASES)
def test_separate_tensors_still_move_and_a_canonical_layout_is_refused(backend: str) -> None:
    mem = Mem(backend)
    gpu = [mem.rand_u8((BLOCKS, PAGE), seed=70 + t) for t in range(3)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), CHUNKS, backend=backend)
    assert off.store(gpu_blocks=[4, 5], cpu_chunks=[1, 2], path="pitched").wait(30).success
    for t in range(3):
        np.testing.assert_array_equal(off.cpu_tensors[t][1:3].reshape(2, PAGE),
                                      mem.to_numpy(gpu[t])[4:6])
    off.close()
    # canonical pages copy parts of pages: refused with nothing enqueued
    half = PAGE // 2
    split = kv.PageMapping(PAGE + 16, PAGE, (kv.CopyRun(0, 0, half), kv.CopyRun(half, half + 16, half)))
    mapped = kv.KVCacheLayout([kv.KVTensor(g) for g in gpu],
                              [[kv.KVRef(t, mapping=split) for t in range(3)]])
    off = kv.Offloader(mapped, CHUNKS, backend=backend, canonical=True)
    with pytest.raises(kv.InvalidTransferError, match="pitched"):
        off.store(gpu_blocks=[4], cpu_chunks=[1], path="pitched")
    assert sum(lane.submitted for lane in off.stats().lanes) == 0
    off.close()


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_auto_sends_tall_copies_of_64_kib_pages_pitched() -> None:
    """16 tensors of one pool, 64 KiB pages: "auto" runs "pitched" for a big store (enqueued
    by the lane's launcher) and its load, and the kernel for an urgent load; bytes match."""
    mem, t, blocks, page = Mem("cuda"), 16, 64, 64 << 10
    pool = mem.rand_u8((t, blocks, page), seed=90)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([pool[i] for i in range(t)]), blocks)
    want = mem.to_numpy(pool).copy()
    ids = list(range(0, 64, 2))  # 32 blocks x 16 tensors x 64 KiB = 32 MiB
    assert (await off.store(gpu_blocks=ids, cpu_chunks=list(range(32)))).success
    assert off.backend.counts["pitched"] == 1
    for i in range(t):
        np.testing.assert_array_equal(np.asarray(off.cpu_tensors[i])[:32], want[i, ids])
    back = list(range(1, 64, 2))
    assert (await off.load(cpu_chunks=list(range(32)), gpu_blocks=back)).success
    assert off.backend.counts["pitched"] == 2
    got = mem.to_numpy(pool)
    np.testing.assert_array_equal(got[:, back], want[:, ids])
    kernels = off.backend.counts["kernel"]
    assert (await off.load(cpu_chunks=[0], gpu_blocks=[1], urgent=True)).success
    assert off.backend.counts["kernel"] == kernels + 1
    await off.aclose()


@pytest.mark.parametrize("backend", CASES)
def test_tables_know_which_allocation_each_tensor_lies_in(backend: str) -> None:
    """Views of one pool share an allocation; tensors allocated apart do not (on the host
    backend by storage; on CUDA as the driver sees it: the caching allocator may put the
    two 2 MiB tensors in one segment, never beside the small pool's 32 KiB)."""
    mem = Mem(backend)
    pool = mem.rand_u8((4, BLOCKS, PAGE), seed=80)
    apart = [mem.rand_u8((BLOCKS, 64 << 10), seed=81 + t) for t in range(2)]  # 2 MiB each
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([*(pool[t] for t in range(4)), *apart]),
                       CHUNKS, backend=backend)
    gpu = off._tables["d2h"].src
    assert len(set(gpu.alloc[:4])) == 1
    assert gpu.alloc[4] != gpu.alloc[0] and gpu.alloc[5] != gpu.alloc[0]
    if backend == "host":
        assert gpu.alloc[4] != gpu.alloc[5]
    assert len(set(off._tables["d2h"].dst.alloc)) == 1  # the offloader's own rows
    off.close()


@pytest.mark.gpu
def test_the_driver_names_each_allocation_and_its_inner_views() -> None:
    """`allocation_ids` on the CUDA backend: raw cudaMalloc buffers (no caching pool between)
    are distinct allocations even where they lie evenly spaced; a view inside one is it."""
    import cupy as cp

    from kvasync._arrays import array_info

    size, ptrs = 4 << 20, [cp.cuda.runtime.malloc(4 << 20) for _ in range(4)]
    try:
        def view(ptr: int, offset: int) -> Any:
            memory = cp.cuda.UnownedMemory(ptr, size, None)
            return cp.ndarray((16, 1024), cp.uint8, cp.cuda.MemoryPointer(memory, offset))

        backend = kv.Offloader(kv.KVCacheLayout.from_tensors([view(ptrs[0], 0)]), 2,
                               backend="cuda").backend
        ids = backend.allocation_ids([array_info(view(p, 0)) for p in ptrs]
                                     + [array_info(view(ptrs[2], 1 << 20))])
        assert ids[:4] == ptrs and ids[4] == ptrs[2]
        backend.close()
    finally:
        for p in ptrs:
            cp.cuda.runtime.free(p)


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.parametrize("page", [16 << 10, 4 << 10])
async def test_pitched_over_tensors_allocated_one_by_one(page: int) -> None:
    """64 tensors of 1 MiB or 256 KiB allocated one by one lie evenly spaced inside and across
    the caching allocator's segments: a 2-D copy over neighbouring segments is refused by
    the driver, so runs stop at each segment; every byte still lands, on "pitched" and
    on "auto" (pitched from 4 KiB pages here)."""
    mem, t, blocks = Mem("cuda"), 64, 64
    gpu = [mem.rand_u8((blocks, page), seed=100 + i) for i in range(t)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks)
    off.backend.PITCHED_MIN_LINE_BYTES = 4 << 10  # type: ignore[attr-defined]  # 4 KiB too
    want = [mem.to_numpy(g) for g in gpu]
    ids = list(range(0, blocks, 2))
    for path in ("pitched", "auto"):
        assert (await off.store(gpu_blocks=ids, cpu_chunks=list(range(32)), path=path)).success
        for i in range(t):
            np.testing.assert_array_equal(np.asarray(off.cpu_tensors[i])[:32], want[i][ids])
        back = list(range(1, blocks, 2))
        assert (await off.load(cpu_chunks=list(range(32)), gpu_blocks=back, path=path)).success
        for i in range(t):
            np.testing.assert_array_equal(mem.to_numpy(gpu[i])[back], want[i][ids])
    await off.aclose()


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_many_short_pitched_copies_land_in_order() -> None:
    """128 2-D copies of 8 short lines per transfer, stored, loaded back elsewhere and
    stored again: each transfer's copies land before it completes, byte-exact."""
    mem, t, blocks, page = Mem("cuda"), 8, 256, 4 << 10
    pool = mem.rand_u8((t, blocks, page), seed=120)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([pool[i] for i in range(t)]), blocks)
    want = mem.to_numpy(pool).copy()
    ids = list(range(0, blocks, 2))  # 128 copies of 8 lines
    assert (await off.store(gpu_blocks=ids, cpu_chunks=list(range(128)), path="pitched")).success
    back = list(range(1, blocks, 2))
    assert (await off.load(cpu_chunks=list(range(128)), gpu_blocks=back,
                           path="pitched")).success
    assert (await off.store(gpu_blocks=back, cpu_chunks=list(range(128, 256)),
                            path="pitched")).success
    for i in range(t):
        np.testing.assert_array_equal(np.asarray(off.cpu_tensors[i])[128:], want[i, ids])
    await off.aclose()


def test_caller_host_arrays_are_allocations_of_their_own() -> None:
    """Caller `host_tensors` are pinned array by array, so even evenly spaced views of one
    buffer never share a 2-D copy: one line per copy, bytes as the reference path's."""
    mem = Mem("host")
    pool = mem.rand_u8((T, BLOCKS, PAGE), seed=130)
    big = np.zeros((T, CHUNKS, PAGE), np.uint8)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([pool[t] for t in range(T)]), CHUNKS,
                       backend="host", host_tensors=list(big))
    assert len(set(off._tables["d2h"].dst.alloc)) == T
    plan = off._submitter.plan("d2h", [3, 9], [0, 1], None, None)
    assert mean_height(plan) == 1
    assert off.store(gpu_blocks=[3, 9], cpu_chunks=[0, 1], path="pitched").wait(30).success
    np.testing.assert_array_equal(big[:, :2], pool[:, [3, 9]])
    off.close()


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_pitched_copies_of_one_line_run_as_coalesced_dma() -> None:
    """One KV tensor: every pitched copy would be a single page, so an explicit "pitched"
    runs as "dma", whose runs coalesce the 64 contiguous pages; the bytes land either way."""
    mem, blocks, page = Mem("cuda"), 128, 4 << 10
    gpu = mem.rand_u8((blocks, page), seed=130)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), blocks)
    want = mem.to_numpy(gpu).copy()
    ids = list(range(64))
    assert (await off.store(gpu_blocks=ids, cpu_chunks=ids, path="pitched")).success
    assert (off.backend.counts["pitched"], off.backend.counts["dma"]) == (0, 1)
    np.testing.assert_array_equal(np.asarray(off.cpu_tensors[0])[:64].reshape(64, page),
                                  want[:64])
    assert (await off.load(cpu_chunks=ids, gpu_blocks=list(range(64, 128)),
                           path="pitched")).success
    np.testing.assert_array_equal(mem.to_numpy(gpu)[64:], want[:64])
    await off.aclose()
