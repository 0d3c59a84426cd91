"""`Offloader.calibrate()` on the GPU: kernel, DMA and staged timed alone and beside a
fp16 matmul loop, the choice preferred by "auto", the KV cache untouched."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync import _calibrate
from kvasync._backends._calibrated import Preference

pytestmark = pytest.mark.gpu

PAGE = 16 << 10


def _torch() -> Any:
    import torch

    return torch


def test_calibrate_times_every_path_beside_a_matmul_and_auto_follows_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_calibrate, "TRANSFER_BYTES", 16 << 20)
    torch = _torch()
    gen = torch.Generator(device="cuda").manual_seed(0)
    gpu = [torch.randint(0, 256, (256, PAGE), dtype=torch.uint8, device="cuda", generator=gen)
           for _ in range(16)]
    before = [g.cpu().numpy().copy() for g in gpu]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), num_cpu_chunks=256,
                      backend="cuda") as off:
        cal = off.calibrate(seconds=0.15)
        print("\n" + cal.table())  # the GPU run's log keeps what it measured
        assert {(m.direction, m.path) for m in cal.measurements} == {
            (d, p) for d in ("d2h", "h2d") for p in ("kernel", "dma", "staged")}
        for m in cal.measurements:
            assert m.gbps_alone > 0.5 and m.gbps_beside > 0, m
            assert 0 < m.kept < 2, m
        assert cal.choice == _calibrate.rank(cal.measurements, 0.97, cal.incumbent)
        assert cal.incumbent == {"d2h": "staged", "h2d": "staged"}  # the fixed rules
        assert cal.notes == []
        assert not any(t.name == "kvasync-compute-load" for t in threading.enumerate())
        torch.cuda.synchronize()
        for g, b in zip(gpu, before):  # the calibration ran on scratch memory
            np.testing.assert_array_equal(g.cpu().numpy(), b)
        # auto takes the choice for a big transfer of these pages, and moves the bytes
        ids = list(range(64))  # 64 x 16 x 16 KiB = 16 MiB
        for direction in ("d2h", "h2d"):
            pref = off.backend.preference(direction)  # type: ignore[arg-type]
            path = cal.choice[direction]
            assert pref == (None if path == cal.incumbent[direction]
                            else Preference(path, PAGE, _calibrate.MIN_BYTES))
            counts = dict(off.backend.counts)  # type: ignore[attr-defined]
            if direction == "d2h":
                off.store(gpu_blocks=ids, cpu_chunks=ids).wait(30)
            else:
                off.load(cpu_chunks=ids, gpu_blocks=list(range(100, 164))).wait(30)
            ran = [k for k, v in off.backend.counts.items()  # type: ignore[attr-defined]
                   if v != counts[k] and k in ("kernel", "dma", "staged")]
            assert ran == [cal.choice[direction]], (direction, ran)
        torch.cuda.synchronize()
        for g, b in zip(gpu, before):
            np.testing.assert_array_equal(g[100:164].cpu().numpy(), b[:64])
            np.testing.assert_array_equal(g[164:].cpu().numpy(), b[164:])


def test_the_matmul_load_reports_its_rate_alone_and_stops() -> None:
    from kvasync._backends._cuda_load import CudaMatmulLoad

    load = CudaMatmulLoad(0, n=4096)
    load.start()
    try:
        def nap() -> int:
            time.sleep(0.1)
            return 7

        rate, out = load.rate(nap)
        assert out == 7 and rate > 10, rate  # 4096^3 fp16 matmuls: far more than 10/s
    finally:
        load.close()
    assert not any(t.name == "kvasync-compute-load" for t in threading.enumerate())
