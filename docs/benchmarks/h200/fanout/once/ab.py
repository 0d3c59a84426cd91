"""A/B in one process: how a multi-piece DMA transfer uses the four helper streams.

- ``per-piece``: the old way, each 32 MiB piece split over the helpers, forked and joined
  around every piece (~17 API calls per piece);
- ``once``: the default, whole pieces round-robin over the helpers, one fork and one join
  per transfer (`CudaBackend.FAN_JOIN_PIECES = 0`);
- ``round4``: whole pieces, joined every 4 pieces (`FAN_JOIN_PIECES = 4`).

Sections: bandwidth at 256 KiB and 2 MiB (where DMA fans out), latency (its CPU rows await
a 1 GiB load of 2 MiB pages: 32 pieces), plus a 256 KiB urgent load behind a 512 MiB load of
random 256 KiB pages (fanned out),
alternated `AB_ROUNDS` times. Run on the H200 from the repo root:
`PYTHONPATH=. python3 docs/benchmarks/h200/fanout/once/ab.py`; prints a table, writes
$OUT/ab.json (every bench row tagged with its variant and round).
"""
import json
import os
import sys
import tempfile

from kvasync import bench
from kvasync._backends._base import Backend
from kvasync._backends._cuda import CudaBackend
from urgent import measure  # this folder's urgent.py (the script's dir is on sys.path)

OUT = os.environ.get("OUT", "/tmp")
ROUNDS = int(os.environ.get("AB_ROUNDS", "2"))
SECTIONS = os.environ.get("AB_SECTIONS", "bandwidth,latency")
mine = CudaBackend.enqueue_pieces
VARIANTS = {"per-piece": (Backend.enqueue_pieces, 0), "once": (mine, 0), "round4": (mine, 4)}
rows = []


def urgent_behind_fanned() -> dict:
    """A 1-block (256 KiB) urgent load submitted right behind a 512 MiB load of random
    256 KiB pages (DMA, fanned out): seconds to its await, and the big load's seconds."""
    r = measure(256 << 10, "h2d", True, "dma")
    return {"section": "urgent-fanned", "path": "dma", "p50_us": r["p50_ms"] * 1e3,
            "p99_us": r["max_ms"] * 1e3, "seconds": r["big_ms"] / 1e3, "samples": r["samples"]}


for rnd in range(1, ROUNDS + 1):
    for name, (fn, join) in VARIANTS.items():
        CudaBackend.enqueue_pieces = fn  # type: ignore[method-assign]
        CudaBackend.FAN_JOIN_PIECES = join
        with tempfile.TemporaryDirectory() as d:
            bench.main(["--out", d, "--sections", SECTIONS, "--pages", "256K,2M",
                        "--reps", "3"])
            for r in json.load(open(os.path.join(d, "bench.json"))):
                r.pop("samples", None)
                rows.append({**r, "variant": name, "round": rnd})
        rows.append({**urgent_behind_fanned(), "variant": name, "round": rnd})
        json.dump(rows, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
CudaBackend.enqueue_pieces = mine  # type: ignore[method-assign]
CudaBackend.FAN_JOIN_PIECES = 0


def pick(**kw):
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


print(f"{'variant':<10} {'rnd':>3}  dma/ceiling h2d 256K/2M  d2h 256K/2M   auto h2d/d2h 256K/2M"
      "   CPU awaiting 1 GiB (hybrid, thread)   urgent behind 512M fanned p50/max ms, big ms")
for rnd in range(1, ROUNDS + 1):
    for name in VARIANTS:
        def bw(path, direction):
            got = {r["page_bytes"]: r["ratio"] for r in pick(variant=name, round=rnd,
                   section="bandwidth", path=path, direction=direction)}
            return "/".join(f"{got[k] * 100:.0f}" for k in sorted(got)) or "-"
        cpu = {r["path"]: r["cpu_frac"] for r in pick(variant=name, round=rnd,
               section="latency-cpu")}
        urg = pick(variant=name, round=rnd, section="urgent-fanned")
        u = (f"{urg[0]['p50_us'] / 1e3:.3f}/{urg[0]['p99_us'] / 1e3:.3f}, "
             f"{urg[0]['seconds'] * 1e3:.1f}") if urg else "-"
        print(f"{name:<10} {rnd:>3}  {bw('dma', 'h2d'):>9} {bw('dma', 'd2h'):>11}"
              f"   {bw('auto', 'h2d'):>7} {bw('auto', 'd2h'):>7}"
              f"   {cpu.get('kvasync-hybrid', float('nan')):7.1%} "
              f"{cpu.get('kvasync-thread', float('nan')):7.1%}"
              f"                      {u}")
sys.stdout.flush()
