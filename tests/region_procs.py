"""Child-process bodies for the shared-region tests (a plain module so `spawn` can import it).

Every function runs in a fresh interpreter, opens a `SharedHostRegion`, does its part and
reports through a queue; the parent checks the reports and the raw file.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

SPAWN = mp.get_context("spawn")


def shm_leftovers(tag: str, directory: str = "/dev/shm") -> list[str]:
    """Files of this test run (their names carry `tag`) still present in `directory`."""
    return sorted(f for f in os.listdir(directory) if tag in f)


def race_writer(name: str, rank: int, world: int, rows: int, stride: int, go: Any,
                out: Any) -> None:
    """Wait for the start signal, open the region, fill this rank's slot with rank+1."""
    from kvasync import SharedHostRegion

    go.wait()
    try:
        region = SharedHostRegion(name, rows, stride, rank, world, keep_file=True)
        view = region.create_next_worker_view(stride // world)
        view[:] = rank + 1
        out.put((rank, region.is_creator, None))
        del view
        region.close()
    except BaseException as exc:  # reported, the parent fails the test
        out.put((rank, False, repr(exc)))


def barrier_peer(name: str, rank: int, rows: int, stride: int, barrier: Any, out: Any) -> None:
    """Two ranks with a real barrier: rank 0 writes, rank 1 reads it through its mapping."""
    from kvasync import SharedHostRegion

    region = SharedHostRegion(name, rows, stride, rank, 2, barrier=barrier.wait)
    raw = region.raw_view()
    if rank == 0:
        raw[:] = 0x5C
    barrier.wait()  # rank 0's bytes are in place, and its constructor has unlinked the path
    exists_after = os.path.exists(region.path)
    seen = int(raw[rows - 1, stride - 1]) if rank == 1 else 0x5C
    ident = region._file.ident
    del raw
    out.put((rank, region.is_creator, exists_after, ident, seen, region.populated_with))
    barrier.wait()
    region.close()


def sleeper(name: str, rank: int, rows: int, stride: int, barrier: Any, out: Any) -> None:
    """Open the region, report ready, then sleep until killed."""
    from kvasync import SharedHostRegion

    region = SharedHostRegion(name, rows, stride, rank, 2, barrier=barrier.wait)
    region.raw_view()[:] = rank + 1
    out.put((rank, os.getpid()))
    time.sleep(60)
    region.close()  # never reached: the parent SIGKILLs us


def failing_peer(name: str, rank: int, rows: int, stride: int, barrier: Any,
                 out: Any) -> None:
    """Rank 0 creates, then fails its free-space check; rank 1, joined to the stub, must
    get a clear error instead of waiting out its timeout."""
    import kvasync._region_file as regfile
    from kvasync import SharedHostRegion

    if rank == 0:
        def no_space(directory: str) -> int:
            time.sleep(0.5)  # hold the 0-byte stub long enough for rank 1 to join it
            return 0

        regfile._free_bytes = no_space
    else:
        path = f"/dev/shm/kvasync-{name}.shm"
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.001)
    calls = []

    def counted() -> None:
        calls.append(1)
        barrier.wait()

    try:
        SharedHostRegion(name, rows, stride, rank, 2, barrier=counted, timeout=5.0)
        out.put((rank, "ok", len(calls)))
    except BaseException as exc:
        out.put((rank, repr(exc), len(calls)))


# -- file safety: other jobs' files, dead jobs' files ---------------------------------------------


def slow_creator(name: str, rows: int, stride: int, proceed: Any, directory: str,
                 out: Any) -> None:
    """Job A: create the file, stall before sizing it until `proceed` is set (a slow
    creator), then finish and keep the file. Reports ("stalled", inode), then ("done",
    creator, inode, error)."""
    import kvasync._region_file as regfile
    from kvasync import SharedHostRegion

    real = regfile._free_bytes

    def slow(d: str) -> int:
        out.put(("stalled", os.stat(regfile.path_for(directory, name)).st_ino))
        proceed.wait(60)
        return real(d)

    regfile._free_bytes = slow
    try:
        region = SharedHostRegion(name, rows, stride, 0, 1, keep_file=True, directory=directory)
        out.put(("done", region.is_creator, os.stat(region.path).st_ino, None))
        region.close()
    except BaseException as exc:
        out.put(("done", False, 0, repr(exc)))


def opener(name: str, rows: int, stride: int, rank: int, world: int, timeout: float,
           directory: str, out: Any) -> None:
    """Job B: open the region as `rank` with a (trivial) barrier; report (creator, error)."""
    from kvasync import SharedHostRegion

    try:
        region = SharedHostRegion(name, rows, stride, rank, world, barrier=lambda: None,
                                  timeout=timeout, directory=directory)
        out.put((region.is_creator, None))
        region.close()
    except BaseException as exc:
        out.put((False, repr(exc)))


def holder(name: str, rows: int, stride: int, directory: str, release: Any, out: Any) -> None:
    """A live job without a barrier: create the region, keep it (and the path) until
    `release` is set, then close it leaving the file (keep_file). Reports the inode."""
    from kvasync import SharedHostRegion

    region = SharedHostRegion(name, rows, stride, 0, 1, keep_file=True, directory=directory)
    region.raw_view()[:] = 0x77
    out.put(os.stat(region.path).st_ino)
    release.wait(60)
    region.close()


# -- tensor-parallel round trips on the host backend ---------------------------------------------

#: ground truth geometry of the cross-topology case (notes 6.2.6): 3 blocks, K/V,
#: 4 tokens, 4 KV heads, 64 B per head: one canonical NHD page is 2048 B
TP_BLOCKS, TP_TOKENS, TP_HEADS, TP_HEAD_BYTES = 3, 4, 4, 64


def ground_truth(seed: int = 7) -> np.ndarray:
    """(blocks, 2, tokens, heads, head_bytes) uint8: the parallelism-free KV cache."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(TP_BLOCKS, 2, TP_TOKENS, TP_HEADS, TP_HEAD_BYTES),
                        dtype=np.uint8)


def head_shard_of(truth: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """This rank's KV tensor: (blocks, 2, tokens, local heads, head_bytes), contiguous."""
    from kvasync._mappings import head_shard

    first, local, _, _ = head_shard(truth.shape[3], tp, rank)
    return np.ascontiguousarray(truth[:, :, :, first : first + local, :])


MLA_PAGE = 1024  # one latent block, replicated on every rank


def mla_truth(seed: int = 11) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(TP_BLOCKS, MLA_PAGE), dtype=np.uint8)


def pss_bytes(ptr: int) -> int:
    """Proportional set size of the mapping that starts at `ptr` (shared pages are split
    between the processes that map them, so summing over processes counts them once)."""
    start = f"{ptr:x}-"
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                inside = head.startswith(start)
            elif inside and line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def tp_rank(name: str, kind: str, role: str, tp: int, rank: int, rows: int, stride: int,
            barrier: Any, out: Any) -> None:
    """One TP rank. A writer stores its KV into the canonical region; after every writer
    finished, a reader (another TP degree) loads its own shard and compares it with the
    ground truth. `kind` "heads": NHD heads sharded over TP; "mla": the latent replicated.
    Reports (role, rank, bytes copied, shard exact, canonical bytes exact, pss, error)."""
    import asyncio

    import kvasync as kv
    from kvasync import SharedHostRegion, derive_page_mapping, mla_page_mapping

    writer = role == "writer"
    region = None
    try:
        if kind == "heads":
            truth = ground_truth()
            mapping = derive_page_mapping(layout="NHD", num_kv_heads=TP_HEADS,
                                          head_bytes=TP_HEAD_BYTES, block_size=TP_TOKENS,
                                          tp_size=tp, tp_rank=rank)
            want = head_shard_of(truth, tp, rank)
            flat = truth.reshape(TP_BLOCKS, -1)
        else:
            truth = mla_truth()
            mapping = mla_page_mapping(MLA_PAGE, tp, rank)
            want = truth
            flat = truth
        region = SharedHostRegion(name, rows, stride, rank, tp, barrier=barrier.wait,
                                  populate=writer)
        gpu = want.copy() if writer else np.zeros_like(want)
        layout = kv.KVCacheLayout([kv.KVTensor(gpu)], [[kv.KVRef(0, mapping=mapping)]])
        off = kv.Offloader(layout, num_cpu_chunks=rows, blocks_per_chunk=1, backend="host",
                           canonical=True, host_region=region)
        blocks = list(range(TP_BLOCKS))

        async def run() -> tuple[int, bool, bool, int]:
            nbytes = 0
            if writer:
                nbytes = (await off.store(gpu_blocks=blocks, cpu_chunks=blocks)).bytes
            barrier.wait()  # every store is done
            canon_ok = bool(np.array_equal(region.raw_view()[:TP_BLOCKS, : flat.shape[1]],
                                           flat))
            if not writer:
                nbytes = (await off.load(cpu_chunks=blocks, gpu_blocks=blocks)).bytes
            shard_ok = bool(np.array_equal(gpu, want))
            barrier.wait()  # every load is done: the page mappings are final
            pss = pss_bytes(region.base_ptr)
            barrier.wait()  # nobody unmaps before every rank measured
            await off.aclose()
            return nbytes, shard_ok, canon_ok, pss

        nbytes, shard_ok, canon_ok, pss = asyncio.run(run())
        out.put((role, rank, nbytes, shard_ok, canon_ok, pss, None))
    except BaseException as exc:
        out.put((role, rank, 0, False, False, 0, repr(exc)))
        barrier.abort()
        if region is not None:
            region.close()
