"""Refs of one group on one tensor (allowed when their bytes are disjoint), and short reprs
for every object a user prints."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvasync as kv


def _kv_rows(blocks: int = 8, half: int = 64) -> np.ndarray:
    """Blocks whose rows are K then V (FlashInfer-like): one tensor, two halves."""
    return np.random.default_rng(0).integers(0, 256, (blocks, 2 * half), dtype=np.uint8)


def test_two_refs_on_disjoint_halves_of_one_tensor_round_trip() -> None:
    t = _kv_rows()
    orig = t.copy()
    layout = kv.KVCacheLayout([t], [[kv.KVRef(0, 64), kv.KVRef(0, 64, offset_bytes=64)]])
    assert [r.offset_bytes for r in layout.groups[0]] == [0, 64]
    with kv.Offloader(layout, 4, backend="host") as off:
        assert off.store(gpu_blocks=[2, 5], cpu_chunks=[0, 3]).wait(5).bytes == 2 * 128
        np.testing.assert_array_equal(off.cpu_tensors[0][3], orig[5])
        t[:] = 0
        off.load(cpu_chunks=[0, 3], gpu_blocks=[1, 6]).wait(5)
    np.testing.assert_array_equal(t[[1, 6]], orig[[2, 5]])
    assert not t[[0, 2, 3, 4, 5, 7]].any()


@pytest.mark.parametrize("path", ["auto", "memmove", "staged"])  # pitched: whole pages
@pytest.mark.parametrize("case", ["group_sizes", "block_indices", "many ids", "2 per chunk"])
def test_two_halves_of_one_tensor_in_one_group_off_the_small_path(path: str, case: str) -> None:
    """The general plan builder (group sizes, block indices, > 256 ids, chunks of several
    blocks) takes a group with two refs on one tensor: one slot, two byte ranges, not a
    duplicate destination."""
    blocks = 512
    t = _kv_rows(blocks)
    orig = t.copy()
    layout = kv.KVCacheLayout([t], [[kv.KVRef(0, 64), kv.KVRef(0, 64, offset_bytes=64)]])
    bpc = 2 if case == "2 per chunk" else 1
    n = 300 if case == "many ids" else 3
    gpu = list(range(blocks - n, blocks))[::-1]
    kw: dict[str, object] = {}
    if case == "group_sizes":
        kw["group_sizes"] = [n]
    if case == "block_indices":
        kw["block_indices"] = [0]
    chunks = list(range(-(-n // bpc)))[::-1]
    with kv.Offloader(layout, blocks, blocks_per_chunk=bpc, backend="host") as off:
        assert off.store(gpu_blocks=gpu, cpu_chunks=chunks, path=path, **kw).wait(5).bytes == (
            n * 128)
        t[:] = 0
        dst = list(range(n))
        off.load(cpu_chunks=chunks, gpu_blocks=dst, path=path, **kw).wait(5)
    np.testing.assert_array_equal(t[:n], orig[gpu])
    assert not t[n:].any()


def test_a_ref_on_the_v_half_only_copies_only_those_bytes() -> None:
    t = _kv_rows()
    orig = t.copy()
    layout = kv.KVCacheLayout([t], [[kv.KVRef(0, offset_bytes=64)]])
    assert layout.groups[0][0].page_size_bytes == 64  # default: the rest of the row
    with kv.Offloader(layout, 4, backend="host") as off:
        off.store(gpu_blocks=[2], cpu_chunks=[1]).wait(5)
        t[:] = 0
        off.load(cpu_chunks=[1], gpu_blocks=[2]).wait(5)
    np.testing.assert_array_equal(t[2, 64:], orig[2, 64:])
    assert not t[2, :64].any()


@pytest.mark.parametrize(("refs", "match"), [
    ([kv.KVRef(0), kv.KVRef(0)], "two refs cover bytes \\[0, 128\\)"),
    ([kv.KVRef(0, 64), kv.KVRef(0, 64, offset_bytes=32)], "cover bytes \\[32, 64\\)"),
    ([kv.KVRef(0, 64, offset_bytes=64), kv.KVRef(0, offset_bytes=100)], "cover bytes"),
    ([kv.KVRef(0, offset_bytes=128)], "offset_bytes 128 must be an int in \\[0, 128\\)"),
    ([kv.KVRef(0, offset_bytes=-1)], "offset_bytes -1"),
    ([kv.KVRef(0, 80, offset_bytes=64)], "page_size_bytes 80 must be in \\(0, 64\\]"),
])
def test_overlapping_or_out_of_row_refs_are_refused(refs: list[kv.KVRef], match: str) -> None:
    with pytest.raises(kv.InvalidTransferError, match=match):
        kv.KVCacheLayout([_kv_rows()], [refs])


@pytest.mark.parametrize(("make", "match"), [
    (lambda: kv.KVRef(0, 32.5), "KVRef.page_size_bytes must be an int, got 32.5"),
    (lambda: kv.KVRef(True), "KVRef.tensor_idx must be an int"),
    (lambda: kv.KVRef("0"), "KVRef.tensor_idx must be an int"),
    (lambda: kv.KVRef(0, offset_bytes=1.0), "KVRef.offset_bytes must be an int"),
    (lambda: kv.KVRef(0, mapping="identity"), "KVRef.mapping must be a PageMapping"),
    (lambda: kv.CopyRun(0, 0, 32.5), "CopyRun.fragment_size must be an int"),
    (lambda: kv.CopyRun(0, 0, 8, num_fragments=2.0), "CopyRun.num_fragments must be an int"),
    (lambda: kv.PageMapping(64, 64, (kv.CopyRun(0, 0, 64),), 2, 0.5),
     "PageMapping.writer_index must be an int"),
    (lambda: kv.PageMapping(64, 64, (kv.CopyRun(0, 0, 64),), 2**64, 0),
     r"num_writers < 2\*\*32"),
    (lambda: kv.KVTensor(np.zeros((4, 64), np.uint8), page_size_bytes=63.9),
     "KVTensor.page_size_bytes must be an int"),
    (lambda: kv.KVTensor(np.zeros((4, 64), np.uint8), page_size_bytes="64"),
     "KVTensor.page_size_bytes must be an int"),
])
def test_byte_counts_and_indices_must_be_ints(make: Any, match: str) -> None:
    """A float, string or bool where a byte count or index goes is refused where it is given
    (32.5 B per block used to copy 32; writer 0.5 of 2 wrote every other chunk)."""
    with pytest.raises(kv.InvalidTransferError, match=match):
        make()


def test_numpy_integers_are_taken_as_ints() -> None:
    ref = kv.KVRef(np.int64(0), np.uint32(64), offset_bytes=np.int16(64))
    run = kv.CopyRun(np.int64(0), np.int64(0), np.int64(64))
    m = kv.PageMapping(np.int64(64), np.int64(64), (run,), np.int8(2), np.int8(1))
    assert (ref.tensor_idx, ref.page_size_bytes, ref.offset_bytes) == (0, 64, 64)
    assert type(ref.page_size_bytes) is int and type(m.writer_index) is int
    assert m.is_writer(3) and not m.is_writer(2)


def test_refs_of_different_groups_may_share_a_tensor() -> None:
    """Unchanged: groups sharing a tensor are checked per request (a block written by two
    groups in one transfer is a duplicate destination)."""
    layout = kv.KVCacheLayout([_kv_rows()], [[kv.KVRef(0)], [kv.KVRef(0)]])
    with kv.Offloader(layout, 4, backend="host") as off:
        with pytest.raises(kv.InvalidTransferError, match="duplicate destination"):
            off.load(cpu_chunks=[0, 1], gpu_blocks=[3, 3], group_sizes=[1, 1])
        assert off.load(cpu_chunks=[0, 1], gpu_blocks=[3, 4], group_sizes=[1, 1]).wait(5).success


def test_canonical_refs_on_one_tensor_need_disjoint_canonical_bytes() -> None:
    k = kv.PageMapping(128, 64, (kv.CopyRun(0, 0, 64),))
    v_clash = kv.PageMapping(128, 64, (kv.CopyRun(0, 32, 64),))
    v_ok = kv.PageMapping(128, 64, (kv.CopyRun(0, 64, 64),))
    t = _kv_rows()
    clash = kv.KVCacheLayout([t], [[kv.KVRef(0, 64, k), kv.KVRef(0, 64, v_clash, 64)]])
    with pytest.raises(kv.InvalidTransferError, match="canonical bytes at 32 twice"):
        kv.Offloader(clash, 4, backend="host", canonical=True)
    assert kv.Offloader(clash, 4, backend="host").store(gpu_blocks=[0], cpu_chunks=[0]).wait(5).success  # direct
    orig = t.copy()
    ok = kv.KVCacheLayout([t], [[kv.KVRef(0, 64, k), kv.KVRef(0, 64, v_ok, 64)]])
    with kv.Offloader(ok, 4, backend="host", canonical=True) as off:
        off.store(gpu_blocks=[6], cpu_chunks=[2]).wait(5)
        np.testing.assert_array_equal(off.cpu_tensors[0][2], orig[6])
        t[:] = 0
        off.load(cpu_chunks=[2], gpu_blocks=[1]).wait(5)
    np.testing.assert_array_equal(t[1], orig[6])


# -- reprs ------------------------------------------------------------------------------------
def test_kv_tensor_repr_is_short_and_never_dumps_values() -> None:
    torch = pytest.importorskip("torch")
    t = kv.KVTensor(torch.zeros((1000, 16, 8, 128), dtype=torch.bfloat16))
    r = repr(t)
    assert r == ("KVTensor(shape=(1000, 16, 8, 128), dtype=bfloat16, device=cpu, "
                 "page_bytes=32768, blocks=1000)")
    assert repr(kv.KVTensor(np.zeros((4, 8), np.float32))) == (
        "KVTensor(shape=(4, 8), dtype=float32, device=cpu, page_bytes=32, blocks=4)")


def test_ref_layout_and_backend_reprs_are_short() -> None:
    m = kv.PageMapping(256, 64, (kv.CopyRun(0, 64, 64),), num_writers=2, writer_index=1)
    assert repr(kv.KVRef(3, 64, m, 64)) == (
        "KVRef(3, page_size_bytes=64, offset_bytes=64, "
        "mapping=<canonical 256 B, 1 fragments, writer 1/2>)")
    assert repr(kv.KVRef(0)) == "KVRef(0, page_size_bytes=None)"
    tensors = [np.zeros((16, 64), np.uint8) for _ in range(40)]
    layout = kv.KVCacheLayout.from_tensors(tensors)
    assert repr(layout) == ("<KVCacheLayout cpu 40 tensors, 1 group, 40 refs, 16 blocks, "
                            "2560 B per block>")
    one = kv.KVCacheLayout.from_tensors([np.zeros((8, 4), np.uint8)])
    assert repr(one) == "<KVCacheLayout cpu 1 tensor, 1 group, 1 ref, 8 blocks, 4 B per block>"
    with kv.Offloader(layout, 4, backend="host") as off:
        assert repr(off.backend) == "<HostBackend paths=('memmove', 'staged', 'pitched') streams=0>"
        off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(5)
        assert repr(off.backend) == "<HostBackend paths=('memmove', 'staged', 'pitched') streams=1>"
        stream = off.backend._streams[0]  # type: ignore[attr-defined]
        assert repr(stream).startswith("<HostStream kvasync-host-0 ")
        # one mapping holds every tensor's rows: 4 chunks x 40 x 64 B, whole pages
        assert repr(off._host_mem[0]).endswith(" 12288 B pageable>")
        assert repr(off.backend.new_event()) == "<HostEvent done>"
