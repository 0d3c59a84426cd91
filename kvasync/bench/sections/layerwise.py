"""layerwise: `load_layerwise` + per-layer compute vs loading everything, then computing.

32 layers, each a K/V pair of 512 blocks x 32 KiB (1 GiB in all). Each layer's "attention"
is a few bf16 4096^3 matmuls on a compute stream, sized so one layer's compute takes about
one layer's load. Per path, device time from an event recorded before the load:

- ``serial``: the compute stream waits for the last layer, then computes every layer;
- ``layerwise``: layer i's compute waits only for layer i (``wait_layer(i, stream)``).

``first_layer_ms`` is when the first layer's compute could start.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np

from ..common import KiB, Row, Section
from ..context import WAIT_S, Context

LAYERS, BLOCKS, PAGE = 32, 512, 32 * KiB
MATMUL_N = 4096
REPS = 5
MODES = ("serial", "layerwise")


def run(ctx: Context) -> list[Row]:
    torch = ctx.torch
    layers, blocks = (8, 64) if ctx.quick else (LAYERS, BLOCKS)
    reps = 2 if ctx.quick else REPS
    tensors = [ctx.device_array((blocks, PAGE)) for _ in range(2 * layers)]
    off = ctx.make_offloader(tensors, blocks)
    spec = [[2 * i, 2 * i + 1] for i in range(layers)]
    rng = np.random.default_rng(7)
    gpu, cpu = rng.permutation(blocks), rng.permutation(blocks)
    comp = torch.cuda.Stream()
    a, b, out = (torch.randn((MATMUL_N, MATMUL_N), device="cuda", dtype=torch.bfloat16)
                 for _ in range(3))

    def event() -> Any:
        return torch.cuda.Event(enable_timing=True)

    def compute(matmuls: int) -> None:
        with torch.cuda.stream(comp):
            for _ in range(matmuls):
                torch.matmul(a, b, out=out)

    def device_seconds(fn: Any) -> float:
        e0, e1 = event(), event()
        e0.record(comp)
        fn()
        e1.record(comp)
        e1.synchronize()
        return float(e0.elapsed_time(e1)) / 1e3

    rows: list[Row] = []
    nbytes = 2 * layers * blocks * PAGE
    for path in ctx.paths:
        ctx.progress(f"size the per-layer compute, path {path}")
        load_s = statistics.median(
            off.load(cpu_chunks=cpu, gpu_blocks=gpu, path=path, stream=comp).wait(WAIT_S).seconds
            for _ in range(3))
        compute(3)
        matmul_s = device_seconds(lambda: compute(10)) / 10
        per_layer = max(1, round(load_s / layers / matmul_s))
        compute_s = device_seconds(lambda n=per_layer * layers: compute(n))

        async def once(mode: str, path: str = path, per_layer: int = per_layer
                       ) -> tuple[float, float, float]:
            """(total, first layer) device seconds, and the load_layerwise() call's seconds."""
            base, first, end = event(), event(), event()
            base.record(comp)
            s0 = time.perf_counter()
            lt = off.load_layerwise(cpu_chunks=cpu, gpu_blocks=gpu, layers=spec, path=path,
                                    stream=comp)
            call = time.perf_counter() - s0
            for i in range(layers):
                if mode == "layerwise" or i == 0:
                    lt.wait_layer(i if mode == "layerwise" else layers - 1, comp)
                if i == 0:
                    first.record(comp)
                compute(per_layer)
            end.record(comp)
            await lt
            end.synchronize()
            return (base.elapsed_time(end) / 1e3, base.elapsed_time(first) / 1e3, call)

        results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
        for rep in range(reps + 1):
            for mode in MODES:
                ctx.progress(f"{mode} rep {rep}, path {path}")
                value = asyncio.run(once(mode))
                if rep:
                    results[mode].append(value)
        for mode, vals in results.items():
            total = statistics.median(v[0] for v in vals)
            rows.append(Row(
                "layerwise", path, "h2d", PAGE, gbps=round(nbytes / total / 1e9, 2),
                values={"total_ms": round(total * 1e3, 3),
                        "first_layer_ms": round(statistics.median(v[1] for v in vals) * 1e3, 3),
                        "load_ms": round(load_s * 1e3, 3),
                        "compute_ms": round(compute_s * 1e3, 3),
                        "call_ms": round(statistics.median(v[2] for v in vals) * 1e3, 3),
                        "layers": float(layers), "matmuls_per_layer": float(per_layer)},
                samples=[round(v[0], 6) for v in vals],
                note=f"{mode}: {layers} layers of {2 * blocks} x {PAGE // KiB} KiB pages",
                extra={"mode": mode}))
    off.close()
    return rows


SECTION = Section("layerwise", run, ("gpu", "torch"),
                  "load_layerwise + per-layer compute vs load-then-compute")
