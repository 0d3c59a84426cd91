"""Whether a plan's host memory is CUDA-registered: the check under the `kernel` and
`staged` paths, which dereference host memory from the device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _cudart
from ._cuda_device import device

if TYPE_CHECKING:
    from .._program import RefTable, TransferPlan
    from ._base import Direction

__all__ = ["RegisteredCheck"]


class RegisteredCheck:
    """Whether every host tensor of a plan's table is CUDA-registered (cached per table
    and direction): a safety net under the caller's `host_pinned` claim, since a kernel
    dereferencing pageable memory would poison the whole CUDA context."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._cache: dict[tuple[int, str], tuple[RefTable, bool]] = {}

    def check(self, plan: TransferPlan, direction: Direction) -> bool:
        """Wraps `cudaPointerGetAttributes` on each tensor's first and last row (at the
        first check of a table); blocks briefly in the driver."""
        table = plan.table
        if table is None or not plan.segments:
            return True  # raw descriptors (tests, calibration): the caller vouches
        key = (id(table), direction)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is table:
            return hit[1]
        side = table.dst if direction == "d2h" else table.src
        ok = True
        with device(self.device_id):
            for base, stride, rows in zip(side.base, side.row_stride, side.num_rows):
                last = base + max(rows - 1, 0) * stride
                if not (_cudart.is_registered(base) and _cudart.is_registered(last)):
                    ok = False
                    break
        self._cache[key] = (table, ok)
        return ok

    def clear(self) -> None:
        self._cache.clear()
