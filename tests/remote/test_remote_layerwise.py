"""Over NIXL (DRAM loopback, a pool process): transfers post runs of rows, not pages;
`load_layerwise` lands each layer's bytes in order, as the local offloader's does; bad
layer-wise requests are refused before anything is enqueued."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from remote_support import PoolProcess, needs_nixl

import kvasync as kv
from kvasync._backends._host import HostStream

pytestmark = [needs_nixl, pytest.mark.timeout(120)]


def _remote(pool: PoolProcess, kvs: list[np.ndarray], chunks: int, bpc: int = 1, **kw):
    from kvasync.remote import RemoteOffloader

    return RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), chunks, bpc,
                           peer=pool.address, timeout=20, **kw)


def test_full_chunks_post_one_descriptor_per_run_of_rows(pool: PoolProcess) -> None:
    """64 tensors, 8 scattered blocks into chunks 3-7 and 10-12: one NIXL request of two
    descriptors each way, and every byte back."""
    rng = np.random.default_rng(3)
    kvs = [rng.integers(0, 256, (32, 512), dtype=np.uint8) for _ in range(64)]
    want = [t.copy() for t in kvs]
    blocks, chunks = [9, 2, 30, 4, 17, 5, 1, 0], [3, 4, 5, 6, 7, 10, 11, 12]
    with _remote(pool, kvs, 16) as off:
        be = off.backend
        assert off.store(gpu_blocks=blocks, cpu_chunks=chunks).wait(20).bytes == 64 * 8 * 512
        assert (be.requests_posted, be.descriptors_posted) == (1, 2)
        for t in kvs:
            t[blocks] = 0
        assert off.load(cpu_chunks=chunks, gpu_blocks=blocks).wait(20).success
        assert (be.requests_posted, be.descriptors_posted) == (2, 4)
        for t, w in zip(kvs, want):
            np.testing.assert_array_equal(t, w)
        assert be.staging_buffers == 1  # reused by the load


def test_small_staging_buffers_split_a_transfer_into_requests(pool: PoolProcess) -> None:
    rng = np.random.default_rng(4)
    kvs = [rng.integers(0, 256, (32, 1024), dtype=np.uint8) for _ in range(4)]
    want = [t.copy() for t in kvs]
    with _remote(pool, kvs, 32, staging_bytes=3 * 4096) as off:  # 3 rows per buffer
        off.store(gpu_blocks=list(range(10)), cpu_chunks=list(range(10))).wait(20)
        assert (off.backend.requests_posted, off.backend.descriptors_posted) == (4, 4)
        for t in kvs:
            t[:10] = 0
        off.load(cpu_chunks=list(range(10)), gpu_blocks=list(range(10))).wait(20)
        for t, w in zip(kvs, want):
            np.testing.assert_array_equal(t, w)


@pytest.mark.asyncio
async def test_load_layerwise_lands_each_layer_in_order_like_the_local_offloader(
        pool: PoolProcess) -> None:
    layers = 4
    pages = [256, 256, 512, 512, 128, 128, 1024, 1024]
    rng = np.random.default_rng(8)
    a = [rng.integers(0, 256, (24, p), dtype=np.uint8) for p in pages]
    b = [t.copy() for t in a]
    spec = [[6, 7], [0, 1], [4, 5], [2, 3]]  # a load order other than the row order
    bpc = 2
    local = kv.Offloader(kv.KVCacheLayout.from_tensors(a), 12, bpc, backend="host")
    off = _remote(pool, b, 12, bpc)
    try:
        blocks, chunks = list(range(3, 12)), [2, 3, 4, 5, 6]
        req = {"group_sizes": [9], "block_indices": [1]}
        await local.store(gpu_blocks=blocks, cpu_chunks=chunks, **req)
        await off.store(gpu_blocks=blocks, cpu_chunks=chunks, **req)
        for t in a + b:
            t[:] = 0
        lb = [13, 14, 15, 16, 17, 18, 19, 20, 21]
        t1 = local.load_layerwise(cpu_chunks=chunks, gpu_blocks=lb, layers=spec, **req)
        compute = HostStream(name="remote-layer-wait")
        t2 = off.load_layerwise(cpu_chunks=chunks, gpu_blocks=lb, layers=spec, job_id=5,
                                stream=compute, **req)
        assert len(t2) == layers and t2.job_id == 5
        assert all(tr.job_id == 5 for tr in t2.layers)
        done_order: list[int] = []
        for i, layer in enumerate(t2.layers):
            layer.add_done_callback(lambda _tr, i=i: done_order.append(i))
        first = await t2.layers[0]
        assert first.bytes == 9 * (1024 + 1024)
        # a host compute stream waits for the last layer on its own thread
        t2.wait_layer(layers - 1, compute)
        reached = threading.Event()
        compute.enqueue(reached.set)
        total = await t2
        assert await asyncio.to_thread(reached.wait, 20)
        await asyncio.sleep(0)
        assert done_order == list(range(layers))
        r1 = await t1
        assert total.bytes == r1.bytes == 9 * sum(pages)
        assert [tr.result().bytes for tr in t2.layers] == [
            tr.result().bytes for tr in t1.layers]
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        assert np.any(b[0][lb])
        compute.close()
    finally:
        local.close()
        off.close()


@pytest.mark.parametrize("call, match", [
    (lambda off: off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], layers=[[0]]), "partition"),
    (lambda off: off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], layers=[[0], [0, 1]]),
     "partition"),
    (lambda off: off.load_layerwise(cpu_chunks=[16], gpu_blocks=[0]), "out of range"),
    (lambda off: off.load_layerwise(cpu_chunks=[0, 1], gpu_blocks=[3, 3]), None),
    (lambda off: off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], job_id="x"), "job_id"),
    (lambda off: off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], stream=object()),
     "HostStream"),
    (lambda off: off.load_layerwise([0], [0]), "keyword only"),  # TypeError, as Offloader's
])
def test_bad_layerwise_requests_rejected_before_enqueue(pool: PoolProcess, call, match) -> None:
    kvs = [np.zeros((8, 256), dtype=np.uint8) for _ in range(2)]
    with _remote(pool, kvs, 16) as off:
        with pytest.raises((kv.InvalidTransferError, TypeError), match=match):
            call(off)
        assert off._resources()["inflight"] == 0
        assert all(q.last_transfer is None for q in off._queues.values())
        assert off.backend.requests_posted == 0
        # nothing consumed a job id
        assert off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0]).wait(20).job_id == 0


def test_a_cuda_compute_stream_is_refused_before_enqueue(pool: PoolProcess,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the compute stream is a CUDA stream (the default on CUDA tensors), a layer
    cannot signal it: InvalidTransferError, nothing enqueued, no job id drawn."""
    from kvasync.remote._backend import _TorchCompute

    kvs = [np.zeros((8, 256), dtype=np.uint8) for _ in range(2)]
    with _remote(pool, kvs, 16) as off:
        monkeypatch.setattr(off.backend, "compute_stream",
                            lambda override: _TorchCompute(object()))
        with pytest.raises(kv.InvalidTransferError, match="CUDA compute stream"):
            off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0])
        assert all(q.last_transfer is None for q in off._queues.values())
        monkeypatch.undo()
        assert off.load(cpu_chunks=[0], gpu_blocks=[0]).wait(20).job_id == 0


def test_a_close_between_layers_fails_the_later_layers_not_the_call(
        pool: PoolProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the local offloader: the layers already submitted write into the GPU blocks,
    so the call returns them and the later layers fail as closed."""
    from kvasync._scheduler import DirectionQueue

    kvs = [np.zeros((8, 4096), np.uint8) for _ in range(3)]
    with _remote(pool, kvs, 8) as off:
        assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).success
        real, calls = DirectionQueue.submit, []

        def submit(self: DirectionQueue, *args: object, **kw: object) -> kv.Transfer:
            if len(calls) == 1:
                self.refuse_new()  # what close() does first, landing after layer 0
            calls.append(1)
            return real(self, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(DirectionQueue, "submit", submit)
        lt = off.load_layerwise(cpu_chunks=[0], gpu_blocks=[1], stream=HostStream())
        monkeypatch.setattr(DirectionQueue, "submit", real)
        assert lt.layers[0].wait(20).success
        for x in lt.layers[1:]:
            with pytest.raises(kv.TransferFailedError, match="closed"):
                x.wait(20)
