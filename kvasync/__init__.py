"""kvasync: awaitable moves of paged KV-cache blocks between GPU memory and host memory.

    import kvasync as kv

    layout = kv.KVCacheLayout.from_tensors(kv_tensors)
    async with kv.Offloader(layout, num_cpu_chunks=256) as off:
        await off.store(gpu_blocks=[3, 7], cpu_chunks=[0, 1])
        await off.load(cpu_chunks=[0, 1], gpu_blocks=[5, 9])
"""

from __future__ import annotations

from ._calibrate import AutoCalibration, PathMeasurement
from ._errors import (
    BackendUnavailableError,
    CalibrationError,
    InvalidTransferError,
    KVAsyncError,
    OffloaderBrokenError,
    OffloaderClosedError,
    RegionOverflowError,
    SharedRegionError,
    SharedRegionTimeoutError,
    TransferFailedError,
)
from ._layered_transfer import LayeredTransfer
from ._layout import CopyRun, KVCacheLayout, KVRef, KVTensor, PageMapping
from ._mappings import derive_page_mapping, mla_page_mapping, private_page_mapping, verify_tiling
from ._offloader import Offloader
from ._region import SharedHostRegion
from ._stats import Distribution, LaneStats, OffloaderStats, PathStats
from ._transfer import Progress, Transfer, TransferResult

__version__ = "0.1.0"

__all__ = [
    "AutoCalibration",
    "BackendUnavailableError",
    "CalibrationError",
    "CopyRun",
    "Distribution",
    "InvalidTransferError",
    "KVAsyncError",
    "KVCacheLayout",
    "KVRef",
    "KVTensor",
    "LaneStats",
    "LayeredTransfer",
    "Offloader",
    "OffloaderBrokenError",
    "OffloaderClosedError",
    "OffloaderStats",
    "PageMapping",
    "PathMeasurement",
    "PathStats",
    "Progress",
    "RegionOverflowError",
    "SharedHostRegion",
    "SharedRegionError",
    "SharedRegionTimeoutError",
    "Transfer",
    "TransferFailedError",
    "TransferResult",
    "derive_page_mapping",
    "mla_page_mapping",
    "private_page_mapping",
    "verify_tiling",
]

for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("kvasync."):
        _obj.__module__ = "kvasync"
del _name, _obj
