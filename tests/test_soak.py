"""Soak: many random stores and loads against an oracle model of host and device memory.

Stores and loads run concurrently (independent queues). The model applies each transfer at
submission time, which is exact because the test never submits a transfer that conflicts
with the other direction's in-flight work (a load reading a chunk a pending store writes,
a load overwriting a block a pending store still reads, and so on): it drains the other direction first, as a
caller with such a dependency must.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import kvasync as kv

N_OPS = int(os.environ.get("KVASYNC_SOAK_OPS", "200000"))
TIME_LIMIT = float(os.environ.get("KVASYNC_SOAK_SECONDS", "60"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak_random_transfers_match_the_oracle() -> None:
    rng = np.random.default_rng(1234)
    bpc, blocks, chunks = 3, 512, 400
    pages = [48, 64, 40, 32]
    gpu = [rng.integers(0, 256, (blocks, p), dtype=np.uint8) for p in pages]
    groups = [[kv.KVRef(0), kv.KVRef(1)], [kv.KVRef(2), kv.KVRef(3, page_size_bytes=24)]]
    layout = kv.KVCacheLayout([kv.KVTensor(t) for t in gpu], groups)
    off = kv.Offloader(layout, chunks, bpc, backend="host")
    cpu = off.cpu_tensors
    for c in cpu:
        c[:] = rng.integers(0, 256, c.shape, dtype=np.uint8)
    m_gpu = [g.copy() for g in gpu]
    m_cpu = [c.copy().reshape(chunks * bpc, -1) for c in cpu]
    ref_page = [[48, 64], [40, 24]]
    pending: dict[str, list[tuple[kv.Transfer, set[int], set[int]]]] = {"d2h": [], "h2d": []}

    def prune(d: str) -> None:
        pending[d] = [p for p in pending[d] if not p[0].done()]

    def drain(d: str) -> None:
        for t, _, _ in pending[d]:
            t.wait(30)
        pending[d] = []

    rss0 = 0
    done = 0
    t_start = time.perf_counter()
    transfers_bytes = 0
    while done < N_OPS and time.perf_counter() - t_start < TIME_LIMIT:
        if done == 2000:
            rss0 = _rss_bytes()
        store = bool(rng.integers(0, 2))
        gsizes, bidx, g_ids, c_ids = [], [], [], []
        per_group = []
        free_chunks = rng.permutation(chunks)
        cpos = 0
        for _g in range(2):
            n = int(rng.integers(0, 6))
            start = int(rng.integers(0, 9))
            skip = start % bpc
            nchunks = -(-(n + skip) // bpc) if n else 0
            ids = rng.choice(blocks, size=n, replace=False)
            cs = free_chunks[cpos : cpos + nchunks]
            cpos += nchunks
            slots = (cs[:, None] * bpc + np.arange(bpc)).ravel()[skip : skip + n]
            gsizes.append(n)
            bidx.append(start)
            g_ids += ids.tolist()
            c_ids += cs.tolist()
            per_group.append((ids, slots))
        blocks_touched = set(g_ids)
        chunks_touched = set(c_ids)
        other = "h2d" if store else "d2h"
        prune(other)
        # hazards with the other direction's in-flight transfers (read-after-write and
        # write-after-read: both directions touch both a block and a chunk)
        if any(blocks_touched & b or chunks_touched & c for _, b, c in pending[other]):
            drain(other)
        if store:
            t = off.store(g_ids, c_ids, gsizes, bidx)
        else:
            t = off.load(c_ids, g_ids, gsizes, bidx)
        d = "d2h" if store else "h2d"
        pending[d].append((t, blocks_touched, chunks_touched))
        for g, (ids, slots) in enumerate(per_group):
            for r, tidx in enumerate((2 * g, 2 * g + 1)):
                p = ref_page[g][r]
                if store:
                    m_cpu[tidx][slots, :p] = m_gpu[tidx][ids, :p]
                else:
                    m_gpu[tidx][ids, :p] = m_cpu[tidx][slots, :p]
        transfers_bytes += t.nbytes
        done += 1
        if len(pending[d]) > 256:
            pending[d][0][0].wait(30)
            prune(d)
        if done % 20000 == 0:
            drain("d2h")
            drain("h2d")
            for i in range(4):
                np.testing.assert_array_equal(gpu[i], m_gpu[i], f"gpu tensor {i} after {done}")
                np.testing.assert_array_equal(cpu[i].reshape(chunks * bpc, -1), m_cpu[i])
    drain("d2h")
    drain("h2d")
    elapsed = time.perf_counter() - t_start
    for i in range(4):
        np.testing.assert_array_equal(gpu[i], m_gpu[i], f"gpu tensor {i}")
        np.testing.assert_array_equal(cpu[i].reshape(chunks * bpc, -1), m_cpu[i], f"cpu {i}")
    rss1 = _rss_bytes()
    print(f"\nsoak: {done} transfers ({transfers_bytes / 1e6:.1f} MB) in {elapsed:.1f} s, "
          f"0 mismatches; RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB")
    assert done >= min(N_OPS, 20000), f"only {done} transfers in {TIME_LIMIT} s"
    assert rss1 - rss0 < 64 * 2**20, "memory grew during the soak"
    assert off.backend.name == "host"
    off.close()
    assert off._resources()["completion_threads"] == 0


@pytest.mark.asyncio
async def test_ten_thousand_in_flight_resolve_in_order() -> None:
    gpu = [np.random.default_rng(3).integers(0, 256, (64, 64), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host")
    ts = [off.store([i % 64], [(i * 7) % 64]) for i in range(10_000)]
    out_of_order: list[int] = []

    def check(tr: kv.Transfer) -> None:  # when a transfer completes, its predecessor has
        if tr.job_id and not ts[tr.job_id - 1].done():
            out_of_order.append(tr.job_id)

    for t in ts:
        t.add_done_callback(check)
    import asyncio

    results = await asyncio.gather(*ts)
    assert [r.job_id for r in results] == list(range(10_000))
    assert out_of_order == []
    assert all(r.success for r in results)
    await off.aclose()
