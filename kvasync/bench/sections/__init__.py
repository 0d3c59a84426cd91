"""The bench's sections, one module per family, in the order a default run measures them.

A section is a `Section` (``kvasync.bench.common``): a name, ``run(ctx) -> list[Row]``, what
it needs ("gpu", "torch") and one line of what it measures. Every section measures each copy
path the backend offers (``Context.paths``), so a new path appears in every section.
"""

from __future__ import annotations

from ..common import Section
from . import (
    bandwidth,
    bidirectional,
    calibrate,
    hostcost,
    interference,
    latency,
    layerwise,
    pipeline,
    priority,
    rate,
    remote,
)

__all__ = ["SECTIONS"]

SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        bandwidth.SECTION,
        pipeline.SECTION,
        interference.SECTION,
        calibrate.SECTION,
        bidirectional.SECTION,
        latency.LATENCY,
        latency.CPU,
        hostcost.SECTION,
        priority.SECTION,
        layerwise.SECTION,
        rate.SECTION,
        remote.SECTION,
    )
}
