"""Urgent lanes (a small transfer is not stuck behind a big one) and layer-wise loads."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from support import Mem

import kvasync as kv
from kvasync._backends._host import HostStream


@pytest.mark.asyncio
async def test_urgent_transfer_passes_a_held_normal_one() -> None:
    gpu = [np.random.default_rng(0).integers(0, 256, (32, 512), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 32, backend="host")
    gate = threading.Event()
    compute = HostStream(name="held")
    compute.enqueue(gate.wait)
    big = off.load([0, 1, 2, 3], [0, 1, 2, 3], stream=compute)  # held behind 'compute'
    normal = off.load([4], [4])  # FIFO: waits for `big`
    urgent = off.load([5], [5], urgent=True)
    r = await asyncio.wait_for(urgent, 5)
    assert r.success and not big.done() and not normal.done()
    gate.set()
    await normal
    assert big.done()
    np.testing.assert_array_equal(gpu[0][5], off.cpu_tensors[0][5])
    compute.close()
    await off.aclose()


@pytest.mark.asyncio
async def test_layerwise_load_signals_each_layer(
    backend_case: tuple[str, str], mem: Mem
) -> None:
    backend, path = backend_case
    layers = 4
    gpu = [mem.rand_u8((16, 256), seed=i) for i in range(2 * layers)]  # K and V per layer
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 16, backend=backend, copy_path=path)
    for i, c in enumerate(off.cpu_tensors):
        c[:] = np.random.default_rng(40 + i).integers(0, 256, c.shape, dtype=np.uint8)
    spec = [[2 * i, 2 * i + 1] for i in range(layers)]
    t = off.load_layerwise([3, 4, 5], [7, 8, 9], layers=spec)
    assert len(t) == layers
    done_order: list[int] = []
    for i, layer in enumerate(t.layers):
        layer.add_done_callback(lambda _tr, i=i: done_order.append(i))
    first = await t.layers[0]
    assert first.bytes == 3 * 2 * 256
    t.wait_layer(layers - 1)  # a compute-stream wait on the last layer's event
    total = await t
    assert total.bytes == 3 * 2 * 256 * layers and total.success
    assert done_order == list(range(layers))
    for i in range(2 * layers):
        np.testing.assert_array_equal(mem.to_numpy(gpu[i])[[7, 8, 9]], off.cpu_tensors[i][[3, 4, 5]])
    await off.aclose()


def test_layerwise_rejects_bad_layer_specs() -> None:
    gpu = [np.zeros((4, 8), np.uint8) for _ in range(3)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 4, backend="host")
    for bad in ([[0, 1]], [[0, 1], [1, 2]], [[0], [], [1, 2]], [[0, 1, 2, 3]]):
        with pytest.raises(kv.InvalidTransferError, match="partition"):
            off.load_layerwise([0], [0], layers=bad)
    assert off.load_layerwise([0], [1]).wait(5).bytes == 3 * 8
    off.close()
