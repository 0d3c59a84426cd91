"""Ids and group sizes: what is refused, with a message that says what came, before
anything is enqueued and with every byte unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvasync as kv
from kvasync.compat import vllm

BLOCKS, PAGE, CHUNKS = 16, 128, 8


def _setup(groups: int = 1) -> tuple[list[np.ndarray], kv.Offloader]:
    gpu = [np.random.default_rng(i).integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)
           for i in range(groups)]
    layout = kv.KVCacheLayout([kv.KVTensor(t) for t in gpu],
                              [[kv.KVRef(g)] for g in range(groups)])
    off = kv.Offloader(layout, CHUNKS, backend="host")
    for i, c in enumerate(off.cpu_tensors):
        c[:] = np.random.default_rng(50 + i).integers(0, 256, c.shape, dtype=np.uint8)
    return gpu, off


def _gen() -> Any:
    return (i for i in range(2))


Call = Callable[[kv.Offloader], Any]

BAD: list[tuple[str, int, Call, str]] = [
    ("a bool among ints", 1, lambda o: o.store(gpu_blocks=[3, True], cpu_chunks=[0, 1]), "got a bool among them"),
    ("a bool among ints, load", 1, lambda o: o.load(cpu_chunks=[0, 1], gpu_blocks=[True, 3]), "bool among them"),
    ("a NumPy bool among ints", 1, lambda o: o.store(gpu_blocks=(3, np.True_), cpu_chunks=[0, 1]), "bool among"),
    ("a bool among many ints", 1,
     lambda o: o.store(gpu_blocks=[*range(299), False], cpu_chunks=list(range(300))), "bool among"),
    ("bool array", 1, lambda o: o.store(gpu_blocks=np.array([True, False]), cpu_chunks=[0, 1]), "integers"),
    ("a set", 1, lambda o: o.store(gpu_blocks={1, 2}, cpu_chunks=[0, 1]), "got set"),
    ("a generator", 1, lambda o: o.store(gpu_blocks=_gen(), cpu_chunks=[0, 1]), "got generator"),
    ("a string", 1, lambda o: o.store(gpu_blocks="ab", cpu_chunks=[0, 1]), "got str 'ab'"),
    ("bytes", 1, lambda o: o.store(gpu_blocks=b"\x00\x01", cpu_chunks=[0, 1]), "got bytes"),
    ("a dict", 1, lambda o: o.store(gpu_blocks={0: 1}, cpu_chunks=[0]), "got dict"),
    ("None", 1, lambda o: o.store(gpu_blocks=None, cpu_chunks=[0]), "got NoneType"),
    ("an int", 1, lambda o: o.store(gpu_blocks=3, cpu_chunks=[0]), "got int 3"),
    ("a 0-d array", 1, lambda o: o.store(gpu_blocks=np.int64(3), cpu_chunks=[0]), "of shape \\(\\)"),
    ("nested lists", 1, lambda o: o.store(gpu_blocks=[[0], [1]], cpu_chunks=[0, 1]), "list of shape \\(2, 1\\)"),
    ("ragged lists", 1, lambda o: o.store(gpu_blocks=[[0], [1, 2]], cpu_chunks=[0, 1]), "cannot read ids from list"),
    ("group sizes that wrap int64", 3,
     lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], group_sizes=[2**63 - 1, 2**63 - 1, 3]),
     r"sum\(group_sizes\) = 18446744073709551617 != len\(gpu_blocks\) = 1"),
    ("group sizes that wrap to the length", 3,
     lambda o: o.store(gpu_blocks=[0, 1, 2], cpu_chunks=[0, 1, 2], group_sizes=[2**63 - 1, 2**63 - 1, 5]),
     r"sum\(group_sizes\)"),
    ("group sizes above int64", 3, lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], group_sizes=[2**64, 0, 0]),
     "cannot read ids|out of range"),
    ("huge block index", 3,
     lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], group_sizes=[1, 0, 0], block_indices=[2**63, 0, 0]),
     "out of range"),
    ("a bool group size", 3, lambda o: o.store(gpu_blocks=[0], cpu_chunks=[0], group_sizes=[True, 0, 0]), "bool"),
]


@pytest.mark.parametrize(("name", "groups", "call", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_ids_raise_before_anything_is_enqueued(name: str, groups: int, call: Call,
                                                   match: str) -> None:
    gpu, off = _setup(groups)
    gpu_before = [g.copy() for g in gpu]
    cpu_before = [c.copy() for c in off.cpu_tensors]
    with pytest.raises(kv.InvalidTransferError, match=match):
        call(off)
    assert off._resources()["inflight"] == 0
    assert all(q.last_transfer is None for q in off._queues.values())
    for a, b in zip(off.cpu_tensors, cpu_before):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(gpu, gpu_before):
        np.testing.assert_array_equal(a, b)
    # the next good call gets job id 0: the rejected one used none
    sizes = None if groups == 1 else [1] + [0] * (groups - 1)
    assert off.store(gpu_blocks=[0], cpu_chunks=[0], group_sizes=sizes).wait(5).job_id == 0
    off.close()


GOOD: list[tuple[str, Callable[[], Any]]] = [
    ("list", lambda: [3, 5]),
    ("tuple", lambda: (3, 5)),
    ("range", lambda: range(3, 7, 2)),
    ("int32 array", lambda: np.array([3, 5], dtype=np.int32)),
    ("uint8 array", lambda: np.array([3, 5], dtype=np.uint8)),
    ("NumPy ints in a list", lambda: [np.int64(3), np.int32(5)]),
    ("a long list", lambda: [3, 5]),
]


@pytest.mark.parametrize(("name", "make"), GOOD, ids=[g[0] for g in GOOD])
def test_integer_sequences_are_accepted(name: str, make: Callable[[], Any]) -> None:
    gpu, off = _setup()
    assert off.store(gpu_blocks=make(), cpu_chunks=[0, 1]).wait(5).bytes == 2 * PAGE
    np.testing.assert_array_equal(off.cpu_tensors[0][1], gpu[0][5])
    off.close()


def test_torch_tensors_are_ids() -> None:
    torch = pytest.importorskip("torch")
    gpu, off = _setup()
    for dtype in (torch.int64, torch.int32, torch.int16):
        ids = torch.tensor([3, 5], dtype=dtype)
        assert off.load(cpu_chunks=torch.tensor([0, 1], dtype=dtype), gpu_blocks=ids).wait(5).success
        assert off.store(gpu_blocks=ids, cpu_chunks=torch.tensor([2, 3], dtype=dtype)).wait(5).success
    np.testing.assert_array_equal(off.cpu_tensors[0][3], gpu[0][5])
    with pytest.raises(kv.InvalidTransferError, match="integers"):
        off.store(gpu_blocks=torch.tensor([True, False]), cpu_chunks=[0, 1])
    with pytest.raises(kv.InvalidTransferError, match="integers"):
        off.store(gpu_blocks=torch.tensor([1.0, 2.0]), cpu_chunks=[0, 1])
    with pytest.raises(kv.InvalidTransferError, match="of shape \\(1, 2\\)"):
        off.store(gpu_blocks=torch.tensor([[1, 2]]), cpu_chunks=[0, 1])
    # ids in device memory (a CUDA tensor reads the same): the message says how to fix it
    with pytest.raises(kv.InvalidTransferError, match=r"cannot read ids from Tensor.*cpu\(\)"):
        off.store(gpu_blocks=torch.zeros(2, dtype=torch.long, device="meta"), cpu_chunks=[0, 1])
    off.close()


def test_long_lists_with_bools_are_refused_too() -> None:
    """The plain-Python path for short lists and the NumPy path for long ones agree."""
    gpu, off = _setup()
    big = list(range(BLOCKS)) * 20
    with pytest.raises(kv.InvalidTransferError, match="bool among"):
        off.store(gpu_blocks=[*big[:-1], True], cpu_chunks=[0] * len(big))
    off.close()


def test_the_vllm_facade_refuses_bool_ids() -> None:
    with pytest.raises(kv.InvalidTransferError, match="bool among"):
        vllm.GPULoadStoreSpec([3, True])
    with pytest.raises(kv.InvalidTransferError, match="bool among"):
        vllm.CPULoadStoreSpec([True, 3])


def test_ids_type_accepts_what_runs() -> None:
    """The `Ids` hint names what `as_ids` takes: sequences, NumPy arrays, and anything with
    `__array__` (a torch tensor)."""
    import typing

    from kvasync._program import IdArray, Ids

    args = typing.get_args(Ids)
    assert np.ndarray in args and IdArray in args
    assert hasattr(IdArray, "__array__")
