"""Test-only hooks (not public API): submit raw descriptors to inject device faults."""

from __future__ import annotations

import numpy as np

from ._offloader import Offloader
from ._program import TransferPlan
from ._transfer import Transfer

__all__ = ["submit_raw"]


def submit_raw(
    off: Offloader,
    direction: str,
    src: np.ndarray,
    dst: np.ndarray,
    sizes: np.ndarray,
    path: str | None = None,
) -> Transfer:
    """Enqueue explicit (src, dst, size) descriptors, bypassing every validation.

    With an invalid pointer this makes the device fail the copy, which is how the fault
    tests check that errors surface on the transfer that caused them.
    """
    assert direction in ("d2h", "h2d")
    plan = TransferPlan.raw(off._tables[direction], src, dst, sizes)  # type: ignore[index]
    return off._enqueue(direction, plan, None, None, path)  # type: ignore[arg-type]
