"""A synchronous facade with the interface of vLLM's CPU offloading worker.

A vLLM user swaps `CPUOffloadingWorker` in and keeps calling `submit_store` /
`submit_load` / `get_finished` / `wait` / `shutdown` from the engine loop. Underneath it is a
`kvasync.Offloader`, so the copies, ordering and completion are kvasync's. vLLM itself is
never imported: its `CanonicalKVCaches` (objects with `.tensors` and `.group_data_refs`) is
read by duck typing.

Differences from vLLM, on purpose: a bad request raises `InvalidTransferError` instead of
failing an assert, and a transfer that fails on the device is reported with
``success=False`` instead of never being reported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._descriptors import _as_ids
from .._errors import InvalidTransferError, TransferFailedError
from .._layout import CopyRun, KVCacheLayout, KVRef, KVTensor, PageMapping
from .._offloader import Offloader
from .._transfer import Transfer

__all__ = [
    "CPULoadStoreSpec",
    "CPUOffloadingWorker",
    "GPULoadStoreSpec",
    "TransferResult",
]


class TransferResult(NamedTuple):
    """vLLM's result record: bytes this rank copied and GPU seconds."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


class _BlockIDs:
    def __init__(self, block_ids: Iterable[int]) -> None:
        ids = block_ids if isinstance(block_ids, np.ndarray) else list(block_ids)
        # integers only (floats, bools and strings are refused, never truncated), 64-bit
        self.block_ids = _as_ids(ids, "block_ids")


class CPULoadStoreSpec(_BlockIDs):
    """CPU chunk ids of a transfer."""

    @staticmethod
    def medium() -> str:
        return "CPU"


class GPULoadStoreSpec(_BlockIDs):
    """GPU block ids, ordered by KV-cache group (`group_sizes`), with each group's logical
    start block (`block_indices`)."""

    def __init__(
        self,
        block_ids: Iterable[int],
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        super().__init__(block_ids)
        self.group_sizes = (
            (len(self.block_ids),) if group_sizes is None else tuple(int(g) for g in group_sizes)
        )
        self.block_indices = (
            (0,) * len(self.group_sizes)
            if block_indices is None
            else tuple(int(b) for b in block_indices)
        )
        if sum(self.group_sizes) != len(self.block_ids):
            raise InvalidTransferError(
                f"sum(group_sizes) = {sum(self.group_sizes)} != {len(self.block_ids)} block ids"
            )
        if len(self.block_indices) != len(self.group_sizes):
            raise InvalidTransferError("block_indices and group_sizes differ in length")

    @staticmethod
    def medium() -> str:
        return "GPU"


def _mapping(m: Any) -> PageMapping | None:
    if m is None or isinstance(m, PageMapping):
        return m
    runs = tuple(
        CopyRun(r.local_offset, r.canonical_offset, r.fragment_size, r.num_fragments,
                r.local_stride, r.canonical_stride)
        for r in m.runs
    )
    return PageMapping(
        m.canonical_page_size_bytes, m.local_page_size_bytes, runs,
        getattr(m, "num_writers", 1), getattr(m, "writer_index", 0),
        getattr(m, "parallelism_agnostic", True),
    )


def _to_layout(kv_caches: Any) -> KVCacheLayout:
    if isinstance(kv_caches, KVCacheLayout):
        return kv_caches
    if hasattr(kv_caches, "tensors") and hasattr(kv_caches, "group_data_refs"):
        tensors = [
            t if isinstance(t, KVTensor) else KVTensor(t.tensor, t.page_size_bytes)
            for t in kv_caches.tensors
        ]
        groups = [
            [KVRef(r.tensor_idx, r.page_size_bytes, _mapping(getattr(r, "mapping", None)))
             for r in refs]
            for refs in kv_caches.group_data_refs
        ]
        return KVCacheLayout(tensors, groups)
    return KVCacheLayout.from_tensors(list(kv_caches))


class CPUOffloadingWorker:
    """vLLM's `CPUOffloadingWorker` interface over a kvasync `Offloader`."""

    def __init__(
        self,
        kv_caches: Any,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        canonical_layout: bool = False,
        *,
        mmap_region: Any | None = None,
        backend: str = "auto",
        copy_path: str = "auto",
    ) -> None:
        self.offloader = Offloader(
            _to_layout(kv_caches),
            num_cpu_chunks=num_cpu_chunks,
            blocks_per_chunk=blocks_per_chunk,
            backend=backend,
            copy_path=copy_path,
            canonical=canonical_layout,
            host_region=mmap_region,
        )
        self._queues: dict[str, deque[Transfer]] = {"d2h": deque(), "h2d": deque()}
        self._by_id: dict[int, Transfer] = {}

    @property
    def cpu_tensors(self) -> list[np.ndarray]:
        return self.offloader.cpu_tensors

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec
    ) -> bool:
        """Asynchronous GPU -> CPU copy of `src_spec`'s blocks into `dst_spec`'s chunks."""
        self._check_new(job_id)
        t = self.offloader.store(
            gpu_blocks=src_spec.block_ids, cpu_chunks=dst_spec.block_ids,
            group_sizes=src_spec.group_sizes, block_indices=src_spec.block_indices, job_id=job_id,
        )
        return self._track(t)

    def submit_load(
        self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        """Asynchronous CPU -> GPU copy of `src_spec`'s chunks into `dst_spec`'s blocks."""
        self._check_new(job_id)
        t = self.offloader.load(
            cpu_chunks=src_spec.block_ids, gpu_blocks=dst_spec.block_ids,
            group_sizes=dst_spec.group_sizes, block_indices=dst_spec.block_indices, job_id=job_id,
        )
        return self._track(t)

    def _check_new(self, job_id: int) -> None:
        if job_id in self._by_id:
            raise InvalidTransferError(f"job_id {job_id} is already in flight")

    def _track(self, t: Transfer) -> bool:
        self._queues[t.direction].append(t)
        self._by_id[t.job_id] = t
        return True

    def get_finished(self) -> list[TransferResult]:
        """Finished transfers, reported from the head of each direction's queue only."""
        out: list[TransferResult] = []
        for direction in ("d2h", "h2d"):
            q = self._queues[direction]
            while q and q[0].done():
                t = q.popleft()
                self._by_id.pop(t.job_id, None)
                try:
                    r = t.result()
                    out.append(TransferResult(r.job_id, True, r.bytes, r.seconds))
                except TransferFailedError:
                    out.append(TransferResult(t.job_id, False, 0, 0.0))
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the listed jobs finished (unknown or reported ids are ignored)."""
        for jid in job_ids:
            t = self._by_id.get(jid)
            if t is not None:
                try:
                    t.wait()
                except TransferFailedError:
                    pass

    def shutdown(self) -> None:
        """Drain both directions, then release everything."""
        self.offloader.close()
        self._queues["d2h"].clear()
        self._queues["h2d"].clear()
        self._by_id.clear()
