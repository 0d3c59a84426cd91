"""Shutdown on the GPU releases everything: threads, tasks, staging buffers, device tables,
registered host memory; and a closed offloader's streams do no more work."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._backends import _cudart

pytestmark = pytest.mark.gpu


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["kernel", "dma"])
async def test_aclose_releases_every_resource(cp: Any, path: str) -> None:
    threads_before = threading.active_count()
    gpu = cp.asarray(np.random.default_rng(0).integers(0, 256, (64, 16384), dtype=np.uint8))
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 64, backend="cuda",
                       copy_path=path)
    host_ptr = int(off.cpu_tensors[0].ctypes.data)
    assert off.host_pinned and _cudart.is_registered(host_ptr)
    ts = [off.store(gpu_blocks=[i], cpu_chunks=[63 - i]) for i in range(64)]
    ts += [off.load(cpu_chunks=[i], gpu_blocks=[i]) for i in range(32)]
    await asyncio.gather(*ts)
    backend: Any = off.backend
    assert off._resources()["completion_threads"] == 2
    await off.aclose()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    res = off._resources()
    assert res == {"completion_threads": 0, "resolver_tasks": 0, "stream_threads": 0,
                   "host_bytes": 0, "inflight": 0}, res
    assert backend._staging._free == {} and not backend._table_cache.entries
    assert not _cudart.is_registered(host_ptr)  # unpinned on close
    assert threading.active_count() <= threads_before
    await off.aclose()  # twice: a no-op
    with pytest.raises(kv.OffloaderClosedError):
        off.load(cpu_chunks=[0], gpu_blocks=[0])


def test_repeated_offloaders_do_not_leak_pinned_memory(cp: Any) -> None:
    """Build and close 20 offloaders of 64 MiB pinned each: registrations never pile up."""
    gpu = cp.zeros((256, 262144), dtype=cp.uint8)
    ptrs = []
    for _ in range(20):
        off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 256, backend="cuda")
        ptrs.append(int(off.cpu_tensors[0].ctypes.data))
        off.store(gpu_blocks=list(range(8)), cpu_chunks=list(range(8))).wait(30)
        off.close()
    assert not any(_cudart.is_registered(p) for p in ptrs)
