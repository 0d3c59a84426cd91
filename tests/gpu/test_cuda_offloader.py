"""End to end through the Offloader on the GPU, for every copy path.

Reference for the byte-level checks: the very same requests run on the host backend over
NumPy copies of the data (the host backend executes plain `memmove`s of `plan.flat()`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import kvasync as kv

pytestmark = pytest.mark.gpu

PATHS = ["kernel", "dma", "staged", "auto"]


def _torch() -> Any:
    import torch

    return torch


def _u8(shape: tuple[int, ...], seed: int) -> Any:
    torch = _torch()
    host = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return torch.from_numpy(host).cuda()


def _np(t: Any) -> np.ndarray:
    torch = _torch()
    torch.cuda.synchronize()
    return np.ascontiguousarray(t.cpu().numpy())


# -- mixed layouts against the host backend -------------------------------------------------------
def _twin_layouts(canonical: bool) -> tuple[list[Any], list[np.ndarray], Any]:
    """GPU tensors, their NumPy twins, and a function building a layout from either."""
    shapes = [(40, 1000), (40, 4099), (24, 2, 512)]
    gpu = [_u8(s, seed=i) for i, s in enumerate(shapes)]
    host = [_np(g) for g in gpu]

    def layout(ts: list[Any]) -> kv.KVCacheLayout:
        tensors = [kv.KVTensor(ts[0], page_size_bytes=1000), kv.KVTensor(ts[1]),
                   kv.KVTensor(ts[2])]
        if canonical:
            m0 = kv.PageMapping(2048, 900, (kv.CopyRun(0, 3, 100, 9, 100, 200),),
                                num_writers=2, writer_index=0)
            m1 = kv.PageMapping.identity(4099)
            m2 = kv.PageMapping(4096, 1024, (kv.CopyRun(0, 1024, 512),
                                             kv.CopyRun(512, 3000, 512)))
            groups = [[kv.KVRef(0, 900, m0), kv.KVRef(1, mapping=m1)], [kv.KVRef(2, mapping=m2)]]
        else:
            groups = [[kv.KVRef(0, 900), kv.KVRef(1)], [kv.KVRef(2)]]
        return kv.KVCacheLayout(tensors, groups)

    return gpu, host, layout


def _requests(seed: int, n: int, bpc: int) -> list[tuple[str, list[int], list[int], list[int],
                                                          list[int]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        sizes = [int(rng.integers(0, 12)), int(rng.integers(0, 12))]
        starts = [int(rng.integers(0, 5)), int(rng.integers(0, 5))]
        limits = [40, 24]
        blocks: list[int] = []
        chunks: list[int] = []
        used: set[int] = set()
        for g in range(2):
            blocks += rng.choice(limits[g], sizes[g], replace=False).tolist()
            need = -(-(sizes[g] + starts[g] % bpc) // bpc) if sizes[g] else 0
            free = [c for c in range(48) if c not in used]
            pick = rng.choice(free, need, replace=False).tolist()
            used.update(pick)
            chunks += pick
        out.append(("store" if rng.random() < 0.5 else "load", blocks, chunks, sizes, starts))
    return out


@pytest.mark.parametrize("canonical", [False, True], ids=["direct", "canonical"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_random_requests_match_the_host_backend(path: str, canonical: bool) -> None:
    bpc = 2
    gpu, host, layout = _twin_layouts(canonical)
    off = kv.Offloader(layout(gpu), 48, bpc, backend="cuda", copy_path=path, canonical=canonical)
    ref = kv.Offloader(layout(host), 48, bpc, backend="host", canonical=canonical)
    assert off.host_pinned
    for i, (a, b) in enumerate(zip(off.cpu_tensors, ref.cpu_tensors)):
        a[:] = b[:] = np.random.default_rng(90 + i).integers(0, 256, a.shape, dtype=np.uint8)
    for kind, blocks, chunks, sizes, starts in _requests(7, 30, bpc):
        for o in (off, ref):
            if kind == "store":
                t = o.store(gpu_blocks=blocks, cpu_chunks=chunks, group_sizes=sizes, block_indices=starts)
            else:
                t = o.load(cpu_chunks=chunks, gpu_blocks=blocks, group_sizes=sizes, block_indices=starts)
            r = await t
            assert r.success
    for i in range(3):
        np.testing.assert_array_equal(_np(gpu[i]), host[i], f"gpu tensor {i}")
        np.testing.assert_array_equal(off.cpu_tensors[i], ref.cpu_tensors[i], f"cpu tensor {i}")
    if path in ("kernel", "staged"):
        assert off.backend.counts[path] > 0  # type: ignore[attr-defined]
    await off.aclose()
    await ref.aclose()


# -- ordering against the compute stream ------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_load_waits_for_pending_compute_stream_writes(path: str) -> None:
    """vLLM 6.1.3: a long kernel then zeroing on the compute stream; the load lands after."""
    torch = _torch()
    page = 128 * 1024
    gpu = torch.full((64, page), 0x11, dtype=torch.uint8, device="cuda")
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 64, 1, backend="cuda",
                       copy_path=path)
    off.cpu_tensors[0][:] = 0x5A
    for _ in range(3):
        gpu.fill_(0x11)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        gpu[:32].zero_()
        r = await off.load(cpu_chunks=list(range(32)), gpu_blocks=list(range(32)))
        assert r.success
        torch.cuda.synchronize()
        assert bool((gpu[:32] == 0x5A).all())
        assert bool((gpu[32:] == 0x11).all())
    await off.aclose()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_store_waits_for_writes_on_an_override_stream(path: str) -> None:
    torch = _torch()
    gpu = torch.zeros((16, 65536), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 16, backend="cuda",
                       copy_path=path, compute_stream=side)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        gpu.fill_(7)
    await off.store(gpu_blocks=list(range(16)), cpu_chunks=list(range(16)))
    assert (off.cpu_tensors[0] == 7).all()
    await off.aclose()


# -- real-model shapes ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_bf16_round_trip_32_layers(path: str) -> None:
    """32 layers x (2, blocks, 16, 8, 128) bf16 (K and V as separate tensors)."""
    torch = _torch()
    blocks, chunks = 64, 128
    layers = [torch.randn((2, blocks, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
              for _ in range(32)]
    tensors = [t[kv_i] for t in layers for kv_i in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(tensors), chunks, backend="cuda",
                       copy_path=path)
    rng = np.random.default_rng(3)
    src_blocks = rng.choice(blocks, 40, replace=False).tolist()
    cpu = rng.choice(chunks, 40, replace=False).tolist()
    before = [t.clone() for t in layers]
    r = await off.store(gpu_blocks=src_blocks, cpu_chunks=cpu)
    assert r.success and r.bytes == 40 * 64 * 16 * 8 * 128 * 2
    for t in layers:
        t.normal_()
    dst_blocks = rng.choice(blocks, 40, replace=False).tolist()
    r = await off.load(cpu_chunks=cpu, gpu_blocks=dst_blocks)
    assert r.success and r.seconds > 0
    torch.cuda.synchronize()
    for b, a in zip(before, layers):
        want = b[:, src_blocks].view(torch.int16)
        got = a[:, dst_blocks].view(torch.int16)
        assert torch.equal(want, got)
    await off.aclose()


# -- asyncio ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.asyncio
async def test_transfer_awaited_while_another_task_keeps_running(path: str) -> None:
    torch = _torch()
    n, page = 1024, 256 * 1024
    gpu = torch.randint(0, 255, (n, page), dtype=torch.uint8, device="cuda")
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), n, backend="cuda", copy_path=path)
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    perm = np.random.default_rng(0).permutation(n).tolist()
    for _ in range(3):
        t = off.store(gpu_blocks=list(range(n)), cpu_chunks=perm)
        before = ticks
        r = await t
        assert r.success and r.bytes == n * page
        assert ticks - before > 5, "the loop did not run while the transfer was in flight"
    stop = True
    await task
    np.testing.assert_array_equal(off.cpu_tensors[0][perm[:8]], _np(gpu[:8]))
    await off.aclose()


@pytest.mark.asyncio
async def test_many_transfers_complete_in_order_both_directions() -> None:
    torch = _torch()
    gpu = torch.randint(0, 255, (256, 4096), dtype=torch.uint8, device="cuda")
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 256, backend="cuda")
    stores = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(256)]
    done: list[int] = []
    for t in stores:
        t.add_done_callback(lambda tr: done.append(tr.job_id))
    results = await asyncio.gather(*stores)
    assert [r.job_id for r in results] == [t.job_id for t in stores]
    assert done == sorted(done)
    loads = [off.load(cpu_chunks=[i], gpu_blocks=[255 - i]) for i in range(256)]
    await asyncio.gather(*loads)
    got = _np(gpu)
    np.testing.assert_array_equal(got[::-1], off.cpu_tensors[0])
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("path", PATHS)
async def test_short_transfers_are_polled_by_the_awaiting_task(path: str) -> None:
    """Hybrid mode on the GPU: awaits of short transfers poll the end event from the awaiting
    task (no resolver task); a transfer held behind a long kernel on the compute stream
    outlives the spin window and is resolved by the loop's resolver instead."""
    torch = _torch()
    t = _u8((64, 4096), 7)
    async with kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 64) as off:
        assert off._queues[("h2d", False)].spin_await
        for i in range(50):
            r = await off.store(gpu_blocks=[i], cpu_chunks=[i], path=path)
            assert r.success
        assert off._resources()["resolver_tasks"] == 0
        host = off.cpu_tensors[0]
        assert np.array_equal(host[:50], _np(t)[:50])
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # ~50 ms on the compute stream
        held = off.load(cpu_chunks=[3], gpu_blocks=[60], stream=side, path=path)
        assert (await held).success
        assert off._resources()["resolver_tasks"] == 1
        assert np.array_equal(_np(t)[60], host[3])


@pytest.mark.parametrize("path", PATHS)
def test_caller_may_reuse_its_id_arrays_once_store_returns(path: str) -> None:
    """The CUDA backend does not copy int64 id arrays (it packs them during the call): so
    overwriting them right after `store()` returns must not change what is copied."""
    t = _u8((4096, 256), 11)
    with kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 4096) as off:
        rng = np.random.default_rng(0)
        g = rng.permutation(4096)[:3000].astype(np.int64)  # large: the numpy path
        c = rng.permutation(4096)[:3000].astype(np.int64)
        want_g, want_c = g.copy(), c.copy()
        tr = off.store(gpu_blocks=g, cpu_chunks=c, path=path)
        g[:] = 0
        c[:] = np.arange(3000)
        tr.wait(60)
        assert np.array_equal(off.cpu_tensors[0][want_c], _np(t)[want_g])


@pytest.mark.asyncio
@pytest.mark.parametrize("lazy", [False, True])
async def test_both_completion_threads_resolve_awaits_and_waits_in_order(
        lazy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager thread (`LAZY_THREAD = False`, woken per transfer) and the lazy one both
    finish awaited and waited transfers, in submission order, with the bytes in place."""
    from kvasync._scheduler import DirectionQueue

    monkeypatch.setattr(DirectionQueue, "LAZY_THREAD", lazy)
    t = _u8((256, 4096), 13)
    with kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 256) as off:
        assert off._queues[("d2h", False)].lazy is lazy
        done: list[int] = []
        trs = [off.store(gpu_blocks=[i], cpu_chunks=[i]) for i in range(200)]
        for i, tr in enumerate(trs):
            tr.add_done_callback(lambda _t, i=i: done.append(i))
        # the newest first: once it is done, every older one must be (in-order completion)
        last = await trs[-1] if lazy else trs[-1].wait(30)
        assert last.success and all(tr.done() for tr in trs)
        results = [await tr if i % 2 else tr.wait(30) for i, tr in enumerate(trs)]
        assert all(r.success for r in results)
        # callbacks run just after the result is visible: give the last one time to run
        deadline = time.monotonic() + 10
        while len(done) < 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert done == list(range(200))  # callbacks run in completion order
        assert np.array_equal(off.cpu_tensors[0][:200], _np(t)[:200])


@pytest.mark.parametrize("path", PATHS)
def test_wait_polls_near_the_predicted_end_then_falls_back_to_the_thread(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`wait()` on the GPU polls the direction itself near the predicted end (no thread
    wake-up); a misprediction (the copy held behind a ~50 ms kernel) ends the polling after
    the grace and the completion thread finishes the transfer. Timeouts still hold."""
    from kvasync._scheduler import DirectionQueue

    monkeypatch.setattr(DirectionQueue, "LAZY_THREAD", True)  # the default, pinned here
    torch = _torch()
    t = _u8((64, 4096), 9)
    with kv.Offloader(kv.KVCacheLayout.from_tensors([t]), 64) as off:
        q = off._queues[("h2d", False)]
        calls = 0
        real_poll = q.poll

        def counting_poll() -> int:
            nonlocal calls
            calls += 1
            return real_poll()

        q.poll = counting_poll  # type: ignore[method-assign]
        off.store(gpu_blocks=[1], cpu_chunks=[1], path=path).wait(30)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
        held = off.load(cpu_chunks=[1], gpu_blocks=[40], stream=side, path=path)
        held._eta = 0.0  # "predicted to have ended already": poll for the grace, then sleep
        with pytest.raises(TimeoutError):
            held.wait(0.001)
        assert calls > 0 and not held.done()
        assert held.wait(30).success
        assert np.array_equal(_np(t)[40], off.cpu_tensors[0][1])
