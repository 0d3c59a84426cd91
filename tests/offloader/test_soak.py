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
from typing import Any

import numpy as np
import pytest
from support import Mem

import kvasync as kv

N_OPS = int(os.environ.get("KVASYNC_SOAK_OPS", "200000"))
TIME_LIMIT = float(os.environ.get("KVASYNC_SOAK_SECONDS", "100"))
#: transfers every soak runs whatever its time budget (a slow host takes longer, it does not
#: fail): enough to read memory after the warm-up (`done == 2000`) and well past it
MIN_OPS = min(N_OPS, 5000)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow  # ~100 s: CI runs it as its own step (`pytest -m slow`)
@pytest.mark.parametrize(
    "backend_path",
    [pytest.param(("host", "auto", 1.0), id="host"),
     pytest.param(("host", "staged", 0.5), id="host-staged"),
     pytest.param(("cuda", "auto", 0.25), id="cuda-auto", marks=pytest.mark.gpu),
     # tiny multi-group transfers: staged's host cost per transfer (~1 ms on the H200 host) sets the pace
     pytest.param(("cuda", "staged", 0.5), id="cuda-staged", marks=pytest.mark.gpu),
     pytest.param(("cuda", "dma", 0.15), id="cuda-dma", marks=pytest.mark.gpu)],
)
def test_soak_random_transfers_match_the_oracle(backend_path: tuple[str, str, float]) -> None:
    backend, path, share = backend_path
    mem = Mem(backend)
    time_limit = TIME_LIMIT * share
    rng = np.random.default_rng(1234)
    bpc, blocks, chunks = 3, 512, 400
    pages = [48, 64, 40, 32]
    gpu = [mem.rand_u8((blocks, p), seed=i) for i, p in enumerate(pages)]
    groups = [[kv.KVRef(0), kv.KVRef(1)], [kv.KVRef(2), kv.KVRef(3, page_size_bytes=24)]]
    layout = kv.KVCacheLayout([kv.KVTensor(t) for t in gpu], groups)
    # the soak's transfers move at most 880 B: under auto on CUDA, staging from 400 B up
    # mixes staged transfers with the other paths' in each lane, as big transfers would
    mixed = backend == "cuda" and path == "auto"
    with kv.Offloader(layout, chunks, bpc, backend=backend, copy_path=path) as off:
        if mixed:
            off.backend.STAGED_MIN_BYTES = 400  # type: ignore[attr-defined]
        _soak(off, backend, path, gpu, mem, rng, time_limit, bpc, blocks, chunks)
        if mixed:
            counts = off.backend.counts  # type: ignore[attr-defined]
            assert counts["staged"] > 0 and counts["kernel"] + counts["dma"] > 0, counts
    assert off._resources()["completion_threads"] == 0


def _soak(off: kv.Offloader, backend: str, path: str, gpu: list[Any], mem: Mem,
          rng: np.random.Generator, time_limit: float, bpc: int, blocks: int,
          chunks: int) -> None:
    cpu = off.cpu_tensors
    for c in cpu:
        c[:] = rng.integers(0, 256, c.shape, dtype=np.uint8)
    m_gpu = [mem.to_numpy(g) for g in gpu]
    m_cpu = [c.copy().reshape(chunks * bpc, -1) for c in cpu]
    ref_page = [[48, 64], [40, 24]]
    pending: dict[str, list[tuple[kv.Transfer, set[int], set[int]]]] = {"d2h": [], "h2d": []}

    def prune(d: str) -> None:
        pending[d] = [p for p in pending[d] if not p[0].done()]

    def drain(d: str) -> None:
        for t, _, _ in pending[d]:
            t.wait(30)
        pending[d] = []

    rss0 = pinned0 = 0
    done = 0
    t_start = time.perf_counter()
    transfers_bytes = 0
    while done < N_OPS and (done < MIN_OPS or time.perf_counter() - t_start < time_limit):
        if done == 2000:
            rss0 = _rss_bytes()
            pinned0 = off._resources()["host_bytes"] if off.host_pinned else 0
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
            t = off.store(gpu_blocks=g_ids, cpu_chunks=c_ids, group_sizes=gsizes, block_indices=bidx)
        else:
            t = off.load(cpu_chunks=c_ids, gpu_blocks=g_ids, group_sizes=gsizes, block_indices=bidx)
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
                np.testing.assert_array_equal(mem.to_numpy(gpu[i]), m_gpu[i],
                                              f"gpu tensor {i} after {done}")
                np.testing.assert_array_equal(cpu[i].reshape(chunks * bpc, -1), m_cpu[i])
    drain("d2h")
    drain("h2d")
    elapsed = time.perf_counter() - t_start
    for i in range(4):
        np.testing.assert_array_equal(mem.to_numpy(gpu[i]), m_gpu[i], f"gpu tensor {i}")
        np.testing.assert_array_equal(cpu[i].reshape(chunks * bpc, -1), m_cpu[i], f"cpu {i}")
    rss1 = _rss_bytes()
    pinned1 = off._resources()["host_bytes"] if off.host_pinned else 0
    print(f"\nsoak[{backend}/{path}]: {done} transfers ({transfers_bytes / 1e6:.1f} MB) in {elapsed:.1f} s, "
          f"0 mismatches; RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB; "
          f"pinned {pinned0 / 2**20:.2f} -> {pinned1 / 2**20:.2f} MiB")
    assert pinned1 == pinned0
    assert rss1 - rss0 < 64 * 2**20, "memory grew during the soak"
    assert off.backend.name == backend


@pytest.mark.asyncio
async def test_ten_thousand_in_flight_resolve_in_order() -> None:
    gpu = [np.random.default_rng(3).integers(0, 256, (64, 64), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host")
    ts = [off.store(gpu_blocks=[i % 64], cpu_chunks=[(i * 7) % 64]) for i in range(10_000)]
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
