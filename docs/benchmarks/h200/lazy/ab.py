"""A/B in one process: the bandwidth section with the 8 MiB first piece ("ramp", the
default) and without it ("noramp": the first piece as big as the rest), alternated twice.

Run on the H200 from the repo root: `PYTHONPATH=. python3 docs/benchmarks/h200/lazy/ab.py`;
prints auto/ceiling per page, direction and round, writes $OUT/ab.json (every bench row,
tagged with its variant and round)."""
import json, os, sys, tempfile
from kvasync import bench
from kvasync._scheduler import DirectionQueue

OUT = os.environ.get("OUT", "/tmp")
REPS = os.environ.get("AB_REPS", "3")
default_first = DirectionQueue.FIRST_PIECE_BYTES
rows = []
for rnd in (1, 2):
    for name, first in (("ramp", default_first), ("noramp", 1 << 62)):
        DirectionQueue.FIRST_PIECE_BYTES = first
        with tempfile.TemporaryDirectory() as d:
            bench.main(["--out", d, "--sections", "bandwidth", "--reps", REPS])
            for r in json.load(open(os.path.join(d, "bench.json"))):
                r.pop("samples", None)
                rows.append({**r, "variant": name, "round": rnd})
DirectionQueue.FIRST_PIECE_BYTES = default_first
json.dump(rows, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
print(f"{'variant':<8} {'rnd':>3} {'dir':<4} " + " ".join(f"{p:>7}" for p in ("4K", "16K", "64K", "256K", "2M")),
      "   (auto/ceiling; kernel/ceiling; dma/ceiling)")
for rnd in (1, 2):
    for name in ("ramp", "noramp"):
        for direction in ("h2d", "d2h"):
            cells = []
            for path in ("auto", "kernel", "dma"):
                got = {r["page_bytes"]: r["ratio"] for r in rows if r["variant"] == name
                       and r["round"] == rnd and r["direction"] == direction and r["path"] == path}
                cells.append("/".join(f"{got[k] * 100:.0f}" for k in sorted(got)))
            print(f"{name:<8} {rnd:>3} {direction:<4} auto {cells[0]}  kernel {cells[1]}  dma {cells[2]}")
sys.stdout.flush()
