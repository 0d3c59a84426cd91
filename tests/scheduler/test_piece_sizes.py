"""How a lane cuts a big transfer into pieces: staged pieces by bytes (a small first piece,
then 4x growth), the descriptor paths with their slot floors, small transfers whole."""

from __future__ import annotations

import numpy as np
import pytest

import kvasync as kv
from kvasync._lane_launch import LaneLaunch
from kvasync._program import TransferPlan

MiB = 1 << 20


def _plan(blocks: int, tensors: int, page: int) -> tuple[kv.Offloader, TransferPlan]:
    gpu = [np.zeros((blocks, page), dtype=np.uint8) for _ in range(tensors)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, 1)
    ids = list(range(blocks))
    plan = off._submitter.plan("h2d", ids, ids, None, None)
    return off, plan


def _sizes(lane: LaneLaunch, plan: TransferPlan, path: str) -> list[int]:
    return [p.nbytes for p in plan.pieces(*lane._piece_slots(plan, path))]


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piece sizes of a 1 GiB transfer at 1/64 scale: 128 KiB first (staged: 768 KiB,
    then 2x), 4 MiB at most, one program up to 1 MiB; slot floors of 64 / 8 for the
    descriptor paths."""
    for name, value in (("FIRST_PIECE_BYTES", 128 << 10), ("KERNEL_PIECE_BYTES", 4 * MiB),
                        ("STAGED_FIRST_PIECE_BYTES", 768 << 10),
                        ("PIECE_BYTES", 512 << 10), ("STAGED_WHOLE_BYTES", MiB),
                        ("MIN_PIECE_SLOTS", 64), ("MIN_FIRST_SLOTS", 8)):
        monkeypatch.setattr(LaneLaunch, name, value)


@pytest.mark.usefixtures("small")
def test_staged_pieces_ramp_by_bytes_whatever_the_slot_size() -> None:
    # 16 MiB of 16 KiB pages x 16 tensors: a slot (one block of every tensor) is 256 KiB
    off, plan = _plan(64, 16, 16 << 10)
    lane = off._queues[("h2d", False)]
    try:
        sizes = _sizes(lane, plan, "staged")
        assert sum(sizes) == plan.nbytes == 16 * MiB
        # no slot floor: the first piece is STAGED_FIRST_PIECE_BYTES rounded down to
        # whole slots (at least one), then 2x per piece up to KERNEL_PIECE_BYTES
        assert sizes[:5] == [768 << 10, 1536 << 10, 3 * MiB, 4 * MiB, 4 * MiB]
        assert all(s <= 4 * MiB for s in sizes)
        # the descriptor paths keep their floors: 64 slots per piece is the whole transfer
        assert _sizes(lane, plan, "dma") == [plan.nbytes]
    finally:
        off.close()


@pytest.mark.usefixtures("small")
def test_a_staged_transfer_up_to_the_whole_limit_is_one_program() -> None:
    off, plan = _plan(4, 16, 16 << 10)  # 1 MiB = STAGED_WHOLE_BYTES
    lane = off._queues[("h2d", False)]
    try:
        assert _sizes(lane, plan, "staged") == [MiB]
    finally:
        off.close()


def test_pieces_of_a_plan_no_bigger_than_its_first_piece_is_the_plan() -> None:
    off, plan = _plan(8, 2, 4096)
    try:
        assert plan.pieces(100, first=8) == [plan]
        ramp = plan.pieces(100, first=2)  # bigger than the first piece: a ramp
        assert [sum(len(s.src_slots) for s in p.segments) for p in ramp] == [2, 6]
        assert sum(p.nbytes for p in ramp) == plan.nbytes
    finally:
        off.close()
