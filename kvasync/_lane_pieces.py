"""How a lane cuts a big transfer into pieces, and which transfers its launcher enqueues.

A mixin of `_lane_launch.LaneLaunch` (its sizes are class attributes, so a test or a bench
can change them on the lane class): piece sizes per path (`_piece_slots`), transfers up to a
size kept whole (`_whole_bytes`), staged and pitched stores of 1 MiB or more deferred to the
launcher thread (`_deferred`) and big staged loads split between the caller and the
launcher (`_split_at`).
"""

from __future__ import annotations

from ._backends import Direction, Event
from ._program import TransferPlan

__all__ = ["PieceSizes"]


class PieceSizes:
    """Piece sizes and the launcher's share of a lane's transfers (see the module)."""

    direction: Direction

    #: bytes per piece of a big transfer (about 0.6 ms of PCIe time) and the fewest slots.
    #: Pieces bound how long a DMA transfer holds the copy engines (which ignore stream
    #: priority), so an urgent transfer gets through; kernel copies share the link with an
    #: urgent lane's kernel anyway, so they are cut only into `KERNEL_PIECE_BYTES` pieces,
    #: which lets the device start while the host packs the rest (each piece costs a pack
    #: and a launch, a quarter of a mid-size store's host time at 32 MiB)
    PIECE_BYTES = 32 << 20
    KERNEL_PIECE_BYTES = 256 << 20
    MIN_PIECE_SLOTS = 2048

    #: the first piece of a big DMA or kernel transfer is this small (then `PIECE_GROWTH`
    #: times bigger per piece up to the limit): packing 256 MiB of 4 KiB pages took ~0.5 ms
    #: on the H200 host, time in which the device sat idle; 8 MiB packs in tens of
    #: microseconds
    FIRST_PIECE_BYTES = 8 << 20
    MIN_FIRST_SLOTS = 256
    PIECE_GROWTH = 4
    #: a staged transfer's first piece, and its growth per piece: each piece costs the host
    #: ~0.4 ms before its first row copy (program, jobs, launches), so a piece's copy must
    #: outlast the next one's preparation. 8 MiB then 4x left the copy engines idle
    #: 0.6-1.2 ms per GiB at the first two piece boundaries; 48 MiB then 2x, 0.02-0.3 ms
    #: (H100, 1 GiB at 4 and 16 KiB pages, helper-stream events around every slab's copies)
    STAGED_FIRST_PIECE_BYTES = 48 << 20
    STAGED_GROWTH = 2
    #: a staged transfer up to this size is one program (its build is short)
    STAGED_WHOLE_BYTES = 64 << 20

    def _piece_bytes(self, path: str) -> int:
        # staged pieces pipeline through one staging ring like one program; a piece's
        # program is built when it is enqueued, so the first slab need not wait for a whole
        # gigabyte's (~3 ms of host time at 4 KiB pages on the H200 host). They grow to the
        # kernel's size: at 32 MiB each piece's job upload and table lookups cost the H200
        # 1 GiB staged transfers 5-8% of their device time
        return self.KERNEL_PIECE_BYTES if path in ("kernel", "staged") else self.PIECE_BYTES

    def _whole_bytes(self, path: str) -> int:
        """Transfers up to this size on `path` are never cut (checked before any slot
        count: this runs on every submission)."""
        return self.STAGED_WHOLE_BYTES if path == "staged" else self._piece_bytes(path)

    #: a big staged load's caller enqueues this many of its pieces (48 and 96 MiB, ~2.7 ms
    #: of copying, time in which the launcher thread gets the GIL and goes on), the
    #: launcher the rest: the driver's ~0.7 us per row copy held the caller 5-8 ms per GiB
    #: (H200 host). 3, 4 or all pieces on the caller moved 1 GiB loads of 4 and 16 KiB
    #: pages within 0.01 of the ceiling of 2 pieces, at 1.6-4x the call time (H100 host)
    SPLIT_HEAD_PIECES = 2

    def _split_at(self, path: str, signal: Event | None, pieces: int) -> int:
        """How many of a transfer's `pieces` its caller enqueues: all but for a big staged
        load with no signal (a compute stream may wait on a signal as soon as the call
        returns, and an event not yet recorded does not hold it)."""
        if (self.direction == "h2d" and signal is None and path in self.DEFER_PATHS
                and pieces > self.SPLIT_HEAD_PIECES):
            return self.SPLIT_HEAD_PIECES
        return pieces

    def _piece_slots(self, plan: TransferPlan, path: str = "dma") -> tuple[int, int, int]:
        """(slots per piece, slots of the first piece, growth per piece) for a big `plan`
        on `path` (`TransferPlan.pieces`' arguments).

        Staged pieces are sized in bytes only: a slot there is a block of every KV tensor
        (1 MiB at 16 KiB pages x 64 tensors), and the slot floors below, set for the
        descriptor paths, made a 1 GiB transfer of 16 KiB pages one piece whose whole
        program (~1.8 ms of host time on the H200 host) was built before its first row
        copy started."""
        limit = self._piece_bytes(path)
        staged = path == "staged"
        slots = sum(len(s.src_slots) for s in plan.segments)
        growth = self.STAGED_GROWTH if staged else self.PIECE_GROWTH
        if slots == 0 or plan.nbytes <= self._whole_bytes(path):
            return max(slots, 1), max(slots, 1), growth
        per_slot = plan.nbytes / slots
        floor_most, floor_first = ((1, 1) if staged
                                   else (self.MIN_PIECE_SLOTS, self.MIN_FIRST_SLOTS))
        most = max(floor_most, int(limit / per_slot))
        if slots <= most and not staged:
            return slots, slots, growth
        head = self.STAGED_FIRST_PIECE_BYTES if staged else self.FIRST_PIECE_BYTES
        first = max(floor_first, int(head / per_slot))
        return most, min(first, most), growth

    #: staged and pitched stores of at least this many bytes are enqueued by the lane's
    #: launcher thread (the caller only validates, builds the plan and records the order
    #: event): a 64 x 128 blocks store of 16 KiB pages spent ~1.5 ms enqueueing its slabs
    #: on the H200 host. Even one slab's program and launches cost more than the hand-off:
    #: on an H100 host a 1 x 128 blocks staged store (2 MiB), enqueued by its caller, held
    #: it 153 us, where a deferred 8 x 128 one held it 64 us
    DEFER_MIN_BYTES = 1 << 20
    DEFER_PATHS = frozenset({"staged", "pitched"})

    def _deferred(self, plan: TransferPlan, path: str, signal: Event | None) -> bool:
        # loads stay on the caller's thread: a compute stream may wait on their events as
        # soon as load() returns, and waiting on an event not yet recorded does not wait
        return (self.direction == "d2h" and signal is None and path in self.DEFER_PATHS
                and plan.nbytes >= self.DEFER_MIN_BYTES)
