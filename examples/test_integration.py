"""How to test your own code against a kvasync Offloader with pytest-asyncio.

Copy this file as a starting point. It needs only ``pip install -e ".[test]"`` (pytest,
pytest-asyncio) and runs on the host backend, so it works on any CI machine; the same tests
run on a GPU when the ``backend`` fixture below is given ``"cuda"`` (skipped without one).

Patterns shown:

- an async fixture (``@pytest_asyncio.fixture``) that yields an open Offloader and closes it
  afterwards, even when the test fails;
- ``@pytest.mark.asyncio`` tests that await transfers;
- ``asyncio.wait_for`` around awaits, so a bug shows up as a failure, not a hung CI job;
- bad requests raise ``InvalidTransferError`` from the call itself, before anything is
  enqueued, so no ``await`` is needed to see them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import kvasync as kv

NUM_TENSORS, NUM_BLOCKS, PAGE, NUM_CHUNKS = 4, 64, 4096, 128
TIMEOUT_S = 10  # generous: a healthy transfer here takes microseconds


def _cuda_usable() -> bool:
    try:
        import cupy

        if not cupy.is_available():  # cheap; torch is imported only on a GPU machine
            return False
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@dataclass
class KV:
    """What the tests need: the 'GPU' tensors and the offloader moving their blocks."""

    tensors: list[Any]
    off: kv.Offloader

    def gpu(self, i: int) -> np.ndarray:
        """Tensor i as numpy (a copy from the device on CUDA)."""
        t = self.tensors[i]
        return t if isinstance(t, np.ndarray) else t.cpu().numpy()


@pytest.fixture(
    params=[
        "host",
        pytest.param("cuda", marks=pytest.mark.skipif(not _cuda_usable(), reason="no CUDA GPU")),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest_asyncio.fixture
async def cache(backend: str) -> AsyncIterator[KV]:
    """A small KV cache filled with random bytes and an open Offloader over it."""
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 256, (NUM_BLOCKS, PAGE), dtype=np.uint8) for _ in range(NUM_TENSORS)]
    if backend == "cuda":
        import torch

        tensors: list[Any] = [torch.from_numpy(h).cuda() for h in host]
    else:
        tensors = host
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(tensors), NUM_CHUNKS, backend=backend)
    yield KV(tensors, off)
    await off.aclose()  # drains in order, then frees threads and host memory
    assert off.closed


@pytest.mark.asyncio
async def test_store_then_load_round_trip(cache: KV) -> None:
    off = cache.off
    src, chunks, dst = [3, 7, 9], [0, 1, 2], [40, 41, 42]

    stored = await asyncio.wait_for(off.store(gpu_blocks=src, cpu_chunks=chunks), TIMEOUT_S)
    assert stored.success and stored.bytes == len(src) * PAGE * NUM_TENSORS
    for i, host in enumerate(off.cpu_tensors):  # the host copy holds the blocks, in order
        np.testing.assert_array_equal(host[chunks], cache.gpu(i)[src])

    await asyncio.wait_for(off.load(cpu_chunks=chunks, gpu_blocks=dst), TIMEOUT_S)
    for i in range(NUM_TENSORS):
        np.testing.assert_array_equal(cache.gpu(i)[dst], cache.gpu(i)[src])


@pytest.mark.asyncio
async def test_many_concurrent_transfers_complete_in_submission_order(cache: KV) -> None:
    off = cache.off
    # 64 single-block stores, all submitted before the first await
    transfers = [off.store(gpu_blocks=[b], cpu_chunks=[b]) for b in range(NUM_BLOCKS)]
    completed: list[int] = []
    for t in transfers:
        t.add_done_callback(lambda t: completed.append(t.job_id))  # runs on this loop

    results = await asyncio.wait_for(asyncio.gather(*transfers), TIMEOUT_S)

    assert [r.job_id for r in results] == [t.job_id for t in transfers]
    assert completed == sorted(completed)  # one direction completes in submission order
    assert all(r.success for r in results)
    for i, host in enumerate(off.cpu_tensors):
        np.testing.assert_array_equal(host[:NUM_BLOCKS], cache.gpu(i))


@pytest.mark.asyncio
async def test_stores_and_loads_run_concurrently(cache: KV) -> None:
    off = cache.off
    await off.store(gpu_blocks=list(range(8)), cpu_chunks=list(range(8)))
    # loads of chunks 0..7 and stores into chunks 8..15 interleave freely: two queues
    loads = [off.load(cpu_chunks=[c], gpu_blocks=[32 + c]) for c in range(8)]
    stores = [off.store(gpu_blocks=[16 + c], cpu_chunks=[8 + c]) for c in range(8)]
    await asyncio.wait_for(asyncio.gather(*loads, *stores), TIMEOUT_S)
    for i in range(NUM_TENSORS):
        np.testing.assert_array_equal(cache.gpu(i)[32:40], cache.gpu(i)[0:8])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda off: off.store(gpu_blocks=[-1], cpu_chunks=[0]), "out of range"),
        (lambda off: off.store(gpu_blocks=[0], cpu_chunks=[NUM_CHUNKS]), "out of range"),
        (lambda off: off.store(gpu_blocks=[0, 1], cpu_chunks=[0]), "cpu chunks"),
        (lambda off: off.store(gpu_blocks=[0, 1], cpu_chunks=[5, 5]), "duplicate destination"),
        (lambda off: off.load(cpu_chunks=[0], gpu_blocks=[0.5]), "integers"),
    ],
    ids=["negative block", "chunk too large", "count mismatch", "duplicate chunk", "float id"],
)
@pytest.mark.asyncio
async def test_bad_requests_raise_before_anything_is_enqueued(
    cache: KV, call: Any, match: str
) -> None:
    off = cache.off
    before = [c.copy() for c in off.cpu_tensors]

    with pytest.raises(kv.InvalidTransferError, match=match):
        call(off)  # raised by the call itself: there is no transfer to await

    good = await asyncio.wait_for(off.store(gpu_blocks=[0], cpu_chunks=[9]), TIMEOUT_S)
    assert good.job_id == 0  # the rejected call did not even take a job id
    for i, (now, was) in enumerate(zip(off.cpu_tensors, before)):
        np.testing.assert_array_equal(np.delete(now, 9, axis=0), np.delete(was, 9, axis=0))
        np.testing.assert_array_equal(now[9], cache.gpu(i)[0])


@pytest.mark.asyncio
async def test_closed_offloader_refuses_work(cache: KV) -> None:
    await cache.off.aclose()
    with pytest.raises(kv.OffloaderClosedError):
        cache.off.store(gpu_blocks=[0], cpu_chunks=[0])
    await cache.off.aclose()  # closing twice is fine (the fixture closes it again)
