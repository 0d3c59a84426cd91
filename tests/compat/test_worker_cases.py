"""vLLM's CPU offloading worker cases, ported to kvasync's API (notes section 6.1 / 6.2).

Each runs on the host backend in CI and, on a GPU machine, on every CUDA copy path.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from support import Mem

import kvasync as kv
from kvasync._program import build_ref_table
from kvasync.compat.vllm import CPULoadStoreSpec, CPUOffloadingWorker, GPULoadStoreSpec

NUM_GPU_BLOCKS = 64
NUM_CPU_CHUNKS = 256


def _oracle_rows(
    dst: np.ndarray, before: np.ndarray, src: np.ndarray, mapping: dict[int, int], page: int
) -> None:
    """Every destination row equals its mapped source row, every other row is unchanged."""
    for row in range(dst.shape[0]):
        if row in mapping:
            np.testing.assert_array_equal(dst[row, :page], src[mapping[row], :page], f"row {row}")
        else:
            np.testing.assert_array_equal(dst[row], before[row], f"unmapped row {row} changed")


@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.asyncio
async def test_transfer(
    backend_case: tuple[str, str], mem: Mem, direction: str, page: int, bpc: int
) -> None:
    backend, path = backend_case
    rng = np.random.default_rng(0)
    num_tensors = 4
    gpu = [mem.rand_u8((NUM_GPU_BLOCKS, page), seed=i) for i in range(num_tensors)]
    layout = kv.KVCacheLayout.from_tensors(gpu)
    off = kv.Offloader(layout, NUM_CPU_CHUNKS, bpc, backend=backend, copy_path=path)
    for i, cpu in enumerate(off.cpu_tensors):
        cpu[:] = np.random.default_rng(100 + i).integers(0, 256, cpu.shape, dtype=np.uint8)
    num_mappings = 3
    gpu_ids = rng.choice(NUM_GPU_BLOCKS, size=num_mappings * bpc, replace=False).tolist()
    chunks = rng.choice(NUM_CPU_CHUNKS, size=num_mappings, replace=False).tolist()
    slots = [c * bpc + j for c in chunks for j in range(bpc)]
    gpu_ids, slots = gpu_ids[bpc - 1 :], slots[bpc - 1 :]  # start mid-chunk
    gpu_before = [mem.to_numpy(t) for t in gpu]
    cpu_before = [c.copy() for c in off.cpu_tensors]

    t0 = time.perf_counter()
    if direction == "store":
        t = off.store(gpu_blocks=gpu_ids, cpu_chunks=chunks, group_sizes=[len(gpu_ids)], block_indices=[bpc - 1])
    else:
        t = off.load(cpu_chunks=chunks, gpu_blocks=gpu_ids, group_sizes=[len(gpu_ids)], block_indices=[bpc - 1])
    assert t.job_id == 0 and t.direction == ("d2h" if direction == "store" else "h2d")
    r = await t
    wall = time.perf_counter() - t0
    assert r.job_id == 0 and r.success
    assert r.bytes == len(gpu_ids) * page * num_tensors
    assert 0 < r.seconds < wall

    for i in range(num_tensors):
        g_now = mem.to_numpy(gpu[i])
        c_now = off.cpu_tensors[i].reshape(NUM_CPU_CHUNKS * bpc, page)
        c_before = cpu_before[i].reshape(NUM_CPU_CHUNKS * bpc, page)
        if direction == "store":
            np.testing.assert_array_equal(g_now, gpu_before[i])  # source untouched
            _oracle_rows(c_now, c_before, g_now, dict(zip(slots, gpu_ids)), page)
        else:
            np.testing.assert_array_equal(c_now, c_before)
            _oracle_rows(g_now, gpu_before[i], c_now, dict(zip(gpu_ids, slots)), page)
    await off.aclose()


@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.asyncio
async def test_transfer_multi_group(
    backend_case: tuple[str, str], mem: Mem, direction: str, page: int, bpc: int
) -> None:
    backend, path = backend_case
    rng = np.random.default_rng(1)
    gpu = [mem.rand_u8((NUM_GPU_BLOCKS, page), seed=10 + i) for i in range(6)]
    groups = [[kv.KVRef(2 * g), kv.KVRef(2 * g + 1)] for g in range(3)]
    layout = kv.KVCacheLayout([kv.KVTensor(t) for t in gpu], groups)
    off = kv.Offloader(layout, NUM_CPU_CHUNKS, bpc, backend=backend, copy_path=path)
    for i, cpu in enumerate(off.cpu_tensors):
        cpu[:] = np.random.default_rng(200 + i).integers(0, 256, cpu.shape, dtype=np.uint8)
    chunk_counts = [2, 0, 2]
    all_chunks = rng.choice(NUM_CPU_CHUNKS, size=sum(chunk_counts), replace=False).tolist()
    gpu_ids_all: list[int] = []
    per_group: list[dict[int, int]] = []  # dst row -> src row (store: slot->block)
    group_sizes: list[int] = []
    block_indices = [0, 0, bpc - 1]
    cpos = 0
    for g, count in enumerate(chunk_counts):
        chunks = all_chunks[cpos : cpos + count]
        cpos += count
        slots = [c * bpc + j for c in chunks for j in range(bpc)]
        if g == 2 and slots:  # unaligned start and end
            slots = slots[bpc - 1 : len(slots) - (bpc - 1)]
        blocks = rng.choice(NUM_GPU_BLOCKS, size=len(slots), replace=False).tolist()
        gpu_ids_all += blocks
        group_sizes.append(len(blocks))
        per_group.append(
            dict(zip(slots, blocks)) if direction == "store" else dict(zip(blocks, slots))
        )
    gpu_before = [mem.to_numpy(t) for t in gpu]
    cpu_before = [c.copy() for c in off.cpu_tensors]
    if direction == "store":
        t = off.store(gpu_blocks=gpu_ids_all, cpu_chunks=all_chunks, group_sizes=group_sizes, block_indices=block_indices)
    else:
        t = off.load(cpu_chunks=all_chunks, gpu_blocks=gpu_ids_all, group_sizes=group_sizes, block_indices=block_indices)
    r = await t
    assert r.success and r.bytes == sum(group_sizes) * 2 * page
    for g in range(3):
        for i in (2 * g, 2 * g + 1):
            g_now = mem.to_numpy(gpu[i])
            c_now = off.cpu_tensors[i].reshape(NUM_CPU_CHUNKS * bpc, page)
            c_before = cpu_before[i].reshape(NUM_CPU_CHUNKS * bpc, page)
            if direction == "store":
                _oracle_rows(c_now, c_before, g_now, per_group[g], page)
            else:
                _oracle_rows(g_now, gpu_before[i], c_now, per_group[g], page)
    await off.aclose()


# -- canonical copy plans (6.2.1 - 6.2.4) ----------------------------------------------------

NHD_TP4_RANK2 = kv.PageMapping(
    canonical_page_size_bytes=4096,
    local_page_size_bytes=1024,
    runs=(kv.CopyRun(0, 256, 128, 4, 128, 512), kv.CopyRun(512, 2304, 128, 4, 128, 512)),
)


def _canonical_table(mapping: kv.PageMapping, gpu_to_cpu: bool):  # type: ignore[no-untyped-def]
    from kvasync._program import SideGeometry

    t = np.zeros((4, mapping.local_page_size_bytes), dtype=np.uint8)
    layout = kv.KVCacheLayout([kv.KVTensor(t)], [[kv.KVRef(0, mapping=mapping)]])
    zero = SideGeometry([0], [mapping.local_page_size_bytes], [0], [4], 1)
    host = SideGeometry([0], [mapping.canonical_page_size_bytes],
                        [mapping.canonical_page_size_bytes], [4], 1)
    return build_ref_table(layout, zero, host, gpu_to_cpu, True)


def test_copy_plan_unrolls_runs() -> None:
    table = _canonical_table(NHD_TP4_RANK2, gpu_to_cpu=True)
    assert table.frag_src.tolist() == list(range(0, 1024, 128))
    assert table.frag_dst.tolist() == [256, 768, 1280, 1792, 2304, 2816, 3328, 3840]
    assert table.frag_size.tolist() == [128] * 8


def test_load_direction_swaps_offsets() -> None:
    store = _canonical_table(NHD_TP4_RANK2, gpu_to_cpu=True)
    load = _canonical_table(NHD_TP4_RANK2, gpu_to_cpu=False)
    assert load.frag_src.tolist() == store.frag_dst.tolist()
    assert load.frag_dst.tolist() == store.frag_src.tolist()
    assert load.frag_size.tolist() == store.frag_size.tolist()


def test_writer_rotation_matches_is_writer() -> None:
    """Canonical page ids of chunks [3, 7, 9], bpc 4, 10 blocks, skip 2 (notes 2.1)."""
    mapping = kv.PageMapping(256, 256, (kv.CopyRun(0, 0, 256),), num_writers=2, writer_index=1)
    gpu = np.zeros((16, 256), dtype=np.uint8)
    layout = kv.KVCacheLayout([kv.KVTensor(gpu)], [[kv.KVRef(0, mapping=mapping)]])
    off = kv.Offloader(layout, num_cpu_chunks=10, blocks_per_chunk=4, backend="host",
                       canonical=True)
    from kvasync._program import build_plan

    plan = build_plan(off._tables["d2h"], list(range(10)), [3, 7, 9], [10], [2], True, 10)
    ids = [14, 15, 28, 29, 30, 31, 36, 37, 38, 39]
    kept = [i for i in ids if mapping.is_writer(i)]
    assert kept == [i for i in ids if i % 2 == 1]
    (seg,) = plan.segments
    assert seg.dst_slots.tolist() == kept
    assert plan.nbytes == len(kept) * 256
    # loads never filter
    lplan = build_plan(off._tables["h2d"], list(range(10)), [3, 7, 9], [10], [2], False, 10)
    assert lplan.segments[0].src_slots.tolist() == ids
    off.close()


def test_canonical_block_sizes_take_max_per_tensor() -> None:
    t0 = np.zeros((4, 4096), dtype=np.uint8)
    t1 = np.zeros((4, 2048), dtype=np.uint8)
    m4096 = kv.PageMapping(4096, 2048, (kv.CopyRun(0, 0, 2048),))
    m2048 = kv.PageMapping(2048, 2048, (kv.CopyRun(0, 0, 2048),))
    layout = kv.KVCacheLayout(
        [kv.KVTensor(t0), kv.KVTensor(t1)],
        [[kv.KVRef(0, 2048, m4096)], [kv.KVRef(0, 2048, m2048), kv.KVRef(1, 2048, m2048)]],
    )
    assert layout.canonical_bytes_per_block() == [4096, 2048]


@pytest.mark.asyncio
async def test_canonical_round_trip_assembles_page_across_ranks(
    backend_case: tuple[str, str], mem: Mem
) -> None:
    """Two 'TP2 ranks' scatter their halves into one canonical page; each loads its own."""
    backend, path = backend_case
    from kvasync._hostmem import alloc_mmap

    _mm, raw, ptr = alloc_mmap(4 * 2048)  # page-aligned, so the CUDA backend can pin it
    host = raw[: 4 * 2048].reshape(4, 2048)

    class OneRegion:  # the minimal region protocol the Offloader reads
        is_pinned = False
        _unregister = None

        def create_next_canonical_view(self, page: int) -> np.ndarray:
            assert page == 2048
            return host

        def pin(self, register, unregister) -> None:  # type: ignore[no-untyped-def]
            if not self.is_pinned and register(ptr, 4 * 2048):
                self.is_pinned, self._unregister = True, unregister

        def close(self) -> None:
            pass

    region = OneRegion()
    ranks = []
    for r in range(2):
        mapping = kv.PageMapping(
            2048, 1024,
            (kv.CopyRun(0, r * 128, 128, 4, 128, 256), kv.CopyRun(512, 1024 + r * 128, 128, 4, 128, 256)),
        )
        gpu = mem.rand_u8((4, 1024), seed=300 + r)
        layout = kv.KVCacheLayout([kv.KVTensor(gpu)], [[kv.KVRef(0, mapping=mapping)]])
        off = kv.Offloader(layout, 4, 1, backend=backend, copy_path=path, canonical=True,
                           host_region=region)
        ranks.append((gpu, mapping, off))
    for gpu, _, off in ranks:
        await off.store(gpu_blocks=[0, 1, 2, 3], cpu_chunks=[0, 1, 2, 3])
    expected = np.zeros((4, 2048), dtype=np.uint8)
    for gpu, mapping, _ in ranks:
        g = mem.to_numpy(gpu)
        for run in mapping.runs:
            for lo, co, size in run.fragments():
                expected[:, co : co + size] = g[:, lo : lo + size]
    np.testing.assert_array_equal(host, expected)
    gpu0, _, off0 = ranks[0]
    before = mem.to_numpy(gpu0)
    await off0.load(cpu_chunks=[3, 2, 1, 0], gpu_blocks=[0, 1, 2, 3])
    np.testing.assert_array_equal(mem.to_numpy(gpu0), before[::-1])
    for _, _, off in ranks:
        await off.aclose()
    if region._unregister is not None:
        region._unregister(ptr)


# -- the vLLM facade ---------------------------------------------------------------------------


def test_facade_reports_from_head_only_and_waits() -> None:
    gpu = [np.random.default_rng(i).integers(0, 256, (16, 256), dtype=np.uint8) for i in range(2)]
    worker = CPUOffloadingWorker(gpu, blocks_per_chunk=1, num_cpu_chunks=8)
    backend = worker.offloader.backend
    gate = __import__("threading").Event()
    # hold the first store's stream until the gate opens: later stores must not be reported
    from kvasync._backends._host import HostStream

    compute = HostStream(backend)  # type: ignore[arg-type]
    compute.enqueue(gate.wait)
    worker.offloader._compute_override = compute
    assert worker.submit_store(7, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0, 1]))
    worker.offloader._compute_override = None
    assert worker.submit_store(8, GPULoadStoreSpec([3]), CPULoadStoreSpec([2]))
    worker.cpu_tensors[0][4] = 77
    assert worker.submit_load(9, CPULoadStoreSpec([4]), GPULoadStoreSpec([5]))
    time.sleep(0.05)
    # the load is independent of the stores and finishes; store 8 waits behind store 7
    finished = worker.get_finished()
    assert [r.job_id for r in finished] == [9]
    assert worker.get_finished() == []
    gate.set()
    worker.wait({7, 8, 12345})
    finished = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in finished] == [
        (7, True, 2 * 2 * 256), (8, True, 256 * 2)
    ]
    assert finished[0].transfer_time is not None and finished[0].transfer_time >= 0
    np.testing.assert_array_equal(worker.cpu_tensors[1][2], gpu[1][3])
    assert (gpu[0][5] == 77).all()
    compute.close()
    worker.shutdown()
    worker.shutdown()


def test_facade_shutdown_drains() -> None:
    gpu = [np.random.default_rng(5).integers(0, 256, (32, 4096), dtype=np.uint8)]
    worker = CPUOffloadingWorker(gpu, blocks_per_chunk=1, num_cpu_chunks=32)
    for j in range(20):
        worker.submit_store(j, GPULoadStoreSpec([j]), CPULoadStoreSpec([31 - j]))
    cpu = worker.cpu_tensors[0]
    worker.shutdown()
    for j in range(20):
        np.testing.assert_array_equal(cpu[31 - j], gpu[0][j])


class VllmLikeRegion:
    """The shape of vLLM's SharedOffloadRegion as its worker uses it: int8 torch views (or
    NumPy, for a run without torch) carved from a cursor into this rank's slot of each row,
    `is_pinned` (its worker pins it with a free function) and `cleanup()`; no `pin` and no
    `close`. Rows of 4 KiB, two ranks of 2 KiB each."""

    ROW, WORLD = 4096, 2

    def __init__(self, raw: np.ndarray, rank: int, rows: int, as_torch: bool) -> None:
        self._raw, self._rows, self._torch = raw, rows, as_torch
        self.cursor = rank * (self.ROW // self.WORLD)
        self.is_pinned = False
        self.cleaned = 0

    def create_next_worker_view(self, page: int) -> object:
        view = np.lib.stride_tricks.as_strided(self._raw[self.cursor:], (self._rows, page),
                                               (self.ROW, 1)).view(np.int8)
        self.cursor += page
        if self._torch:
            import torch

            return torch.from_numpy(view)
        return view

    def cleanup(self) -> None:
        self.cleaned += 1


@pytest.mark.parametrize("views", ["numpy", "torch"])
def test_facade_takes_a_vllm_shaped_region(backend_case: tuple[str, str], mem: Mem,
                                           views: str) -> None:
    """vLLM's worker is built with mmap_region=its SharedOffloadRegion: int8 torch views,
    pinned by the worker, cleaned up (not closed) at shutdown. Two TP ranks share the rows;
    each stores into its slot and loads its own bytes back."""
    if views == "torch":
        pytest.importorskip("torch")
    backend, path = backend_case
    from kvasync._hostmem import alloc_mmap

    rows = 8
    _mm, raw, _ = alloc_mmap(rows * VllmLikeRegion.ROW)
    workers = []
    for rank in range(VllmLikeRegion.WORLD):
        region = VllmLikeRegion(raw, rank, rows, views == "torch")
        gpu = [mem.rand_u8((16, 512), seed=40 + 2 * rank + i) for i in range(2)]
        w = CPUOffloadingWorker(gpu, 2, rows, region, backend=backend, copy_path=path)
        if backend == "cuda" and rank == 0:  # the pages under its views, pinned here;
            assert w.offloader.host_pinned  # rank 1 in this same process finds them taken
        workers.append((rank, region, gpu, w))
    for rank, _, _, w in workers:
        assert w.submit_store(1, GPULoadStoreSpec([5, 6]), CPULoadStoreSpec([3]))
        w.wait([1])
        assert [r.success for r in w.get_finished()] == [True]
    rows_img = raw[: rows * VllmLikeRegion.ROW].reshape(rows, VllmLikeRegion.ROW)
    for rank, _, gpu, _ in workers:
        slot = rows_img[3, rank * 2048 : (rank + 1) * 2048].reshape(2, 2, 512)
        for t in range(2):  # tensor t's part: blocks 5 and 6 side by side
            np.testing.assert_array_equal(slot[t], mem.to_numpy(gpu[t])[[5, 6]])
    for rank, _, gpu, w in workers:
        before = mem.to_numpy(gpu[1])
        assert w.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([0, 1]))
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True]
        np.testing.assert_array_equal(mem.to_numpy(gpu[1])[[0, 1]], before[[5, 6]])
    for _, region, _, w in workers:
        w.shutdown()
        assert region.cleaned == 1 and w.offloader._resources()["host_bytes"] == 0
