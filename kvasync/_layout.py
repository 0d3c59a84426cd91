"""Layout math: what a KV cache looks like in bytes, on the GPU and in canonical host pages.

A KV cache is a list of tensors whose dim 0 indexes blocks (`KVTensor`), plus, per KV-cache
group, the references (`KVRef`) to the tensors that hold that group's layers. A reference
copies `page_size_bytes` of each block row from `offset_bytes` on; the tensor's own page may
be larger (padding), and the host side keeps the tensor's page as its sub-slot stride so
stores and loads are exact inverses. No two tensors of a layout share a byte, and refs of
one group on one tensor cover disjoint bytes, so no destination byte is written twice.

Under the canonical layout a `PageMapping` tells where this rank's bytes of one block live
inside the parallelism-free canonical page, as `CopyRun`s of equally spaced fragments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._arrays import ArrayInfo, array_info
from ._errors import InvalidTransferError
from ._memory import MemoryGuard, overlapping_pair
from ._vllm_layouts import blocks_first, check_list, vllm_block_views

__all__ = ["CopyRun", "KVCacheLayout", "KVRef", "KVTensor", "PageMapping"]


def _ints(obj: object, *names: str) -> None:
    """Byte counts and indices are ints: a NumPy integer is taken (stored as an int), a bool,
    float or string refused (``KVRef(0, 32.5)`` would have copied 32 B per block)."""
    for name in names:
        v = getattr(obj, name)
        if v is None and name == "page_size_bytes":  # the default: the rest of the row
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidTransferError(f"{type(obj).__name__}.{name} must be an int, got {v!r}")
        object.__setattr__(obj, name, int(v))


@dataclass(frozen=True)
class CopyRun:
    """`num_fragments` fragments of `fragment_size` bytes.

    Fragment i covers ``[local_offset + i*local_stride, +fragment_size)`` of this rank's page
    and ``[canonical_offset + i*canonical_stride, +fragment_size)`` of the canonical page.
    """

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int = 1
    local_stride: int = 0
    canonical_stride: int = 0

    def __post_init__(self) -> None:
        _ints(self, "local_offset", "canonical_offset", "fragment_size", "num_fragments",
              "local_stride", "canonical_stride")
        for name in ("local_offset", "canonical_offset", "local_stride", "canonical_stride"):
            if int(getattr(self, name)) < 0:
                raise InvalidTransferError(f"CopyRun.{name} must be >= 0")
        if self.fragment_size <= 0 or self.num_fragments <= 0:
            raise InvalidTransferError("CopyRun needs fragment_size > 0 and num_fragments > 0")

    def fragments(self) -> list[tuple[int, int, int]]:
        """(local offset, canonical offset, size) of each fragment, in order."""
        return [
            (
                self.local_offset + i * self.local_stride,
                self.canonical_offset + i * self.canonical_stride,
                self.fragment_size,
            )
            for i in range(self.num_fragments)
        ]


@dataclass(frozen=True)
class PageMapping:
    """Where this rank's page of one block lies inside the canonical page.

    `runs` cover the whole local page and are used in both directions. `num_writers` ranks
    hold byte-identical copies of these canonical bytes; stores keep only the blocks whose
    canonical page id satisfies ``id % num_writers == writer_index`` (rotation spreads the
    store bandwidth over the replicas). Loads never filter.
    """

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int = 1
    writer_index: int = 0
    parallelism_agnostic: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", tuple(self.runs))
        _ints(self, "canonical_page_size_bytes", "local_page_size_bytes", "num_writers",
              "writer_index")
        if not 1 <= self.num_writers < 2**32 or not 0 <= self.writer_index < self.num_writers:
            raise InvalidTransferError(
                "PageMapping needs 1 <= num_writers < 2**32 and 0 <= writer_index < "
                f"num_writers, got {self.num_writers}, {self.writer_index}"
            )
        if self.canonical_page_size_bytes <= 0 or self.local_page_size_bytes <= 0:
            raise InvalidTransferError("PageMapping page sizes must be > 0")
        local: list[tuple[int, int]] = []
        canon: list[tuple[int, int]] = []
        for run in self.runs:
            for lo, co, size in run.fragments():
                if lo + size > self.local_page_size_bytes:
                    raise InvalidTransferError(
                        f"CopyRun fragment [{lo}, {lo + size}) exceeds the local page "
                        f"({self.local_page_size_bytes} B)"
                    )
                if co + size > self.canonical_page_size_bytes:
                    raise InvalidTransferError(
                        f"CopyRun fragment [{co}, {co + size}) exceeds the canonical page "
                        f"({self.canonical_page_size_bytes} B)"
                    )
                local.append((lo, size))
                canon.append((co, size))
        for name, spans in (("local", local), ("canonical", canon)):
            spans.sort()
            for (a, sa), (b, _) in zip(spans, spans[1:]):
                if a + sa > b:
                    raise InvalidTransferError(f"PageMapping {name} fragments overlap at {b}")
        if sum(s for _, s in local) != self.local_page_size_bytes:
            raise InvalidTransferError(
                "PageMapping runs must cover the local page exactly "
                f"({sum(s for _, s in local)} of {self.local_page_size_bytes} B)"
            )

    def is_writer(self, page_id: int) -> bool:
        """True iff this rank writes canonical page `page_id` on stores."""
        return page_id % self.num_writers == self.writer_index

    @property
    def num_fragments(self) -> int:
        return sum(r.num_fragments for r in self.runs)

    @classmethod
    def identity(cls, page_size_bytes: int) -> PageMapping:
        """Whole page at offset 0: the single-rank canonical mapping."""
        return cls(page_size_bytes, page_size_bytes, (CopyRun(0, 0, page_size_bytes),))


@dataclass(repr=False)
class KVTensor:
    """One unique KV tensor; dim 0 indexes blocks.

    The other dims must be densely packed (C order or any permutation of it, such as vLLM's
    HND view of an NHD allocation), so one block is one byte range. `page_size_bytes` is
    this tensor's bytes per block (default: the bytes of one row). It may include padding up
    to the row stride; it is the sub-slot stride of the host copy.
    """

    tensor: Any
    page_size_bytes: int | None = None
    info: ArrayInfo = field(init=False)

    def __post_init__(self) -> None:
        info = array_info(self.tensor, "KVTensor")
        if len(info.shape) < 1 or info.shape[0] < 1:
            raise InvalidTransferError("KVTensor: the tensor needs dim 0 (blocks) of size >= 1")
        if info.row_bytes == 0:
            raise InvalidTransferError(
                f"KVTensor: a block of {info.describe()} has 0 bytes (an inner dim of size 0)"
            )
        if any(st < 0 for sz, st in zip(info.shape, info.strides) if sz > 1):
            raise InvalidTransferError(
                f"KVTensor: negative strides {info.strides} (a reversed view) are not "
                "supported; pass the forward view"
            )
        if not info.inner_dense():
            raise InvalidTransferError(
                f"KVTensor: the dims after dim 0 of {info.describe()} with byte strides "
                f"{info.strides} must be contiguous (in some order) so a block is one byte "
                "range; for vLLM caches use KVCacheLayout.from_vllm"
            )
        if info.shape[0] > 1 and info.row_stride < info.row_bytes:
            raise InvalidTransferError("KVTensor: block rows overlap (row stride < row bytes)")
        if not info.writeable:
            raise InvalidTransferError(
                f"KVTensor: {info.describe()} is read-only memory (e.g. np.frombuffer of a "
                "bytes object); loads write into KV tensors, so they must be writable"
            )
        _ints(self, "page_size_bytes")
        page = info.row_bytes if self.page_size_bytes is None else self.page_size_bytes
        if page <= 0:
            raise InvalidTransferError("KVTensor: page_size_bytes must be > 0")
        limit = max(info.row_stride, info.row_bytes) if info.shape[0] > 1 else info.row_bytes
        if page > limit:
            raise InvalidTransferError(
                f"KVTensor: page_size_bytes {page} exceeds the row stride ({limit} B)"
            )
        self.page_size_bytes = page
        self.info = info

    @property
    def num_blocks(self) -> int:
        return self.info.shape[0]

    @property
    def page(self) -> int:
        assert self.page_size_bytes is not None
        return self.page_size_bytes

    def __repr__(self) -> str:
        i = self.info
        dev = "cpu" if i.device == "cpu" else f"cuda:{i.device_id}"
        return (f"KVTensor(shape={i.shape}, dtype={i.dtype}, device={dev}, "
                f"page_bytes={self.page}, blocks={self.num_blocks})")


@dataclass(frozen=True)
class KVRef:
    """A layer (or layer set) of one KV group stored in tensor `tensor_idx`.

    `page_size_bytes` is the un-padded bytes copied per block, from `offset_bytes` on
    (default: the rest of the tensor's row); `mapping` places them in the canonical page
    (None: no canonical form). Two refs of one group may share a tensor when they cover
    disjoint bytes of its blocks (the K and V halves of a row, say).
    """

    tensor_idx: int
    page_size_bytes: int | None = None
    mapping: PageMapping | None = None
    offset_bytes: int = 0

    def __post_init__(self) -> None:
        _ints(self, "tensor_idx", "page_size_bytes", "offset_bytes")
        if self.mapping is not None and not isinstance(self.mapping, PageMapping):
            raise InvalidTransferError(
                f"KVRef.mapping must be a PageMapping or None, got {self.mapping!r}")

    def __repr__(self) -> str:
        out = f"KVRef({self.tensor_idx}, page_size_bytes={self.page_size_bytes}"
        if self.offset_bytes:
            out += f", offset_bytes={self.offset_bytes}"
        m = self.mapping
        if m is not None:
            out += (f", mapping=<canonical {m.canonical_page_size_bytes} B, "
                    f"{m.num_fragments} fragments, writer {m.writer_index}/{m.num_writers}>")
        return out + ")"


class KVCacheLayout:
    """The tensors of a KV cache and, per KV-cache group, the refs into them."""

    def __init__(
        self,
        tensors: Sequence[KVTensor | Any],
        groups: Sequence[Sequence[KVRef]] | None = None,
    ) -> None:
        check_list(tensors, "KVCacheLayout")
        if len(tensors) == 0:
            raise InvalidTransferError("KVCacheLayout needs at least one tensor")
        self.tensors: list[KVTensor] = [
            t if isinstance(t, KVTensor) else KVTensor(blocks_first(t, i))
            for i, t in enumerate(tensors)
        ]
        if groups is None:
            groups = [[KVRef(i) for i in range(len(self.tensors))]]
        if len(groups) == 0:
            raise InvalidTransferError("KVCacheLayout needs at least one group")
        devices = {(t.info.device, t.info.device_id) for t in self.tensors}
        if len(devices) != 1:
            raise InvalidTransferError(f"KVCacheLayout: tensors live on several devices {devices}")
        pair = overlapping_pair([t.info for t in self.tensors])
        if pair is not None:
            raise InvalidTransferError(
                f"tensors {pair[0]} and {pair[1]} share memory (the same tensor twice, or "
                "overlapping views of one buffer): a load would write those bytes twice"
            )
        self.groups: list[list[KVRef]] = [self._resolve(g, refs) for g, refs in enumerate(groups)]
        #: checked at every submit: the tensors still own the memory read here
        self._guard = MemoryGuard([t.info for t in self.tensors])

    def _resolve(self, g: int, refs: Sequence[KVRef]) -> list[KVRef]:
        out: list[KVRef] = []
        spans: dict[int, list[tuple[int, int]]] = {}
        for ref in refs:
            if not isinstance(ref, KVRef):
                raise InvalidTransferError(f"group {g}: expected KVRef, got {type(ref)}")
            if not 0 <= ref.tensor_idx < len(self.tensors):
                raise InvalidTransferError(
                    f"group {g}: tensor_idx {ref.tensor_idx} out of range "
                    f"[0, {len(self.tensors)})"
                )
            tensor = self.tensors[ref.tensor_idx]
            limit = min(tensor.info.row_bytes, tensor.page)
            off = ref.offset_bytes
            if isinstance(off, bool) or not isinstance(off, int) or not 0 <= off < limit:
                raise InvalidTransferError(
                    f"group {g}: ref offset_bytes {off!r} must be an int in [0, {limit}) for "
                    f"tensor {ref.tensor_idx}"
                )
            page = limit - off if ref.page_size_bytes is None else ref.page_size_bytes
            if not 0 < page <= limit - off:
                raise InvalidTransferError(
                    f"group {g}: ref page_size_bytes {page} must be in (0, {limit - off}] for "
                    f"tensor {ref.tensor_idx} (offset {off}, row {limit} B)"
                )
            for lo, hi in spans.get(ref.tensor_idx, []):
                if off < hi and lo < off + page:
                    raise InvalidTransferError(
                        f"group {g}: two refs cover bytes [{max(lo, off)}, {min(hi, off + page)}) "
                        f"of tensor {ref.tensor_idx}'s blocks; its blocks would be copied twice "
                        "onto the same bytes (refs of one tensor need disjoint offset_bytes "
                        "ranges)"
                    )
            spans.setdefault(ref.tensor_idx, []).append((off, off + page))
            if ref.mapping is not None and ref.mapping.local_page_size_bytes != page:
                raise InvalidTransferError(
                    f"group {g}: mapping.local_page_size_bytes "
                    f"{ref.mapping.local_page_size_bytes} != ref page {page}"
                )
            out.append(KVRef(ref.tensor_idx, page, ref.mapping, off))
        return out

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any], *, block_dim: int | None = None) -> KVCacheLayout:
        """One group, one ref per tensor; each page is the bytes of one block.

        Dim 0 indexes blocks unless `block_dim` says which dim does. A tensor of 3 or more
        dims whose dim 0 has size 2 is refused without `block_dim`: it is more likely K and V
        (vLLM's FlashAttention layout; see `from_vllm`) than 2 blocks.
        """
        check_list(tensors, "from_tensors")
        return cls([t if isinstance(t, KVTensor) else KVTensor(blocks_first(t, i, block_dim))
                    for i, t in enumerate(tensors)])

    @classmethod
    def from_vllm(cls, kv_caches: Any, block_dim: int | None = None) -> KVCacheLayout:
        """The per-layer KV tensors of a vLLM worker: a list, or a dict of layer name ->
        tensor. FlashAttention ``(2, num_blocks, ...)`` layers become two tensors (K and V
        views) with one ref each, FlashInfer ``(num_blocks, 2, ...)`` and MLA
        ``(num_blocks, block_size, head_size)`` layers one; stride orders (NHD, HND,
        cross-layer) are read from the strides. `block_dim` names the block dim of any other
        layout. One KV-cache group; layers sharing a tensor share its ref."""
        tensors = [KVTensor(v) for v in vllm_block_views(kv_caches, block_dim)]
        return cls(tensors, [[KVRef(i) for i in range(len(tensors))]])

    @property
    def device(self) -> str:
        return self.tensors[0].info.device

    @property
    def num_blocks(self) -> list[int]:
        return [t.num_blocks for t in self.tensors]

    def canonical_bytes_per_block(self) -> list[int]:
        """Per tensor, the largest canonical page of the refs using it (all need a mapping;
        refs of one group sharing a tensor need disjoint canonical bytes)."""
        sizes = [0] * len(self.tensors)
        for g, refs in enumerate(self.groups):
            canon: dict[int, list[tuple[int, int]]] = {}
            for ref in refs:
                if ref.mapping is None:
                    raise InvalidTransferError(
                        f"canonical layout: group {g} ref on tensor {ref.tensor_idx} has no "
                        "PageMapping (uncertified layouts cannot be stored canonically)"
                    )
                sizes[ref.tensor_idx] = max(
                    sizes[ref.tensor_idx], ref.mapping.canonical_page_size_bytes
                )
                spans = canon.setdefault(ref.tensor_idx, [])
                for run in ref.mapping.runs:
                    for _, co, size in run.fragments():
                        if any(co < hi and lo < co + size for lo, hi in spans):
                            raise InvalidTransferError(
                                f"canonical layout: group {g} refs on tensor {ref.tensor_idx} "
                                f"write canonical bytes at {co} twice"
                            )
                        spans.append((co, co + size))
        for t, size in enumerate(sizes):
            if size == 0:
                raise InvalidTransferError(f"canonical layout: tensor {t} is used by no ref")
        return sizes

    def __repr__(self) -> str:
        t0 = self.tensors[0].info
        dev = "cpu" if t0.device == "cpu" else f"cuda:{t0.device_id}"
        refs = sum(len(g) for g in self.groups)
        per_block = sum(r.page_size_bytes or 0 for g in self.groups for r in g)
        blocks = sorted(set(self.num_blocks))
        nb = blocks[0] if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"
        return (f"<KVCacheLayout {dev} {_n(len(self.tensors), 'tensor')}, "
                f"{_n(len(self.groups), 'group')}, {_n(refs, 'ref')}, {nb} blocks, "
                f"{per_block} B per block>")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"
