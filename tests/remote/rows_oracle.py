"""A plain-Python oracle of the remote tier's NIXL descriptors (no NumPy in the math).

Written from the rules, the slow and obvious way: groups consume block and chunk ids in
order, the host side skips ``block_indices[g] % bpc`` sub-blocks of a group's first chunk;
block k of a group lands in sub-block ``(skip + k) % bpc`` of chunk ``(skip + k) // bpc``,
at ``base + chunk * row_bytes + offset[t] + sub * page[t]`` for each tensor t of the group.
The distinct chunks a transfer touches, sorted, take staging rows in that order (rank r:
buffer ``r // rows_per_buffer``, row ``r % rows_per_buffer``, rows of `span` bytes, each
byte at its offset in the chunk row). Every covered byte range becomes a (staging offset,
pool address, size) triple; triples contiguous on both sides within a buffer merge.
"""

from __future__ import annotations


def covered(groups: list[list[int]], pages: list[int], offsets: list[int], row_bytes: int,
            base: int, bpc: int, cpu_chunks: list[int], group_sizes: list[int],
            block_indices: list[int]) -> list[tuple[int, int, int]]:
    """(chunk, offset in its row, size) of every page the request moves in the pool."""
    out = []
    ci = 0
    for g, tensors in enumerate(groups):
        n = group_sizes[g]
        if n == 0:
            continue
        skip = block_indices[g] % bpc
        used = -(-(n + skip) // bpc)
        chunks = cpu_chunks[ci : ci + used]
        ci += used
        for k in range(n):
            chunk = chunks[(skip + k) // bpc]
            sub = (skip + k) % bpc
            for t in tensors:
                out.append((chunk, offsets[t] + sub * pages[t], pages[t]))
    return out


def runs(groups: list[list[int]], pages: list[int], offsets: list[int], row_bytes: int,
         base: int, bpc: int, cpu_chunks: list[int], group_sizes: list[int],
         block_indices: list[int], span: int, rows_per_buffer: int, window: int = 0
         ) -> list[list[tuple[int, int, int]]]:
    """Per staging buffer, the sorted (staging offset, pool address, size) runs; a staging
    row holds the `span` bytes of a pool row from offset `window` on."""
    pieces = covered(groups, pages, offsets, row_bytes, base, bpc, cpu_chunks, group_sizes,
                     block_indices)
    chunks = sorted({c for c, _, _ in pieces})
    rank = {c: r for r, c in enumerate(chunks)}
    nbuf = -(-len(chunks) // rows_per_buffer)
    # every covered byte, once (a load may read one page into several blocks)
    bytes_of: list[set[tuple[int, int]]] = [set() for _ in range(nbuf)]
    for c, off, size in pieces:
        r = rank[c]
        for i in range(size):
            bytes_of[r // rows_per_buffer].add(((r % rows_per_buffer) * span + off - window + i,
                                                base + c * row_bytes + off + i))
    out = []
    for k in range(nbuf):
        merged: list[list[int]] = []
        for stage, pool in sorted(bytes_of[k], key=lambda x: x[1]):
            if merged and merged[-1][0] + merged[-1][2] == stage and \
                    merged[-1][1] + merged[-1][2] == pool:
                merged[-1][2] += 1
            else:
                merged.append([stage, pool, 1])
        out.append([(a, b, n) for a, b, n in merged])
    return out
