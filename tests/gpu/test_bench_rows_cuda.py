"""The bench's bare-rows reference on the GPU: the copy engines move the transfer's own host
rows (ranked by chunk id, as the staged program ranks them), byte for byte and nothing else,
and the pipeline section reports them as ``ref-rows``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvasync.bench.common import KiB, MiB, Options
from kvasync.bench.context import Context, bare_rows, row_copier
from kvasync.bench.rows import bare_row_seconds, host_rows, row_runs
from kvasync.bench.sections import pipeline

pytestmark = pytest.mark.gpu


def _context() -> Context:
    return Context(Options(backend="cuda", total_bytes=8 * MiB, reps=1, pages=(4 * KiB,),
                           tensors=4, quick=True))


def _host(views: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.concatenate([v[c] for v in views]) for c in range(views[0].shape[0])])


@pytest.mark.parametrize("batch_call", [True, False], ids=["batch", "per-run"])
def test_bare_rows_move_the_transfers_rows_both_ways(batch_call: bool) -> None:
    import torch

    ctx = _context()
    try:
        off = ctx.offloader(4 * KiB)
        _, cpu = ctx.ids(4 * KiB, 2 * MiB)
        views = off.cpu_tensors
        rng = np.random.default_rng(7)
        for v in views:
            v[:] = rng.integers(0, 256, v.shape, dtype=np.uint8)
        before = _host(views)
        ranked = np.sort(cpu)
        found = host_rows(views, cpu)
        assert found is not None and found[1] == before.shape[1]
        starts, sizes = row_runs(*found)
        hold = torch.cuda.Stream()
        spins: list[int] = []

        def spin() -> None:
            spins.append(1)
            with torch.cuda.stream(hold):
                torch.cuda._sleep(1000)

        def move(direction: str) -> list[float] | None:
            if batch_call:
                return bare_rows(ctx, off, cpu, direction, hold.cuda_stream, spin)
            copy = row_copier(off, use_batch=False)
            return bare_row_seconds(ctx.cp, starts, sizes, int(ctx.pool.data_ptr()),
                                    direction, hold.cuda_stream, spin, 1, copy)

        pool: Any = ctx.pool
        n = before[ranked].size
        tail = pool[n : n + 4096].clone()
        secs = move("h2d")
        assert secs is not None and len(secs) == 1 and secs[0] > 0 and len(spins) == 2
        torch.cuda.synchronize()
        np.testing.assert_array_equal(pool[:n].cpu().numpy().reshape(-1, before.shape[1]),
                                      before[ranked])
        assert torch.equal(pool[n : n + 4096], tail)  # nothing past the rows
        # back: other bytes into the same rows of the host copy, and only those rows
        back = rng.integers(0, 256, (len(ranked), before.shape[1]), dtype=np.uint8)
        pool[:n] = torch.from_numpy(back.ravel()).cuda()
        torch.cuda.synchronize()
        secs = move("d2h")
        assert secs is not None and secs[0] > 0
        want = before.copy()
        want[ranked] = back
        np.testing.assert_array_equal(_host(views), want)
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
