"""bandwidth: GB/s of each copy path alone, per page size and direction, against the ceiling.

Each transfer moves about `total` bytes of random blocks (random GPU block ids, random CPU
chunk ids) of every KV tensor of the run's layout. GB/s is bytes over the wall time from the
`store()`/`load()` call until the transfer is done, so host work counts; ``device_gbps`` is
over the transfer's own event time. Rows: one per page, direction and path, plus
``vllm-policy`` where the backend has a kernel and a DMA path (vLLM's shipped choice re-created
with kvasync's paths: stores DMA; loads a 12-CTA kernel below 28 KiB, DMA above) and one
``ceiling`` row per direction.
"""

from __future__ import annotations

import sys

import kvasync as kv

from ..common import DIRECTIONS, Row, Section, bandwidth_row, fmt_size
from ..context import Context


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for direction in DIRECTIONS:
        ceil = ctx.ceiling(direction)
        rows.append(Row("bandwidth", "ceiling", direction, 0, ratio=1.0, gbps=round(ceil, 2),
                        ceiling_gbps=round(ceil, 2), values={"bytes": float(ctx.total)},
                        note=ctx.ceiling_note))
    for page in ctx.opts.pages:
        off = ctx.offloader(page)
        gpu, cpu = ctx.ids(page)
        for direction in DIRECTIONS:
            cases: list[tuple[str, str, int | None]] = [(p, p, None) for p in ctx.paths]
            policy = ctx.vllm_policy(direction, page)
            if policy is not None:
                cases.append(("vllm-policy", *policy))
            for name, path, ctas in cases:
                ctx.progress(f"{fmt_size(page)} {direction} {name}")
                try:
                    with ctx.grid(off, ctas):
                        t = ctx.time_transfer(off, direction, gpu, cpu, path)
                except kv.InvalidTransferError as exc:  # e.g. a row beyond a staging buffer
                    print(f"bandwidth: {fmt_size(page)} {direction} {name} not run: {exc}",
                          file=sys.stderr)
                    continue
                note = f"ran {t.ran}" + (f", {ctas} CTAs" if ctas else "")
                row = bandwidth_row(
                    "bandwidth", name, direction, page, t.samples, t.nbytes,
                    ctx.ceiling(direction), t.device_seconds, note,
                    {"ran": t.ran, "tensors": ctx.tensors, "blocks": len(gpu)})
                row.values["call_seconds"] = round(t.call_seconds, 6)
                rows.append(row)
    return rows


SECTION = Section("bandwidth", run, (), "GB/s per copy path alone, by page size, vs the ceiling")
