"""The CUDA staged path: pack/unpack through the staging ring plus row DMA, on the GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvasync as kv

pytestmark = pytest.mark.gpu


def _torch() -> Any:
    import torch

    return torch


def _u8(shape: tuple[int, ...], seed: int) -> Any:
    host = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return _torch().from_numpy(host).cuda()


def _np(t: Any) -> np.ndarray:
    torch = _torch()
    torch.cuda.synchronize()
    return np.ascontiguousarray(t.cpu().numpy())


@pytest.mark.asyncio
async def test_partial_chunks_leave_neighbouring_sub_blocks_untouched() -> None:
    """A group starting mid-chunk and ending mid-chunk: the store writes only its covered
    sub-blocks of the host rows, the load only its GPU blocks."""
    bpc, page, blocks, chunks = 4, 4096, 32, 8
    gpu = [_u8((blocks, page), seed=i) for i in range(3)]
    layout = kv.KVCacheLayout.from_tensors(gpu)
    off = kv.Offloader(layout, chunks, bpc, backend="cuda", copy_path="staged")
    sentinel = [np.full(v.shape, 0xA5, np.uint8) for v in off.cpu_tensors]
    for v, s in zip(off.cpu_tensors, sentinel):
        v[:] = s
    # 5 blocks from logical index 2: chunk 3 gets sub-blocks 2, 3; chunk 5 gets 0..2
    ids = [9, 1, 30, 4, 17]
    r = await off.store(gpu_blocks=ids, cpu_chunks=[3, 5], block_indices=[2])
    assert r.success and off.backend.counts["staged"] == 1  # type: ignore[attr-defined]
    for t in range(3):
        host = off.cpu_tensors[t]
        src = _np(gpu[t])
        exp = sentinel[t].copy()
        exp[3, 2 * page : 4 * page] = src[ids[:2]].ravel()
        exp[5, : 3 * page] = src[ids[2:]].ravel()
        np.testing.assert_array_equal(host, exp, f"tensor {t}")
    # load two sub-blocks back into fresh blocks; every other GPU byte stays as it was
    before = [_np(g) for g in gpu]
    r = await off.load(cpu_chunks=[3], gpu_blocks=[0, 31], block_indices=[2])
    assert r.success
    for t in range(3):
        exp = before[t].copy()
        exp[[0, 31]] = before[t][ids[:2]]
        np.testing.assert_array_equal(_np(gpu[t]), exp, f"tensor {t}")
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("staging_mib", [1, 64])
async def test_many_slabs_round_trip_exactly_and_in_order(staging_mib: int) -> None:
    """A transfer bigger than the ring pipelines slab after slab through both buffers; a
    later store to the same chunks wins; loads after stores read what they wrote."""
    page, blocks, n_t = 16384, 512, 8
    gpu = [_u8((blocks, page), seed=10 + i) for i in range(n_t)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       copy_path="staged", staging_bytes=staging_mib << 20)
    assert off.staging_bytes == staging_mib << 20
    rng = np.random.default_rng(3)
    first, second = rng.permutation(blocks), rng.permutation(blocks)
    chunks = rng.permutation(blocks)
    off.store(gpu_blocks=first, cpu_chunks=chunks)
    await off.store(gpu_blocks=second, cpu_chunks=chunks)
    ref = [_np(g) for g in gpu]
    for t in range(n_t):
        np.testing.assert_array_equal(off.cpu_tensors[t][chunks], ref[t][second])
    for g in gpu:
        g.zero_()
    target = rng.permutation(blocks)
    await off.load(cpu_chunks=chunks, gpu_blocks=target)
    for t in range(n_t):
        np.testing.assert_array_equal(_np(gpu[t])[target], ref[t][second])
    await off.aclose()


@pytest.mark.asyncio
async def test_auto_stages_big_transfers_and_keeps_the_kernel_for_urgent_ones() -> None:
    page, blocks, n_t = 4096, 256, 16
    gpu = [_u8((blocks, page), seed=40 + i) for i in range(n_t)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda")
    be: Any = off.backend
    before = dict(be.counts)
    await off.store(gpu_blocks=list(range(64)), cpu_chunks=list(range(64)))  # 4 MiB: staged
    assert be.counts["staged"] - before["staged"] == 1
    await off.load(cpu_chunks=[0], gpu_blocks=[100], urgent=True)  # urgent: the kernel passes queued DMA
    assert be.counts["kernel"] - before["kernel"] == 1
    ref = _np(gpu[3])
    np.testing.assert_array_equal(ref[100], ref[0])
    # the layers of a layer-wise load are not staged under auto (per-transfer host cost)
    staged = be.counts["staged"]
    await off.load_layerwise(cpu_chunks=list(range(64)), gpu_blocks=list(range(128, 192)),
                             layers=[[i] for i in range(n_t)])
    assert be.counts["staged"] == staged
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("staging_kib", [0, 512])
async def test_layerwise_staged_loads_signal_each_layer(staging_kib: int) -> None:
    """Each layer stages only its tensors' part of the rows: with four 128 KiB buffers a
    whole 96 KiB row fits one per buffer, a layer's 16 KiB part eight (four slabs a layer)."""
    page, blocks, layers = 8192, 64, 6
    gpu = [_u8((blocks, page), seed=60 + i) for i in range(2 * layers)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       copy_path="staged", staging_bytes=(staging_kib << 10) or None)
    await off.store(gpu_blocks=list(range(32)), cpu_chunks=list(range(32)))
    ref = [_np(g) for g in gpu]
    for g in gpu:
        g.zero_()
    spec = [[2 * i, 2 * i + 1] for i in range(layers)]
    t = off.load_layerwise(cpu_chunks=list(range(32)), gpu_blocks=list(range(32, 64)),
                           layers=spec)
    for i in range(layers):
        r = await t.layers[i]
        assert r.success
        for k in spec[i]:
            np.testing.assert_array_equal(_np(gpu[k])[32:], ref[k][:32])
    await t
    await off.aclose()


def test_a_plan_moving_nothing_is_staged_whatever_the_row_size() -> None:
    """A row (768 KiB) wider than a staging buffer (512 KiB) refuses only plans that move
    bytes: empty groups and the empty layer of a layer-wise load complete on the device."""
    page, blocks = 384 << 10, 4
    gpu = [_u8((blocks, page), seed=90 + i) for i in range(2)]
    lay = kv.KVCacheLayout(gpu, [[kv.KVRef(0)], [kv.KVRef(1)]])
    with kv.Offloader(lay, blocks, backend="cuda", staging_bytes=2 << 20) as off:
        assert off.store(gpu_blocks=[], cpu_chunks=[], group_sizes=[0, 0],
                         path="staged").wait(30).bytes == 0
        assert off.store(gpu_blocks=[3], cpu_chunks=[2], group_sizes=[1, 0],
                         path="staged").wait(30).bytes == page
        with pytest.raises(kv.InvalidTransferError, match="staged"):
            off.store(gpu_blocks=[3, 1], cpu_chunks=[2, 1], group_sizes=[1, 1],
                      path="staged")
        want = _np(gpu[0])[3].copy()
        gpu[0][1].zero_()
        t = off.load_layerwise(cpu_chunks=[2], gpu_blocks=[1], group_sizes=[1, 0],
                               path="staged")
        assert t.wait(30).success and [x.wait(30).bytes for x in t.layers] == [page, 0]
        np.testing.assert_array_equal(_np(gpu[0])[1], want)
        assert off.backend.counts["staged"] >= 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("staging", [1 << 50, 1 << 70])
def test_staging_the_device_cannot_hold_refuses_staged_calls_only(staging: int) -> None:
    """The ring is allocated at the staged path's first use: a call that asks for it gets
    an InvalidTransferError with nothing enqueued, and "auto" copies without it."""
    gpu = [_u8((64, 4096), seed=95 + i) for i in range(4)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="cuda",
                       staging_bytes=staging)
    with pytest.raises(kv.InvalidTransferError, match="staging_bytes"):
        off.store(gpu_blocks=[0], cpu_chunks=[0], path="staged")
    assert off._resources()["inflight"] == 0
    assert off.store(gpu_blocks=list(range(64)), cpu_chunks=list(range(64))).wait(30).success
    np.testing.assert_array_equal(off.cpu_tensors[2], _np(gpu[2]))
    off.close()


def test_unstageable_plans_are_refused_before_anything_is_enqueued() -> None:
    """A row larger than one staging buffer: explicit 'staged' raises, 'auto' falls back."""
    page, blocks = 1 << 20, 4
    gpu = [_u8((blocks, page), seed=80 + i) for i in range(4)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       staging_bytes=2 << 20)
    with pytest.raises(kv.InvalidTransferError, match="staged"):
        off.store(gpu_blocks=[0], cpu_chunks=[0], path="staged")
    assert off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1]).wait(30).success
    assert off.backend.counts["staged"] == 0  # type: ignore[attr-defined]
    off.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("staging_mib", [4, 64])
async def test_queued_transfers_overlap_yet_land_in_submission_order(staging_mib: int) -> None:
    """Transfers queued back to back, staged ones overlapping their predecessor (a staged
    store packs ahead, a staged load stages rows ahead): every later write to the same
    chunk or block wins, whatever path came before, and each completes in order with its
    own device time."""
    page, blocks, n_t = 16384, 256, 8
    gpu = [_u8((blocks, page), seed=40 + i) for i in range(n_t)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       copy_path="staged", staging_bytes=staging_mib << 20)
    be: Any = off.backend
    asked: list[tuple[str, str, bool]] = []
    may = be.may_overlap

    def spy(path: str, direction: str, previous: str) -> bool:
        ok: bool = may(path, direction, previous)
        asked.append((path, previous, ok))
        return ok

    be.may_overlap = spy
    torch = _torch()
    compute = torch.cuda.Stream()  # busy ~tens of ms: every transfer is queued behind it
    rng = np.random.default_rng(5)
    chunks = rng.permutation(blocks)[:128]
    srcs = [rng.permutation(blocks)[:128] for _ in range(6)]
    paths = ["staged", "staged", "dma", "staged", "kernel", "staged"]
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)
    stores = [off.store(gpu_blocks=s, cpu_chunks=chunks, path=p, stream=compute)
              for s, p in zip(srcs, paths)]
    results = [await t for t in stores]
    assert [r.job_id for r in results] == sorted(r.job_id for r in results)
    assert all(r.success and r.seconds > 0 for r in results)
    ref = [_np(g) for g in gpu]
    for t in range(n_t):  # the last store of each chunk wins
        np.testing.assert_array_equal(off.cpu_tensors[t][chunks], ref[t][srcs[-1]])
    assert asked == [(p, prev, p == prev == "staged") for p, prev in zip(paths[1:], paths)]
    # loads: six loads into the same blocks from different chunks; the last one wins
    dst = rng.permutation(blocks)[:128]
    sets = [rng.permutation(blocks)[:128] for _ in range(6)]
    lpaths = ["dma", "staged", "staged", "kernel", "staged", "staged"]
    asked.clear()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)
    loads = [off.load(cpu_chunks=c, gpu_blocks=dst, path=p, stream=compute)
             for c, p in zip(sets, lpaths)]
    assert asked == [(p, prev, p == "staged") for p, prev in zip(lpaths[1:], lpaths)]
    lres = [await t for t in loads]
    assert all(r.success and r.seconds > 0 for r in lres)
    for t in range(n_t):
        np.testing.assert_array_equal(_np(gpu[t])[dst], off.cpu_tensors[t][sets[-1]])
    await off.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("staging_mib", [4, 64])
async def test_split_loads_land_in_order_beside_urgent_and_layerwise_loads(
        staging_mib: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Big staged loads whose later pieces the launcher enqueues (`_split_at`), queued
    behind a busy compute stream, one overlapping the other; an urgent load through the
    same staging ring in between; a layer-wise load behind them. The last writer of each
    block wins, the urgent load lands its own blocks, every layer's signal holds a stream."""
    import threading

    from kvasync._lane_launch import LaneLaunch

    for name, value in (("STAGED_WHOLE_BYTES", 1 << 20), ("FIRST_PIECE_BYTES", 256 << 10),
                        ("KERNEL_PIECE_BYTES", 2 << 20)):
        monkeypatch.setattr(LaneLaunch, name, value)
    page, blocks, n_t = 16384, 256, 8
    gpu = [_u8((blocks, page), seed=60 + i) for i in range(n_t)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       copy_path="staged", staging_bytes=staging_mib << 20)
    be: Any = off.backend
    calls: list[tuple[str, tuple[bool, bool]]] = []
    real = be.enqueue_pieces

    def spy(*args: Any, edges: tuple[bool, bool] = (True, True), **kw: Any) -> None:
        calls.append((threading.current_thread().name, edges))
        real(*args, edges=edges, **kw)

    be.enqueue_pieces = spy
    rng = np.random.default_rng(9)
    for view in off.cpu_tensors:
        view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    torch = _torch()
    compute = torch.cuda.Stream()
    dst = rng.permutation(blocks)[:160]
    urgent_dst = np.setdiff1d(np.arange(blocks), dst)[:16]
    sets = [rng.permutation(blocks)[:160] for _ in range(2)]
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)
    loads = [off.load(cpu_chunks=c, gpu_blocks=dst, stream=compute) for c in sets]
    urgent = off.load(cpu_chunks=sets[0][:16], gpu_blocks=urgent_dst, urgent=True)
    layered = off.load_layerwise(cpu_chunks=sets[0][:8], gpu_blocks=dst[:8], stream=compute,
                                 layers=[[0, 1, 2, 3], [4, 5, 6, 7]])
    after = torch.empty(8 * page, dtype=torch.uint8, device="cuda")
    layered.wait_layer(1, compute)  # on the device: the copy below sees layer 1's bytes
    with torch.cuda.stream(compute):
        after.copy_(gpu[7][torch.as_tensor(dst[:8], device="cuda")].reshape(-1))
    results = [await t for t in loads]
    assert all(r.success and r.seconds > 0 for r in results)
    assert (await urgent).success and (await layered).success
    # the first load's head on this thread (the second overlaps it: `enqueue_overlapped`,
    # or waits whole for the launcher), every rest on the launcher
    heads = [n for n, edges in calls if edges == (True, False)]
    rests = [n for n, edges in calls if edges == (False, True)]
    assert heads and all(n == threading.current_thread().name for n in heads)
    assert rests and all(n.endswith("-launcher") for n in rests)
    want = [v.reshape(blocks, page) for v in off.cpu_tensors]
    for t in range(n_t):
        got = _np(gpu[t])
        np.testing.assert_array_equal(got[dst[:8]], want[t][sets[0][:8]])  # layer-wise last
        np.testing.assert_array_equal(got[dst[8:]], want[t][sets[1][8:]])  # then load 2
        np.testing.assert_array_equal(got[urgent_dst], want[t][sets[0][:16]])
    np.testing.assert_array_equal(_np(after).reshape(8, page), want[7][sets[0][:8]])
    await off.aclose()


@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_row_copy_failing_mid_transfer_ends_after_its_queued_copies(
        direction: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged transfer whose second slab's row copy call fails: its first slab's row
    copy is queued on the ring's helper stream (held here by a 0.1 s kernel). The failed
    transfer must not end before that copy (its memory could go under it), and the ring's
    next user, the urgent lane, then moves exactly its own bytes."""
    from kvasync._backends._cuda_staged import StagedPath

    torch = _torch()
    page, blocks, n_t = 65536, 32, 4  # a row: 256 KiB; a 1 MiB buffer: 4 rows
    gpu = [_u8((blocks, page), seed=70 + i) for i in range(n_t)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend="cuda",
                       copy_path="staged", staging_bytes=4 << 20)
    assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(30).success  # the rings exist
    assert off.load(cpu_chunks=[0], gpu_blocks=[1]).wait(30).success
    ring = off.backend._staged.rings["d2h" if direction == "store" else "h2d"]  # type: ignore[attr-defined]
    real, calls = StagedPath._dma, []

    def failing(self: StagedPath, *args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise kv.TransferFailedError("injected row copy failure")
        real(self, *args)

    monkeypatch.setattr(StagedPath, "_dma", failing)
    helper = torch.cuda.ExternalStream(ring.helper.ptr)
    with torch.cuda.stream(helper):
        torch.cuda._sleep(200_000_000)  # ~0.1 s on the helper: the row copies wait
    ids = list(range(8, 16))  # 2 MiB: two slabs
    call = off.store if direction == "store" else off.load
    t = call(gpu_blocks=ids, cpu_chunks=ids)
    with pytest.raises(kv.TransferFailedError):
        t.wait(30)
    assert helper.query(), "the failed transfer ended before its queued row copies"
    monkeypatch.setattr(StagedPath, "_dma", real)
    want = [_np(g)[16:32] for g in gpu]
    urgent = off.store(gpu_blocks=list(range(16, 32)), cpu_chunks=list(range(16, 32)),
                       urgent=True, path="staged")  # four slabs: through every buffer
    assert urgent.wait(30).success
    for i in range(n_t):
        np.testing.assert_array_equal(off.cpu_tensors[i][16:32], want[i])
    off.close(timeout=30)
