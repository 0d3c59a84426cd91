"""Offload a conversation's KV blocks to another process's memory and bring them back.

Two processes on one machine: this script starts a pool owner (`python -m kvasync.serve`),
then, as the client, stores a conversation's blocks into the pool's memory through NIXL,
overwrites them locally, reloads them, checks every byte and prints the GB/s of each
direction. Needs ``pip install 'kvasync[nixl]'``. On a GPU pass ``--cuda`` (the KV tensors
are then torch CUDA tensors: VRAM -> the pool's DRAM).

    python examples/remote_tier.py [--page-kib 16] [--blocks 4096] [--tensors 8] [--cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time

import numpy as np

import kvasync as kv
from kvasync.remote import RemoteOffloader
from kvasync.serve import spawn


def start_pool(nbytes: int) -> tuple[subprocess.Popen[str], str]:
    """The owner process (`python -m kvasync.serve`); returns it and its control address."""
    proc, address = spawn(nbytes)
    print(f"pool listening on {address}")
    return proc, address


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()
    page = args.page_kib << 10
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 256, (args.blocks, page), dtype=np.uint8)
            for _ in range(args.tensors)]
    if args.cuda:
        import torch

        kvs = [torch.from_numpy(h).cuda() for h in host]
    else:
        kvs = [h.copy() for h in host]
    layout = kv.KVCacheLayout.from_tensors(kvs)
    conversation = rng.permutation(args.blocks)[: args.blocks // 2].tolist()  # its blocks
    chunks = list(range(len(conversation)))
    nbytes = len(conversation) * page * args.tensors
    proc, address = start_pool(args.blocks * page * args.tensors + (64 << 20))
    try:
        async with RemoteOffloader(layout, args.blocks, peer=address) as off:
            await off.store(gpu_blocks=conversation[:8], cpu_chunks=chunks[:8])  # connection set-up, not timed
            t0 = time.perf_counter()
            stored = await off.store(gpu_blocks=conversation, cpu_chunks=chunks)
            t1 = time.perf_counter()
            for t in kvs:
                t[conversation] = 0  # the GPU blocks are reused by another request
            t2 = time.perf_counter()
            loaded = await off.load(cpu_chunks=chunks, gpu_blocks=conversation)
            t3 = time.perf_counter()
        back = [t.cpu().numpy() if args.cuda else t for t in kvs]
        ok = all(np.array_equal(b, h) for b, h in zip(back, host))
        print(f"{len(conversation)} blocks x {args.tensors} tensors x {args.page_kib} KiB = "
              f"{nbytes / 2**20:.0f} MiB; store {stored.bytes / (t1 - t0) / 1e9:.2f} GB/s, "
              f"load {loaded.bytes / (t3 - t2) / 1e9:.2f} GB/s; bytes match: {ok}")
        if not ok:
            raise SystemExit(1)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    asyncio.run(main())
