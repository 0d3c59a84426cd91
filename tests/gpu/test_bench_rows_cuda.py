"""The bench's bare-rows reference on the GPU: the copy engines move the transfer's own host
rows, byte for byte, and the pipeline section reports them as ``ref-rows``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvasync.bench.common import KiB, MiB, Options
from kvasync.bench.context import Context, bare_rows
from kvasync.bench.rows import host_rows
from kvasync.bench.sections import pipeline

pytestmark = pytest.mark.gpu


def _context() -> Context:
    return Context(Options(backend="cuda", total_bytes=8 * MiB, reps=1, pages=(4 * KiB,),
                           tensors=4, quick=True))


def test_bare_rows_move_the_transfers_rows_both_ways() -> None:
    import torch

    ctx = _context()
    try:
        off = ctx.offloader(4 * KiB)
        _, cpu = ctx.ids(4 * KiB, 2 * MiB)
        views = off.cpu_tensors
        rng = np.random.default_rng(7)
        for v in views:
            v[:] = rng.integers(0, 256, v.shape, dtype=np.uint8)
        rows = np.stack([np.concatenate([v[c] for v in views]) for c in cpu])
        found = host_rows(views, cpu)
        assert found is not None and found[1] == rows.shape[1]
        hold = torch.cuda.Stream()
        spins: list[int] = []

        def spin() -> None:
            spins.append(1)
            with torch.cuda.stream(hold):
                torch.cuda._sleep(1000)

        secs = bare_rows(ctx, off, cpu, "h2d", hold.cuda_stream, spin)
        assert secs is not None and len(secs) == 1 and secs[0] > 0 and len(spins) == 2
        pool: Any = ctx.pool
        torch.cuda.synchronize()
        landed = pool[: rows.size].cpu().numpy().reshape(rows.shape)
        np.testing.assert_array_equal(landed, rows)
        # back: the pool's rows into the host rows, in the same order
        pool[: rows.size] = torch.from_numpy(rows[::-1].copy().ravel()).cuda()
        torch.cuda.synchronize()
        secs = bare_rows(ctx, off, cpu, "d2h", hold.cuda_stream, spin)
        assert secs is not None and secs[0] > 0
        for k, c in enumerate(cpu):
            np.testing.assert_array_equal(np.concatenate([v[c] for v in views]),
                                          rows[::-1][k])
    finally:
        ctx.close()


def test_pipeline_section_reports_the_bare_rows() -> None:
    ctx = _context()
    try:
        rows = pipeline.run(ctx)
    finally:
        ctx.close()
    bare = {r.direction: r for r in rows if r.path == "ref-rows"}
    assert set(bare) == {"h2d", "d2h"}
    for r in bare.values():
        assert r.extra == {"mode": "held", "ran": "rows"} and r.page_bytes == 4 * KiB
        assert r.ratio is not None and 0.05 < r.ratio < 1.5 and r.gbps and r.gbps > 0
