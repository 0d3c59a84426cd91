"""Tensor-parallel round trips through one SharedHostRegion on the host backend.

Rank processes of one TP degree store their KV into a canonical region; readers of another
TP degree load their shard from it and must get exactly the ground truth (notes 6.2.6).
Replicated (MLA-style) KV must cost one copy of host memory however many ranks hold it.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import region_procs as procs

import kvasync as kv
from kvasync import SharedHostRegion, derive_page_mapping, mla_page_mapping
from kvasync._mappings import head_shard

PAGE = mmap.PAGESIZE
ROOT = Path(__file__).resolve().parents[2]

Names = Callable[[], str]


def run_ranks(name: str, kind: str, writers: int, readers: int,
              rows: int = procs.TP_BLOCKS) -> list[tuple[Any, ...]]:
    """Spawn `writers` + `readers` rank processes on one region; their reports, sorted."""
    stride = PAGE
    barrier, out = procs.SPAWN.Barrier(writers + readers), procs.SPAWN.Queue()
    ps = [
        procs.SPAWN.Process(target=procs.tp_rank,
                            args=(name, kind, role, tp, r, rows, stride, barrier, out))
        for role, tp in (("writer", writers), ("reader", readers))
        for r in range(tp)
    ]
    for p in ps:
        p.start()
    reports = sorted((out.get(timeout=60) for _ in ps), key=lambda x: (x[0], x[1]))
    for p in ps:
        p.join(timeout=30)
    assert [e for *_, e in reports] == [None] * len(ps), reports
    assert all(p.exitcode == 0 for p in ps)
    assert procs.shm_leftovers(name) == []  # unlinked after the barrier
    return reports


@pytest.mark.parametrize(("writers", "readers"), [(2, 4), (4, 2), (2, 1), (4, 4)])
def test_cross_topology_roundtrip(names: Names, writers: int, readers: int) -> None:
    reports = run_ranks(names(), "heads", writers, readers)
    page = 2 * procs.TP_TOKENS * procs.TP_HEADS * procs.TP_HEAD_BYTES  # 2048
    for role, rank, nbytes, shard_ok, canon_ok, _, _ in reports:
        tp = writers if role == "writer" else readers
        assert shard_ok, (role, rank)
        assert canon_ok, (role, rank)  # the region holds the parallelism-free pages
        assert nbytes == procs.TP_BLOCKS * page // tp


def test_replicated_mla_is_stored_once_and_costs_one_copy(names: Names) -> None:
    writers, readers, rows = 4, 2, 64
    reports = run_ranks(names(), "mla", writers, readers, rows)
    stored = [r[2] for r in reports if r[0] == "writer"]
    # rotation: block b is written by rank b % 4 only
    assert stored == [procs.MLA_PAGE if b < procs.TP_BLOCKS else 0 for b in range(writers)]
    assert sum(stored) == procs.TP_BLOCKS * procs.MLA_PAGE
    for role, _, nbytes, shard_ok, canon_ok, _, _ in reports:
        assert shard_ok and canon_ok
        if role == "reader":
            assert nbytes == procs.TP_BLOCKS * procs.MLA_PAGE
    # the proportional set sizes of all six processes add up to one copy of the region
    # (the kernel truncates each process's Pss to whole KiB)
    total = sum(r[5] for r in reports)
    assert rows * PAGE - 1024 * len(reports) <= total <= rows * PAGE


# -- in-process variants: several openers of one region in this process ---------------------


def _canonical_rank(region: SharedHostRegion, gpu: np.ndarray,
                    mapping: kv.PageMapping) -> kv.Offloader:
    layout = kv.KVCacheLayout([kv.KVTensor(gpu)], [[kv.KVRef(0, mapping=mapping)]])
    return kv.Offloader(layout, num_cpu_chunks=region.num_rows, blocks_per_chunk=1,
                        backend="host", canonical=True, host_region=region)


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("heads", [8, 2])
@pytest.mark.parametrize("path", ["auto", "staged"])
async def test_every_topology_pair_in_one_process(
    names: Names, layout: str, packed: bool, heads: int, path: str
) -> None:
    """Every writer and reader TP degree through one region, on the default path and on
    the staged program (the region's rows staged as they lie)."""
    blocks, bs, hb = 4, 4, 32
    rng = np.random.default_rng(heads)
    # logical (blocks, K/V, tokens, heads, hb) -> page bytes of the given encoding
    full = rng.integers(0, 256, size=(blocks, 2, bs, heads, hb), dtype=np.uint8)

    def encode(x: np.ndarray) -> np.ndarray:
        if layout == "NHD":
            y = x.transpose(0, 2, 3, 1, 4) if packed else x
        else:
            y = x.transpose(0, 3, 2, 1, 4) if packed else x.transpose(0, 1, 3, 2, 4)
        return np.ascontiguousarray(y).reshape(x.shape[0], -1)

    def shard(tp: int, r: int) -> np.ndarray:
        first, local, _, _ = head_shard(heads, tp, r)
        return encode(full[:, :, :, first : first + local])

    def mapping(tp: int, r: int) -> kv.PageMapping:
        return derive_page_mapping(layout=layout, num_kv_heads=heads, head_bytes=hb,  # type: ignore[arg-type]
                                   block_size=bs, tp_size=tp, tp_rank=r, kv_packed=packed)

    for writers in (1, 2, 4):
        for readers in (1, 2, 4, 8):
            name = names()
            wr = [SharedHostRegion(name, blocks, PAGE, r, writers, populate=False)
                  for r in range(writers)]
            rd = [SharedHostRegion(name, blocks, PAGE, r, readers, populate=False)
                  for r in range(readers)]
            woffs = [_canonical_rank(wr[r], shard(writers, r), mapping(writers, r))
                     for r in range(writers)]
            for off in woffs:
                await off.store(gpu_blocks=list(range(blocks)), cpu_chunks=list(range(blocks)),
                                path=path)
            np.testing.assert_array_equal(rd[0].raw_view()[:, : 2 * bs * heads * hb],
                                          encode(full))
            for r in range(readers):
                gpu = np.zeros_like(shard(readers, r))
                off = _canonical_rank(rd[r], gpu, mapping(readers, r))
                await off.load(cpu_chunks=list(range(blocks))[::-1], gpu_blocks=list(range(blocks)),
                               path=path)
                np.testing.assert_array_equal(gpu, shard(readers, r)[::-1])
                if path == "staged":
                    assert off.backend.counts["staged"] == 1  # type: ignore[attr-defined]
                await off.aclose()
            for off in woffs:
                if path == "staged":
                    assert off.backend.counts["staged"] == 1  # type: ignore[attr-defined]
                await off.aclose()
            assert not os.path.exists(wr[0].path)


def test_mla_host_memory_is_one_copy_not_n(names: Names) -> None:
    """N ranks holding the same latent: canonical region = 1 copy, worker views = N."""
    n, blocks, page = 4, 64, 3 * PAGE

    async def store_all(canonical: bool) -> int:
        stride = page if canonical else n * page
        name = names()
        regions = [SharedHostRegion(name, blocks, stride, r, n, populate=False)
                   for r in range(n)]
        latent = np.random.default_rng(1).integers(0, 256, (blocks, page), dtype=np.uint8)
        offs = []
        for r in range(n):
            gpu = latent.copy()
            if canonical:
                offs.append(_canonical_rank(regions[r], gpu, mla_page_mapping(page, n, r)))
            else:
                layout = kv.KVCacheLayout.from_tensors([gpu])
                offs.append(kv.Offloader(layout, blocks, 1, backend="host",
                                         host_region=regions[r]))
        for off in offs:
            await off.store(gpu_blocks=list(range(blocks)), cpu_chunks=list(range(blocks)))
        used = regions[0].allocated_bytes
        for off in offs:
            await off.aclose()
        return used

    assert asyncio.run(store_all(canonical=True)) == blocks * page
    assert asyncio.run(store_all(canonical=False)) == n * blocks * page


def test_example_runs_and_verifies() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tensor_parallel.py"), "--quick"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all round trips exact" in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "dma"])
def test_example_on_the_gpu_shares_one_pinned_region(path: str) -> None:
    """Real rank processes on one GPU, one pinned shared region, both copy paths."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tensor_parallel.py"), "--quick",
         "--backend", "cuda"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**__import__("os").environ, "KVASYNC_COPY_PATH": path},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all round trips exact" in proc.stdout
