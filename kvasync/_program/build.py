"""Request validation: from (block ids, chunk ids, groups) to a `TransferPlan`.

Per group g with n blocks and logical start ``block_indices[g]`` the host side skips
``block_indices[g] % bpc`` sub-blocks of its first chunk and consumes
``ceil((n + skip) / bpc)`` chunks; groups consume both id lists in order and must use them
up exactly. Every check runs before anything is enqueued: a rejected request raises
`InvalidTransferError` and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .._errors import InvalidTransferError
from .plan import Segment, TransferPlan
from .table import U64, RefTable

__all__ = ["IdArray", "Ids", "as_ids", "build_plan"]


_INT64_MAX = int(np.iinfo(np.int64).max)


class IdArray(Protocol):
    """An array NumPy reads in one call (`__array__`): a NumPy array, a CPU torch tensor."""

    def __array__(self, *args: Any, **kwargs: Any) -> Any: ...


#: block or chunk ids: a list, tuple or range of ints, or a 1-D integer NumPy array or CPU
#: torch tensor
Ids = Sequence[int] | np.ndarray | IdArray

_IDS_EXPECTED = "a 1-D sequence of ints (list, tuple, range, NumPy array or CPU torch tensor)"


def as_ids(x: Any, what: str, copy: bool = True) -> np.ndarray:
    """A 1-D int64 array of ids; rejects floats, bools, non-1-D and non-integer input.

    `copy=False` lets an int64 array through as is (no fresh 2 MB page-faulting copy for a
    262k-id request): for copy paths that consume the plan before `store()` returns."""
    if not hasattr(x, "__array__") and (
        not isinstance(x, Sequence) or isinstance(x, (str, bytes, bytearray))
    ):  # sets, dicts, generators, strings, None, scalars: say what came
        shown = f" {x!r}" if isinstance(x, (str, bytes, int, float)) else ""
        raise InvalidTransferError(
            f"{what}: expected {_IDS_EXPECTED}, got {type(x).__name__}{shown}"
        )
    try:
        arr = np.asarray(x)
    except Exception as exc:
        raise InvalidTransferError(
            f"{what}: cannot read ids from {type(x).__name__} ({exc})"
        ) from None
    if arr.ndim != 1:
        if arr.ndim == 0 or arr.size != 0:
            raise InvalidTransferError(
                f"{what}: expected {_IDS_EXPECTED}, got {type(x).__name__} of shape {arr.shape}"
            )
        arr = arr.reshape(0)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind not in "iu":  # 'b' (bool), 'f', 'U', 'O', ... are refused
        if type(x) in (list, tuple) and all(type(v) is int for v in x):  # beyond int64
            raise InvalidTransferError(f"{what}: id {max(x, key=abs)} out of range")
        raise InvalidTransferError(f"{what}: ids must be integers, got dtype {arr.dtype}")
    if type(x) in (list, tuple):
        # NumPy reads [3, True] as int64: a bool among ints is refused like [True] is
        types = frozenset(map(type, x))
        if bool in types or np.bool_ in types:
            raise InvalidTransferError(f"{what}: ids must be integers, got a bool among them")
    if kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
        raise InvalidTransferError(f"{what}: id {int(arr.max())} out of range")
    # one private copy where the plan may be read after the call returns (host backend): it
    # must not alias an array the caller may reuse; later steps take zero-copy views of it
    if not copy:
        return np.asarray(arr, dtype=np.int64)
    return np.array(arr, dtype=np.int64, copy=True)


def _check_unique(slots: np.ndarray, gpu_to_cpu: bool, where: str) -> None:
    """Reject a transfer that writes one destination slot twice (copies of one batch run in
    any order, so the result would be undefined)."""
    n = len(slots)
    if n <= 1:
        return
    if n <= 256:
        if len(set(slots.tolist())) == n:
            return
    else:
        # strictly increasing ids (e.g. freshly allocated chunks) are unique: one vector
        # compare (~0.2 ms per 262k ids) instead of the bitmap's random scatter (~1 ms); a
        # 64-id probe keeps the cost nil for unsorted requests
        head = slots[:64]
        if bool((head[1:] > head[:-1]).all()) and bool((slots[1:] > slots[:-1]).all()):
            return
        # np.unique's hash path is ~60x slower than this (NumPy 2); a bitmap is ~3x faster
        # than a sort when the ids are dense
        top = int(slots.max()) + 1
        if top <= 16 * n:
            seen = np.zeros(top, dtype=np.bool_)
            # int64 indices: numpy converts uint64 ones first (2x slower); ids are < 2^63
            seen[slots.view(np.int64) if slots.dtype == U64 else slots] = True
            if np.count_nonzero(seen) == n:
                return
        else:
            ordered = np.sort(slots)
            if not (ordered[1:] == ordered[:-1]).any():
                return
    vals, counts = np.unique(slots, return_counts=True)
    side = "cpu chunk slot" if gpu_to_cpu else "gpu block"
    raise InvalidTransferError(
        f"duplicate destination: {side} {int(vals[counts > 1][0])} ({where}) is written twice "
        "in one transfer"
    )


#: requests of at most this many ids are validated in plain Python (numpy's per-call
#: overhead is most of a small transfer's host cost)
_SMALL_IDS = 256


def _small_ids(x: Any) -> list[int] | None:
    """`x` as a list of Python ints if it is a short list of ints or a short 1-D integer
    array; None for anything else (the general path validates it and words the error)."""
    if type(x) is list:
        if not 0 < len(x) <= _SMALL_IDS:
            return None
        for v in x:
            if type(v) is not int:
                return None
        return x
    if type(x) is np.ndarray:
        if x.ndim != 1 or not 0 < x.size <= _SMALL_IDS or x.dtype.kind not in "iu":
            return None
        out: list[int] = x.tolist()
        return out
    return None


def _build_small(
    table: RefTable,
    gpu_blocks: Any,
    cpu_chunks: Any,
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    gpu_to_cpu: bool,
    num_cpu_chunks: int,
) -> TransferPlan | None:
    """The common request (one group, one chunk per block, up to `_SMALL_IDS` ids as a list
    or an integer array, no writer rotation) validated in plain Python. Returns None to take
    the general path (which also produces every error message)."""
    if (
        table.num_groups != 1
        or group_sizes is not None
        or block_indices is not None
        or table.dst.factor != 1
        or table.src.factor != 1
        or len(table.partitions[0]) != 1
        or table.partitions[0][0][1] != 1
    ):
        return None
    g = _small_ids(gpu_blocks)
    if g is None:
        return None
    c = _small_ids(cpu_chunks)
    if c is None or len(g) != len(c):
        return None
    if min(g) < 0 or max(g) >= table.max_gpu_block[0]:
        return None
    if min(c) < 0 or max(c) >= num_cpu_chunks:
        return None
    dst = c if gpu_to_cpu else g
    if len(dst) > 1 and len(set(dst)) != len(dst):
        return None
    rows = table.partitions[0][0][0]
    # private copies (the caller may reuse its arrays); validated non-negative above
    ga = gpu_blocks.astype(U64) if type(gpu_blocks) is np.ndarray else np.array(g, dtype=U64)
    ca = cpu_chunks.astype(U64) if type(cpu_chunks) is np.ndarray else np.array(c, dtype=U64)
    src_slots, dst_slots = (ga, ca) if gpu_to_cpu else (ca, ga)
    k = len(g)
    per_block, frags = table.partition_totals[0][0]
    return TransferPlan(table, [Segment(rows, src_slots, dst_slots)], k * per_block, k * frags)


def build_plan(
    table: RefTable,
    gpu_blocks: Any,
    cpu_chunks: Any,
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    gpu_to_cpu: bool,
    num_cpu_chunks: int,
    copy_ids: bool = True,
) -> TransferPlan:
    """Validate one request and build its plan; raises InvalidTransferError, writes nothing.

    `copy_ids=False`: the plan may alias the caller's id arrays (it must be used up before
    the caller can touch them again, i.e. within the submitting call)."""
    fast = _build_small(table, gpu_blocks, cpu_chunks, group_sizes, block_indices, gpu_to_cpu,
                        num_cpu_chunks)
    if fast is not None:
        return fast
    gpu = as_ids(gpu_blocks, "gpu_blocks", copy_ids)
    cpu = as_ids(cpu_chunks, "cpu_chunks", copy_ids)
    ng = table.num_groups
    if group_sizes is None:
        if ng != 1:
            raise InvalidTransferError(
                f"group_sizes is required: the layout has {ng} KV-cache groups"
            )
        gs = np.asarray([len(gpu)], dtype=np.int64)
    else:
        gs = as_ids(group_sizes, "group_sizes")
    bi = np.zeros(ng, dtype=np.int64) if block_indices is None else as_ids(
        block_indices, "block_indices"
    )
    if len(gs) != ng:
        raise InvalidTransferError(f"group_sizes has {len(gs)} entries, the layout has {ng} groups")
    if len(bi) != ng:
        raise InvalidTransferError(
            f"block_indices has {len(bi)} entries, the layout has {ng} groups"
        )
    if (gs < 0).any():
        raise InvalidTransferError(f"group_sizes must be >= 0, got {gs.tolist()}")
    if (bi < 0).any():
        raise InvalidTransferError(f"block_indices must be >= 0, got {bi.tolist()}")
    total = sum(gs.tolist())  # Python ints: an int64 sum could wrap around to len(gpu)
    if total != len(gpu):
        raise InvalidTransferError(
            f"sum(group_sizes) = {total} != len(gpu_blocks) = {len(gpu)}"
        )
    if len(cpu) and (int(cpu.min()) < 0 or int(cpu.max()) >= num_cpu_chunks):
        bad = int(cpu.min()) if int(cpu.min()) < 0 else int(cpu.max())
        raise InvalidTransferError(f"cpu chunk id {bad} out of range [0, {num_cpu_chunks})")
    host_side = table.dst if gpu_to_cpu else table.src
    bpc = host_side.factor
    skips = bi % bpc
    chunks_per_group = np.where(gs > 0, (gs + skips + bpc - 1) // bpc, 0)
    if int(chunks_per_group.sum()) != len(cpu):
        raise InvalidTransferError(
            f"the groups need {int(chunks_per_group.sum())} cpu chunks "
            f"({chunks_per_group.tolist()} with blocks_per_chunk={bpc}), got {len(cpu)}"
        )
    segments: list[Segment] = []
    dst_by_group: dict[int, np.ndarray] = {}
    nbytes = 0
    count = 0
    g_off = 0
    c_off = 0
    arange = np.arange(bpc, dtype=np.int64) if bpc > 1 else None
    for g in range(ng):
        n = int(gs[g])
        if n == 0:
            continue
        g_ids = gpu[g_off : g_off + n]
        nch = int(chunks_per_group[g])
        c_ids = cpu[c_off : c_off + nch]
        g_off += n
        c_off += nch
        limit = table.max_gpu_block[g]
        lo, hi = int(g_ids.min()), int(g_ids.max())
        if lo < 0 or hi >= limit:
            raise InvalidTransferError(
                f"gpu block id {lo if lo < 0 else hi} out of range [0, {limit}) in group {g}"
            )
        if arange is None:
            h_slots = c_ids
        else:
            skip = int(skips[g])
            h_slots = (c_ids[:, None] * bpc + arange[None, :]).ravel()[skip : skip + n]
        g_u = g_ids.view(U64)  # validated non-negative: the bits are the same
        h_u = h_slots.view(U64) if h_slots.flags.c_contiguous else h_slots.astype(U64)
        src_slots, dst_slots = (g_u, h_u) if gpu_to_cpu else (h_u, g_u)
        _check_unique(dst_slots, gpu_to_cpu, f"group {g}")
        dst_by_group[g] = dst_slots
        for rows, nw, wi in table.partitions[g]:
            if nw > 1:
                keep = (h_u % U64(nw)) == U64(wi)
                s_, d_ = src_slots[keep], dst_slots[keep]
            else:
                s_, d_ = src_slots, dst_slots
            k = len(s_)
            if k == 0:
                continue
            segments.append(Segment(rows, s_, d_))
            nbytes += k * int(table.bytes_per_block[rows].sum())
            count += k * int(table.frag_count[rows].sum())
    for t, groups in table.shared_tensors:
        parts = [dst_by_group[g] for g in groups if g in dst_by_group]
        if len(parts) > 1:
            _check_unique(np.concatenate(parts), gpu_to_cpu, f"tensor {t}")
    return TransferPlan(table, segments, nbytes, count)

