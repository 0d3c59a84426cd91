"""A remote transfer's NIXL descriptors, from the copy program: runs over chunk rows.

The pool region holds the row layout of an offloader's own host copy (one row per CPU
chunk, every KV tensor's sub-blocks side by side), so on the pool's side a transfer of
scattered pages is a few long runs: a whole row per fully covered chunk, one run per range
of consecutive chunk ids, only the covered sub-ranges of a partly covered chunk. NIXL pairs
each local descriptor with a remote one of the same size, so the local side is a staging
buffer in the same row layout (`_rows.StagingRows`): the staged program of `kvasync._program`
(`build_staged`) ranks the chunks a transfer touches into staging rows, gives the local
pack (stores) or unpack (loads) copies between the KV tensors and the staging rows, and the
runs (staging offset, pool address, bytes) merged where contiguous on both sides. One NIXL
descriptor per run, not per page.

A plan that is not rows (a raw descriptor plan, a row larger than a staging buffer, more
than 64 blocks per chunk) keeps the plan's own coalesced descriptors (`page_descriptors`).
Everything here is pure NumPy over plans; nothing touches NIXL.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._backends import Direction
from .._program import StagedProgram, TransferPlan, build_staged, slab_descriptors

__all__ = ["desc_rows", "merged_plan", "page_descriptors", "remote_program", "run_descriptors"]

U64 = np.uint64


def merged_plan(pieces: Sequence[TransferPlan]) -> TransferPlan | None:
    """The pieces of one transfer as one plan (their segments in order), or None where a
    piece has no segments to stage (a raw descriptor plan)."""
    live = [p for p in pieces if p.num_descriptors]
    if not live or any(not p.segments for p in live):
        return None
    if len(live) == 1:
        return live[0]
    return TransferPlan(live[0].table, [s for p in live for s in p.segments],
                        sum(p.nbytes for p in live), sum(p.num_descriptors for p in live))


def remote_program(pieces: Sequence[TransferPlan], direction: Direction, slab_bytes: int
                   ) -> StagedProgram | None:
    """The staged program of a transfer's pieces with staging buffers of `slab_bytes`, or
    None where it is not rows (then `page_descriptors`)."""
    plan = merged_plan(pieces)
    if plan is None:
        return None
    return build_staged(plan, direction == "d2h", slab_bytes)


def run_descriptors(program: StagedProgram, slab_index: int, stage_ptr: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local staging addresses, remote pool addresses, sizes) of one slab's runs with the
    staging buffer at `stage_ptr`: the slab's NIXL descriptor lists."""
    src, dst, sizes = slab_descriptors(program, program.slabs[slab_index], stage_ptr)
    if program.gpu_to_cpu:  # staging -> pool rows
        return src, dst, sizes
    return dst, src, sizes  # pool rows -> staging


def page_descriptors(pieces: Sequence[TransferPlan], direction: Direction
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local, remote, sizes) of the pieces' coalesced descriptors (neighbours contiguous on
    both sides merged), the tensors' own pages on the local side."""
    parts = [p.coalesced() for p in pieces if p.num_descriptors]
    src, dst, sizes = (np.concatenate(x) for x in zip(*parts))
    return (src, dst, sizes) if direction == "d2h" else (dst, src, sizes)


def desc_rows(ptrs: np.ndarray, sizes: np.ndarray, dev_id: int) -> np.ndarray:
    """The (address, bytes, device id) rows NIXL's `get_xfer_descs` reads."""
    rows = np.empty((len(sizes), 3), dtype=U64)
    rows[:, 0], rows[:, 1], rows[:, 2] = ptrs, sizes, dev_id
    return rows
