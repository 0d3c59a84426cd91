"""torch tensors on the CPU: read in place (no copy), moved byte-exact, refused when they
cannot be. Skipped without torch, which no other CPU test needs; CI runs this module again
with torch installed and KVASYNC_REQUIRE_TORCH=1, which turns the skip into a failure."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvasync as kv

if os.environ.get("KVASYNC_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def test_a_torch_tensor_is_read_in_place() -> None:
    t = torch.zeros((16, 2, 8, 64), dtype=torch.bfloat16)  # blocks x K/V x heads x head dim
    k = kv.KVTensor(t)
    assert k.info.ptr == t.data_ptr() and k.info.device == "cpu"
    assert k.num_blocks == 16 and k.page == 2 * 8 * 64 * 2


@pytest.mark.asyncio
async def test_bf16_blocks_round_trip_byte_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn((32, 4, 128), generator=gen).to(torch.bfloat16) for _ in range(4)]
    layout = kv.KVCacheLayout.from_tensors(tensors)
    async with kv.Offloader(layout, num_cpu_chunks=8) as off:  # "auto": host backend
        assert off.backend.name == "host"
        await off.store(gpu_blocks=[3, 17, 30], cpu_chunks=[0, 1, 2])
        await off.load(cpu_chunks=[0, 1, 2], gpu_blocks=[5, 6, 7])
        for t, host in zip(tensors, off.cpu_tensors):
            assert torch.equal(t[[5, 6, 7]], t[[3, 17, 30]])
            np.testing.assert_array_equal(host[0], t[3].view(torch.uint8).numpy().ravel())


def test_tensors_that_cannot_be_read_in_place_are_refused() -> None:
    sparse = torch.zeros((4, 8)).to_sparse()
    with pytest.raises(kv.InvalidTransferError, match="strided"):
        kv.KVTensor(sparse)
    with pytest.raises(kv.InvalidTransferError, match="not supported"):
        kv.KVTensor(torch.zeros((4, 8), device="meta"))
    with pytest.raises(kv.InvalidTransferError, match="contiguous"):
        kv.KVTensor(torch.zeros((4, 8, 8))[:, :, ::2])
