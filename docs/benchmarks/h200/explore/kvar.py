"""Kernel variants on raw flat device descriptors: ld/st flavours, unroll, grid, block; and a TMA bulk variant."""
import json, os, statistics, sys, time
import numpy as np, cupy as cp
MiB = 1 << 20
TOTAL = 1024 * MiB
OUT = os.environ.get("OUT", "/tmp")
MODE = sys.argv[1] if len(sys.argv) > 1 else "simt"
dev = cp.cuda.alloc(2 * TOTAL); dbase = int(dev.ptr)
host = cp.cuda.alloc_pinned_memory(2 * TOTAL); hbase = int(host.ptr)
cp.ndarray((2 * TOTAL // 8,), cp.uint64, dev)[:] = cp.arange(2 * TOTAL // 8, dtype=cp.uint64) * 3 + 1
np.frombuffer(host, np.uint64, 2 * TOTAL // 8)[:] = np.arange(2 * TOTAL // 8, dtype=np.uint64) * 5 + 2
rng = np.random.default_rng(0)
SRC = r'''
typedef unsigned long long u64;
extern "C" __global__ void k(const u64* __restrict__ desc, const u64 n) {
  const unsigned lane = threadIdx.x & 31u;
  const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
  for (u64 w = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < n; w += warps) {
    const uint4* s = (const uint4*)desc[w]; uint4* d = (uint4*)desc[n + w];
    const u64 nv = desc[2 * n + w] / 16;
    u64 i = lane;
    for (; i + 32 * (U - 1) < nv; i += 32 * U) {
      uint4 r[U];
#pragma unroll
      for (int j = 0; j < U; ++j) r[j] = LD(s + i + 32 * j);
#pragma unroll
      for (int j = 0; j < U; ++j) ST(d + i + 32 * j, r[j]);
    }
    for (; i < nv; i += 32) ST(d + i, LD(s + i));
  }
}
'''
TMA = r'''
typedef unsigned long long u64;
#define CH 4096
#define WPB (8 / STAGES)
extern "C" __global__ void k(const u64* __restrict__ desc, const u64 n) {
  __shared__ __align__(128) unsigned char buf[WPB][STAGES][CH];
  __shared__ __align__(8) u64 bars[WPB][STAGES];
  const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
  if (lane != 0) return;
  unsigned bar[STAGES], sm[STAGES], phase[STAGES];
  for (int st = 0; st < STAGES; ++st) {
    bar[st] = (unsigned)__cvta_generic_to_shared(&bars[wid][st]);
    sm[st] = (unsigned)__cvta_generic_to_shared(&buf[wid][st][0]);
    phase[st] = 0;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar[st]) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const u64 workers = (u64)gridDim.x * WPB;
  int st = 0;
  for (u64 w = (u64)blockIdx.x * WPB + wid; w < n; w += workers) {
    const u64 s = desc[w], d = desc[n + w], z = desc[2 * n + w];
    for (u64 off = 0; off < z; off += CH) {
      const unsigned len = (unsigned)(z - off < CH ? z - off : CH);
      // stage st free? wait until its previous store has read smem
      asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(STAGES - 1) : "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar[st]), "r"(len) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(sm[st]), "l"(s + off), "r"(len), "r"(bar[st]) : "memory");
      unsigned ok = 0;
      do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar[st]), "r"(phase[st]) : "memory");
      } while (!ok);
      phase[st] ^= 1;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(d + off), "r"(sm[st]), "r"(len) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      st = (st + 1) % STAGES;
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
'''
LDS = {"ldcg": "__ldcg", "plain": "[](const uint4* p){return *p;}", "ldg": "__ldg", "ldcs": "__ldcs", "ldlu": "__ldlu", "ldcv": "__ldcv"}
STS = {"stcg": "__stcg", "plain": "[](uint4* p, uint4 v){*p = v;}", "stcs": "__stcs", "stwt": "__stwt", "stwb": "__stwb"}
cache = {}
def kern(ld, st, u):
    key = (ld, st, u)
    if key not in cache:
        src = f"#define LD {LDS[ld]}\n#define ST {STS[st]}\n#define U {u}\n" + SRC
        cache[key] = cp.RawKernel(src, "k", options=("-std=c++17",))
    return cache[key]
def tma(stages):
    key = ("tma", stages)
    if key not in cache:
        cache[key] = cp.RawKernel(f"#define STAGES {stages}\n" + TMA, "k", options=("-std=c++17",))
    return cache[key]
rows = []
stream = cp.cuda.Stream(non_blocking=True)
def descs(page, direction):
    n = 2 * TOTAL // page; k = TOTAL // page
    g = rng.permutation(n)[:k].astype(np.uint64); c = rng.permutation(n)[:k].astype(np.uint64)
    gp = g * np.uint64(page) + np.uint64(dbase); hp = c * np.uint64(page) + np.uint64(hbase)
    src, dst = (hp, gp) if direction == "h2d" else (gp, hp)
    return cp.asarray(np.concatenate([src, dst, np.full(k, page, np.uint64)])), k
def time_k(fn, grid, block, d, k, reps=4):
    ts = []
    with stream:
        for r in range(reps + 1):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream); fn((grid,), (block,), (d, np.uint64(k))); b.record(stream); b.synchronize()
            if r: ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return TOTAL / statistics.median(ts) / 1e9
def check(d, k, page):
    h = cp.asnumpy(d).reshape(3, k)
    bad = 0
    for i in rng.integers(0, k, 32):
        a = np.empty(page, np.uint8); b = np.empty(page, np.uint8)
        cp.cuda.runtime.memcpy(a.ctypes.data, int(h[0, i]), page, 4)
        cp.cuda.runtime.memcpy(b.ctypes.data, int(h[1, i]), page, 4)
        bad += int(not np.array_equal(a, b))
    return f"{bad} bad of 32"
def ceiling(direction):
    a, b = cp.cuda.Event(), cp.cuda.Event(); ts = []
    for r in range(5):
        a.record(stream)
        s, dd = (hbase, dbase) if direction == "h2d" else (dbase, hbase)
        cp.cuda.runtime.memcpyAsync(dd, s, TOTAL, 4, stream.ptr); b.record(stream); b.synchronize()
        if r: ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return TOTAL / statistics.median(ts) / 1e9
def rec(name, direction, page, gbps, ceil):
    rows.append(dict(name=name, direction=direction, page=page, gbps=gbps, ceiling=ceil))
    print(f"{direction} {page//1024:>5}K {name:<34} {gbps:6.1f} GB/s  {gbps/ceil:5.1%}", flush=True)
for direction in ("h2d", "d2h"):
    ceil = ceiling(direction); print(direction, "ceiling", round(ceil, 1))
    for page in (4096, 16384, 262144) if MODE == "simt" else (4096, 16384, 65536):
        d, k = descs(page, direction)
        if MODE == "simt":
            combos = [(ld, "stcg", 4) for ld in LDS] + [("ldcg", st, 4) for st in STS if st != "stcg"]
            if page != 4096:
                combos = [("ldcg", "stcg", 4), ("ldcs", "stcs", 4), ("plain", "plain", 4)]
            for ld, st, u in combos:
                rec(f"{ld}/{st}/u{u} g16x512", direction, page, time_k(kern(ld, st, u), 16, 512, d, k), ceil)
            if page == 4096:
                for u in (1, 2, 8):
                    rec(f"ldcg/stcg/u{u} g16x512", direction, page, time_k(kern("ldcg", "stcg", u), 16, 512, d, k), ceil)
                for grid, block in ((8, 512), (24, 512), (32, 512), (64, 256), (132, 256), (132, 512), (264, 256), (16, 1024), (32, 1024)):
                    rec(f"ldcg/stcg/u4 g{grid}x{block}", direction, page, time_k(kern("ldcg", "stcg", 4), grid, block, d, k), ceil)
        else:
            for stages in (1, 2, 4):
                for grid in (16, 66, 132, 264):
                    cp.cuda.runtime.memset(dbase if direction == 'h2d' else hbase, 0, 0) if False else None
                    rec(f"tma s{stages} g{grid}x{32*(8//stages)}", direction, page, time_k(tma(stages), grid, 32 * (8 // stages), d, k), ceil)
                    print('   check', check(d, k, page), flush=True)
        # verify last run bytes for one descriptor set: compare a few pages
json.dump(rows, open(os.path.join(OUT, f"kvar-{MODE}.json"), "w"), indent=1)
