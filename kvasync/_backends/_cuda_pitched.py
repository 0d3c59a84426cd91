"""The CUDA "pitched" copy path: one `cudaMemcpy2DAsync` per block and run of tensors.

Where a ref set's KV tensors are evenly spaced on the GPU (one pool's slices) and side by
side in the host rows, a block's pages form a 2-D array on both sides (`_program/pitched.py`
builds the copies). A copy engine moves each one: no kernel competes with the model for
SMs, no staging buffer bounds what is in flight, and the host makes one driver call per
block and run instead of one per page.

One engine leaves a gap between two copies, and a 2-D copy of short lines may be mostly
gaps: a transfer's copies can be spread over `fan_out` helper streams (`_cuda_dma.FanRound`,
forked off the transfer's stream and joined back to it), so several engines overlap them.
Off by default (`CudaBackend.PITCHED_FAN_OUT = 1`) until a GPU run measures it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import TransferFailedError
from .._program import build_pitched, check_pitchable
from . import _cudart
from ._cuda_dma import FanRound

if TYPE_CHECKING:
    from .._program import TransferPlan
    from ._cuda_device import CudaStream
    from ._cuda_dma import DmaPath

__all__ = ["FAN_MIN_COPIES", "enqueue_pitched", "pitched_path"]

#: a transfer of fewer 2-D copies per helper stream stays on its own stream
FAN_MIN_COPIES = 16


def pitched_path(plan: TransferPlan) -> str:
    """"pitched", or InvalidTransferError (nothing enqueued) where `plan` has no pitched
    form (a path choice's check)."""
    check_pitchable(plan)
    return "pitched"


def enqueue_pitched(stream: CudaStream, plan: TransferPlan, dma: DmaPath | None = None,
                    fan_out: int = 1) -> None:
    """Enqueue `plan`'s 2-D copies (one `cudaMemcpy2DAsync` each): on `stream`, or split
    in order over `fan_out` helper streams of `dma` forked off and joined back to it;
    returns without waiting. InvalidTransferError where the plan has no pitched form."""
    check_pitchable(plan)
    p = build_pitched(plan)
    n = len(p)
    ways = max(1, min(fan_out, n // FAN_MIN_COPIES)) if dma is not None else 1
    try:
        if ways == 1:
            _cudart.memcpy_2d(p.src, p.dst, p.src_pitch, p.dst_pitch, p.width, p.height,
                              stream.ptr)
            return
        assert dma is not None
        fan = FanRound(dma, stream, ways)
        bounds = [n * i // ways for i in range(ways + 1)]
        try:
            for lo, hi in zip(bounds, bounds[1:]):
                _cudart.memcpy_2d(p.src[lo:hi], p.dst[lo:hi], p.src_pitch[lo:hi],
                                  p.dst_pitch[lo:hi], p.width[lo:hi], p.height[lo:hi],
                                  fan.helper())
        finally:
            fan.join()
    except Exception as exc:  # CuPy's CUDARuntimeError: a bad pointer or pitch
        raise TransferFailedError(f"pitched copy failed: {exc}") from exc
