"""Ids by keyword only (store and load take them in opposite roles) and host sizing in bytes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync.compat.vllm import CPULoadStoreSpec, CPUOffloadingWorker, GPULoadStoreSpec

BLOCKS, PAGE = 16, 64


def _offloader(**kw: Any) -> tuple[list[np.ndarray], kv.Offloader]:
    gpu = [np.random.default_rng(i).integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)
           for i in range(2)]
    kw.setdefault("num_cpu_chunks", 8)
    return gpu, kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), backend="host", **kw)


POSITIONAL: list[tuple[str, Callable[[kv.Offloader], object], str]] = [
    ("store", lambda o: o.store([3], [5]), "store(gpu_blocks=[...], cpu_chunks=[...])"),
    ("load", lambda o: o.load([3], [5]), "load(cpu_chunks=[...], gpu_blocks=[...])"),
    ("load one positional", lambda o: o.load([3], gpu_blocks=[5]), "cpu_chunks="),
    ("load_layerwise", lambda o: o.load_layerwise([3], [5]),
     "load_layerwise(cpu_chunks=[...], gpu_blocks=[...])"),
]


@pytest.mark.parametrize("call,expect", [(c, e) for _, c, e in POSITIONAL],
                         ids=[n for n, _, _ in POSITIONAL])
def test_positional_ids_raise_a_type_error_that_names_the_keywords(
        call: Callable[[kv.Offloader], object], expect: str) -> None:
    """`load([3], [5])` meant as store's order used to copy chunk 3 into block 5 silently."""
    gpu, off = _offloader()
    before = [g.copy() for g in gpu]
    with off:
        with pytest.raises(TypeError, match="by keyword only") as info:
            call(off)
        assert expect in str(info.value)
        assert off._resources()["inflight"] == 0
        # nothing was enqueued and no job id was used
        assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(5).job_id == 0
    for g, b in zip(gpu, before):
        np.testing.assert_array_equal(g, b)


@pytest.mark.parametrize("name", ["store", "load", "load_layerwise"])
def test_signatures_are_keyword_only(name: str) -> None:
    params = inspect.signature(getattr(kv.Offloader, name)).parameters
    assert [p for p in params if p != "self"][:2] == (
        ["gpu_blocks", "cpu_chunks"] if name == "store" else ["cpu_chunks", "gpu_blocks"])
    assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n != "self")


def test_keyword_calls_move_the_named_blocks() -> None:
    gpu, off = _offloader()
    with off:
        off.store(cpu_chunks=[5], gpu_blocks=[3]).wait(5)  # keyword order does not matter
        np.testing.assert_array_equal(off.cpu_tensors[0][5], gpu[0][3])
        off.load(gpu_blocks=[9], cpu_chunks=[5]).wait(5)
        np.testing.assert_array_equal(gpu[1][9], gpu[1][3])


def test_vllm_facade_keeps_positional_specs() -> None:
    gpu = [np.random.default_rng(i).integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)
           for i in range(2)]
    w = CPUOffloadingWorker(gpu, 1, 8, backend="host")
    assert w.submit_store(1, GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([5]))
    w.wait([1])
    assert w.submit_load(2, CPULoadStoreSpec([5]), GPULoadStoreSpec([9], [1], [0]))
    w.wait([2])
    assert [r.success for r in w.get_finished()] == [True, True]
    for g in gpu:
        np.testing.assert_array_equal(g[9], g[3])
    w.shutdown()


# -- sizing the host copy in bytes ----------------------------------------------------------

def test_cpu_bytes_rounds_down_to_whole_chunks_and_reports_the_bytes_used() -> None:
    per_chunk = 2 * PAGE * 3  # two tensors, blocks_per_chunk=3
    gpu, off = _offloader(num_cpu_chunks=None, cpu_bytes=5 * per_chunk + per_chunk - 1,
                          blocks_per_chunk=3)
    with off:
        assert off.num_cpu_chunks == 5
        assert off.cpu_bytes == 5 * per_chunk == sum(v.nbytes for v in off.cpu_tensors)
        assert f"({5 * per_chunk} B host)" in repr(off)
        off.store(gpu_blocks=list(range(15)), cpu_chunks=[0, 1, 2, 3, 4]).wait(5)
        with pytest.raises(kv.InvalidTransferError, match=r"out of range \[0, 5\)"):
            off.store(gpu_blocks=[0, 1, 2], cpu_chunks=[5])


def test_cpu_bytes_of_exactly_one_chunk_and_num_cpu_chunks_report_alike() -> None:
    _, a = _offloader(num_cpu_chunks=None, cpu_bytes=2 * PAGE)
    _, b = _offloader(num_cpu_chunks=1)
    with a, b:
        assert a.num_cpu_chunks == b.num_cpu_chunks == 1
        assert a.cpu_bytes == b.cpu_bytes == 2 * PAGE


def test_cpu_bytes_uses_the_canonical_page_in_canonical_mode() -> None:
    gpu = [np.zeros((BLOCKS, PAGE), np.uint8)]
    mapping = kv.PageMapping.identity(PAGE)
    layout = kv.KVCacheLayout([kv.KVTensor(gpu[0])], [[kv.KVRef(0, mapping=mapping)]])
    with kv.Offloader(layout, cpu_bytes=10 * PAGE + 1, backend="host", canonical=True) as off:
        assert off.num_cpu_chunks == 10 and off.cpu_bytes == 10 * PAGE


@pytest.mark.parametrize("kw,match", [
    ({"num_cpu_chunks": None, "cpu_bytes": 2 * PAGE - 1}, "holds no whole chunk"),
    ({"num_cpu_chunks": None, "cpu_bytes": 0}, "cpu_bytes must be an int >= 1"),
    ({"num_cpu_chunks": None, "cpu_bytes": True}, "cpu_bytes must be an int >= 1"),
    ({"num_cpu_chunks": None, "cpu_bytes": 1.5e9}, "cpu_bytes must be an int >= 1"),
    ({"num_cpu_chunks": None}, "exactly one"),
    ({"num_cpu_chunks": 4, "cpu_bytes": 4096}, "exactly one"),
])
def test_bad_sizes_are_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(kv.InvalidTransferError, match=match):
        _offloader(**kw)


def test_a_host_copy_too_large_to_map_raises_invalid_transfer_error_not_os_error() -> None:
    """docs/errors.md: an oversized num_cpu_chunks is an InvalidTransferError (1 PiB here,
    beyond any x86-64 or arm64 user address space, so the mapping fails everywhere)."""
    with pytest.raises(kv.InvalidTransferError, match="cannot allocate") as info:
        _offloader(num_cpu_chunks=2**50 // (2 * PAGE))
    assert not isinstance(info.value, OSError)
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize("kw", [{"num_cpu_chunks": 2**62}, {"blocks_per_chunk": 2**62},
                                {"num_cpu_chunks": None, "cpu_bytes": 2**70}])
def test_a_host_copy_beyond_any_address_space_is_an_invalid_transfer_error(
        kw: dict[str, Any]) -> None:
    """Sizes past what a C size can hold fail like any mapping too large to have."""
    with pytest.raises(kv.InvalidTransferError, match="cannot allocate"):
        _offloader(**kw)


@pytest.mark.parametrize("staging", [2**50, 2**70])
def test_staging_too_large_to_allocate_refuses_staged_calls_only(staging: int) -> None:
    """The staging is allocated at the staged path's first use: a call that asks for it
    gets an InvalidTransferError with nothing enqueued, and "auto" copies without it."""
    layout = kv.KVCacheLayout.from_tensors([np.zeros((8, 256), np.uint8) for _ in range(2)])
    with kv.Offloader(layout, 8, backend="host", staging_bytes=staging) as off:
        with pytest.raises(kv.InvalidTransferError, match="staging_bytes"):
            off.store(gpu_blocks=[1], cpu_chunks=[0], path="staged")
        assert off._resources()["inflight"] == 0
        assert off.store(gpu_blocks=list(range(8)), cpu_chunks=list(range(8))).wait(5).success


@pytest.mark.parametrize(("tensors", "page", "budget"), [(3, 40, 1200), (8, 4, 1024)])
def test_cpu_bytes_counts_the_rows_alignment(tensors: int, page: int, budget: int) -> None:
    """Each tensor's part of a host row starts on a 16-byte boundary: pages that are not
    multiples of 16 still fit the budget, and `cpu_bytes` reports what the rows take."""
    layout = kv.KVCacheLayout.from_tensors([np.zeros((4, page), np.uint8)
                                            for _ in range(tensors)])
    off = kv.Offloader(layout, cpu_bytes=budget)
    row = off.cpu_tensors[0].strides[0]
    assert off.cpu_bytes == off.num_cpu_chunks * row <= budget
    assert (off.num_cpu_chunks + 1) * row > budget
    off.close()
