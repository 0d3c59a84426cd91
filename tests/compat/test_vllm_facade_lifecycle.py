"""The vLLM facade as a drop-in: vLLM's constructor order, job ids, exactly-once reporting
across shutdown, and its calls from other threads and from done-callbacks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvasync as kv
from kvasync._backends._host import HostStream
from kvasync.compat.vllm import CPULoadStoreSpec, CPUOffloadingWorker, GPULoadStoreSpec

PAGE = 4096


def tensors(blocks: int = 32, page: int = 256, n: int = 2) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 256, (blocks, page), dtype=np.uint8)
            for i in range(n)]


class Gate:
    """Holds every transfer of the worker's offloader behind a host 'compute stream'."""

    def __init__(self, worker: CPUOffloadingWorker) -> None:
        self.event = threading.Event()
        self.stream = HostStream(name="test-gate")
        self.stream.enqueue(self.event.wait)
        self.worker = worker
        worker.offloader._compute_override = self.stream

    def open(self) -> None:
        self.event.set()
        self.worker.offloader._compute_override = None

    def close(self) -> None:
        self.open()
        self.stream.close()


@pytest.fixture
def worker() -> Iterator[CPUOffloadingWorker]:
    w = CPUOffloadingWorker(tensors(), 1, 32)
    yield w
    w.shutdown()


def store(w: CPUOffloadingWorker, jid: object, block: int, chunk: int) -> bool:
    return w.submit_store(jid, GPULoadStoreSpec([block]), CPULoadStoreSpec([chunk]))  # type: ignore[arg-type]


# -- reporting every job exactly once ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_shutdown_with_jobs_in_flight_reports_each_once() -> None:
    w = CPUOffloadingWorker(tensors(blocks=64, page=PAGE), 1, 64)
    gate = Gate(w)
    for j in range(20):
        store(w, 100 + j, j, j)
        w.submit_load(200 + j, CPULoadStoreSpec([40 + j]), GPULoadStoreSpec([40 + j]))
    assert w.get_finished() == []  # all held
    threading.Timer(0.1, gate.open).start()
    w.shutdown()  # drains the jobs in flight
    results = w.get_finished()
    assert sorted(r.job_id for r in results) == [*range(100, 120), *range(200, 220)]
    assert all(r.success for r in results)
    assert w.get_finished() == []  # exactly once
    w.shutdown()
    assert w.get_finished() == []
    gate.close()


@pytest.mark.timeout(60)
def test_shutdown_right_after_submitting_loses_nothing() -> None:
    """Whatever finished before or during shutdown is reported afterwards, once."""
    w = CPUOffloadingWorker(tensors(blocks=64, page=1 << 16), 1, 64)
    for j in range(32):
        store(w, j, j, j)
    early = w.get_finished()
    w.shutdown()
    late = w.get_finished()
    assert sorted(r.job_id for r in early + late) == list(range(32))
    assert w.get_finished() == []


@pytest.mark.timeout(60)
def test_failed_job_in_flight_at_shutdown_is_reported_failed() -> None:
    w = CPUOffloadingWorker(tensors(), 1, 32)
    gate = Gate(w)
    w.offloader.backend.inject_fault()  # type: ignore[attr-defined]
    store(w, 1, 0, 0)
    store(w, 2, 1, 1)
    threading.Timer(0.05, gate.open).start()
    w.shutdown()
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, False), (2, False)]
    gate.close()


# -- job ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, True, False, 1.0, "3", b"3", [1], np.float64(2)])
def test_job_ids_must_be_ints(worker: CPUOffloadingWorker, bad: object) -> None:
    with pytest.raises(kv.InvalidTransferError, match="job_id must be an int"):
        store(worker, bad, 0, 0)
    with pytest.raises(kv.InvalidTransferError, match="job_id must be an int"):
        worker.submit_load(bad, CPULoadStoreSpec([0]), GPULoadStoreSpec([0]))  # type: ignore[arg-type]
    assert worker.offloader._resources()["inflight"] == 0  # nothing was enqueued
    assert worker.get_finished() == []


def test_numpy_integer_job_ids_are_ints(worker: CPUOffloadingWorker) -> None:
    store(worker, np.int64(5), 0, 0)
    worker.wait([5])
    assert [(r.job_id, type(r.job_id)) for r in worker.get_finished()] == [(5, int)]


@pytest.mark.timeout(60)
def test_reusing_an_id_still_in_flight_is_refused(worker: CPUOffloadingWorker) -> None:
    gate = Gate(worker)
    store(worker, 7, 0, 0)
    with pytest.raises(kv.InvalidTransferError, match="already in flight"):
        store(worker, 7, 1, 1)
    gate.close()
    worker.wait([7])
    assert [r.job_id for r in worker.get_finished()] == [7]


@pytest.mark.timeout(60)
def test_reusing_a_finished_unreported_id_overwrites() -> None:
    """vLLM's overwrite: the finished job and the new one are each reported, in order, and
    wait() waits for the new one."""
    gpu = tensors()
    worker = CPUOffloadingWorker(gpu, 1, 32)
    store(worker, 3, 0, 0)
    worker.wait([3])  # finished, not reported
    gate = Gate(worker)
    store(worker, 3, 1, 1)
    waited = threading.Event()
    th = threading.Thread(target=lambda: (worker.wait([3]), waited.set()))
    th.start()
    assert not waited.wait(0.1)  # waits for the new job 3, held by the gate
    gate.close()
    th.join(10)
    assert waited.is_set()
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(3, True), (3, True)]
    assert (worker.cpu_tensors[0][1] == gpu[0][1]).all()
    assert worker._by_id == {}
    store(worker, 3, 2, 2)  # the id is free again
    worker.wait([3])
    assert [r.job_id for r in worker.get_finished()] == [3]
    worker.shutdown()


@pytest.mark.timeout(60)
def test_wait_ignores_unknown_and_non_int_ids(worker: CPUOffloadingWorker) -> None:
    gate = Gate(worker)
    store(worker, 1, 0, 0)
    start = time.monotonic()
    worker.wait([None, "x", 1.5, True, 12345])  # type: ignore[list-item]
    assert time.monotonic() - start < 1  # none of them is job 1 (True == 1 is no job id)
    gate.close()
    worker.wait([np.int64(1)])
    assert [r.job_id for r in worker.get_finished()] == [1]


# -- block ids: 64-bit, range checked at submit ------------------------------------------------


def test_block_ids_are_64_bit_and_checked_at_submit(worker: CPUOffloadingWorker) -> None:
    spec = GPULoadStoreSpec([2**40])
    assert spec.block_ids.dtype == np.int64 and spec.block_ids.tolist() == [2**40]
    with pytest.raises(kv.InvalidTransferError, match="out of range"):
        worker.submit_store(1, spec, CPULoadStoreSpec([0]))
    with pytest.raises(kv.InvalidTransferError, match="out of range"):
        worker.submit_load(1, CPULoadStoreSpec([2**40]), GPULoadStoreSpec([0]))
    for ids in ([2**63 + 5], [2**64 + 1]):  # beyond int64: refused by the spec
        with pytest.raises(kv.InvalidTransferError):
            CPULoadStoreSpec(ids)
    assert worker.offloader._resources()["inflight"] == 0 and worker.get_finished() == []


@pytest.mark.parametrize("bad", [None, 3, [0.5], [True], "ab"])
def test_spec_ids_refused(bad: object) -> None:
    with pytest.raises(kv.InvalidTransferError):
        CPULoadStoreSpec(bad)  # type: ignore[arg-type]
    with pytest.raises(kv.InvalidTransferError):
        GPULoadStoreSpec(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("sizes, indices", [([1.0], None), ([True], None), ([1], [0.5]),
                                            (["1"], None)])
def test_spec_group_fields_are_ints(sizes: object, indices: object) -> None:
    with pytest.raises(kv.InvalidTransferError):
        GPULoadStoreSpec([0], sizes, indices)  # type: ignore[arg-type]


def test_submit_needs_specs(worker: CPUOffloadingWorker) -> None:
    with pytest.raises(kv.InvalidTransferError, match="spec"):
        worker.submit_store(1, [0], [0])  # type: ignore[arg-type]
    assert worker.get_finished() == []


# -- vLLM's constructor ------------------------------------------------------------------------


def test_fourth_positional_is_mmap_region(names: Callable[[], str]) -> None:
    from kvasync import SharedHostRegion

    region = SharedHostRegion(names(), 16, PAGE, 0, 1)  # a row: 2 tensors x 2 blocks x 256 B
    try:
        w = CPUOffloadingWorker(tensors(page=256), 2, 16, region)
        assert not w.offloader.canonical
        view = w.cpu_tensors[0]
        base = region.base_ptr
        assert base <= view.ctypes.data < base + 16 * PAGE  # the region's memory
        w.submit_store(1, GPULoadStoreSpec([4, 5]), CPULoadStoreSpec([3]))
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
        w.shutdown()
        assert region.closed  # the worker owns the region after construction, as in vLLM
    finally:
        region.close()


@pytest.mark.parametrize("fourth", [True, False, 1, "canonical", np.True_])
def test_a_fourth_positional_that_is_no_region_is_refused(fourth: object) -> None:
    with pytest.raises(kv.InvalidTransferError, match="mmap_region"):
        CPUOffloadingWorker(tensors(), 1, 8, fourth)


def test_a_mapping_of_layer_tensors_is_refused_with_what_to_pass() -> None:
    caches = {"layer.0": tensors()[0], "layer.1": tensors()[1]}
    with pytest.raises(kv.InvalidTransferError, match="kv_caches is a mapping"):
        CPUOffloadingWorker(caches, 1, 8)
    w = CPUOffloadingWorker(list(caches.values()), 1, 8)  # what the message offers
    w.shutdown()


def test_two_blocks_of_three_dims_name_the_call_that_takes_block_dim() -> None:
    kv_like = [np.zeros((2, 4, 64), np.uint8)]
    with pytest.raises(kv.InvalidTransferError, match=r"from_tensors\(\.\.\., block_dim=0\)"):
        CPUOffloadingWorker(kv_like, 1, 8)
    layout = kv.KVCacheLayout.from_tensors(kv_like, block_dim=0)
    CPUOffloadingWorker(layout, 1, 8).shutdown()


def test_num_cpu_blocks_alias_and_conflicts() -> None:
    w = CPUOffloadingWorker(tensors(), 1, num_cpu_blocks=8)
    assert w.offloader.num_cpu_chunks == 8
    w.shutdown()
    w = CPUOffloadingWorker(kv_caches=tensors(), blocks_per_chunk=1, num_cpu_chunks=8)
    w.shutdown()
    with pytest.raises(kv.InvalidTransferError, match="once"):
        CPUOffloadingWorker(tensors(), 1, 8, num_cpu_blocks=8)
    with pytest.raises(kv.InvalidTransferError, match="once"):
        CPUOffloadingWorker(tensors(), 1)


def test_canonical_layout_fifth_positional_and_type() -> None:
    gpu = [np.zeros((8, 256), np.uint8)]
    mapping = kv.private_page_mapping(256, world_size=1, rank=0)
    layout = kv.KVCacheLayout(gpu, [[kv.KVRef(0, 256, mapping)]])
    w = CPUOffloadingWorker(layout, 1, 8, None, True)
    assert w.offloader.canonical
    w.shutdown()
    with pytest.raises(kv.InvalidTransferError, match="canonical_layout must be a bool"):
        CPUOffloadingWorker(layout, 1, 8, None, "yes")  # type: ignore[arg-type]


# -- from other threads and from callbacks -----------------------------------------------------


@pytest.mark.timeout(60)
def test_concurrent_submit_and_get_finished_report_each_job_once() -> None:
    w = CPUOffloadingWorker(tensors(blocks=64), 1, 64)
    seen: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def submitter(base: int) -> None:
        for j in range(150):
            store(w, base + j, j % 64, (base // 1000 * 7 + j) % 64)
            if j % 3 == 0:
                w.wait([base + j])

    def reporter() -> None:
        while not stop.is_set():
            got = w.get_finished()
            with lock:
                seen.extend(r.job_id for r in got)
            time.sleep(0)

    subs = [threading.Thread(target=submitter, args=(k * 1000,)) for k in range(2)]
    reps = [threading.Thread(target=reporter) for _ in range(2)]
    for t in [*subs, *reps]:
        t.start()
    for t in subs:
        t.join(30)
    w.shutdown()
    stop.set()
    for t in reps:
        t.join(10)
    seen.extend(r.job_id for r in w.get_finished())
    expected = [k * 1000 + j for k in range(2) for j in range(150)]
    assert sorted(seen) == expected  # each exactly once


@pytest.mark.timeout(60)
def test_facade_calls_inside_a_done_callback() -> None:
    w = CPUOffloadingWorker(tensors(), 1, 32)
    gate = Gate(w)
    store(w, 1, 0, 0)  # held
    gate_done = threading.Event()
    report: dict[str, object] = {}

    def cb(tr: kv.Transfer) -> None:
        try:
            report["finished"] = [r.job_id for r in w.get_finished()]
            report["submit"] = store(w, 2, 1, 1)
            try:
                w.wait([2])
                report["wait"] = "returned"
            except RuntimeError as exc:
                report["wait"] = str(exc)
            w.shutdown()  # does not wait: the release follows the last job
            report["shutdown"] = True
        finally:
            gate_done.set()

    own = w.offloader.store(gpu_blocks=[5], cpu_chunks=[5])  # a transfer of the same lane, behind job 1
    own.add_done_callback(cb)
    gate.open()
    assert gate_done.wait(10)
    assert report["finished"] == [1] and report["submit"] is True  # job 1 ran before
    assert "done-callback" in str(report["wait"]) and report["shutdown"] is True
    with pytest.raises(kv.OffloaderClosedError):
        store(w, 3, 2, 2)
    w.wait([1, 2])
    assert [r.job_id for r in w.get_finished()] == [2]
    w.shutdown()
    assert w.offloader._resources()["host_bytes"] == 0
    gate.close()
