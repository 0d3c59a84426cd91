"""Bad input: a clear exception from the call itself, nothing enqueued, nothing written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._testing import submit_raw

BLOCKS, PAGE, CHUNKS = 16, 256, 8


def _setup(bpc: int = 1, groups: int = 1) -> tuple[list[np.ndarray], kv.Offloader]:
    gpu = [np.random.default_rng(i).integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)
           for i in range(2 * groups)]
    layout = kv.KVCacheLayout(
        [kv.KVTensor(t) for t in gpu],
        [[kv.KVRef(2 * g), kv.KVRef(2 * g + 1)] for g in range(groups)],
    )
    off = kv.Offloader(layout, CHUNKS, bpc, backend="host")
    for i, c in enumerate(off.cpu_tensors):
        c[:] = np.random.default_rng(50 + i).integers(0, 256, c.shape, dtype=np.uint8)
    return gpu, off


Call = Callable[[kv.Offloader], Any]

BAD_CALLS: list[tuple[str, Call, str]] = [
    ("negative gpu id", lambda o: o.store(gpu_blocks=[-1], cpu_chunks=[0]), "out of range"),
    ("gpu id too large", lambda o: o.store(gpu_blocks=[BLOCKS], cpu_chunks=[0]), "out of range"),
    ("negative cpu id", lambda o: o.load(cpu_chunks=[-2], gpu_blocks=[0]), "out of range"),
    ("cpu id too large", lambda o: o.load(cpu_chunks=[CHUNKS], gpu_blocks=[0]), "out of range"),
    ("length mismatch", lambda o: o.store(gpu_blocks=[0, 1], cpu_chunks=[0]), "cpu chunks"),
    ("group_sizes sum", lambda o: o.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1], group_sizes=[3]), r"sum\(group_sizes\)"),
    ("group count", lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], group_sizes=[1, 0]), "groups"),
    ("block_indices count", lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], block_indices=[0, 0]), "block_indices"),
    ("negative group size", lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], group_sizes=[-1]), ">= 0"),
    ("negative block index", lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], block_indices=[-1]), ">= 0"),
    ("duplicate cpu dst", lambda o: o.store(gpu_blocks=[0, 1], cpu_chunks=[3, 3]), "duplicate destination"),
    ("duplicate gpu dst", lambda o: o.load(cpu_chunks=[0, 1], gpu_blocks=[4, 4]), "duplicate destination"),
    ("float ids", lambda o: o.store(gpu_blocks=[0.5], cpu_chunks=[0]), "integers"),
    ("bool ids", lambda o: o.store(gpu_blocks=[True], cpu_chunks=[0]), "integers"),
    ("2-D ids", lambda o: o.store(gpu_blocks=[[0]], cpu_chunks=[[0]]), "1-D"),
    ("string ids", lambda o: o.store(gpu_blocks="ab", cpu_chunks=[0]), "1-D"),
    ("huge id", lambda o: o.store(gpu_blocks=[2**63 + 5], cpu_chunks=[0]), "out of range"),
    ("unknown path", lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], path="warp"), "path"),
    ("bad job id", lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], job_id="x"), "job_id"),
    ("bad compute stream", lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], stream=object()), "HostStream"),
]


@pytest.mark.parametrize(("name", "call", "match"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_before_anything_is_enqueued(name: str, call: Call, match: str) -> None:
    gpu, off = _setup()
    gpu_before = [g.copy() for g in gpu]
    cpu_before = [c.copy() for c in off.cpu_tensors]
    with pytest.raises(kv.InvalidTransferError, match=match):
        call(off)
    assert off._resources()["inflight"] == 0 and all(q.last_transfer is None for q in off._queues.values())
    # the next good transfer gets job id 0: nothing was enqueued
    assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(5).job_id == 0
    for i, before in enumerate(cpu_before):  # only chunk 0 (the good store) changed
        np.testing.assert_array_equal(off.cpu_tensors[i][1:], before[1:])
        np.testing.assert_array_equal(off.cpu_tensors[i][0], gpu[i][0])
    off.close()
    for a, b in zip(gpu, gpu_before):
        np.testing.assert_array_equal(a, b)


def test_destination_bytes_untouched_by_rejected_requests() -> None:
    gpu, off = _setup()
    cpu_before = [c.copy() for c in off.cpu_tensors]
    for _, call, _ in BAD_CALLS:
        with pytest.raises(kv.InvalidTransferError):
            call(off)
    off.drain_sync(5)
    for c, b in zip(off.cpu_tensors, cpu_before):
        np.testing.assert_array_equal(c, b)
    off.close()


def test_multi_group_needs_group_sizes_and_checks_chunk_counts() -> None:
    gpu, off = _setup(bpc=2, groups=2)
    with pytest.raises(kv.InvalidTransferError, match="group_sizes is required"):
        off.store(gpu_blocks=[0, 1], cpu_chunks=[0])
    # group 0: 3 blocks starting at logical 1 -> skip 1 -> 2 chunks; group 1: empty
    with pytest.raises(kv.InvalidTransferError, match=r"need 2 cpu chunks"):
        off.store(gpu_blocks=[0, 1, 2], cpu_chunks=[0], group_sizes=[3, 0], block_indices=[1, 0])
    assert off.store(gpu_blocks=[0, 1, 2], cpu_chunks=[0, 1], group_sizes=[3, 0], block_indices=[1, 0]).wait(5).success
    off.close()


def test_empty_transfer_completes_with_zero_bytes() -> None:
    gpu, off = _setup(groups=2)
    r = off.store(gpu_blocks=[], cpu_chunks=[], group_sizes=[0, 0]).wait(5)
    assert r.success and r.bytes == 0
    off.close()


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: kv.KVCacheLayout([]), "at least one tensor"),
        (lambda: kv.KVTensor(np.zeros((4, 8, 8), np.uint8)[:, :, ::2]), "contiguous"),
        (lambda: kv.KVTensor(np.zeros((0, 8), np.uint8)), "dim 0"),
        (lambda: kv.KVTensor(np.zeros((4, 8), np.uint8), page_size_bytes=9), "exceeds"),
        (lambda: kv.KVTensor([1, 2, 3]), "expected a torch tensor"),
        (lambda: kv.KVCacheLayout([np.zeros((4, 8), np.uint8)], [[kv.KVRef(1)]]), "out of range"),
        (lambda: kv.KVCacheLayout([np.zeros((4, 8), np.uint8)], [[kv.KVRef(0), kv.KVRef(0)]]),
         "twice"),
        (lambda: kv.KVCacheLayout([np.zeros((4, 8), np.uint8)], [[kv.KVRef(0, 9)]]), "page_size"),
        (lambda: kv.PageMapping(8, 8, (kv.CopyRun(0, 4, 8),)), "exceeds the canonical"),
        (lambda: kv.PageMapping(8, 8, (kv.CopyRun(0, 0, 4),)), "cover the local page"),
        (lambda: kv.PageMapping(16, 8, (kv.CopyRun(0, 0, 4), kv.CopyRun(2, 8, 6))), "overlap"),
        (lambda: kv.PageMapping(8, 8, (kv.CopyRun(0, 0, 8),), num_writers=2, writer_index=2),
         "writer_index"),
        (lambda: kv.CopyRun(-1, 0, 4), ">= 0"),
        (lambda: kv.Offloader(kv.KVCacheLayout.from_tensors([np.zeros((4, 8), np.uint8)]), 0),
         "num_cpu_chunks"),
        (lambda: kv.Offloader(kv.KVCacheLayout.from_tensors([np.zeros((4, 8), np.uint8)]), 2, 0),
         "blocks_per_chunk"),
        (lambda: kv.Offloader(kv.KVCacheLayout.from_tensors([np.zeros((4, 8), np.uint8)]), 2,
                              canonical=True), "PageMapping"),
        (lambda: kv.Offloader(kv.KVCacheLayout.from_tensors([np.zeros((4, 8), np.uint8)]), 2,
                              copy_path="dma"), "copy_path"),
        (lambda: kv.Offloader("layout", 2), "KVCacheLayout"),  # type: ignore[arg-type]
    ],
)
def test_bad_construction(build: Callable[[], Any], match: str) -> None:
    with pytest.raises(kv.InvalidTransferError, match=match):
        build()


def test_unknown_backend_and_cuda_tensors_on_host() -> None:
    layout = kv.KVCacheLayout.from_tensors([np.zeros((4, 8), np.uint8)])
    with pytest.raises(kv.BackendUnavailableError, match="unknown backend"):
        kv.Offloader(layout, 2, backend="tpu")


def test_invalid_transfer_error_is_a_value_error() -> None:
    assert issubclass(kv.InvalidTransferError, ValueError)
    assert issubclass(kv.OffloaderBrokenError, kv.TransferFailedError)
    assert issubclass(kv.TransferFailedError, kv.KVAsyncError)


@pytest.mark.asyncio
async def test_device_fault_fails_transfer_and_those_behind_it() -> None:
    gpu, off = _setup()
    ok = off.store(gpu_blocks=[0], cpu_chunks=[0])
    await ok
    bad = submit_raw(off, "d2h", np.array([8], np.uint64), np.array([16], np.uint64),
                     np.array([4], np.uint64))
    behind = off.store(gpu_blocks=[1], cpu_chunks=[1])
    cpu1 = off.cpu_tensors[0][1].copy()
    with pytest.raises(kv.TransferFailedError, match="illegal address") as info:
        await bad
    assert info.value.job_id == bad.job_id
    with pytest.raises(kv.TransferFailedError, match="failed") as info2:
        await behind
    assert info2.value.job_id == behind.job_id
    np.testing.assert_array_equal(off.cpu_tensors[0][1], cpu1)  # skipped, not written
    assert off.broken
    with pytest.raises(kv.OffloaderBrokenError):
        off.store(gpu_blocks=[2], cpu_chunks=[2])
    # the other direction is unaffected
    assert (await off.load(cpu_chunks=[0], gpu_blocks=[5])).success
    await off.aclose()  # returns


@pytest.mark.asyncio
async def test_injected_fault_on_host_backend() -> None:
    gpu, off = _setup()
    off.backend.inject_fault()  # type: ignore[attr-defined]
    t = off.load(cpu_chunks=[0], gpu_blocks=[0])
    with pytest.raises(kv.TransferFailedError, match="injected"):
        await t
    assert isinstance(t.exception(), kv.TransferFailedError)
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["auto", "staged"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
async def test_injected_fault_fails_its_transfer_and_writes_nothing(path: str,
                                                                   direction: str) -> None:
    """An injected device fault, on the default path (memmove here) and on the staged
    program, surfaces on the transfer that caused it, leaves the destination untouched,
    and breaks only its direction: the next submission there is refused, the other
    direction still copies."""
    gpu, off = _setup()
    before_gpu = [g.copy() for g in gpu]
    before_cpu = [c.copy() for c in off.cpu_tensors]
    off.backend.inject_fault()  # type: ignore[attr-defined]
    ids = {"gpu_blocks": [3, 1, 2], "cpu_chunks": [0, 5, 6], "path": path}
    submit, other = (off.store, off.load) if direction == "d2h" else (off.load, off.store)
    with pytest.raises(kv.TransferFailedError, match="injected"):
        await submit(**ids)
    for a, b in zip(gpu + off.cpu_tensors, before_gpu + before_cpu):
        assert np.array_equal(a, b)
    with pytest.raises(kv.OffloaderBrokenError):
        submit(**ids)
    await other(**ids)
    if direction == "d2h":  # the load still ran: GPU blocks now hold the chunks
        assert np.array_equal(gpu[0][[3, 1, 2]], off.cpu_tensors[0][[0, 5, 6]])
    else:
        assert np.array_equal(off.cpu_tensors[0][[0, 5, 6]], gpu[0][[3, 1, 2]])
    await off.aclose()


def test_facade_refuses_non_integer_ids_and_reused_job_ids() -> None:
    from kvasync.compat.vllm import CPULoadStoreSpec, CPUOffloadingWorker, GPULoadStoreSpec

    for bad in ([0.5], [True], ["3"]):
        with pytest.raises(kv.InvalidTransferError, match="integers"):
            GPULoadStoreSpec(bad)
        with pytest.raises(kv.InvalidTransferError, match="integers"):
            CPULoadStoreSpec(bad)
    assert GPULoadStoreSpec([2**40]).block_ids.tolist() == [2**40]  # no int32 overflow
    worker = CPUOffloadingWorker([np.zeros((8, 64), np.uint8)], 1, 8)
    worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    with pytest.raises(kv.InvalidTransferError, match="already in flight"):
        worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    worker.shutdown()


def test_layerwise_bad_types_and_path() -> None:
    gpu, off = _setup()
    for bad in ([["a"], [1]], [0, 1]):
        with pytest.raises(kv.InvalidTransferError, match="partition"):
            off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], layers=bad)  # type: ignore[arg-type]
    with pytest.raises(kv.InvalidTransferError, match="path"):
        off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], path="warp")
    assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(5).job_id == 0  # nothing used a job id
    off.close()


def test_huge_host_allocation_is_a_clear_error() -> None:
    layout = kv.KVCacheLayout.from_tensors([np.zeros((4, 1 << 20), np.uint8)])
    with pytest.raises(kv.InvalidTransferError, match="host memory"):
        kv.Offloader(layout, 1 << 40)
