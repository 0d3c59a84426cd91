"""Device exploration: multi-stream DMA, kernel+DMA split, call costs. Prints a table, writes JSON."""
import json, os, statistics, sys, time, threading
from concurrent.futures import ThreadPoolExecutor
import numpy as np, cupy as cp, torch
import kvasync as kv
from kvasync._backends import _cudart
from kvasync._descriptors import TransferPlan

MiB = 1 << 20
TOTAL = int(os.environ.get("EXP_MIB", "1024")) * MiB
REPS = 3
OUT = os.environ.get("OUT", "/tmp")
pool = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda"); pool.random_(0, 256)
dbase = pool.data_ptr()
rng = np.random.default_rng(0)
rows = []
batch = _cudart.batch_copier()
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
def ev(): return cp.cuda.Event()

def run(fn, nstreams):
    """fn(streams) enqueues work on streams[0..n); fork/join around it. returns wall, dev, call."""
    walls, devs, calls = [], [], []
    for rep in range(REPS + 1):
        s0 = streams[0]
        a, b = ev(), ev()
        t0 = time.perf_counter()
        a.record(s0)
        for s in streams[1:nstreams]:
            s.wait_event(a)
        fn(streams[:nstreams])
        t1 = time.perf_counter()
        for s in streams[1:nstreams]:
            e = ev(); e.record(s); s0.wait_event(e)
        b.record(s0)
        b.synchronize()
        t2 = time.perf_counter()
        if rep:
            walls.append(t2 - t0); calls.append(t1 - t0); devs.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(walls), statistics.median(devs), statistics.median(calls)

def record(name, direction, page, nbytes, res):
    w, d, c = res
    r = dict(name=name, direction=direction, page=page, wall_gbps=nbytes / w / 1e9,
             dev_gbps=nbytes / d / 1e9, call_ms=c * 1e3)
    rows.append(r)
    print(f"{direction} {page//1024:>5}K {name:<28} wall {r['wall_gbps']:6.1f} dev {r['dev_gbps']:6.1f} call {r['call_ms']:7.2f} ms", flush=True)

def chunks(n, k):
    b = np.linspace(0, n, k + 1).astype(int)
    return [(int(b[i]), int(b[i + 1])) for i in range(k)]

offs = {}
def offloader(page):
    if page not in offs:
        n = 2 * TOTAL // page
        view = pool[: n * page].view(n, page)
        offs[page] = kv.Offloader(kv.KVCacheLayout.from_tensors([view]), n, backend="cuda")
    return offs[page]

# ceilings: 1 stream and 2/4 streams split contiguous
off = offloader(2 * MiB); hbase = int(off.cpu_tensors[0].ctypes.data)
for direction in ("h2d", "d2h"):
    for k in (1, 2, 4):
        def f(ss, k=k, direction=direction):
            for (lo, hi), s in zip(chunks(TOTAL, k), ss):
                src, dst = (hbase + lo, dbase + lo) if direction == "h2d" else (dbase + lo, hbase + lo)
                cp.cuda.runtime.memcpyAsync(dst, src, hi - lo, 4, s.ptr)
        record(f"ceiling-{k}stream", direction, 0, TOTAL, run(f, k))

pages = [int(p) * 1024 for p in os.environ.get("EXP_PAGES", "16,64,256,1024").split(",")]
for page in pages:
    off = offloader(page); backend = off.backend; backend.warm_up()
    hbase = int(off.cpu_tensors[0].ctypes.data)
    n = 2 * TOTAL // page; k = TOTAL // page
    g = rng.permutation(n)[:k]; c = rng.permutation(n)[:k]
    gp = g.astype(np.uint64) * np.uint64(page) + np.uint64(dbase)
    hp = c.astype(np.uint64) * np.uint64(page) + np.uint64(hbase)
    sizes = np.full(k, page, np.uint64)
    for direction in ("h2d", "d2h"):
        src, dst = (hp, gp) if direction == "h2d" else (gp, hp)
        order = _cudart.ACCESS_ORDER_STREAM if direction == "d2h" else _cudart.ACCESS_ORDER_ANY
        sd, dd = (0, -1) if direction == "d2h" else (-1, 0)
        def dma(ss, lo=0, hi=k):
            for (a, b), s in zip(chunks(hi - lo, len(ss)), ss):
                a += lo; b += lo
                batch(src[a:b], dst[a:b], sizes[a:b], s.ptr, order, sd, dd)
        def kern(s, lo, hi, grid):
            from kvasync._backends._cuda import CudaStream
            plan = TransferPlan.raw(None, src[lo:hi], dst[lo:hi], sizes[lo:hi])
            cs = CudaStream(s.ptr, s, 0)
            old = backend.grid; backend.grid = grid
            backend.enqueue_copy(cs, plan, direction, "kernel")
            backend.grid = old
        for S in (1, 2, 4):
            record(f"dma-batch-{S}stream", direction, page, TOTAL, run(dma, S))
        def dma_threads(ss):
            with ThreadPoolExecutor(len(ss)) as ex:
                list(ex.map(lambda t: (cp.cuda.runtime.setDevice(0), batch(src[t[0][0]:t[0][1]], dst[t[0][0]:t[0][1]], sizes[t[0][0]:t[0][1]], t[1].ptr, order, sd, dd)), zip(chunks(k, len(ss)), ss)))
        if page >= 16 * 1024:
            record("dma-batch-4stream-4thr", direction, page, TOTAL, run(dma_threads, 4))
        for grid in ((16, 32) if page < 1 << 20 else ()):
            record(f"kernel@{grid}", direction, page, TOTAL, run(lambda ss, grid=grid: kern(ss[0], 0, k, grid), 1))
        for frac in (0.05, 0.1, 0.2, 0.4):
            if page <= 16 * 1024:
                continue
            cut = int(k * (1 - frac))
            def mix(ss, cut=cut):
                kern(ss[0], 0, cut, 16)
                dma(ss[1:], cut, k)
            record(f"kernel@16+dma{int(frac*100)}%x1", direction, page, TOTAL, run(mix, 2))
            record(f"kernel@16+dma{int(frac*100)}%x2", direction, page, TOTAL, run(mix, 3))
json.dump(rows, open(os.path.join(OUT, "explore.json"), "w"), indent=1)
