"""The CUDA "pitched" copy path: one `cudaMemcpy2DAsync` per block and run of tensors.

Where a ref set's KV tensors are evenly spaced on the GPU (one pool's slices) and side by
side in the host rows, a block's pages form a 2-D array on both sides (`_program/pitched.py`
builds the copies). A copy engine moves each one: no kernel competes with the model for
SMs, no staging buffer bounds what is in flight, and the host makes one driver call per
block and run instead of one per page.

A 2-D copy of short lines runs below the link's ceiling (64 lines of 16 KiB: 0.74 of it on
an H200, 0.96 at 64 KiB), and spreading a transfer's copies over 2 or 4 streams moved
exactly as much as one stream (H200, 1 GiB, 64 lines 32 MiB apart): so one stream, and
`auto` sends only pages of 64 KiB and more here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import TransferFailedError
from .._program import build_pitched, check_pitchable
from . import _cudart

if TYPE_CHECKING:
    from .._program import TransferPlan
    from ._cuda_device import CudaStream

__all__ = ["enqueue_pitched", "pitched_path"]


def pitched_path(plan: TransferPlan) -> str:
    """"pitched", or InvalidTransferError (nothing enqueued) where `plan` has no pitched
    form (a path choice's check)."""
    check_pitchable(plan)
    return "pitched"


def enqueue_pitched(stream: CudaStream, plan: TransferPlan) -> None:
    """Enqueue `plan`'s 2-D copies on `stream`, one `cudaMemcpy2DAsync` each; returns
    without waiting. InvalidTransferError where the plan has no pitched form."""
    check_pitchable(plan)
    p = build_pitched(plan)
    try:
        _cudart.memcpy_2d(p.src, p.dst, p.src_pitch, p.dst_pitch, p.width, p.height,
                          stream.ptr)
    except Exception as exc:  # CuPy's CUDARuntimeError: a bad pointer or pitch
        raise TransferFailedError(f"pitched copy failed: {exc}") from exc
