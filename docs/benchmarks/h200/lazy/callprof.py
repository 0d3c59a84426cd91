"""Where a 1-block `load()` spends its host time on the GPU (cProfile, lazy completion).

Run on the H200 from the repo root: `PYTHONPATH=. python3 docs/benchmarks/h200/lazy/callprof.py`;
writes callprof-<path>.txt under $OUT (default /tmp)."""
import cProfile, io, os, pstats, time
import torch
import kvasync as kv

OUT = os.environ.get("OUT", "/tmp")
N = 3000
t = torch.zeros((1024, 4096), dtype=torch.uint8, device="cuda")
for path in ("dma", "kernel"):
    with kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 1024) as off:
        for i in range(300):
            off.load(cpu_chunks=[i % 1024], gpu_blocks=[i % 1024], path=path).wait(10)
        calls = []
        for i in range(N):
            a = time.perf_counter(); tr = off.load(cpu_chunks=[i % 1024], gpu_blocks=[i % 1024], path=path)
            calls.append(time.perf_counter() - a); tr.wait(10)
        calls.sort()
        print(f"{path}: load() call p50 {calls[N // 2] * 1e6:.1f} us p99 {calls[int(N * .99)] * 1e6:.1f} us")
        pr = cProfile.Profile()
        for i in range(N):
            j = i % 1024
            pr.enable(); tr = off.load(cpu_chunks=[j], gpu_blocks=[j], path=path); pr.disable(); tr.wait(10)
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
        open(os.path.join(OUT, f"callprof-{path}.txt"), "w").write(s.getvalue())
        print(s.getvalue()[:6000])
