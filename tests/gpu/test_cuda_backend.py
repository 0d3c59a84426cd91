"""The CUDA backend's seam: streams, events, pinning, path choice, and device faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync._backends import _cudart
from kvasync._backends._cuda import Calibration, CudaBackend, CudaEvent, CudaStream
from kvasync._hostmem import host_memory
from kvasync._program import TransferPlan

pytestmark = pytest.mark.gpu

PAGE = 4096


# -- streams and events -------------------------------------------------------------------------
def test_streams_are_never_the_legacy_default_stream(backend: CudaBackend) -> None:
    streams = [backend.new_stream() for _ in range(3)]
    ptrs = [s.ptr for s in streams if isinstance(s, CudaStream)]
    assert len(set(ptrs)) == 3 and not set(ptrs) & {0, 1, 2}


def test_event_timeout_then_completion(backend: CudaBackend) -> None:
    import torch

    stream = torch.cuda.Stream()
    compute = backend.compute_stream(stream)
    ev = backend.new_event(timing=False)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s
    assert compute is not None
    compute.record(ev)
    assert not ev.query()
    t0 = time.perf_counter()
    assert ev.synchronize(timeout=0.01) is False
    assert time.perf_counter() - t0 < 0.08
    assert ev.synchronize(timeout=10) is True
    assert ev.query() and ev.error() is None


def test_timing_events_measure_device_time(backend: CudaBackend) -> None:
    import torch

    stream = torch.cuda.Stream()
    compute = backend.compute_stream(stream)
    assert compute is not None
    a, b = backend.new_event(), backend.new_event()
    compute.record(a)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)
    compute.record(b)
    b.synchronize()
    assert 0.001 < a.elapsed_seconds(b) < 5


def test_compute_stream_variants(backend: CudaBackend, cp: Any) -> None:
    import torch

    ts = torch.cuda.Stream()
    assert backend.compute_stream(ts).ptr == ts.cuda_stream  # type: ignore[union-attr]
    cs = cp.cuda.Stream(non_blocking=True)
    assert backend.compute_stream(cs).ptr == cs.ptr  # type: ignore[union-attr]
    ours = backend.new_stream()
    assert backend.compute_stream(ours) is ours
    with cs:
        assert backend.compute_stream(None).ptr == cs.ptr  # type: ignore[union-attr]
    tb = CudaBackend(0, "torch")
    with torch.cuda.stream(ts):
        assert tb.compute_stream(None).ptr == ts.cuda_stream  # type: ignore[union-attr]
    with pytest.raises(kv.InvalidTransferError, match="compute_stream"):
        backend.compute_stream(object())
    tb.close()


def test_check_device_array(backend: CudaBackend, cp: Any) -> None:
    from kvasync._arrays import array_info

    backend.check_device_array(array_info(cp.zeros((4, 8), cp.uint8)), "t")
    with pytest.raises(kv.InvalidTransferError, match="CUDA device memory"):
        backend.check_device_array(array_info(np.zeros((4, 8), np.uint8)), "t")
    with pytest.raises(kv.InvalidTransferError, match="device"):
        other = CudaBackend(0, "cupy")
        other.device_id = 7
        other.check_device_array(array_info(cp.zeros((4, 8), cp.uint8)), "t")


def test_unknown_path_is_rejected(backend: CudaBackend) -> None:
    plan = TransferPlan.raw(None, np.zeros(1, np.uint64), np.zeros(1, np.uint64),  # type: ignore[arg-type]
                            np.ones(1, np.uint64))
    with pytest.raises(kv.InvalidTransferError, match="path"):
        backend.resolve_path("warp", "h2d", plan, True)
    with pytest.raises(kv.InvalidTransferError, match="path"):
        backend.enqueue_copy(backend.new_stream(), plan, "h2d", "memmove")


def test_resolve_path_never_picks_the_kernel_for_pageable_memory(backend: CudaBackend) -> None:
    plan = TransferPlan.raw(None, np.zeros(1, np.uint64), np.zeros(1, np.uint64),  # type: ignore[arg-type]
                            np.full(1, 4096, np.uint64))
    assert backend.resolve_path("kernel", "h2d", plan, False) == "dma"
    assert backend.resolve_path("auto", "d2h", plan, False) == "dma"
    assert backend.resolve_path("kernel", "h2d", plan, True) == "kernel"
    assert backend.resolve_path("dma", "h2d", plan, True) == "dma"


def test_calibration_is_measured_once_and_cached(backend: CudaBackend) -> None:
    cal = backend.calibration()
    assert isinstance(cal, Calibration) and cal.measured, cal.notes
    assert backend.calibration() is cal
    assert CudaBackend(0, "cupy").calibration() is cal
    for d in ("h2d", "d2h"):
        for p in ("kernel", "dma"):
            assert len(cal.gbps[d][p]) == len(cal.pages)
            assert all(g > 0 for g in cal.gbps[d][p])
    # the choice is per transfer and follows the model
    assert cal.choose("h2d", 4096 * 1000, 1000) in ("kernel", "dma")


def test_a_failed_measurement_frees_its_device_scratch(backend: CudaBackend, cp: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The path measurement allocates 128 MiB of device scratch; a failure part-way (here
    the third timed copy) falls back to the static figures and must free it."""
    from kvasync._backends import _cuda_policy

    real, calls = _cuda_policy._time_raw, []

    def failing(*args: Any) -> float:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(_cuda_policy, "_time_raw", failing)
    measure = lambda: _cuda_policy.measure(  # noqa: E731
        backend.device_id, backend.warm_up, backend.alloc_host, backend.new_stream,
        backend._enqueue)
    lost = []
    for _ in range(3):
        calls.clear()
        cp.cuda.runtime.deviceSynchronize()
        free_before = cp.cuda.runtime.memGetInfo()[0]
        with pytest.raises(RuntimeError, match="injected"):
            measure()
        cp.cuda.runtime.deviceSynchronize()
        lost.append(free_before - cp.cuda.runtime.memGetInfo()[0])
    assert max(lost) < 64 << 20, lost  # 128 MiB per try before


# -- pinning ------------------------------------------------------------------------------------
class Recorder:
    """Wraps the backend's pin functions; registration `fail_at` (0-based) fails."""

    def __init__(self, backend: CudaBackend, fail_at: int | None = None) -> None:
        self.reg, self.unreg = backend.pin_functions()
        self.fail_at = fail_at
        self.calls: list[tuple[str, int, int]] = []

    def register(self, ptr: int, n: int) -> bool:
        k = sum(1 for c in self.calls if c[0] == "reg")
        self.calls.append(("reg", ptr, n))
        if k == self.fail_at:
            return False
        return self.reg(ptr, n)

    def unregister(self, ptr: int) -> bool:
        self.calls.append(("unreg", ptr, 0))
        return self.unreg(ptr)


def test_pinning_registers_row_aligned_chunks_and_unregisters_in_reverse(
    backend: CudaBackend,
) -> None:
    rec = Recorder(backend)
    row = 3 * PAGE
    mem = host_memory(5 * row, row, rec.register, rec.unregister, cap=7 * PAGE)
    assert mem.pinned
    regs = [(p - mem.ptr, n) for op, p, n in rec.calls if op == "reg"]
    assert regs == [(0, 6 * PAGE), (6 * PAGE, 6 * PAGE), (12 * PAGE, 3 * PAGE)]
    assert _cudart.is_registered(mem.ptr) and _cudart.is_registered(mem.ptr + 14 * PAGE)
    mem.release()
    unregs = [p - mem.ptr for op, p, _ in rec.calls if op == "unreg"]
    assert unregs == [12 * PAGE, 6 * PAGE, 0]
    assert not _cudart.is_registered(mem.ptr)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_pinning_rolls_back_when_chunk_k_fails(backend: CudaBackend, k: int) -> None:
    rec = Recorder(backend, fail_at=k)
    row = 3 * PAGE
    mem = host_memory(5 * row, row, rec.register, rec.unregister, cap=7 * PAGE)
    assert not mem.pinned
    ops = [op for op, _, _ in rec.calls]
    assert ops == ["reg"] * (k + 1) + ["unreg"] * k
    unregs = [p - mem.ptr for op, p, _ in rec.calls if op == "unreg"]
    assert unregs == [6 * PAGE * i for i in reversed(range(k))]
    assert not _cudart.is_registered(mem.ptr)
    mem.array[:] = 1  # still usable, pageable
    mem.release()


def test_a_failed_register_leaves_no_pending_error(backend: CudaBackend, cp: Any) -> None:
    """Registering the same range twice fails; the next CUDA call must still succeed."""
    mem = backend.alloc_host(4 * PAGE, PAGE)
    assert mem.pinned
    assert _cudart.host_register(mem.ptr, 4 * PAGE) is False  # already registered
    x = cp.arange(10)
    assert int(x.sum()) == 45
    mem.release()


@pytest.mark.asyncio
async def test_unpinnable_host_memory_falls_back_to_dma(cp: Any,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    backend = CudaBackend(0, "cupy")
    backend._register = lambda ptr, n: False  # type: ignore[method-assign]
    gpu = cp.asarray(np.random.default_rng(0).integers(0, 256, (16, 8192), dtype=np.uint8))
    layout = kv.KVCacheLayout.from_tensors([gpu])
    off = kv.Offloader(layout, 16, backend=backend, copy_path="kernel")
    assert not off.host_pinned
    assert "could not pin" in caplog.text
    await off.store(gpu_blocks=list(range(16)), cpu_chunks=list(range(16))[::-1])
    np.testing.assert_array_equal(off.cpu_tensors[0][::-1], gpu.get())
    assert backend.counts["kernel"] == 0 and backend.counts["dma"] == 1
    await off.aclose()


@pytest.mark.asyncio
async def test_kernel_refuses_a_host_region_that_only_claims_to_be_pinned(cp: Any) -> None:
    host = np.zeros((8, 4096), dtype=np.uint8)  # pageable

    class LyingRegion:
        is_pinned = True

        def create_next_worker_view(self, page: int) -> np.ndarray:
            return host

        def pin(self, *a: object) -> None:
            pass

    gpu = cp.asarray(np.random.default_rng(1).integers(0, 256, (8, 4096), dtype=np.uint8))
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 8, backend="cuda",
                       copy_path="kernel", host_region=LyingRegion())
    await off.store(gpu_blocks=list(range(8)), cpu_chunks=list(range(8)))
    np.testing.assert_array_equal(host, gpu.get())
    assert off.backend.counts["kernel"] == 0  # type: ignore[attr-defined]
    await off.aclose()


def test_close_is_idempotent() -> None:
    b = CudaBackend(0, "cupy")
    b.new_stream()
    b.close()
    b.close()


# -- faults (in a subprocess: an illegal address poisons the whole CUDA context) ---------------
def _run_script(code: str, prelude: str = "") -> str:
    script = textwrap.dedent(prelude) + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                         text=True, timeout=180, check=False)
    return out.stdout + "\n--stderr--\n" + out.stderr[-3000:]


#: script prelude: `report(name, t)` awaits transfer `t` (None: skipped) and prints
#: "<name> no error" or "<name> failed <own job id> <a CUDA error> <message>"; `finish(off)`
#: prints "BROKEN <off.broken>", closes `off` and prints "CLOSED"
_REPORT = """
    import asyncio
    import kvasync as kv
    async def _w(t):
        return await t
    async def report(name, t):
        if t is None:
            return
        try:
            await asyncio.wait_for(_w(t), 60)
            print(name, "no error")
        except kv.TransferFailedError as e:
            print(name, "failed", e.job_id == t.job_id, "cuda" in str(e).lower(),
                  str(e)[:200])
    async def finish(off):
        print("BROKEN", off.broken)
        await asyncio.wait_for(off.aclose(), 60)
        print("CLOSED")
"""


def test_device_fault_surfaces_in_event_error() -> None:
    out = _run_script("""
        import numpy as np, cupy
        from kvasync._backends._cuda import CudaBackend
        from kvasync._program import TransferPlan
        b = CudaBackend(0, "cupy")
        x = cupy.zeros(4096, cupy.uint8)
        s = b.new_stream(); end = b.new_event(); later = b.new_event()
        bad = np.asarray([int(x.data.ptr) + (1 << 40)], np.uint64)
        plan = TransferPlan.raw(None, np.asarray([int(x.data.ptr)], np.uint64), bad,
                                np.asarray([4096], np.uint64))
        b.enqueue_copy(s, plan, "d2h", "kernel")
        s.record(end)
        print("SYNC", end.synchronize())
        print("QUERY", end.query())
        print("ERROR", repr(end.error()))
        s.record(later)
        print("LATER", later.synchronize(timeout=5), later.error() is not None)
    """)
    assert "SYNC True" in out and "QUERY True" in out, out
    assert "ERROR TransferFailedError" in out and "illegal" in out.lower(), out
    assert "LATER True True" in out, out


def test_device_fault_fails_the_transfer_and_aclose_returns() -> None:
    out = _run_script("""
        import asyncio, numpy as np, cupy
        import kvasync as kv
        from kvasync._testing import submit_raw
        x = cupy.zeros((8, 4096), cupy.uint8)
        off = kv.Offloader(kv.KVCacheLayout.from_tensors([x]), 8, backend="cuda",
                           copy_path="kernel")
        async def main():
            print("OK", (await off.store(gpu_blocks=[0], cpu_chunks=[0])).success)
            host = off.cpu_tensors[0]
            bad = submit_raw(off, "h2d", np.asarray([host.ctypes.data], np.uint64),
                             np.asarray([int(x.data.ptr) + (1 << 40)], np.uint64),
                             np.asarray([4096], np.uint64), path="kernel")
            behind = off.load(cpu_chunks=[0], gpu_blocks=[1])
            await report("BAD", bad)
            await report("BEHIND", behind)
            await finish(off)
        asyncio.run(main())
    """, _REPORT)
    assert "OK True" in out, out
    assert "BAD failed True" in out and "illegal" in out.lower(), out
    assert "BEHIND failed True" in out, out
    assert "BROKEN True" in out and "CLOSED" in out, out


@pytest.mark.parametrize(("path", "direction"), [("staged", "d2h"), ("auto", "h2d")])
def test_a_staged_pack_or_unpack_fault_fails_its_transfer(path: str, direction: str) -> None:
    """A fault in a staged transfer's pack (stores) or unpack (loads) kernel, here an
    illegal staging address, surfaces on that transfer and on the one queued behind it;
    the offloader is broken and still closes."""
    out = _run_script(f"""
        import asyncio, numpy as np, cupy
        import kvasync as kv
        from kvasync._backends import _cuda_staged
        real = _cuda_staged.staging_table
        def bad_table(table, rows, store, stage_ptr, rows_per_slab):
            return real(table, rows, store, stage_ptr + (1 << 40), rows_per_slab)
        xs = [cupy.zeros((64, 16384), cupy.uint8) for _ in range(4)]  # 4 MiB: auto stages
        off = kv.Offloader(kv.KVCacheLayout.from_tensors(xs), 64, backend="cuda")
        ids = dict(gpu_blocks=list(range(64)), cpu_chunks=list(range(64)), path="{path}")
        submit = off.store if "{direction}" == "d2h" else off.load
        async def main():
            print("OK", (await submit(**ids)).success)
            _cuda_staged.staging_table = bad_table
            bad = submit(**ids)
            try:
                behind = submit(**ids)
            except kv.OffloaderBrokenError:  # the fault already came: refused at once
                print("BEHIND refused")
                behind = None
            await report("BAD", bad)
            await report("BEHIND", behind)
            print("STAGED", off.backend.counts["staged"])
            await finish(off)
        asyncio.run(main())
    """, _REPORT)
    assert "OK True" in out, out
    # BAD's own error names the CUDA failure; the illegal address shows in the output
    assert "BAD failed True True" in out and "illegal" in out.lower(), out
    assert "BEHIND failed True" in out or "BEHIND refused" in out, out
    assert "STAGED 3" in out or "STAGED 2" in out, out  # each ran staged (auto too)
    assert "BROKEN True" in out and "CLOSED" in out, out


def test_event_error_is_none_for_a_healthy_event(backend: CudaBackend) -> None:
    ev = backend.new_event()
    s = backend.new_stream()
    s.record(ev)
    assert ev.synchronize() and ev.error() is None
    assert isinstance(ev, CudaEvent)


# -- kernel launches ----------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False])
def test_kernel_launch_direct_and_through_cupy_copy_the_same_bytes(direct: bool) -> None:
    """Launches go through cuLaunchKernel; CuPy's launch (the fallback) must agree."""
    import torch

    layout_t = [torch.randint(0, 256, (64, 1000 + 8 * i), dtype=torch.uint8, device="cuda")
                for i in range(3)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(layout_t), 64) as off:
        kernels = off.backend._kernels  # type: ignore[attr-defined]
        kernels.compile()
        assert kernels.direct, kernels.direct_error  # the driver call is available
        kernels.direct = direct
        ids = list(range(0, 64, 3))
        off.store(gpu_blocks=ids, cpu_chunks=ids, path="kernel").wait(30)
        before = [t.clone() for t in layout_t]
        for t in layout_t:
            t.zero_()
        off.load(cpu_chunks=ids, gpu_blocks=ids, path="kernel").wait(30)
        torch.cuda.synchronize()
        for a, b in zip(before, layout_t):
            assert torch.equal(a[ids].cpu(), b[ids].cpu())
            assert int(b[[i for i in range(64) if i not in ids]].sum().item()) == 0
        assert kernels.direct is direct  # no silent fallback


def test_small_dma_plans_use_plain_copies_and_stay_exact() -> None:
    """Up to `EACH_RUNS` coalesced runs go out as cudaMemcpyAsync calls, more as a batch."""
    import torch

    t = torch.randint(0, 256, (64, 4096 + 3), dtype=torch.uint8, device="cuda")
    with kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 64) as off:
        be = off.backend
        for ids in ([5], [1, 2, 3], list(range(0, 40, 2))):
            each, batch = be.counts["dma_each"], be.counts["dma_batch"]  # type: ignore[attr-defined]
            off.store(gpu_blocks=ids, cpu_chunks=ids, path="dma").wait(30)
            host = off.cpu_tensors[0]
            for i in ids:
                assert bytes(host[i]) == bytes(t[i].cpu().numpy())
            runs = 1 if len(ids) <= 3 else len(ids)
            if runs <= be.EACH_RUNS or not be.batch_available:  # type: ignore[attr-defined]
                assert be.counts["dma_each"] == each + 1  # type: ignore[attr-defined]
            else:
                assert be.counts["dma_batch"] == batch + 1  # type: ignore[attr-defined]


def test_big_dma_batches_fan_out_over_helper_streams_and_keep_order() -> None:
    """Batches of >= 128 KiB descriptors are split over helper streams (fork/join events):
    two stores into the same chunks land in call order, and a load still waits for the
    compute stream's earlier writes."""
    import torch

    page = 256 * 1024
    t = torch.randint(0, 256, (64, page), dtype=torch.uint8, device="cuda")
    with kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 64) as off:
        be = off.backend
        if not be.batch_available:  # type: ignore[attr-defined]
            pytest.skip("no cuMemcpyBatchAsync on this driver")
        rng = np.random.default_rng(5)
        first, second = rng.permutation(64)[:32].tolist(), rng.permutation(64)[:32].tolist()
        chunks = rng.permutation(64)[:32].tolist()
        fanned = be.counts["dma_fanned"]  # type: ignore[attr-defined]
        off.store(gpu_blocks=first, cpu_chunks=chunks, path="dma")
        last = off.store(gpu_blocks=second, cpu_chunks=chunks, path="dma")  # same chunks: must win
        last.wait(30)
        assert be.counts["dma_fanned"] == fanned + 2  # type: ignore[attr-defined]
        host = off.cpu_tensors[0]
        expect = t[second].cpu().numpy()
        for i, c in enumerate(chunks):
            assert np.array_equal(host[c], expect[i])
        # load-waits-for-compute through the fan: a long kernel, then zeroing, on the
        # compute stream; the load (submitted after) must land on top of the zeros
        torch.cuda._sleep(50_000_000)
        t[first] = 0  # index_put_ on the compute stream
        off.load(cpu_chunks=chunks, gpu_blocks=first, path="dma").wait(30)
        torch.cuda.synchronize()
        assert torch.equal(t[first].cpu(), torch.from_numpy(expect))
        assert be.counts["dma_fanned"] == fanned + 3  # type: ignore[attr-defined]
