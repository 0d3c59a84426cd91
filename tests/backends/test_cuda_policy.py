"""The CUDA backend's "auto" rules as a plain function (no GPU): which path a plan gets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvasync._backends._cuda_policy import (
    CONTENDED_DMA_BYTES,
    PITCHED_MIN_HEIGHT,
    PITCHED_MIN_LINE_BYTES,
    STAGED_MAX_PAGE_BYTES,
    STAGED_MIN_BYTES,
    Calibration,
    choose_auto,
)

KiB, MiB = 1 << 10, 1 << 20


@dataclass
class Plan:
    nbytes: int
    num_descriptors: int


def choose(plan: Plan, *, urgent: bool = False, busy: bool = False, layered: bool = False,
           stageable: bool = True) -> str:
    def stage(p: Any, d: Any) -> bool:
        return stageable

    return choose_auto("h2d", plan, urgent, busy, layered, True,  # type: ignore[arg-type]
                       CONTENDED_DMA_BYTES, STAGED_MIN_BYTES, stage,
                       Calibration.static_default, STAGED_MAX_PAGE_BYTES)


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB, 64 * KiB])
def test_small_pages_of_a_big_transfer_are_staged(page: int) -> None:
    assert choose(Plan(64 * MiB, 64 * MiB // page)) == "staged"


@pytest.mark.parametrize("page", [256 * KiB, 2 * MiB])
def test_big_pages_are_not_staged(page: int) -> None:
    """DMA moves them near the ceiling and leaves a concurrent matmul alone."""
    assert choose(Plan(64 * MiB, 64 * MiB // page)) != "staged"


def test_the_exceptions_to_staging() -> None:
    big = Plan(64 * MiB, 64 * MiB // (4 * KiB))
    assert choose(big, urgent=True) == "kernel"  # passes queued DMA
    assert choose(big, layered=True) != "staged"  # one layer of a layer-wise load
    assert choose(big, stageable=False) != "staged"  # e.g. a row beyond a staging buffer
    assert choose(Plan(STAGED_MIN_BYTES - 4 * KiB, 511)) != "staged"  # too small to pay off
    assert choose(Plan(0, 0)) == "dma"


def test_contended_big_descriptors_go_to_dma_when_not_staged() -> None:
    plan = Plan(64 * MiB, 32)  # 2 MiB descriptors
    assert choose(plan, busy=True, stageable=False) == "dma"


def choose_pitched(plan: Plan, height: float, *, urgent: bool = False, layered: bool = False,
                   min_line: int = 16 * KiB) -> str:
    return choose_auto("h2d", plan, urgent, False, layered, True,  # type: ignore[arg-type]
                       CONTENDED_DMA_BYTES, STAGED_MIN_BYTES, lambda p, d: True,
                       Calibration.static_default, STAGED_MAX_PAGE_BYTES,
                       min_line, lambda p: height, PITCHED_MIN_HEIGHT)


@pytest.mark.parametrize("page", [16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB])
def test_tall_pitched_copies_of_big_enough_lines_go_pitched(page: int) -> None:
    assert choose_pitched(Plan(64 * MiB, 64 * MiB // page), 64.0) == "pitched"


def test_pitched_starts_at_64_kib_pages() -> None:
    assert PITCHED_MIN_LINE_BYTES // KiB == 64


def test_the_exceptions_to_pitched() -> None:
    big = Plan(64 * MiB, 64 * MiB // (16 * KiB))
    assert choose_pitched(big, 64.0, urgent=True) == "kernel"
    assert choose_pitched(big, 64.0, layered=True) not in ("pitched", "staged")
    assert choose_pitched(big, PITCHED_MIN_HEIGHT - 1) == "staged"  # short copies
    assert choose_pitched(big, 0.0) == "staged"  # no pitched form
    assert choose_pitched(big, 64.0, min_line=0) == "staged"  # turned off
    small_lines = Plan(64 * MiB, 64 * MiB // (4 * KiB))  # the engines' short lines are slow
    assert choose_pitched(small_lines, 64.0) == "staged"
