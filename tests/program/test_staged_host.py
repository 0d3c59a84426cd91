"""The staged path end to end on the host backend: exact bytes, nothing outside a partial
chunk's covered sub-blocks, slabs in order, and refusals before anything is enqueued."""

from __future__ import annotations

import numpy as np
import pytest

import kvasync as kv


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_partial_chunks_leave_neighbouring_sub_blocks_untouched() -> None:
    bpc, page, blocks, chunks = 4, 256, 32, 8
    rng = np.random.default_rng(1)
    gpu = [rng.integers(0, 256, (blocks, page), dtype=np.uint8) for _ in range(3)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), chunks, bpc, copy_path="staged")
    for v in off.cpu_tensors:
        v[:] = 0xA5
    ids = [9, 1, 30, 4, 17]  # from sub-block 2 of chunk 3 to sub-block 2 of chunk 5
    r = await off.store(gpu_blocks=ids, cpu_chunks=[3, 5], block_indices=[2])
    assert r.success and r.bytes == 5 * 3 * page
    for t in range(3):
        exp = np.full((chunks, bpc * page), 0xA5, np.uint8)
        exp[3, 2 * page :] = gpu[t][ids[:2]].ravel()
        exp[5, : 3 * page] = gpu[t][ids[2:]].ravel()
        np.testing.assert_array_equal(off.cpu_tensors[t], exp)
    before = [g.copy() for g in gpu]
    r = await off.load(cpu_chunks=[3], gpu_blocks=[0, 31], block_indices=[2])
    assert r.success
    for t in range(3):
        exp = before[t].copy()
        exp[[0, 31]] = before[t][ids[:2]]
        np.testing.assert_array_equal(gpu[t], exp)
    await off.aclose()


def test_host_rows_hold_every_tensor_side_by_side_in_group_order() -> None:
    pages = [64, 32, 48]
    gpu = [np.zeros((4, p), np.uint8) for p in pages]
    groups = [[kv.KVRef(2)], [kv.KVRef(0), kv.KVRef(1)]]
    off = kv.Offloader(kv.KVCacheLayout([kv.KVTensor(g) for g in gpu], groups), 5, 2)
    views = off.cpu_tensors
    row = sum(2 * p for p in pages)
    assert all(v.strides == (row, 1) for v in views)
    base = min(v.ctypes.data for v in views)
    # group 0's tensor 2 first, then group 1's tensors 0 and 1, gap-free
    assert [v.ctypes.data - base for v in views] == [96, 96 + 128, 0]
    off.close()


@pytest.mark.timeout(60)
def test_many_slabs_keep_order_and_bytes() -> None:
    page, blocks, n_t = 512, 256, 4
    rng = np.random.default_rng(2)
    gpu = [rng.integers(0, 256, (blocks, page), dtype=np.uint8) for _ in range(n_t)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, copy_path="staged",
                       staging_bytes=16 * n_t * page)  # 8 rows per buffer: 32 slabs
    first, second, chunks = (rng.permutation(blocks) for _ in range(3))
    off.store(gpu_blocks=first, cpu_chunks=chunks)
    assert off.store(gpu_blocks=second, cpu_chunks=chunks).wait(30).success
    for t in range(n_t):
        np.testing.assert_array_equal(off.cpu_tensors[t][chunks], gpu[t][second])
    off.close()


def test_a_row_larger_than_a_staging_buffer_is_refused_before_enqueue() -> None:
    gpu = [np.zeros((4, 4096), np.uint8) for _ in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 4, staging_bytes=4096)
    with pytest.raises(kv.InvalidTransferError, match="staged"):
        off.store(gpu_blocks=[0], cpu_chunks=[0], path="staged")
    assert off._resources()["inflight"] == 0
    with pytest.raises(kv.InvalidTransferError, match="staging_bytes"):
        kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 4, staging_bytes=1)
    off.close()


def test_a_plan_moving_nothing_is_staged_whatever_the_row_size() -> None:
    """A row wider than a staging buffer refuses only plans that move bytes: a store of
    empty groups, a non-writer's store and the empty layer of a layer-wise load complete
    with nothing moved, as on every other path."""
    gpu = [np.random.default_rng(i).integers(0, 256, (8, 256), dtype=np.uint8)
           for i in range(2)]
    lay = kv.KVCacheLayout(gpu, [[kv.KVRef(0)], [kv.KVRef(1)]])  # a group: half a row
    with kv.Offloader(lay, 4, staging_bytes=600) as off:  # 300 B buffers: a group fits
        assert off.store(gpu_blocks=[], cpu_chunks=[], group_sizes=[0, 0],
                         path="staged").wait(5).bytes == 0
        assert off.store(gpu_blocks=[3], cpu_chunks=[2], group_sizes=[1, 0],
                         path="staged").wait(5).bytes == 256
        with pytest.raises(kv.InvalidTransferError, match="staged"):  # a whole row
            off.store(gpu_blocks=[3, 4], cpu_chunks=[2, 1], group_sizes=[1, 1],
                      path="staged")
        gpu[0][5] = 0
        t = off.load_layerwise(cpu_chunks=[2], gpu_blocks=[5], group_sizes=[1, 0],
                               path="staged")
        assert t.wait(5).success and [x.wait(5).bytes for x in t.layers] == [256, 0]
        np.testing.assert_array_equal(gpu[0][5], gpu[0][3])
    m = kv.PageMapping(256, 256, kv.PageMapping.identity(256).runs, num_writers=2,
                       writer_index=1)
    lay = kv.KVCacheLayout(gpu, [[kv.KVRef(0, mapping=m)], [kv.KVRef(1, mapping=m)]])
    with kv.Offloader(lay, 4, canonical=True, staging_bytes=600) as off:
        assert off.store(gpu_blocks=[1], cpu_chunks=[0], group_sizes=[1, 0],
                         path="staged").wait(5).bytes == 0  # chunk 0: writer 0's
        assert not off.cpu_tensors[0][0].any()


def test_staging_memory_is_bounded_by_default_configurable_and_reported() -> None:
    """64 MiB per direction by default on CUDA (the class default, read without a GPU);
    an offloader reports what it was given."""
    from kvasync._backends._cuda import CudaBackend

    assert CudaBackend.STAGING_BYTES == 64 << 20
    gpu = [np.zeros((4, 4096), np.uint8) for _ in range(2)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 4, staging_bytes=3 << 20) as off:
        assert off.staging_bytes == 3 << 20
