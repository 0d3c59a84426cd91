"""Staging rows narrowed to the part of a host row a request covers (`row_window`): requests
of different tensor sets on one offloader each move their own bytes, and a layer-wise load
refused by one layer enqueues none."""

from __future__ import annotations

import numpy as np
import pytest
from support import Mem

import kvasync as kv


@pytest.mark.asyncio
async def test_group_subsets_with_one_window_keep_their_own_staging_tables(
    backend_case: tuple[str, str], mem: Mem
) -> None:
    """Groups {0, 2} then {0, 1, 2}: one window start and width, different tensors inside
    (a staging table cached by window alone packed tensor 1 onto tensor 0's bytes)."""
    backend, path = backend_case
    page, blocks = 64, 8
    gpu = [mem.rand_u8((blocks, page), seed=20 + t) for t in range(4)]
    groups = [[kv.KVRef(t)] for t in range(4)]
    off = kv.Offloader(kv.KVCacheLayout([kv.KVTensor(g) for g in gpu], groups), blocks,
                       backend=backend, copy_path=path)
    await off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 0], group_sizes=[1, 0, 1, 0])
    await off.store(gpu_blocks=[2, 3, 4], cpu_chunks=[5, 5, 5], group_sizes=[1, 1, 1, 0])
    for t, b in ((0, 2), (1, 3), (2, 4)):
        np.testing.assert_array_equal(off.cpu_tensors[t][5], mem.to_numpy(gpu[t])[b])
    # and back: layers {0, 2} then {0, 1, 2}, into other blocks
    sizes = [1, 1, 1, 0]
    await off.load_layerwise(cpu_chunks=[5] * 3, gpu_blocks=[6] * 3,
                             layers=[[0, 2], [1], [3]], group_sizes=sizes)
    await off.load_layerwise(cpu_chunks=[5] * 3, gpu_blocks=[7] * 3,
                             layers=[[0, 1, 2], [3]], group_sizes=sizes)
    for t in range(3):
        np.testing.assert_array_equal(mem.to_numpy(gpu[t])[6], off.cpu_tensors[t][5])
        np.testing.assert_array_equal(mem.to_numpy(gpu[t])[7], off.cpu_tensors[t][5])
    await off.aclose()


def test_a_layer_wider_than_a_staging_buffer_refuses_the_call_before_any_layer_moves(
    backend_case: tuple[str, str], mem: Mem
) -> None:
    """Layer 0 (64 B a row) fits a staging buffer, layer 1 (4 KiB) does not: "staged"
    raises and nothing is enqueued, not even layer 0."""
    backend, path = backend_case
    if path not in ("staged", "auto"):
        pytest.skip("only the staged path has staging buffers")
    gpu = [mem.rand_u8((4, 64), seed=30), mem.rand_u8((4, 4096), seed=31)]
    before = [mem.to_numpy(g) for g in gpu]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 4, backend=backend,
                       staging_bytes=4 << 10)  # buffers of 1-2 KiB, below one 4 KiB row
    for v in off.cpu_tensors:
        v[:] = 7
    with pytest.raises(kv.InvalidTransferError, match="staged"):
        off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], layers=[[0], [1]], path="staged")
    assert sum(lane.submitted for lane in off.stats().lanes) == 0
    for g, b in zip(gpu, before):
        np.testing.assert_array_equal(mem.to_numpy(g), b)
    # auto takes another path for what cannot be staged
    assert off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], layers=[[0], [1]]).wait(30).success
    assert (mem.to_numpy(gpu[1])[0] == 7).all()
    off.close()
