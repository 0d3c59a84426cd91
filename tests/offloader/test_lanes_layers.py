"""Urgent lanes (a small transfer is not stuck behind a big one) and layer-wise loads."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from support import Mem

import kvasync as kv
from kvasync._backends._host import HostStream


@pytest.mark.asyncio
async def test_urgent_transfer_passes_a_held_normal_one() -> None:
    gpu = [np.random.default_rng(0).integers(0, 256, (32, 512), dtype=np.uint8)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 32, backend="host")
    gate = threading.Event()
    compute = HostStream(name="held")
    compute.enqueue(gate.wait)
    big = off.load(cpu_chunks=[0, 1, 2, 3], gpu_blocks=[0, 1, 2, 3], stream=compute)  # held behind 'compute'
    normal = off.load(cpu_chunks=[4], gpu_blocks=[4])  # FIFO: waits for `big`
    urgent = off.load(cpu_chunks=[5], gpu_blocks=[5], urgent=True)
    r = await asyncio.wait_for(urgent, 5)
    assert r.success and not big.done() and not normal.done()
    gate.set()
    await normal
    assert big.done()
    np.testing.assert_array_equal(gpu[0][5], off.cpu_tensors[0][5])
    compute.close()
    await off.aclose()


@pytest.mark.asyncio
async def test_layerwise_load_signals_each_layer(
    backend_case: tuple[str, str], mem: Mem
) -> None:
    backend, path = backend_case
    layers = 4
    gpu = [mem.rand_u8((16, 256), seed=i) for i in range(2 * layers)]  # K and V per layer
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 16, backend=backend, copy_path=path)
    for i, c in enumerate(off.cpu_tensors):
        c[:] = np.random.default_rng(40 + i).integers(0, 256, c.shape, dtype=np.uint8)
    spec = [[2 * i, 2 * i + 1] for i in range(layers)]
    t = off.load_layerwise(cpu_chunks=[3, 4, 5], gpu_blocks=[7, 8, 9], layers=spec)
    assert len(t) == layers
    done_order: list[int] = []
    for i, layer in enumerate(t.layers):
        layer.add_done_callback(lambda _tr, i=i: done_order.append(i))
    first = await t.layers[0]
    assert first.bytes == 3 * 2 * 256
    t.wait_layer(layers - 1)  # a compute-stream wait on the last layer's event
    total = await t
    await asyncio.sleep(0)  # callbacks added in a loop run on it: let the last ones run
    assert total.bytes == 3 * 2 * 256 * layers and total.success
    assert done_order == list(range(layers))
    for i in range(2 * layers):
        np.testing.assert_array_equal(mem.to_numpy(gpu[i])[[7, 8, 9]], off.cpu_tensors[i][[3, 4, 5]])
    await off.aclose()


def test_layerwise_rejects_bad_layer_specs() -> None:
    gpu = [np.zeros((4, 8), np.uint8) for _ in range(3)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 4, backend="host")
    for bad in ([[0, 1]], [[0, 1], [1, 2]], [[0], [], [1, 2]], [[0, 1, 2, 3]],
                [[0], [1.0, 2]], [[True], [1, 2]], [["0"], [1, 2]], [[0], 1]):
        with pytest.raises(kv.InvalidTransferError, match="partition"):
            off.load_layerwise(cpu_chunks=[0], gpu_blocks=[0], layers=bad)
    assert off.load_layerwise(cpu_chunks=[0], gpu_blocks=[1]).wait(5).bytes == 3 * 8
    # NumPy integers and arrays are indices as ints are (a spec read from a config)
    t = off.load_layerwise(cpu_chunks=[0], gpu_blocks=[2],
                           layers=[np.array([2]), [np.int64(0), np.uint8(1)]])
    assert t.wait(5).bytes == 3 * 8 and [x.wait(5).bytes for x in t.layers] == [8, 16]
    off.close()


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 8 then 16 slots of 256 KiB, so a 64-block transfer is cut into five."""
    from kvasync._scheduler import DirectionQueue

    for name, value in (("PIECE_BYTES", 4 << 20), ("KERNEL_PIECE_BYTES", 4 << 20),
                        ("FIRST_PIECE_BYTES", 2 << 20),
                        ("STAGED_FIRST_PIECE_BYTES", 2 << 20), ("STAGED_GROWTH", 4),
                        ("MIN_PIECE_SLOTS", 1),
                        ("MIN_FIRST_SLOTS", 1), ("STAGED_WHOLE_BYTES", 2 << 20)):
        monkeypatch.setattr(DirectionQueue, name, value)


@pytest.mark.asyncio
@pytest.mark.parametrize("join_every", [0, 2])
async def test_pieced_transfers_keep_call_order_and_wait_for_compute(
    backend_case: tuple[str, str], mem: Mem, small_pieces: None, join_every: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Big transfers go piece by piece (on CUDA's DMA path, whole pieces round-robin over
    the helper streams, joined once or every `join_every` pieces): a second store into the
    same chunks still wins, and a load lands after the compute stream's earlier writes."""
    backend, path = backend_case
    page, blocks = 256 * 1024, 64
    gpu = [mem.rand_u8((blocks, page), seed=3)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), blocks, backend=backend,
                       copy_path=path)
    be = off.backend
    monkeypatch.setattr(type(be), "FAN_JOIN_PIECES", join_every, raising=False)
    # staged pieces go through 2 MiB staging buffers, several slabs per piece; auto on CUDA
    # sends these 256 KiB pages to DMA (pieced like the rest)
    be.staging_bytes = 8 << 20  # type: ignore[attr-defined]
    per_call = [5]
    calls: list[int] = []

    def spy(name: str) -> None:
        # a staged transfer whose predecessor's stream is still busy is enqueued through
        # enqueue_overlapped (`Backend.may_overlap`): both count
        real = getattr(be, name)

        def call(stream: object, pieces: list[object], *a: object, **kw: object) -> None:
            calls.append(len(pieces))
            real(stream, pieces, *a, **kw)

        monkeypatch.setattr(be, name, call)

    spy("enqueue_pieces")
    if hasattr(be, "enqueue_overlapped"):
        spy("enqueue_overlapped")
    rng = np.random.default_rng(9)
    first, second = rng.permutation(blocks).tolist(), rng.permutation(blocks).tolist()
    chunks = rng.permutation(blocks).tolist()
    counts = dict(getattr(be, "counts", {}))
    off.store(gpu_blocks=first, cpu_chunks=chunks)
    await off.store(gpu_blocks=second, cpu_chunks=chunks)  # same chunks, called later: must win
    assert calls == per_call * 2
    expect = mem.to_numpy(gpu[0])[second]
    for i, c in enumerate(chunks):
        np.testing.assert_array_equal(off.cpu_tensors[0][c], expect[i])
    if backend == "cuda" and path == "dma" and getattr(be, "batch_available", False):
        assert be.counts["dma_fanned"] - counts["dma_fanned"] == 10  # every piece fanned
    if backend == "cuda":
        import torch

        torch.cuda._sleep(50_000_000)  # a long kernel, then zeroing, on the compute stream
        gpu[0][first] = 0
        await off.load(cpu_chunks=chunks, gpu_blocks=first)
        torch.cuda.synchronize()
    else:
        await off.load(cpu_chunks=chunks, gpu_blocks=first)
    # a staged load's first pieces are enqueued by its caller, the rest by the launcher
    assert calls[:2] == per_call * 2 and sum(calls[2:]) == per_call[0]
    assert len(calls) == (4 if path == "staged" else 3)
    np.testing.assert_array_equal(mem.to_numpy(gpu[0])[first], expect)
    await off.aclose()


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_urgent_auto_load_takes_the_kernel_and_passes_queued_batch_dma() -> None:
    """Under "auto" an urgent load runs on the kernel path: the copy engines would queue
    it behind the big load's batched DMA (helper streams), the SMs do not."""
    import torch

    page, n = 256 * 1024, 2048  # 512 MiB behind
    gpu = torch.zeros((n + 1, page), dtype=torch.uint8, device="cuda")
    with kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), n + 1) as off:
        host = off.cpu_tensors[0]
        host[:] = np.random.default_rng(8).integers(0, 256, host.shape, dtype=np.uint8)
        be = off.backend
        kernels, fanned = be.counts["kernel"], be.counts["dma_fanned"]  # type: ignore[attr-defined]
        rng = np.random.default_rng(2)
        g, c = rng.permutation(n), rng.permutation(n)
        big = off.load(cpu_chunks=c, gpu_blocks=g, path="dma")
        urgent = off.load(cpu_chunks=[n], gpu_blocks=[n], urgent=True)
        await urgent
        assert not big.done()  # it passed 512 MiB (~11 ms of link) still in flight
        assert be.counts["kernel"] == kernels + 1  # type: ignore[attr-defined]
        await big
        assert be.counts["dma_fanned"] > fanned  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert np.array_equal(gpu[n].cpu().numpy(), host[n])
        for k in (0, n // 2, n - 1):
            assert np.array_equal(gpu[int(g[k])].cpu().numpy(), host[int(c[k])])
        # an explicit path is kept
        off.load(cpu_chunks=[n], gpu_blocks=[n], urgent=True, path="dma").wait(10)
        assert be.counts["kernel"] == kernels + 1  # type: ignore[attr-defined]
    del gpu
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("page", [4096, 256 * 1024])
def test_auto_sends_big_pages_to_dma_while_the_other_direction_is_busy(
    page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store and a load at once share the link: big descriptors go to the copy engines
    (kernel copies both ways at once lost a fifth of the link on the H200); 4 KiB pages
    stay with the calibrated choice (DMA of 4 KiB pages is driver-bound). The rule is
    checked with the staged path out of auto's way (it takes stageable transfers >= 2 MiB
    before this rule)."""
    import torch

    from kvasync._backends._cuda import CudaBackend

    monkeypatch.setattr(CudaBackend, "STAGED_MIN_BYTES", 0)

    n = (64 << 20) // page
    gpu = torch.randint(0, 256, (2 * n, page), dtype=torch.uint8, device="cuda")
    with kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 2 * n) as off:
        be = off.backend
        off.store(gpu_blocks=list(range(n)), cpu_chunks=list(range(n))).wait(30)  # calibrates "auto"
        # the calibrated choice is the kernel everywhere, so only the rule can pick DMA
        monkeypatch.setattr(be.calibration(), "choose", lambda *a: "kernel")  # type: ignore[attr-defined]
        torch.cuda._sleep(100_000_000)  # holds both transfers behind the compute stream
        store = off.store(gpu_blocks=list(range(n)), cpu_chunks=list(range(n)))
        before = dict(be.counts)  # type: ignore[attr-defined]
        load = off.load(cpu_chunks=list(range(n)), gpu_blocks=list(range(n, 2 * n)))  # only the load counts now
        assert not store.done()
        counts = be.counts  # type: ignore[attr-defined]
        went = {p for p in ("dma", "kernel") if counts[p] > before[p]}
        assert went == ({"dma"} if page >= be.CONTENDED_DMA_BYTES  # type: ignore[attr-defined]
                        else {"kernel"})  # 4 KiB: the calibrated choice
        load.wait(30)
        store.wait(30)
        torch.cuda.synchronize()
        assert torch.equal(gpu[n:], gpu[:n])
    del gpu
    torch.cuda.empty_cache()


def test_both_ways_is_remembered_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that submits a store, then a load, then waits for both finds the load side
    idle at every store: the sighting of both busy (at the load) is remembered."""
    gpu = [np.zeros((8, 256), dtype=np.uint8)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host") as off:
        gate = threading.Event()
        compute = HostStream(name="held")
        compute.enqueue(gate.wait)
        def busy(direction: str) -> bool:
            return off._lanes.both_ways(direction, off.BOTH_WAYS_MEMORY)

        assert not busy("d2h")  # nothing seen yet
        store = off.store(gpu_blocks=[0], cpu_chunks=[0], stream=compute)
        assert busy("h2d")  # the store is in flight
        gate.set()
        store.wait(10)
        assert busy("d2h")  # nothing in flight now, but seen just before
        monkeypatch.setattr(off, "BOTH_WAYS_MEMORY", 0.0)
        assert not busy("d2h")
        compute.close()


def test_a_refused_layerwise_load_uses_no_job_id() -> None:
    gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8) as off:
        assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10).job_id == 0
        for bad in ({"stream": object()}, {"job_id": "7"}):
            with pytest.raises(kv.InvalidTransferError):
                off.load_layerwise(cpu_chunks=[0], gpu_blocks=[1], **bad)  # type: ignore[arg-type]
        assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10).job_id == 1


def test_a_close_between_layers_fails_the_rest_and_returns_the_layers_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """close() on another thread landing between two layers of a layer-wise load: the
    layers already enqueued write into the GPU blocks, so the call returns them (the caller
    can wait before reusing the blocks) and the later layers fail as closed; it used to
    raise OffloaderClosedError with no handle to what was copying."""
    from kvasync._submitter import Submitter

    gpu = [np.zeros((8, 64), np.uint8) for _ in range(4)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host")
    for v in off.cpu_tensors:
        v[:] = 7
    real = Submitter.enqueue
    calls: list[int] = []

    def enqueue(self: Submitter, *args: object, **kw: object) -> kv.Transfer:
        if len(calls) == 2:
            off._life.begin()  # what close() does first, from another thread
        calls.append(1)
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Submitter, "enqueue", enqueue)
    lt = off.load_layerwise(cpu_chunks=[0], gpu_blocks=[3])
    assert [x.wait(10).success for x in lt.layers[:2]] == [True, True]
    for x in lt.layers[2:]:
        with pytest.raises(kv.TransferFailedError, match="closed") as info:
            x.wait(10)
        assert isinstance(info.value.__cause__, kv.OffloaderClosedError)
    with pytest.raises(kv.TransferFailedError):
        lt.wait(10)
    assert [int(g[3, 0]) for g in gpu] == [7, 7, 0, 0]
    seen: list[bool] = []  # the whole is done once its last enqueued layer is
    lt.add_done_callback(lambda t: seen.append(t.done()))
    assert seen == [True]
    off.close(timeout=10)
    with pytest.raises(kv.OffloaderClosedError):  # closed before any layer: refused whole
        off.load_layerwise(cpu_chunks=[0], gpu_blocks=[3])


def test_a_layered_callback_waits_for_the_layers_in_flight_when_later_ones_were_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The later layers, refused by a close between layers, are done from the start; a
    done-callback of the whole used to hang on the last of them and run at once, while
    the first layer was still copying (its result() then raised 'not done yet')."""
    from kvasync._submitter import Submitter

    gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 8, backend="host")
    gate = HostStream(name="held")
    held = threading.Event()
    gate.enqueue(held.wait)
    real = Submitter.enqueue

    def enqueue(self: Submitter, *args: object, **kw: object) -> kv.Transfer:
        t = real(self, *args, **kw)  # type: ignore[arg-type]
        off._life.begin()  # close() lands right after the first layer
        return t

    monkeypatch.setattr(Submitter, "enqueue", enqueue)
    lt = off.load_layerwise(cpu_chunks=[1], gpu_blocks=[1], stream=gate)
    monkeypatch.setattr(Submitter, "enqueue", real)
    seen: list[bool] = []
    lt.add_done_callback(lambda t: seen.append(t.done()))
    assert seen == [] and not lt.layers[0].done() and lt.layers[1].done()
    held.set()
    lt.layers[0].wait(10)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [True]
    gate.close()
    off.close(timeout=10)
