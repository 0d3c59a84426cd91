"""PageMappings for the common attention layouts, derived from head counts and the TP rank.

The canonical page of a layer is the block without parallelism: all KV heads, all tokens,
in the worker page encoding. A rank holds a slice of the heads (or, when tp > num_kv_heads,
a replica of one head group; with MLA, the whole latent), and its `PageMapping` says where
that slice lands in the canonical page. Stores from ranks of any TP degree then produce the
same bytes, and replicated bytes are written once (writer rotation).

Supported page encodings (per block; ``hb`` = bytes of one head's K or V for one token):

==========  ========  ==========================================
layout      packed    page
==========  ========  ==========================================
``"NHD"``   no        ``K[block_size, heads, hb] | V[same]``
``"HND"``   no        ``K[heads, block_size, hb] | V[same]``
``"NHD"``   yes       ``[block_size, heads, K hb | V hb]``
``"HND"``   yes       ``[heads, block_size, K hb | V hb]``
==========  ========  ==========================================

Anything else is refused (`InvalidTransferError` with the reason): a mapping we cannot
certify must not silently produce canonical bytes that another topology misreads. Every
derived mapping is checked against all ranks of its topology with `verify_tiling`.
"""

from __future__ import annotations

import math
from typing import Literal

from ._errors import InvalidTransferError
from ._layout import CopyRun, PageMapping

__all__ = [
    "derive_page_mapping",
    "head_shard",
    "mla_page_mapping",
    "private_page_mapping",
    "verify_tiling",
]

PageLayout = Literal["NHD", "HND"]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidTransferError(f"cannot certify a mapping: {name} must be an int >= 1, "
                                   f"got {value!r}")
    return value


def _rank_arg(tp_size: int, tp_rank: object) -> int:
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise InvalidTransferError(
            f"cannot certify a mapping: tp_rank must be in [0, {tp_size}), got {tp_rank!r}"
        )
    return tp_rank


def head_shard(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int, int, int]:
    """(first head, local heads, replicas, replica index) of `tp_rank`.

    tp <= heads: rank r holds heads ``[r*h, (r+1)*h)`` with ``h = heads // tp``, no replicas.
    tp > heads: ``tp // heads`` consecutive ranks hold the same single head (GQA
    replication); they write it in rotation.
    """
    heads = _positive("num_kv_heads", num_kv_heads)
    tp = _positive("tp_size", tp_size)
    rank = _rank_arg(tp, tp_rank)
    if tp <= heads:
        if heads % tp:
            raise InvalidTransferError(
                f"cannot certify a mapping: {heads} KV heads do not split evenly over TP {tp}"
            )
        local = heads // tp
        return rank * local, local, 1, 0
    if tp % heads:
        raise InvalidTransferError(
            f"cannot certify a mapping: TP {tp} is not a multiple of {heads} KV heads, so the "
            "head replicas are uneven"
        )
    replicas = tp // heads
    return rank // replicas, 1, replicas, rank % replicas


def _raw_runs(
    layout: PageLayout, packed: bool, heads: int, first: int, local: int, hb: int, bs: int
) -> tuple[int, int, list[CopyRun]]:
    """(canonical page, local page, runs) before coalescing; one run per K/V part."""
    if packed:
        if layout == "NHD":  # per token: all heads, each K then V
            frag, lstride, cstride = local * 2 * hb, local * 2 * hb, heads * 2 * hb
            runs = [CopyRun(0, first * 2 * hb, frag, bs, lstride, cstride)]
        else:  # per head: all tokens of K|V
            runs = [CopyRun(0, first * bs * 2 * hb, local * bs * 2 * hb)]
        return heads * bs * 2 * hb, local * bs * 2 * hb, runs
    canon_part, local_part = heads * bs * hb, local * bs * hb
    runs = []
    for part in range(2):  # K, then V
        lo, co = part * local_part, part * canon_part
        if layout == "NHD":
            runs.append(CopyRun(lo, co + first * hb, local * hb, bs, local * hb, heads * hb))
        else:
            runs.append(CopyRun(lo, co + first * bs * hb, local_part))
    return 2 * canon_part, 2 * local_part, runs


def _coalesce(runs: list[CopyRun]) -> tuple[CopyRun, ...]:
    """Fewer, larger copies: a run whose fragments abut on both sides becomes one fragment,
    and neighbouring single-fragment runs that abut on both sides merge. Runs that are
    strided stay as they are (one per K/V part), so the plan keeps its structure."""
    flat: list[CopyRun] = []
    for r in runs:
        if r.num_fragments == 1 or (
            r.local_stride == r.fragment_size and r.canonical_stride == r.fragment_size
        ):
            flat.append(CopyRun(r.local_offset, r.canonical_offset,
                                r.fragment_size * r.num_fragments))
        else:
            flat.append(r)
    out: list[CopyRun] = []
    for r in flat:
        prev = out[-1] if out else None
        if (
            prev is not None and prev.num_fragments == 1 and r.num_fragments == 1
            and prev.local_offset + prev.fragment_size == r.local_offset
            and prev.canonical_offset + prev.fragment_size == r.canonical_offset
        ):
            out[-1] = CopyRun(prev.local_offset, prev.canonical_offset,
                              prev.fragment_size + r.fragment_size)
        else:
            out.append(r)
    return tuple(out)


def _mapping_for(
    layout: PageLayout, packed: bool, heads: int, hb: int, bs: int, tp: int, rank: int
) -> PageMapping:
    first, local, replicas, index = head_shard(heads, tp, rank)
    canon, page, runs = _raw_runs(layout, packed, heads, first, local, hb, bs)
    return PageMapping(canon, page, _coalesce(runs), num_writers=replicas, writer_index=index)


def derive_page_mapping(
    *,
    layout: PageLayout,
    num_kv_heads: int,
    head_bytes: int,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    kv_packed: bool = False,
    local_kv_heads: int | None = None,
) -> PageMapping:
    """This rank's mapping for a K/V attention page whose heads are sharded over TP.

    `num_kv_heads` is the model's total; `head_bytes` the bytes of one head's K (or V) for
    one token (head_dim x dtype size); `local_kv_heads`, when given, must match what this
    rank derives (a cross-check against the real tensor). The mappings of all ranks of the
    topology are derived and tiled (`verify_tiling`) before this rank's is returned.
    """
    if layout not in ("NHD", "HND"):
        raise InvalidTransferError(
            f"cannot certify a mapping: page layout {layout!r} is not 'NHD' or 'HND'"
        )
    if not isinstance(kv_packed, bool):
        raise InvalidTransferError(f"kv_packed must be a bool, got {kv_packed!r}")
    heads = _positive("num_kv_heads", num_kv_heads)
    hb = _positive("head_bytes", head_bytes)
    bs = _positive("block_size", block_size)
    tp = _positive("tp_size", tp_size)
    rank = _rank_arg(tp, tp_rank)
    mappings = [_mapping_for(layout, kv_packed, heads, hb, bs, tp, r) for r in range(tp)]
    verify_tiling(mappings)
    mine = mappings[rank]
    if local_kv_heads is not None:
        _, local, _, _ = head_shard(heads, tp, rank)
        if local_kv_heads != local:
            raise InvalidTransferError(
                f"cannot certify a mapping: the tensor has {local_kv_heads} local KV heads, "
                f"but {heads} heads over TP {tp} give {local} per rank"
            )
    return mine


def mla_page_mapping(page_bytes: int, tp_size: int, tp_rank: int) -> PageMapping:
    """MLA: every rank holds the whole latent page, so canonical = local, and the TP ranks
    write it in rotation (block b by rank ``b % tp``): stored once, stores spread out."""
    page = _positive("page_bytes", page_bytes)
    tp = _positive("tp_size", tp_size)
    rank = _rank_arg(tp, tp_rank)
    return PageMapping(page, page, (CopyRun(0, 0, page),), num_writers=tp, writer_index=rank)


def private_page_mapping(page_bytes: int, world_size: int, rank: int) -> PageMapping:
    """The opaque fallback: the whole page at ``rank * page`` of a ``world * page`` page.

    Not parallelism-agnostic (only the same topology can read it back), but it lets an
    uncertifiable layer share the canonical region with certified ones.
    """
    page = _positive("page_bytes", page_bytes)
    world = _positive("world_size", world_size)
    r = _rank_arg(world, rank)
    return PageMapping(world * page, page, (CopyRun(0, r * page, page),),
                       parallelism_agnostic=False)


def verify_tiling(mappings: list[PageMapping]) -> None:
    """Check that the mappings of all ranks (one per rank) store every canonical byte
    exactly once, for every block.

    For each canonical page id class (ids mod the lcm of the writer counts), the fragments
    of the ranks that write it must cover ``[0, canonical_page)`` with no gap and no
    overlap. Each mapping already covers its own local page exactly (PageMapping checks).
    """
    if not mappings:
        raise InvalidTransferError("verify_tiling needs the mappings of every rank (got none)")
    sizes = {m.canonical_page_size_bytes for m in mappings}
    if len(sizes) != 1:
        raise InvalidTransferError(f"ranks disagree on the canonical page size: {sorted(sizes)}")
    canon = sizes.pop()
    period = 1
    for m in mappings:
        period = period * m.num_writers // math.gcd(period, m.num_writers)
    for page_id in range(period):
        spans = sorted(
            (co, size, rank)
            for rank, m in enumerate(mappings) if m.is_writer(page_id)
            for run in m.runs for _, co, size in run.fragments()
        )
        pos = 0
        for co, size, rank in spans:
            if co < pos:
                raise InvalidTransferError(
                    f"canonical bytes [{co}, {min(pos, co + size)}) are written twice for page "
                    f"id {page_id} (rank {rank} overlaps another writer)"
                )
            if co > pos:
                raise InvalidTransferError(
                    f"canonical bytes [{pos}, {co}) are written by no rank for page id {page_id}"
                )
            pos = co + size
        if pos != canon:
            raise InvalidTransferError(
                f"canonical bytes [{pos}, {canon}) are written by no rank for page id {page_id}"
            )
