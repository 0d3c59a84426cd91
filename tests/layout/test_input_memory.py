"""Freed, moved, read-only and aliased memory: refused before anything is enqueued, never
copied into, never kept from a copy in flight.

Cases that crashed the process (a copy into freed torch storage) run in a subprocess, so a
regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import kvasync as kv
from kvasync._memory import rows_overlap

ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter (kvasync importable); a crash shows as rc < 0."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


# -- torch storage freed or moved after the layout was built ----------------------------------
MATRIX = r"""
import gc, json, numpy as np, torch, kvasync as kv
from kvasync.compat import vllm

MUTATIONS = {
    "storage resize_(0)": lambda x: x.untyped_storage().resize_(0),
    "storage resize_ smaller": lambda x: x.untyped_storage().resize_(x.untyped_storage().nbytes() // 2),
    "set_ to another tensor": lambda x: x.set_(torch.zeros(1, dtype=torch.uint8)),
    ".data = another tensor": lambda x: setattr(x, "data", torch.zeros(8, dtype=torch.uint8)),
    "share_memory_()": lambda x: x.share_memory_(),
    "tensor resize_ larger": lambda x: x.resize_(32, 1 << 20),
}
CALLS = {
    "store": lambda o, w: o.store(gpu_blocks=list(range(16)), cpu_chunks=list(range(16))),
    "load": lambda o, w: o.load(cpu_chunks=list(range(16)), gpu_blocks=list(range(16))),
    "load_layerwise": lambda o, w: o.load_layerwise(cpu_chunks=list(range(16)), gpu_blocks=list(range(16))),
    "vllm submit_store": lambda o, w: w.submit_store(
        7, vllm.GPULoadStoreSpec(list(range(16))), vllm.CPULoadStoreSpec(list(range(16)))),
    "vllm submit_load": lambda o, w: w.submit_load(
        7, vllm.CPULoadStoreSpec(list(range(16))), vllm.GPULoadStoreSpec(list(range(16)))),
}
out = {}
for mname, mutate in MUTATIONS.items():
    for cname, call in CALLS.items():
        # 16 blocks of 1 MiB: freed memory is unmapped, so a stray copy faults
        xs = [torch.randint(0, 256, (16, 1 << 20), dtype=torch.uint8) for _ in range(2)]
        w = vllm.CPUOffloadingWorker(kv.KVCacheLayout.from_tensors(xs), 1, 16,
                                     backend="host")
        o = w.offloader
        for c in o.cpu_tensors:
            c[:] = 7
        other = o.cpu_tensors[1].copy()
        mutate(xs[0])
        gc.collect()
        try:
            call(o, w)
            res = "accepted"
        except kv.InvalidTransferError as exc:
            res = "InvalidTransferError: " + str(exc)
        except Exception as exc:
            res = f"{type(exc).__name__}: {exc}"
        o.drain_sync(10)
        res_inflight = o._resources()["inflight"]
        host_same = bool((o.cpu_tensors[0] == 7).all() and (o.cpu_tensors[1] == other).all())
        out[f"{mname} / {cname}"] = [res, res_inflight, host_same]
        w.shutdown()
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_every_submit_refuses_freed_or_moved_torch_memory() -> None:
    """Every submit path (store, load, load_layerwise, the vLLM facade) x every way a torch
    tensor gives up its memory: InvalidTransferError naming the tensor, nothing enqueued,
    no host byte written, no crash (this segfaulted: the copy went into freed memory)."""
    pytest.importorskip("torch")
    out = run_child(MATRIX, timeout=280)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == 30
    for case, (res, inflight, host_same) in results.items():
        assert res.startswith("InvalidTransferError: KV tensor 0"), (case, res)
        assert "nothing was enqueued" in res and "new KVCacheLayout" in res, (case, res)
        assert inflight == 0, case
        assert host_same, case


def test_error_says_freed_or_moved() -> None:
    torch = pytest.importorskip("torch")
    x = torch.zeros((4, 64), dtype=torch.uint8)
    y = torch.zeros((4, 64), dtype=torch.uint8)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([y, x]), 4, backend="host")
    x.untyped_storage().resize_(0)
    with pytest.raises(kv.InvalidTransferError, match=r"KV tensor 1: its storage was freed"):
        off.store(gpu_blocks=[0], cpu_chunks=[0])
    off.close()
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([y]), 4, backend="host")
    y.set_(torch.zeros(256, dtype=torch.uint8))
    with pytest.raises(kv.InvalidTransferError, match=r"KV tensor 0 moved: data_ptr\(\)"):
        off.load(cpu_chunks=[0], gpu_blocks=[0])
    off.close()


def test_offloader_over_a_layout_whose_memory_is_gone_is_refused() -> None:
    """The layout was built, then its tensor freed: building the Offloader (or the vLLM
    worker) raises, nothing is registered or allocated against the stale pointer."""
    torch = pytest.importorskip("torch")
    from kvasync.compat import vllm

    x = torch.zeros((4, 64), dtype=torch.uint8)
    layout = kv.KVCacheLayout.from_tensors([x])
    x.untyped_storage().resize_(0)
    with pytest.raises(kv.InvalidTransferError, match="storage was freed"):
        kv.Offloader(layout, 4, backend="host")
    with pytest.raises(kv.InvalidTransferError, match="storage was freed"):
        vllm.CPUOffloadingWorker(layout, 1, 4, backend="host")


def test_a_fixed_size_storage_that_moves_is_refused() -> None:
    """A storage torch cannot resize (from NumPy) needs no size check, but it can still move
    (share_memory_): the pointer check catches that."""
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.zeros((4, 64), np.uint8))
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([x]), 4, backend="host")
    assert off.layout._guard._storages == []
    x.share_memory_()
    with pytest.raises(kv.InvalidTransferError, match="KV tensor 0 moved"):
        off.store(gpu_blocks=[0], cpu_chunks=[0])
    off.close()


def test_in_place_writes_keep_the_memory() -> None:
    """Writing a tensor in place (what attention does) keeps its memory: transfers go on."""
    torch = pytest.importorskip("torch")
    x = torch.arange(256, dtype=torch.int32).reshape(4, 64)
    with kv.Offloader(kv.KVCacheLayout.from_tensors([x]), 4, backend="host") as off:
        x.add_(1)
        x[2].zero_()
        x.index_copy_(0, torch.tensor([3]), x[1:2].clone())
        assert off.store(gpu_blocks=[1, 2, 3], cpu_chunks=[0, 1, 2]).wait(5).success
        for c, b in zip((0, 1, 2), (1, 2, 3)):
            assert (off.cpu_tensors[0][c].view(np.int32) == x[b].numpy()).all()


KEEPALIVE = r"""
import gc, threading, torch, kvasync as kv
from kvasync._backends._host import HostStream
gate = threading.Event()
compute = HostStream(name="gate")
compute.enqueue(gate.wait)
x = torch.randint(0, 256, (64, 1 << 20), dtype=torch.uint8)   # 64 MiB: unmapped when freed
off = kv.Offloader(kv.KVCacheLayout.from_tensors([x]), 64, backend="host")
off.cpu_tensors[0][:] = 5
t = off.load(cpu_chunks=list(range(64)), gpu_blocks=list(range(64)), stream=compute)   # queued behind the gate
s = off.store(gpu_blocks=list(range(64)), cpu_chunks=list(range(64)), stream=compute)
{action}
threading.Timer(0.5, gate.set).start()   # (a finalizer that drains on collection may wait)
gc.collect()
print(t.wait(30).success, s.wait(30).success)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("action", [
    "x.set_(torch.zeros(1, dtype=torch.uint8))",
    "del off, x",
    "x.data = torch.zeros(1, dtype=torch.uint8); del off",
])
def test_queued_transfers_keep_the_tensor_memory_alive(action: str) -> None:
    """A transfer already queued when the tensor moves away from its memory, or when the
    offloader and the tensor are dropped, still copies into memory that is alive: the
    queued plans hold the layout, which holds the tensors and their storages."""
    pytest.importorskip("torch")
    out = run_child(KEEPALIVE.replace("{action}", action))
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert out.stdout.split() == ["True", "True"]


# -- NumPy ------------------------------------------------------------------------------------
def test_numpy_arrays_cannot_be_resized_under_a_layout() -> None:
    """A NumPy array (or the array a view comes from) resized in place with refcheck=False
    would free the memory the layout points at; NumPy refuses while the layout lives."""
    a = np.zeros((8, 64), np.uint8)
    base = np.zeros((8, 64), np.uint8)
    view = base[:, :]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([a, view]), 8, backend="host")
    with pytest.raises(ValueError, match="referenced"):
        a.resize((1 << 20, 64), refcheck=False)
    with pytest.raises(ValueError, match="referenced"):
        base.resize((1 << 20, 64), refcheck=False)
    a[3] = 9
    view[3] = 4
    assert off.store(gpu_blocks=[3], cpu_chunks=[1]).wait(5).success
    assert (off.cpu_tensors[0][1] == 9).all() and (off.cpu_tensors[1][1] == 4).all()
    off.close()


def test_a_mapped_file_cannot_be_closed_under_a_layout(tmp_path: Path) -> None:
    """A NumPy view of a writable mmap holds the mapping: closing it raises (Python's rule
    for exported buffers), so the layout never points into an unmapped file."""
    f = tmp_path / "kv.bin"
    f.write_bytes(bytes(8 * 64))
    with open(f, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), 0)
    arr = np.frombuffer(mm, np.uint8).reshape(8, 64)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([arr]), 8, backend="host")
    with pytest.raises(BufferError):
        mm.close()
    off.cpu_tensors[0][2] = 42
    assert off.load(cpu_chunks=[2], gpu_blocks=[5]).wait(5).success
    assert bytes(mm[5 * 64:6 * 64]) == bytes([42]) * 64
    off.close()


def test_numpy_view_of_a_torch_tensor_keeps_its_storage() -> None:
    """torch refuses to resize a storage NumPy exported, and the NumPy array holds it: a
    layout over ``t.numpy()`` needs no per-call check and survives the tensor."""
    torch = pytest.importorskip("torch")
    t = torch.randint(0, 256, (4, 64), dtype=torch.uint8)
    expected = t[2].numpy().copy()
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([t.numpy()]), 4, backend="host")
    with pytest.raises(RuntimeError, match="not resizable"):
        t.untyped_storage().resize_(0)
    t.set_(torch.zeros(1, dtype=torch.uint8))
    del t
    assert off.store(gpu_blocks=[2], cpu_chunks=[0]).wait(5).success
    np.testing.assert_array_equal(off.cpu_tensors[0][0], expected)
    off.close()


# -- read-only memory --------------------------------------------------------------------------
def _readonly_arrays(tmp_path: Path) -> dict[str, np.ndarray]:
    f = tmp_path / "kv.bin"
    f.write_bytes(bytes(8 * 64))
    with open(f, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    flagged = np.zeros((8, 64), np.uint8)
    flagged.flags.writeable = False
    return {
        "frombuffer(bytes)": np.frombuffer(bytes(8 * 64), np.uint8).reshape(8, 64),
        "read-only mmap": np.frombuffer(mm, np.uint8).reshape(8, 64),
        "writeable=False": flagged,
        "broadcast view": np.broadcast_to(np.zeros(64, np.uint8), (8, 64)),
    }


@pytest.mark.parametrize("kind", ["frombuffer(bytes)", "read-only mmap", "writeable=False",
                                  "broadcast view"])
@pytest.mark.parametrize("build", ["KVTensor", "from_tensors", "KVCacheLayout", "from_vllm"])
def test_read_only_memory_is_refused_when_the_layout_is_built(
    tmp_path: Path, kind: str, build: str
) -> None:
    """Loads write into KV tensors: read-only memory is refused at layout build (not at the
    first load), whatever builds the layout. A broadcast view (stride 0) is refused too."""
    arr = _readonly_arrays(tmp_path)[kind]
    before = arr.copy()
    calls = {
        "KVTensor": lambda: kv.KVTensor(arr),
        "from_tensors": lambda: kv.KVCacheLayout.from_tensors([arr]),
        "KVCacheLayout": lambda: kv.KVCacheLayout([arr]),
        "from_vllm": lambda: kv.KVCacheLayout.from_vllm([arr.reshape(8, 4, 16)]),
    }
    with pytest.raises(kv.InvalidTransferError, match=r"read-only|overlap"):
        calls[build]()
    np.testing.assert_array_equal(arr, before)


@pytest.mark.parametrize("dtype", [object, [("a", np.int64), ("b", object)]])
@pytest.mark.parametrize("build", ["from_tensors", "KVCacheLayout", "from_vllm", "host_tensors"])
def test_arrays_of_python_objects_are_refused(dtype: object, build: str) -> None:
    """Copying an object array's bytes copies references without counting them (a freed
    object still referenced): refused as a KV tensor and as a caller's host array."""
    objs = np.empty((8, 4), dtype=dtype)
    ok = np.zeros((8, 64), np.uint8)
    calls = {
        "from_tensors": lambda: kv.KVCacheLayout.from_tensors([objs]),
        "KVCacheLayout": lambda: kv.KVCacheLayout([objs]),
        "from_vllm": lambda: kv.KVCacheLayout.from_vllm([objs.reshape(8, 2, 2)]),
        "host_tensors": lambda: kv.Offloader(kv.KVCacheLayout.from_tensors([ok]), 8,
                                             backend="host", host_tensors=[objs]),
    }
    with pytest.raises(kv.InvalidTransferError, match="Python objects"):
        calls[build]()


# -- aliased memory ------------------------------------------------------------------------------
def _aliases() -> dict[str, list[np.ndarray]]:
    x = np.zeros((16, 64), np.uint8)
    buf = bytearray(16 * 64)
    return {
        "same tensor twice": [x, x],
        "overlapping row ranges": [x[0:8], x[4:12]],
        "a view and its base": [x, x[2:3]],
        "two arrays over one buffer": [np.frombuffer(buf, np.uint8).reshape(16, 64),
                                       np.frombuffer(buf, np.uint8)[64:].reshape(15, 64)],
        "byte-shifted rows": [x[:, :32], x[:, 16:48]],
        "row-strided views that meet": [x[::2], x[1:, :][::3]],
        "a reshaped view": [x, x.reshape(32, 32)],
    }


@pytest.mark.parametrize("case", list(_aliases()))
@pytest.mark.parametrize("build", ["from_tensors", "KVCacheLayout", "KVCacheLayout groups"])
def test_tensors_sharing_memory_are_refused(case: str, build: str) -> None:
    """The same tensor twice, or overlapping views of one buffer: a load would write those
    bytes twice in no defined order (each destination written twice)."""
    arrs = _aliases()[case]
    with pytest.raises(kv.InvalidTransferError, match="share memory"):
        if build == "from_tensors":
            kv.KVCacheLayout.from_tensors(arrs)
        elif build == "KVCacheLayout":
            kv.KVCacheLayout([kv.KVTensor(a) for a in arrs])
        else:  # even in different groups
            kv.KVCacheLayout([kv.KVTensor(a) for a in arrs], [[kv.KVRef(0)], [kv.KVRef(1)]])


def test_interleaved_views_of_one_buffer_are_accepted_and_copied_exactly() -> None:
    """Views whose extents overlap but whose bytes do not (K and V halves of each block, the
    even and odd rows): accepted, and every byte goes where it belongs."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (16, 2, 64), dtype=np.uint8)
    k, v = raw[:, 0], raw[:, 1]
    rows = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    even, odd = rows[0::2], rows[1::2]
    orig = [t.copy() for t in (k, v, even, odd)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors([k, v, even, odd]), 8,
                      backend="host") as off:
        off.store(gpu_blocks=[0, 1, 2, 3, 4, 5, 6, 7], cpu_chunks=list(range(8))).wait(5)
        raw[:] = 0
        rows[:] = 0
        off.load(cpu_chunks=[5, 6, 7], gpu_blocks=[1, 0, 2]).wait(5)
    for t, o in zip((k, v, even, odd), orig):
        np.testing.assert_array_equal(t[[1, 0, 2]], o[[5, 6, 7]])
        assert not t[3:].any()


def _brute(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    def cover(p: int, r: int, s: int, n: int) -> set[int]:
        return {p + i * s + j for i in range(n) for j in range(r)}
    return bool(cover(*a) & cover(*b))


def test_rows_overlap_is_exact() -> None:
    """The overlap test agrees with a byte-by-byte check on random row sets (same strides,
    different strides, single rows)."""
    rng = np.random.default_rng(1)
    for _ in range(3000):
        spans = []
        for _ in range(2):
            r = int(rng.integers(1, 9))
            s = r + int(rng.integers(0, 9)) if rng.random() < 0.7 else r
            spans.append((int(rng.integers(0, 60)), r, s, int(rng.integers(1, 6))))
        if rng.random() < 0.5:
            spans[1] = (spans[1][0], spans[1][1], spans[0][2], spans[1][3]) \
                if spans[1][1] <= spans[0][2] else spans[1]
        a, b = spans
        assert rows_overlap(a, b) == _brute(a, b), (a, b)
        assert rows_overlap(b, a) == _brute(a, b), (a, b)


# -- foreign memory and odd views ----------------------------------------------------------------
FOREIGN = [
    ("bytearray", lambda: bytearray(64), "reshape\\(num_blocks, page_bytes\\)"),
    ("memoryview", lambda: memoryview(bytearray(64)), "reshape\\(num_blocks, page_bytes\\)"),
    ("bytes", lambda: b"x" * 64, "reshape\\(num_blocks, page_bytes\\)"),
    ("nested list", lambda: [[0] * 8] * 4, "expected a torch tensor"),
    ("zero blocks", lambda: np.zeros((0, 64), np.uint8), "dim 0"),
    ("zero-byte blocks", lambda: np.zeros((4, 0), np.uint8), "0 bytes"),
    ("0-d array", lambda: np.zeros((), np.uint8), "dim 0"),
    ("negative row stride", lambda: np.zeros((4, 64), np.uint8)[::-1], "negative strides"),
    ("negative inner stride", lambda: np.zeros((4, 64), np.uint8)[:, ::-1], "negative strides"),
    ("gaps inside a block", lambda: np.zeros((4, 64), np.uint8)[:, ::2], "contiguous"),
    ("CUDA memory on the host backend", lambda: _FakeCuda(), "host \\(CPU\\) arrays"),
]


class _FakeCuda:
    """Device memory from a foreign library (a CUDA-array-interface object)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": (4, 64), "typestr": "|u1", "data": (1 << 40, False), "version": 3,
                "strides": None}


@pytest.mark.parametrize(("name", "make", "match"), FOREIGN, ids=[f[0] for f in FOREIGN])
def test_foreign_and_odd_memory_is_refused_with_the_reason(name: str, make: object,
                                                           match: str) -> None:
    with pytest.raises(kv.InvalidTransferError, match=match):
        kv.Offloader(kv.KVCacheLayout([make()]), 4, backend="host")  # type: ignore[operator]


class _ReadOnlyCuda:
    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": (4, 64), "typestr": "|u1", "data": (1 << 40, True), "version": 3}


def test_read_only_device_memory_is_refused() -> None:
    with pytest.raises(kv.InvalidTransferError, match="read-only memory"):
        kv.KVTensor(_ReadOnlyCuda())


def test_torch_meta_and_sparse_tensors_are_refused() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(kv.InvalidTransferError, match="not supported"):
        kv.KVTensor(torch.zeros((4, 8), device="meta"))
    with pytest.raises(kv.InvalidTransferError, match="strided"):
        kv.KVTensor(torch.zeros((4, 8)).to_sparse())


def test_odd_but_valid_views_round_trip_byte_exact() -> None:
    """Misaligned, row-strided (padding between blocks), permuted-inner and memoryview-backed
    arrays are plain memory: accepted, and copies are byte-exact."""
    rng = np.random.default_rng(2)
    buf = bytearray(rng.integers(0, 256, 8 * 64 + 3, dtype=np.uint8).tobytes())
    misaligned = np.frombuffer(buf, np.uint16, count=8 * 32, offset=1).reshape(8, 32)
    padded = rng.integers(0, 256, (16, 48), dtype=np.uint8)[::2, :40]
    permuted = rng.integers(0, 256, (8, 4, 16), dtype=np.uint8).transpose(0, 2, 1)
    arrays = [misaligned, padded, permuted]
    orig = [a.copy() for a in arrays]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(arrays), 8, backend="host") as off:
        off.store(gpu_blocks=[0, 1, 2], cpu_chunks=[3, 4, 5]).wait(5)
        for a in arrays:
            a[:] = 0
        off.load(cpu_chunks=[3, 4, 5], gpu_blocks=[5, 6, 7]).wait(5)
    for a, o in zip(arrays, orig):
        np.testing.assert_array_equal(a[5:], o[:3])
        assert not a[:5].any()
    # the padding between the strided rows was never touched
    assert misaligned.ctypes.data % 2 == 1


@pytest.mark.timeout(30)
def test_memory_check_runs_before_anything_is_enqueued_from_any_thread() -> None:
    """The check is part of the call: a freed tensor fails the call in the calling thread,
    and the other direction's queue is untouched."""
    torch = pytest.importorskip("torch")
    x = torch.zeros((4, 64), dtype=torch.uint8)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([x]), 4, backend="host")
    x.untyped_storage().resize_(0)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            off.store(gpu_blocks=[0], cpu_chunks=[0])
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=worker)
    th.start()
    th.join(10)
    assert len(errors) == 1 and isinstance(errors[0], kv.InvalidTransferError)
    assert off._resources()["inflight"] == 0
    assert all(q.last_transfer is None for q in off._queues.values())
    off.close()


def test_a_storage_freed_and_reallocated_smaller_is_refused() -> None:
    """Two resizes may land the new, smaller allocation at the old address (allocators reuse
    freed blocks): the pointer check alone would pass, the size check refuses it."""
    torch = pytest.importorskip("torch")
    x = torch.zeros((16, 1 << 16), dtype=torch.uint8)
    off = kv.Offloader(kv.KVCacheLayout.from_tensors([x]), 16, backend="host")
    st = x.untyped_storage()
    st.resize_(0)
    st.resize_(8 << 16)
    with pytest.raises(kv.InvalidTransferError, match="storage was freed or resized"):
        off.store(gpu_blocks=[0], cpu_chunks=[0])
    off.close()
