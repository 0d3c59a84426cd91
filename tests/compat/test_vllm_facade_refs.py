"""vLLM's `CanonicalKVCaches` with several refs of one group on one tensor (layers sharing a
cache): the facade builds and copies each tensor's bytes once, as vLLM's copies would leave
them, and refuses refs whose canonical mappings disagree."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync.compat.vllm import (
    CPULoadStoreSpec,
    CPUOffloadingWorker,
    GPULoadStoreSpec,
    TransferResult,
)

PAGE = 256


@dataclass
class Tensor:
    tensor: np.ndarray
    page_size_bytes: int


@dataclass
class Ref:
    tensor_idx: int
    page_size_bytes: int
    mapping: Any = None


@dataclass
class Caches:
    tensors: list[Tensor]
    group_data_refs: list[list[Ref]] = field(default_factory=list)


def kv_tensors(n: int = 2, blocks: int = 8) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 256, (blocks, PAGE), dtype=np.uint8)
            for i in range(n)]


def finished(w: CPUOffloadingWorker, count: int) -> list[TransferResult]:
    out: list[TransferResult] = []
    deadline = time.monotonic() + 20
    while len(out) < count and time.monotonic() < deadline:
        out += w.get_finished()
        time.sleep(0.001)
    return out


@pytest.mark.timeout(60)
def test_two_refs_on_one_tensor_round_trip_once() -> None:
    t = kv_tensors()
    # group 0: two layers share tensor 0 (one ref narrower than the row), tensor 1 on its own
    caches = Caches([Tensor(x, PAGE) for x in t],
                    [[Ref(0, PAGE), Ref(0, PAGE // 2), Ref(1, PAGE)]])
    w = CPUOffloadingWorker(caches, 1, 8)
    try:
        assert [len(g) for g in w.offloader.layout.groups] == [2]
        before = [x.copy() for x in t]
        w.submit_store(1, GPULoadStoreSpec([2, 5]), CPULoadStoreSpec([0, 3]))
        (r,) = finished(w, 1)
        assert r.success and r.transfer_size == 2 * (PAGE + PAGE)  # tensor 0 copied once
        for x in t:
            x[[2, 5]] = 0
        w.submit_load(2, CPULoadStoreSpec([0, 3]), GPULoadStoreSpec([6, 2]))
        (r,) = finished(w, 1)
        assert r.success
        for x, b in zip(t, before):
            np.testing.assert_array_equal(x[[6, 2]], b[[2, 5]])
    finally:
        w.shutdown()


def test_narrow_refs_keep_the_widest() -> None:
    t = kv_tensors(n=1)
    w = CPUOffloadingWorker(Caches([Tensor(t[0], PAGE)], [[Ref(0, 64), Ref(0, 128)]]), 1, 4)
    try:
        (ref,) = w.offloader.layout.groups[0]
        assert (ref.tensor_idx, ref.page_size_bytes, ref.offset_bytes) == (0, 128, 0)
    finally:
        w.shutdown()


def test_refs_of_different_groups_on_one_tensor_stay() -> None:
    t = kv_tensors(n=1)
    w = CPUOffloadingWorker(Caches([Tensor(t[0], PAGE)], [[Ref(0, PAGE)], [Ref(0, PAGE)]]), 1, 4)
    try:
        assert [len(g) for g in w.offloader.layout.groups] == [1, 1]
    finally:
        w.shutdown()


def test_canonical_identical_refs_merge_differing_refused() -> None:
    t = kv_tensors(n=1)
    same = kv.PageMapping.identity(PAGE)
    w = CPUOffloadingWorker(Caches([Tensor(t[0], PAGE)], [[Ref(0, PAGE, same), Ref(0, PAGE, same)]]),
                            1, 4, canonical_layout=True)
    try:
        assert len(w.offloader.layout.groups[0]) == 1
    finally:
        w.shutdown()
    shifted = kv.PageMapping(2 * PAGE, PAGE, (kv.CopyRun(0, PAGE, PAGE),))
    bad = Caches([Tensor(t[0], PAGE)], [[Ref(0, PAGE, same), Ref(0, PAGE, shifted)]])
    with pytest.raises(kv.InvalidTransferError, match="two refs on tensor 0"):
        CPUOffloadingWorker(bad, 1, 4, canonical_layout=True)
