"""Caller-owned host tensors as the offloader's host copy: bytes round-trip through them,
bad arrays are refused before anything is built, and their memory stays the caller's."""

from __future__ import annotations

import numpy as np
import pytest

import kvasync as kv

PAGE = 128
BLOCKS = 16


ARRAYS: dict[int, list[np.ndarray]] = {}


def layout(n: int = 2) -> kv.KVCacheLayout:
    arrays = [np.random.default_rng(i).integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)
              for i in range(n)]
    lay = kv.KVCacheLayout.from_tensors(arrays)
    ARRAYS[id(lay)] = arrays
    return lay


def arrays(lay: kv.KVCacheLayout) -> list[np.ndarray]:
    return ARRAYS[id(lay)]


def host(chunks: int = 4, bpc: int = 2, n: int = 2) -> list[np.ndarray]:
    return [np.zeros((chunks, bpc * PAGE), dtype=np.uint8) for _ in range(n)]


@pytest.mark.timeout(60)
def test_round_trip_through_the_callers_arrays() -> None:
    lay, h = layout(), host()
    before = [t.copy() for t in arrays(lay)]
    with kv.Offloader(lay, blocks_per_chunk=2, backend="host", host_tensors=h) as off:
        assert off.num_cpu_chunks == 4
        off.store(gpu_blocks=[3, 4, 9], cpu_chunks=[1, 3]).wait()
        for t, x in zip(before, h):  # chunk 1 holds blocks 3, 4; chunk 3 block 9 first
            np.testing.assert_array_equal(x[1].reshape(2, PAGE), t[[3, 4]])
            np.testing.assert_array_equal(x[3, :PAGE], t[9])
            assert not x[0].any()
        for t in arrays(lay):
            t[:] = 0
        off.load(cpu_chunks=[1, 3], gpu_blocks=[0, 1, 2]).wait()
        for t, b in zip(arrays(lay), before):
            np.testing.assert_array_equal(t[[0, 1, 2]], b[[3, 4, 9]])
    # the memory is still the caller's, whole and usable
    h[0][:] = 7
    assert int(h[0].sum()) == 7 * h[0].size


@pytest.mark.timeout(60)
def test_other_dtypes_and_torch() -> None:
    torch = pytest.importorskip("torch")
    lay = layout()
    h = [torch.zeros((3, PAGE // 4), dtype=torch.int32), np.zeros((3, PAGE // 8), np.float64)]
    with kv.Offloader(lay, backend="host", host_tensors=h) as off:
        off.store(gpu_blocks=[5], cpu_chunks=[2]).wait()
    assert h[0][2].numpy().view(np.uint8).tobytes() == arrays(lay)[0][5].tobytes()
    assert h[1][2].view(np.uint8).tobytes() == arrays(lay)[1][5].tobytes()


def test_num_cpu_chunks_uses_the_first_rows() -> None:
    h = host(chunks=6, bpc=1)
    with kv.Offloader(layout(), 2, backend="host", host_tensors=h) as off:
        assert off.num_cpu_chunks == 2 and off.cpu_tensors[0].shape == (2, PAGE)
        with pytest.raises(kv.InvalidTransferError):
            off.store(gpu_blocks=[0], cpu_chunks=[2])


def test_staged_is_not_offered() -> None:
    with kv.Offloader(layout(), backend="host", host_tensors=host(bpc=1)) as off:
        off.store(gpu_blocks=[0], cpu_chunks=[0]).wait()
        ran = {p for lane in off.stats().lanes for p in lane.paths}
        assert ran and "staged" not in ran  # auto picked a path that needs no rows


def refused(match: str, **kw: object) -> None:
    kw.setdefault("backend", "host")
    with pytest.raises(kv.InvalidTransferError, match=match):
        kv.Offloader(layout(), **kw)  # type: ignore[arg-type]


def test_refusals() -> None:
    ro = host(bpc=1)
    ro[1].flags.writeable = False
    refused("read-only", host_tensors=ro)
    refused("rows of 64 B", host_tensors=[np.zeros((4, 64), np.uint8)] * 2)
    refused("has 2 rows, need num_cpu_chunks=4", num_cpu_chunks=4, host_tensors=host(2, 1))
    refused("different row counts", host_tensors=[np.zeros((4, PAGE), np.uint8),
                                                  np.zeros((3, PAGE), np.uint8)])
    refused("list of 2 arrays", host_tensors=host(bpc=1, n=1))
    refused("neither host_region nor cpu_bytes", cpu_bytes=1 << 20, host_tensors=host(bpc=1))
    strided = np.zeros((4, 2 * PAGE), np.uint8)[:, ::2]
    refused("not contiguous", host_tensors=[strided, np.zeros((4, PAGE), np.uint8)])
    buf = np.zeros((4, 2 * PAGE), np.uint8)
    refused("share memory", host_tensors=[buf[:, :PAGE + 1][:, 1:], buf[:, :PAGE]])
    lay = layout()
    kv_rows = arrays(lay)[0].reshape(4, -1)
    with pytest.raises(kv.InvalidTransferError, match="KV tensor 0 and host_tensors"):
        kv.Offloader(lay, 4, backend="host",
                     host_tensors=[np.zeros((4, PAGE), np.uint8), kv_rows[:, :PAGE]])
    refused("NumPy array or a CPU torch tensor", host_tensors=[[[0] * PAGE] * 4] * 2)
    # a refused call leaves the caller's arrays as they were
    assert not any(x.any() for x in ro)


def test_wrong_device() -> None:
    torch = pytest.importorskip("torch")
    meta = [torch.zeros((4, PAGE), dtype=torch.uint8, device="meta")] * 2
    refused("torch device meta", host_tensors=meta)


def test_staged_is_refused_with_host_tensors_at_construction() -> None:
    gpu = [np.zeros((8, 64), np.uint8) for _ in range(2)]
    host = [np.zeros((4, 64), np.uint8) for _ in range(2)]
    with pytest.raises(kv.InvalidTransferError, match="staged"):
        kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), host_tensors=host, copy_path="staged")
