"""kvasync quickstart: build a small KV cache, store blocks to host memory, load them back.

Runs on the host backend (no GPU needed) by default; on the CUDA backend when a GPU, torch
and CuPy are available (or pass --backend cuda).

    python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import kvasync as kv


def make_kv_cache(backend: str, layers: int, blocks: int, block_shape: tuple[int, ...]) -> list:
    """One tensor per layer, shaped (2 [K/V], blocks, *block_shape) -> dim 0 must be blocks,
    so we keep K and V as separate tensors: 2 * layers tensors of (blocks, *block_shape)."""
    rng = np.random.default_rng(0)
    tensors = []
    for _ in range(2 * layers):
        host = rng.integers(0, 256, size=(blocks, *block_shape), dtype=np.uint8)
        if backend == "cuda":
            import torch

            tensors.append(torch.from_numpy(host).cuda())
        else:
            tensors.append(host)
    return tensors


def as_numpy(x: object) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return x.cpu().numpy()  # type: ignore[attr-defined]


async def main(backend: str) -> None:
    layers, blocks, block_shape = 8, 128, (16, 2, 64)  # 16 tokens x 2 heads x 64 B = 2 KiB
    tensors = make_kv_cache(backend, layers, blocks, block_shape)
    layout = kv.KVCacheLayout.from_tensors(tensors)
    rows = []
    async with kv.Offloader(layout, num_cpu_chunks=64, backend=backend) as off:
        gpu_blocks = list(range(0, 64, 2))  # 32 scattered blocks
        cpu_chunks = list(range(32))
        t0 = time.perf_counter()
        stored = await off.store(gpu_blocks=gpu_blocks, cpu_chunks=cpu_chunks)
        rows.append(("store", stored, time.perf_counter() - t0))

        # load them into other GPU blocks, then check every byte
        targets = list(range(64, 96))
        t0 = time.perf_counter()
        loaded = await off.load(cpu_chunks=cpu_chunks, gpu_blocks=targets)
        rows.append(("load", loaded, time.perf_counter() - t0))

        for t in tensors:
            a = as_numpy(t)
            assert np.array_equal(a[targets], a[gpu_blocks]), "round trip mismatch"
        for i, t in enumerate(tensors):
            assert np.array_equal(off.cpu_tensors[i][:32], as_numpy(t)[gpu_blocks].reshape(32, -1))
        backend_name = off.backend.name

    print(f"kvasync {kv.__version__}  backend={backend_name}  "
          f"{2 * layers} tensors x {blocks} blocks x {np.prod(block_shape)} B")
    print(f"{'op':<6} {'job':>4} {'bytes':>10} {'device s':>10} {'await s':>10}")
    for op, r, wall in rows:
        print(f"{op:<6} {r.job_id:>4} {r.bytes:>10} {r.seconds:>10.6f} {wall:>10.6f}")
    print("verified: every loaded block equals its stored source")


def default_backend() -> str:
    try:
        import cupy
        import torch

        if cupy.is_available() and torch.cuda.is_available():
            return "cuda"
    except ImportError:
        pass
    return "host"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", choices=["host", "cuda"], default=None)
    args = ap.parse_args()
    asyncio.run(main(args.backend or default_backend()))
