"""A plain-Python oracle of kvasync's pointer arithmetic (no numpy in the math).

It enumerates, for one request, every byte copy the worker semantics ask for, written the
slow and obvious way from the rules in ../shared/notes (section 2): groups consume GPU
blocks and CPU chunks in order; the host side skips ``block_indices[g] % bpc`` sub-blocks of
its first chunk; canonical runs are unrolled per fragment; stores keep only the blocks whose
canonical page id is ``% num_writers == writer_index``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Side:
    base: list[int]
    row_stride: list[int]
    sub_stride: list[int]


@dataclass
class Ref:
    tensor: int
    page: int
    #: (local offset, canonical offset, size) fragments, None = direct layout
    frags: list[tuple[int, int, int]] | None = None
    num_writers: int = 1
    writer_index: int = 0


def copies(
    groups: list[list[Ref]],
    gpu: Side,
    host: Side,
    bpc: int,
    gpu_blocks: list[int],
    cpu_chunks: list[int],
    group_sizes: list[int],
    block_indices: list[int],
    store: bool,
) -> list[tuple[int, int, int]]:
    """(src address, dst address, size) of every copy, in vLLM's order."""
    out: list[tuple[int, int, int]] = []
    gi = 0
    ci = 0
    for g, refs in enumerate(groups):
        n = group_sizes[g]
        if n == 0:
            continue
        skip = block_indices[g] % bpc
        nchunks = -(-(n + skip) // bpc)
        blocks = gpu_blocks[gi : gi + n]
        chunks = cpu_chunks[ci : ci + nchunks]
        gi += n
        ci += nchunks
        slots = []
        for c in chunks:
            for j in range(bpc):
                slots.append(c * bpc + j)
        slots = slots[skip : skip + n]
        for ref in refs:
            t = ref.tensor
            for b, s in zip(blocks, slots):
                if store and ref.frags is not None and s % ref.num_writers != ref.writer_index:
                    continue
                gaddr = gpu.base[t] + b * gpu.row_stride[t]
                haddr = host.base[t] + (s // bpc) * host.row_stride[t] + (s % bpc) * host.sub_stride[t]
                frags = ref.frags if ref.frags is not None else [(0, 0, ref.page)]
                for local, canon, size in frags:
                    if store:
                        out.append((gaddr + local, haddr + canon, size))
                    else:
                        out.append((haddr + canon, gaddr + local, size))
    return out


def byte_map(descs: list[tuple[int, int, int]]) -> dict[int, int]:
    """dst byte address -> src byte address (the exact set of bytes copied)."""
    m: dict[int, int] = {}
    for src, dst, size in descs:
        for i in range(size):
            assert dst + i not in m, "destination written twice"
            m[dst + i] = src + i
    return m
