"""The exceptions kvasync raises, as one tree so callers can catch at the right level.

    KVAsyncError
     +-- InvalidTransferError (also ValueError)   bad input; raised by store()/load() before
     |    |                                        anything is enqueued, nothing is written
     |    +-- RegionOverflowError                 a view does not fit in a shared region row
     +-- SharedRegionError (also RuntimeError)    creating/joining/mapping a shared region
     |    +-- SharedRegionTimeoutError (also TimeoutError)
     +-- OffloaderClosedError (also RuntimeError) the offloader was closed
     +-- BackendUnavailableError (also RuntimeError)
     |                                             the backend asked for cannot run here
     +-- CalibrationError (also RuntimeError)     calibrate() found its compute load failed
     |                                             or idle: nothing was chosen
     +-- TransferFailedError                      a submitted copy failed (on the device or
          |                                        behind a failed copy of the same direction)
          +-- OffloaderBrokenError                submitting to a direction after a failure

`InvalidTransferError` subclasses `ValueError` so code that validates input generically keeps
working; `TransferFailedError` carries the `job_id` of the transfer it belongs to.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CalibrationError",
    "InvalidTransferError",
    "KVAsyncError",
    "OffloaderBrokenError",
    "OffloaderClosedError",
    "RegionOverflowError",
    "SharedRegionError",
    "SharedRegionTimeoutError",
    "TransferFailedError",
]


class KVAsyncError(Exception):
    """Base class of every exception kvasync raises on purpose."""


class InvalidTransferError(KVAsyncError, ValueError):
    """Arguments of a call are wrong; raised before anything is enqueued or written."""


class OffloaderClosedError(KVAsyncError, RuntimeError):
    """The offloader was closed; no new transfers are accepted."""


class BackendUnavailableError(KVAsyncError, RuntimeError):
    """The requested backend (e.g. ``"cuda"``) cannot run on this machine."""


class TransferFailedError(KVAsyncError):
    """A submitted transfer failed, or was queued behind one that failed."""

    def __init__(self, message: str, job_id: int | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class OffloaderBrokenError(TransferFailedError):
    """A direction of the offloader failed earlier; it accepts no new transfers."""


class RegionOverflowError(InvalidTransferError):
    """A view does not fit in what is left of the rank's slot (or of the row)."""


class SharedRegionError(KVAsyncError, RuntimeError):
    """Creating, joining or mapping a shared host region failed."""


class SharedRegionTimeoutError(SharedRegionError, TimeoutError):
    """A joiner waited `timeout` seconds and the backing file never reached its size."""


class CalibrationError(KVAsyncError, RuntimeError):
    """`Offloader.calibrate()` could not measure: its compute load failed or did no work in a
    window. Nothing was chosen; "auto" keeps its earlier rules."""
