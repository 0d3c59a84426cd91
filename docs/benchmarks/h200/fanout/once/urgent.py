"""How long an urgent 1-block load waits behind a 512 MiB transfer, by what the big one is.

Matrix: big transfer a load (h2d) or a store (d2h) of random 256 KiB pages (DMA, fanned out
over the helper streams) or of contiguous 4 KiB pages (one run per piece); the urgent load
on the DMA or the kernel path; fan-out 4 (default) or 1 (no helper streams); the helpers
forked once per transfer (default) or per piece (the old way). p50 / max of 12 reps, from
submitting the urgent load to its await returning. Run on the H200 from the repo root:
`PYTHONPATH=. python3 docs/benchmarks/h200/fanout/once/urgent.py`; writes $OUT/urgent.json.
"""
import asyncio
import json
import os
import time

import numpy as np
import torch

import kvasync as kv
from kvasync._backends._base import Backend
from kvasync._backends._cuda import CudaBackend

OUT = os.environ.get("OUT", "/tmp")
mine = CudaBackend.enqueue_pieces
rows = []


def measure(page: int, big_dir: str, random: bool, urgent_path: str, reps: int = 12) -> dict:
    n = (512 << 20) // page
    gpu = torch.zeros((n + 1, page), dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(4)
    lat, bigs = [], []
    with kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), n + 1, copy_path="dma") as off:
        async def once() -> tuple[float, float]:
            g = rng.permutation(n) if random else np.arange(n)
            c = rng.permutation(n) if random else np.arange(n)
            t0 = time.perf_counter()
            big = off.load(cpu_chunks=c, gpu_blocks=g) if big_dir == "h2d" else off.store(gpu_blocks=g, cpu_chunks=c)
            t1 = time.perf_counter()
            await off.load(cpu_chunks=[n], gpu_blocks=[n], urgent=True, path=urgent_path)
            t2 = time.perf_counter()
            await big
            return t2 - t1, time.perf_counter() - t0
        for rep in range(reps + 2):
            a, b = asyncio.run(once())
            if rep >= 2:
                lat.append(a)
                bigs.append(b)
    del gpu
    torch.cuda.empty_cache()
    return {"p50_ms": float(np.median(lat)) * 1e3, "max_ms": max(lat) * 1e3,
            "big_ms": float(np.median(bigs)) * 1e3, "samples": lat}


def main() -> None:
    print(f"{'big':<22} {'urgent':<7} {'fan':<9} {'p50 ms':>7} {'max ms':>7} {'big ms':>7}")
    for page, random in ((256 << 10, True), (4 << 10, False)):
        for big_dir in ("h2d", "d2h"):
            for upath in ("dma", "kernel"):
                for fan, per_piece in ((4, False), (4, True), (1, False)):
                    if not random and (fan, per_piece) != (4, False):
                        continue  # contiguous runs never fan out
                    CudaBackend.FAN_OUT = fan
                    CudaBackend.enqueue_pieces = Backend.enqueue_pieces if per_piece else mine
                    r = measure(page, big_dir, random, upath)
                    label = f"{'load' if big_dir == 'h2d' else 'store'} {page >> 10}K " + (
                        "random" if random else "contig")
                    fan_s = f"{fan}" + (" piece" if per_piece else "")
                    r.update(big=label, urgent=upath, fan=fan_s)
                    rows.append(r)
                    print(f"{label:<22} {upath:<7} {fan_s:<9} {r['p50_ms']:7.3f} {r['max_ms']:7.3f}"
                          f" {r['big_ms']:7.1f}", flush=True)
    CudaBackend.FAN_OUT = 4
    CudaBackend.enqueue_pieces = mine
    json.dump(rows, open(os.path.join(OUT, "urgent.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
