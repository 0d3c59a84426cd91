"""Lazy vs eager completion thread: 4 KiB round trips, store() host cost, small-transfer rate."""
import asyncio, cProfile, io, os, pstats, statistics, time
import numpy as np, torch, cupy as cp
import kvasync as kv
from kvasync._scheduler import DirectionQueue
OUT = os.environ.get("OUT", "/tmp")
N = 2000
t = torch.randint(0, 256, (1024, 4096), dtype=torch.uint8, device="cuda")
big = torch.randint(0, 256, (8192, 65536), dtype=torch.uint8, device="cuda")
kv_t = [torch.zeros((1024, 4096), dtype=torch.uint8, device="cuda") for _ in range(128)]
def pct(xs): xs = sorted(xs); return xs[len(xs)//2]*1e6, xs[int(len(xs)*0.99)]*1e6
def report(name, calls, trips):
    c50, c99 = pct(calls) if calls else (0, 0); r50, r99 = pct(trips)
    print(f"{name:<36} call p50 {c50:6.1f} p99 {c99:6.1f} | trip p50 {r50:6.1f} p99 {r99:6.1f} us", flush=True)
for lazy in (False, True, False, True):
    DirectionQueue.LAZY_THREAD = lazy
    tag = "lazy " if lazy else "eager"
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 1024)
    async def async_loop(path, n=N):
        calls, trips = [], []
        for i in range(n + 50):
            j = i % 1024
            t0 = time.perf_counter(); tr = off.load(cpu_chunks=[j], gpu_blocks=[j], path=path); t1 = time.perf_counter()
            await tr
            t2 = time.perf_counter()
            if i >= 50: calls.append(t1 - t0); trips.append(t2 - t0)
        return calls, trips
    def wait_loop(path, n=N):
        calls, trips = [], []
        for i in range(n + 50):
            j = i % 1024
            t0 = time.perf_counter(); tr = off.load(cpu_chunks=[j], gpu_blocks=[j], path=path); t1 = time.perf_counter()
            tr.wait(10); t2 = time.perf_counter()
            if i >= 50: calls.append(t1 - t0); trips.append(t2 - t0)
        return calls, trips
    for path in ("dma", "kernel"):
        report(f"{tag} await {path}", *asyncio.run(async_loop(path)))
        report(f"{tag} wait() {path}", *wait_loop(path))
    off.close()
    # store() of 64 blocks x 128 tensors after a wait
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(kv_t), 1024)
    rng = np.random.default_rng(3)
    ids = [(rng.permutation(1024)[:64], rng.permutation(1024)[:64]) for _ in range(16)]
    for path in ("auto", "kernel"):
        calls, trips = [], []
        for i in range(305):
            g, c = ids[i % 16]
            t0 = time.perf_counter(); tr = off.store(gpu_blocks=g, cpu_chunks=c, path=path); t1 = time.perf_counter(); tr.wait(10); t2 = time.perf_counter()
            if i >= 5: calls.append(t1 - t0); trips.append(t2 - t0)
        report(f"{tag} store 64x128 {path}", calls, trips)
    if lazy:
        pr = cProfile.Profile(); pr.enable()
        for i in range(300):
            g, c = ids[i % 16]
            off.store(gpu_blocks=g, cpu_chunks=c, path="kernel").wait(10)
        pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        open(os.path.join(OUT, "store64-prof.txt"), "w").write(s.getvalue())
    off.close()
    # 64 tasks awaiting 64 KiB loads
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([big]), 8192)
    async def rate(path, seconds=1.0):
        done = 0; stop = time.perf_counter() + seconds
        async def worker(w):
            nonlocal done
            i = w
            while time.perf_counter() < stop:
                await off.load(cpu_chunks=[i % 8192], gpu_blocks=[i % 8192], path=path); done += 1; i += 64
        t0 = time.perf_counter(); await asyncio.gather(*(worker(w) for w in range(64)))
        return done / (time.perf_counter() - t0)
    for path in ("auto", "kernel", "dma"):
        print(f"{tag} 64 KiB x 64 tasks {path}: {asyncio.run(rate(path)):,.0f}/s", flush=True)
    off.close()
