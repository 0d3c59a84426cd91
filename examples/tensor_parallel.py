"""kvasync tensor-parallel example: N rank processes share ONE host region.

Each rank is its own process, as in a TP deployment. The launcher makes one region name with
a per-job token (`SharedHostRegion.new_name`) and hands it to the ranks. They open one
`SharedHostRegion` in /dev/shm (the first creates it, the others join, all meet at a barrier,
then the creator unlinks the file so nothing leaks), store their KV into the
parallelism-free canonical layout, and readers of ANOTHER TP degree load their own shard
back and check every byte. On the CUDA backend the ranks pin the region together: each its
own slice of the rows, one barrier, then the rest.

Cases:
  heads        NHD pages, 8 KV heads sharded over TP (each rank stores its heads)
  mla          an MLA latent every rank holds in full: stored once, writers rotate by block
  mla-private  the same latent in per-rank worker slots (no canonical layout): N copies

Runs on the host backend (no GPU needed) by default.

    python examples/tensor_parallel.py --writers 4 --readers 2
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

import kvasync as kv
from kvasync import SharedHostRegion, derive_page_mapping, mla_page_mapping

PAGE = mmap.PAGESIZE
HEADS, HEAD_BYTES, BLOCK_SIZE = 8, 128 * 2, 16  # 8 KV heads x head_dim 128 x bf16, 16 tokens
MLA_TOKEN_BYTES, MLA_BLOCK = 576 * 2, 64  # (512 latent + 64 rope) x bf16, 64 tokens/block


def heads_page() -> int:
    return 2 * BLOCK_SIZE * HEADS * HEAD_BYTES  # K|V, all heads: 64 KiB


def mla_page() -> int:
    return MLA_BLOCK * MLA_TOKEN_BYTES  # 72 KiB


def truth_for(case: str, blocks: int) -> np.ndarray:
    """The parallelism-free KV every topology must reproduce."""
    rng = np.random.default_rng(2024)
    if case == "heads":  # (blocks, K/V, tokens, heads, head bytes)
        return rng.integers(0, 256, (blocks, 2, BLOCK_SIZE, HEADS, HEAD_BYTES), dtype=np.uint8)
    return rng.integers(0, 256, (blocks, mla_page()), dtype=np.uint8)


def local_kv(case: str, truth: np.ndarray, tp: int, rank: int) -> tuple[np.ndarray, Any]:
    """This rank's KV tensor and the PageMapping that places it in the canonical page."""
    if case == "heads":
        mapping = derive_page_mapping(layout="NHD", num_kv_heads=HEADS, head_bytes=HEAD_BYTES,
                                      block_size=BLOCK_SIZE, tp_size=tp, tp_rank=rank)
        per = max(HEADS // tp, 1)
        first = rank * per if tp <= HEADS else rank // (tp // HEADS)
        shard = np.ascontiguousarray(truth[:, :, :, first : first + per])
        return shard.reshape(truth.shape[0], -1), mapping
    return truth.copy(), mla_page_mapping(mla_page(), tp, rank)


def to_device(x: np.ndarray, backend: str) -> Any:
    if backend == "cuda":
        import torch

        return torch.from_numpy(x).cuda()
    return x


def to_numpy(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def pss_bytes(ptr: int) -> int:
    """This process's proportional share of the mapping at `ptr` (shared pages are split
    between the processes mapping them, so the sum over processes counts them once)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                inside = head.startswith(f"{ptr:x}-")
            elif inside and line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_main(name: str, case: str, role: str, tp: int, rank: int, blocks: int, stride: int,
              backend: str, barrier: Any, out: Any) -> None:
    """One rank process: open the shared region, store (writer) or load (reader), report."""
    region = None
    try:
        truth = truth_for(case, blocks)
        host_kv, mapping = local_kv(case, truth, tp, rank)
        writer = role == "writer"
        canonical = case != "mla-private"
        # populate=False so the measured memory is what the data really occupies; every
        # rank's Offloader pins (CUDA) or none does (host), so pin_barrier is met by all
        region = SharedHostRegion(name, blocks, stride, rank, tp, barrier=barrier.wait,
                                  populate=False, pin_barrier=barrier.wait)
        gpu = to_device(host_kv if writer else np.zeros_like(host_kv), backend)
        refs = [[kv.KVRef(0, mapping=mapping if canonical else None)]]
        layout = kv.KVCacheLayout([kv.KVTensor(gpu)], refs)
        off = kv.Offloader(layout, num_cpu_chunks=blocks, blocks_per_chunk=1, backend=backend,
                           canonical=canonical, host_region=region,
                           copy_path=os.environ.get("KVASYNC_COPY_PATH", "auto"))
        ids = list(range(blocks))

        async def run() -> tuple[int, float, bool, int, int]:
            nbytes, seconds = 0, 0.0
            if writer:
                t0 = time.perf_counter()
                nbytes = (await off.store(gpu_blocks=ids, cpu_chunks=ids)).bytes
                seconds = time.perf_counter() - t0
            barrier.wait()  # every store landed
            ok = True
            if not writer:
                t0 = time.perf_counter()
                nbytes = (await off.load(cpu_chunks=ids[::-1], gpu_blocks=ids)).bytes  # reversed: real remapping
                seconds = time.perf_counter() - t0
                ok = bool(np.array_equal(to_numpy(gpu), host_kv[::-1]))
            barrier.wait()  # every load landed: the page mappings are final
            pss, alloc = pss_bytes(region.base_ptr), region.allocated_bytes
            barrier.wait()  # nobody unmaps before everybody measured
            await off.aclose()
            return nbytes, seconds, ok, pss, alloc

        out.put((role, rank, *asyncio.run(run()), None))
    except BaseException as exc:
        out.put((role, rank, 0, 0.0, False, 0, 0, repr(exc)))
        barrier.abort()
        if region is not None:
            region.close()


def run_case(case: str, writers: int, readers: int, blocks: int, backend: str) -> dict[str, Any]:
    """Spawn the rank processes of one case and gather what they measured."""
    ctx = mp.get_context("spawn")
    if case == "mla-private":
        readers = 0  # per-rank slots are private to their TP layout: no other reader
    page = heads_page() if case == "heads" else mla_page()
    width = writers * page if case == "mla-private" else page  # private: one slot per rank
    stride = -(-width // PAGE) * PAGE
    name = SharedHostRegion.new_name("example")  # one per job, handed to every rank
    barrier, out = ctx.Barrier(writers + readers), ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(name, case, role, tp, r, blocks, stride, backend,
                                            barrier, out))
        for role, tp in (("writer", writers), ("reader", readers)) for r in range(tp)
    ]
    for p in procs:
        p.start()
    reports = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r[-1] for r in reports if r[-1] is not None]
    if errors:
        raise SystemExit(f"{case}: rank failed: {errors[0]}")
    if os.path.exists(f"/dev/shm/kvasync-{name}.shm"):
        raise SystemExit(f"{case}: the region file leaked")
    one_copy = blocks * page
    loaded = [r[2] for r in reports if r[0] == "reader"]
    return {
        "case": case,
        "topology": f"{writers} -> {readers}" if readers else f"{writers}",
        "stored": sum(r[2] for r in reports if r[0] == "writer"),
        "loaded": loaded[0] if loaded else 0,
        "exact": all(r[4] for r in reports) if loaded else None,  # None: nothing loaded
        "alloc": reports[0][6],
        "pss": sum(r[5] for r in reports),
        "copies": reports[0][6] / one_copy,
        "store_s": max(r[3] for r in reports if r[0] == "writer"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--writers", type=int, default=4, help="TP degree that stores")
    ap.add_argument("--readers", type=int, default=2, help="TP degree that loads it back")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--backend", default="host", choices=["host", "cuda"])
    ap.add_argument("--quick", action="store_true", help="small, for CI")
    args = ap.parse_args()
    blocks = 8 if args.quick else args.blocks
    plan = [("heads", args.writers, args.readers), ("mla", args.writers, args.readers),
            ("mla-private", args.writers, 0)]
    if args.quick:
        plan = [("heads", 2, 4), ("heads", 4, 2), ("mla", 4, 2), ("mla-private", 4, 0)]
    rows = [run_case(c, w, r, blocks, args.backend) for c, w, r in plan]

    mib = 1024**2
    print(f"{blocks} blocks; heads page {heads_page() // 1024} KiB, MLA page "
          f"{mla_page() // 1024} KiB; backend {args.backend}")
    print(f"{'case':<12} {'TP w->r':>8} {'stored':>10} {'loaded/rk':>10} {'exact':>6} "
          f"{'host MiB':>9} {'sum PSS':>9} {'copies':>7}")
    for row in rows:
        print(f"{row['case']:<12} {row['topology']:>8} {row['stored'] / mib:>9.2f}M "
              f"{row['loaded'] / mib:>9.2f}M {('n/a' if row['exact'] is None else 'yes' if row['exact'] else 'NO'):>6} "
              f"{row['alloc'] / mib:>9.2f} {row['pss'] / mib:>9.2f} {row['copies']:>7.2f}")
    if any(r["exact"] is False for r in rows):
        print("MISMATCH")
        return 1
    print("all round trips exact (cases without readers: nothing loaded, n/a)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
