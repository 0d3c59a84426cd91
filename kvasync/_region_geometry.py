"""A shared region's geometry and the views carved from its rows.

`RegionGeometry` is what a region's arguments say, checked (`region_geometry`): rows, row
stride, this opener's rank, the TP degree. `ViewCarver` hands out a region's views in call
order from one cursor: worker views from this rank's slot of each row, or canonical views
from the row start (never both in one region). Both are plain data and arithmetic; the
region owns the mapping, the lock and the file.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._errors import InvalidTransferError, RegionOverflowError
from ._region_file import check_name

__all__ = ["PAGE", "Populate", "RegionGeometry", "ViewCarver", "region_geometry"]

PAGE = mmap.PAGESIZE

Populate = bool | Literal["slot", "creator"]


@dataclass(frozen=True)
class RegionGeometry:
    """`num_rows` rows of `row_stride` bytes; `rank` of `world` (None: unranked)."""

    name: str = ""
    num_rows: int = 0
    row_stride: int = 0
    rank: int | None = None
    world: int = 0

    @property
    def total(self) -> int:
        return self.num_rows * self.row_stride

    @property
    def slot_bytes(self) -> int:
        """Bytes of each row that a rank's worker views carve from."""
        return self.row_stride // self.world


def region_geometry(
    name: str, num_rows: int, row_stride: int, rank: int | None, world_size: int,
    timeout: float, directory: str, populate: Populate,
) -> tuple[RegionGeometry, Literal["slot", "creator"] | None]:
    """The checked geometry of a region's arguments, and who pre-faults what (None: nobody);
    the other arguments are checked too (InvalidTransferError)."""
    check_name(name)
    for what, value, low in (
        ("num_rows", num_rows, 1),
        ("row_stride", row_stride, PAGE),
        ("world_size", world_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InvalidTransferError(f"{what} must be an int >= {low}, got {value!r}")
    if row_stride % PAGE:
        raise InvalidTransferError(
            f"row_stride {row_stride} must be a multiple of the page size ({PAGE} B) so "
            "every row starts on a page (pinning seams, population, O_DIRECT tiers)"
        )
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, (int, np.integer))
        or not 0 <= rank < world_size
    ):
        raise InvalidTransferError(f"rank must be None or in [0, {world_size}), got {rank!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidTransferError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not isinstance(directory, str) or not directory:
        raise InvalidTransferError(f"directory must be a path, got {directory!r}")
    if not (isinstance(populate, bool) or (isinstance(populate, str)
            and populate in ("slot", "creator"))):
        raise InvalidTransferError(
            f"populate must be True, False, 'slot' or 'creator', got {populate!r}"
        )
    geometry = RegionGeometry(name, int(num_rows), int(row_stride),
                              None if rank is None else int(rank), int(world_size))
    if populate is False:
        return geometry, None
    return geometry, "creator" if populate == "creator" else "slot"


def page_arg(page_bytes: int) -> int:
    """A view's `page_bytes`, checked: an int > 0."""
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, (int, np.integer)):
        raise InvalidTransferError(f"page_bytes must be an int, got {page_bytes!r}")
    if page_bytes <= 0:
        raise InvalidTransferError(f"page_bytes must be > 0, got {page_bytes}")
    return int(page_bytes)


class ViewCarver:
    """The cursor of a region's views: which kind it carves, and how far it got.

    The caller holds the region's lock and passes the mapped base (checked open); an
    overflow raises and leaves the cursor alone.
    """

    def __init__(self) -> None:
        self.mode: Literal["worker", "canonical"] | None = None
        self.cursor = 0

    def _claim(self, mode: Literal["worker", "canonical"]) -> None:
        if self.mode is not None and self.mode != mode:
            raise InvalidTransferError(
                f"the region is already carved into {self.mode} views; worker and canonical "
                "views of one region would overlap"
            )

    @staticmethod
    def _view(base: np.ndarray, geo: RegionGeometry, offset: int, page: int) -> np.ndarray:
        view: np.ndarray = np.lib.stride_tricks.as_strided(
            base[offset:],
            shape=(geo.num_rows, page),
            strides=(geo.row_stride, 1),
            writeable=True,
        )
        return view

    def next_worker(self, base: np.ndarray, geo: RegionGeometry, page: int) -> np.ndarray:
        """The next `page` bytes of rank `geo.rank`'s slot of every row."""
        if geo.rank is None:
            raise InvalidTransferError("an unranked region (rank=None) has no worker area")
        self._claim("worker")
        slot = geo.slot_bytes
        if self.cursor + page > slot:
            raise RegionOverflowError(
                f"worker view of {page} B at offset {self.cursor} exceeds worker area end "
                f"(slot of rank {geo.rank} is {slot} B = row_stride {geo.row_stride} "
                f"// world_size {geo.world})"
            )
        view = self._view(base, geo, geo.rank * slot + self.cursor, page)
        self.cursor += page
        self.mode = "worker"
        return view

    def next_canonical(self, base: np.ndarray, geo: RegionGeometry, page: int) -> np.ndarray:
        """The next `page` bytes of every row from the row start."""
        self._claim("canonical")
        if self.cursor + page > geo.row_stride:
            raise RegionOverflowError(
                f"canonical view of {page} B at offset {self.cursor} exceeds the row end "
                f"(row_stride {geo.row_stride} B)"
            )
        view = self._view(base, geo, self.cursor, page)
        self.cursor += page
        self.mode = "canonical"
        return view

    def carve(self, base: np.ndarray, geo: RegionGeometry, pages: list[int], canonical: bool,
              lock: threading.Lock) -> tuple[list[np.ndarray], Callable[[], None]]:
        """The next view of each of `pages` bytes, all or none (a failure leaves the cursor
        where it was), and an undo (taking `lock`) that gives them back if nothing was
        carved after them: an `Offloader` refused part-way leaves the cursor alone, so
        every rank's canonical views still agree."""
        before = (self.mode, self.cursor)
        nxt = self.next_canonical if canonical else self.next_worker
        try:
            views = [nxt(base, geo, page_arg(p)) for p in pages]
        except BaseException:
            self.mode, self.cursor = before
            raise
        after = (self.mode, self.cursor)

        def undo() -> None:
            with lock:
                if (self.mode, self.cursor) == after:
                    self.mode, self.cursor = before

        return views, undo
