"""calibrate: what `Offloader.calibrate()` measures and which path it makes "auto" prefer.

Per page size, an offloader over the run's KV tensors count, each allocated on its own (as a
server's per-layer tensors are; `calibrate()` does not measure pitched), is calibrated with
its defaults: each path's transfers of 64 MiB, four in flight, for `calibrate()`'s default
window (0.05 s with --quick) alone and beside the backend's compute load (on CUDA fp16
8192^3 matmuls; on the host backend NumPy matmuls in a thread). One row per direction and
path: `ratio` is its GB/s beside the load over this run's ceiling, ``values.alone_ratio``
the same alone, ``extra.tflops_ratio`` the load's kept share, ``extra.chosen`` whether the
calibration chose it (a preference is left only where it differs from the incumbent),
``extra.incumbent`` whether "auto" took it before (its fixed rules, on the calibration's
scratch offloader, where no three tensors in a row are evenly spaced: ``extra.auto_before``
names that path); ``values.seconds`` how long the calibration held its caller.
"""

from __future__ import annotations

from ..common import KiB, Row, Section, fmt_size
from ..context import Context

PAGES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB)


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    pages = (16 * KiB,) if ctx.quick or not ctx.gpu else PAGES
    for page in pages:
        ctx.progress(f"calibrate() at {fmt_size(page)} pages")
        tensors = [ctx.device_array((2, page)) for _ in range(ctx.tensors)]
        off = ctx.make_offloader(tensors, 2)
        try:
            cal = off.calibrate(seconds=0.05) if ctx.quick else off.calibrate()
        finally:
            off.close()
        for m in cal.measurements:
            ceil = ctx.ceiling(m.direction)
            rows.append(Row(
                "calibrate", m.path, m.direction, page, ratio=round(m.gbps_beside / ceil, 3),
                gbps=m.gbps_beside, ceiling_gbps=round(ceil, 2),
                values={"alone_gbps": m.gbps_alone,
                        "alone_ratio": round(m.gbps_alone / ceil, 3),
                        "seconds": cal.seconds},
                note=f"{cal.tensors} tensors, {fmt_size(cal.transfer_bytes)} per transfer",
                extra={"tflops_ratio": m.kept,
                       "chosen": cal.choice.get(m.direction) == m.path,
                       "incumbent": cal.incumbent.get(m.direction) == m.path,
                       "auto_before": cal.incumbent.get(m.direction, "")}))
    return rows


SECTION = Section("calibrate", run, (),
                  "Offloader.calibrate(): each path alone and beside a compute load, the choice")
