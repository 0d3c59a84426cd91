"""A synchronous facade with the interface of vLLM's CPU offloading worker.

A vLLM user swaps `CPUOffloadingWorker` in and keeps calling `submit_store` /
`submit_load` / `get_finished` / `wait` / `shutdown` from the engine loop. Underneath it is a
`kvasync.Offloader`, so the copies, ordering and completion are kvasync's. vLLM itself is
never imported: its `CanonicalKVCaches` (objects with `.tensors` and `.group_data_refs`) is
read by duck typing.

Differences from vLLM, on purpose (docs/vllm.md lists them): a bad request raises
`InvalidTransferError` instead of failing an assert; a transfer that fails on the device is
reported with ``success=False`` instead of never being reported; every job is reported
exactly once, also those `shutdown()` drained; job ids must be ints, and an id still in
flight cannot be reused; block ids stay 64-bit; refs of one group on one tensor are copied
once, not once per ref.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import InvalidTransferError, TransferFailedError
from .._layout import CopyRun, KVCacheLayout, KVRef, KVTensor, PageMapping
from .._offloader import Offloader
from .._program import as_ids
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


def _int_list(values: Any, what: str) -> np.ndarray:
    """A 1-D int64 array; floats, bools, strings and non-iterables are refused."""
    if not isinstance(values, np.ndarray):
        try:
            values = list(values)
        except TypeError:
            raise InvalidTransferError(
                f"{what}: expected a 1-D sequence of ints, got {type(values).__name__}"
            ) from None
    return as_ids(values, what)


class _BlockIDs:
    def __init__(self, block_ids: Iterable[int]) -> None:
        # integers only (floats, bools and strings are refused, never truncated), 64-bit:
        # ids are not cut to vLLM's int32, and their range is checked by submit_*()
        self.block_ids = _int_list(block_ids, "block_ids")


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
        self.group_sizes: tuple[int, ...] = (
            (len(self.block_ids),) if group_sizes is None
            else tuple(_int_list(group_sizes, "group_sizes").tolist())
        )
        self.block_indices: tuple[int, ...] = (
            (0,) * len(self.group_sizes)
            if block_indices is None
            else tuple(_int_list(block_indices, "block_indices").tolist())
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


def _merge_refs(g: int, refs: list[KVRef], canonical: bool) -> list[KVRef]:
    """One ref per tensor: vLLM's refs carry no offset, so every ref of a tensor copies the
    first `page_size_bytes` of each block and two refs on one tensor (layers sharing a
    cache) copy the same bytes twice. Those bytes are copied once here: the widest ref,
    where the narrower ones are its prefixes. In the canonical layout two refs whose
    mappings differ would put one local byte in two canonical places; that is refused."""
    out: dict[int, KVRef] = {}
    for ref in refs:
        seen = out.get(ref.tensor_idx)
        if seen is None or seen == ref:
            out.setdefault(ref.tensor_idx, ref)
            continue
        if canonical:
            raise InvalidTransferError(
                f"group {g}: two refs on tensor {ref.tensor_idx} with different page sizes "
                "or mappings; under the canonical layout one local byte would map to two "
                "canonical places (refs of one tensor must be identical)"
            )
        if (ref.page_size_bytes or 0) > (seen.page_size_bytes or 0):
            out[ref.tensor_idx] = ref
    return list(out.values())


def _to_layout(kv_caches: Any, canonical: bool = False) -> KVCacheLayout:
    if isinstance(kv_caches, KVCacheLayout):
        return kv_caches
    if hasattr(kv_caches, "tensors") and hasattr(kv_caches, "group_data_refs"):
        tensors = [
            t if isinstance(t, KVTensor) else KVTensor(t.tensor, t.page_size_bytes)
            for t in kv_caches.tensors
        ]
        groups = [
            _merge_refs(g, [
                KVRef(r.tensor_idx, r.page_size_bytes, _mapping(getattr(r, "mapping", None)))
                for r in refs
            ], canonical)
            for g, refs in enumerate(kv_caches.group_data_refs)
        ]
        return KVCacheLayout(tensors, groups)
    if isinstance(kv_caches, Mapping):  # its keys would be taken for tensors
        raise InvalidTransferError(
            "kv_caches is a mapping (layer name -> tensor?): pass vLLM's CanonicalKVCaches, "
            "a KVCacheLayout (KVCacheLayout.from_vllm for vLLM's per-layer caches) or a "
            "list of block-first tensors"
        )
    return KVCacheLayout.from_tensors(list(kv_caches))


def _job_id(job_id: Any) -> int:
    """vLLM's job ids are ints; None, bools and anything else are refused."""
    if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
        raise InvalidTransferError(f"job_id must be an int, got {job_id!r}")
    return int(job_id)


def _spec_ids(spec: Any, what: str) -> Any:
    ids = getattr(spec, "block_ids", None)
    if ids is None:
        raise InvalidTransferError(
            f"{what} must be a load/store spec with .block_ids (e.g. GPULoadStoreSpec), "
            f"got {type(spec).__name__}"
        )
    return ids


class CPUOffloadingWorker:
    """vLLM's `CPUOffloadingWorker` interface over a kvasync `Offloader`.

    The positional order is vLLM's: `(kv_caches, blocks_per_chunk, num_cpu_chunks,
    mmap_region=None, canonical_layout=False)`; `num_cpu_blocks=` is accepted for the
    vLLM revisions that name the third argument so. Every call is thread-safe.
    """

    def __init__(
        self,
        kv_caches: Any,
        blocks_per_chunk: int,
        num_cpu_chunks: int | None = None,
        mmap_region: Any | None = None,
        canonical_layout: bool = False,
        *,
        num_cpu_blocks: int | None = None,
        backend: str = "auto",
        copy_path: str = "auto",
    ) -> None:
        if (num_cpu_chunks is None) == (num_cpu_blocks is None):
            raise InvalidTransferError(
                "pass the number of CPU chunks once: num_cpu_chunks (or num_cpu_blocks, its "
                f"name in some vLLM revisions), got num_cpu_chunks={num_cpu_chunks!r}, "
                f"num_cpu_blocks={num_cpu_blocks!r}"
            )
        if mmap_region is not None and (
            isinstance(mmap_region, (bool, np.bool_))
            or not hasattr(mmap_region, "create_next_worker_view")
        ):
            raise InvalidTransferError(
                "the 4th argument is mmap_region (vLLM's order: kv_caches, blocks_per_chunk, "
                "num_cpu_chunks, mmap_region, canonical_layout): expected a shared host region "
                f"such as kvasync.SharedHostRegion or None, got {mmap_region!r}; pass "
                "canonical_layout=... by keyword"
            )
        if not isinstance(canonical_layout, (bool, np.bool_)):
            raise InvalidTransferError(
                f"canonical_layout must be a bool, got {type(canonical_layout).__name__}"
            )
        chunks = num_cpu_chunks if num_cpu_chunks is not None else num_cpu_blocks
        self.offloader = Offloader(
            _to_layout(kv_caches, bool(canonical_layout)),
            num_cpu_chunks=chunks,  # type: ignore[arg-type]  # checked by Offloader
            blocks_per_chunk=blocks_per_chunk,
            backend=backend,
            copy_path=copy_path,
            canonical=bool(canonical_layout),
            host_region=mmap_region,
        )
        # per direction, submitted and not yet reported, in submission order
        self._queues: dict[str, deque[Transfer]] = {"d2h": deque(), "h2d": deque()}
        # job id -> its newest transfer not yet reported (what wait() waits for)
        self._by_id: dict[int, Transfer] = {}
        # submission order in `_queues` must be the lane's order: held across submit
        self._lock = threading.Lock()

    @property
    def cpu_tensors(self) -> list[np.ndarray]:
        return self.offloader.cpu_tensors

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec
    ) -> bool:
        """Asynchronous GPU -> CPU copy of `src_spec`'s blocks into `dst_spec`'s chunks."""
        jid = _job_id(job_id)
        gpu, cpu = _spec_ids(src_spec, "src_spec"), _spec_ids(dst_spec, "dst_spec")
        with self._lock:
            self._check_new(jid)
            t = self.offloader.store(
                gpu_blocks=gpu, cpu_chunks=cpu,
                group_sizes=getattr(src_spec, "group_sizes", None),
                block_indices=getattr(src_spec, "block_indices", None), job_id=jid,
            )
            self._track(t)
        return True

    def submit_load(
        self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        """Asynchronous CPU -> GPU copy of `src_spec`'s chunks into `dst_spec`'s blocks."""
        jid = _job_id(job_id)
        cpu, gpu = _spec_ids(src_spec, "src_spec"), _spec_ids(dst_spec, "dst_spec")
        with self._lock:
            self._check_new(jid)
            t = self.offloader.load(
                cpu_chunks=cpu, gpu_blocks=gpu,
                group_sizes=getattr(dst_spec, "group_sizes", None),
                block_indices=getattr(dst_spec, "block_indices", None), job_id=jid,
            )
            self._track(t)
        return True

    def _check_new(self, job_id: int) -> None:
        """An id still in flight is refused; one that finished but was not yet reported
        may be reused (vLLM's overwrite): both jobs are reported, `wait()` sees the new."""
        t = self._by_id.get(job_id)
        if t is not None and not t.done():
            raise InvalidTransferError(f"job_id {job_id} is already in flight")

    def _track(self, t: Transfer) -> None:
        self._queues[t.direction].append(t)
        self._by_id[t.job_id] = t

    def get_finished(self) -> list[TransferResult]:
        """Finished transfers, reported from the head of each direction's queue only.

        Every submitted job is reported exactly once, also when it finished during or after
        `shutdown()`: call this after `shutdown()` to collect the jobs it drained.
        """
        out: list[TransferResult] = []
        with self._lock:
            for direction in ("d2h", "h2d"):
                q = self._queues[direction]
                while q and q[0].done():
                    t = q.popleft()
                    if self._by_id.get(t.job_id) is t:
                        del self._by_id[t.job_id]
                    try:
                        r = t.result()
                        out.append(TransferResult(r.job_id, True, r.bytes, r.seconds))
                    except TransferFailedError:
                        out.append(TransferResult(t.job_id, False, 0, 0.0))
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the listed jobs finished (unknown or reported ids are ignored).

        Inside a done-callback, waiting for an unfinished job raises RuntimeError."""
        for jid in job_ids:
            with self._lock:
                known = isinstance(jid, (int, np.integer)) and not isinstance(jid, bool)
                t = self._by_id.get(jid) if known else None
            if t is not None:
                try:
                    t.wait()
                except TransferFailedError:
                    pass

    def shutdown(self) -> None:
        """Refuse new jobs, drain both directions, then release everything (idempotent).

        Jobs in flight are not dropped: `get_finished()` still reports each of them once.
        Interrupted (Ctrl-C), a second call finishes; called from a done-callback, it does
        not wait and the release follows the last job in flight."""
        self.offloader.close()
