"""Request -> copy program: validation, ref tables, plans, pieces, layer splits, staging.

Pure NumPy: nothing here touches a device, a stream or the scheduler. A request is checked
and turned into a `TransferPlan` (`build.py`) over the direction's static `RefTable`
(`table.py`); copy paths read the plan's descriptors (`plan.py`), its layer split
(`split.py`), its staged program (`staged.py`, over the host rows of `rows.py`) or its
2-D copies (`pitched.py`).
`__all__` is what the rest of kvasync may import from here.
"""

from __future__ import annotations

from .build import IdArray, Ids, as_ids, build_plan
from .pitched import PitchedProgram, build_pitched, check_pitchable, mean_height, pitched_lines
from .plan import Segment, TransferPlan, coalesce
from .rows import RowSide, row_side, staging_table
from .split import split_plan
from .staged import (
    Slab,
    StagedProgram,
    build_staged,
    check_stageable,
    kernel_plan,
    prepare_staged,
    slab_descriptors,
    stageable,
    staged_rows,
)
from .table import RefTable, SideGeometry, build_ref_table

__all__ = [
    "IdArray",
    "Ids",
    "PitchedProgram",
    "RefTable",
    "RowSide",
    "Segment",
    "SideGeometry",
    "Slab",
    "StagedProgram",
    "TransferPlan",
    "as_ids",
    "build_pitched",
    "build_plan",
    "build_ref_table",
    "build_staged",
    "check_pitchable",
    "check_stageable",
    "coalesce",
    "kernel_plan",
    "mean_height",
    "pitched_lines",
    "prepare_staged",
    "row_side",
    "slab_descriptors",
    "split_plan",
    "stageable",
    "staged_rows",
    "staging_table",
]
