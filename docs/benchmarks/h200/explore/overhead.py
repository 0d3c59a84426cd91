"""Where a 1 GiB transfer's wall time goes: submit, GPU start (spin on start event), GPU end, wait()."""
import cProfile, pstats, io, os, statistics, time
import numpy as np, torch
import kvasync as kv
from kvasync._descriptors import build_plan
MiB = 1 << 20; TOTAL = 1024 * MiB
pool = torch.empty(2 * TOTAL, dtype=torch.uint8, device="cuda"); pool.random_(0, 256)
rng = np.random.default_rng(0)
OUT = os.environ.get("OUT", "/tmp")
prof_txt = []
for page in (4096, 16384, 262144):
    n = 2 * TOTAL // page; k = TOTAL // page
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([pool[: n * page].view(n, page)]), n, backend="cuda")
    g = rng.permutation(n)[:k]; c = rng.permutation(n)[:k]
    for direction in ("d2h", "h2d"):
        tab = off._tables[direction]
        for path in ("kernel", "auto", "dma"):
            if path == "dma" and page < 262144:
                continue
            rows = []
            for rep in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                t = off.store(gpu_blocks=g, cpu_chunks=c, path=path) if direction == "d2h" else off.load(cpu_chunks=c, gpu_blocks=g, path=path)
                t1 = time.perf_counter()
                rec = t._queue._fifo[-1]
                while not rec.start.query():
                    pass
                t2 = time.perf_counter()
                while not rec.end.query():
                    pass
                t3 = time.perf_counter()
                r = t.wait(60)
                t4 = time.perf_counter()
                if rep:
                    rows.append((t1 - t0, t2 - t0, t3 - t0, t4 - t0, r.seconds))
            m = [statistics.median(x) * 1e3 for x in zip(*rows)]
            bp = []
            for _ in range(5):
                a = time.perf_counter(); build_plan(tab, g, c, None, None, direction == "d2h", n, False); bp.append(time.perf_counter() - a)
            print(f"{direction} {page//1024:>4}K {path:<6} submit {m[0]:6.2f} gpu-start {m[1]:6.2f} gpu-end {m[2]:6.2f} wait {m[3]:6.2f} ms dev {m[4]:6.2f} "
                  f"| build_plan {statistics.median(bp)*1e3:5.2f} ms | wall GB/s {TOTAL/m[3]/1e6:5.1f} dev GB/s {TOTAL/m[4]/1e6:5.1f}", flush=True)
        if page == 4096:
            pr = cProfile.Profile(); pr.enable()
            for _ in range(3):
                t = off.store(gpu_blocks=g, cpu_chunks=c, path="kernel") if direction == "d2h" else off.load(cpu_chunks=c, gpu_blocks=g, path="kernel"); t.wait(60)
            pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); prof_txt.append(s.getvalue())
    off.close()
open(os.path.join(OUT, "overhead-prof.txt"), "w").write("\n".join(prof_txt))
