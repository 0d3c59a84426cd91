"""Input checks on the GPU: freed, moved or resized CUDA tensors are refused at submit (through
torch's batched pointer check where the build has it, and one gather of the storages' byte
counts), vLLM layouts and refs at an offset copy
exactly on every copy path."""

from __future__ import annotations

from typing import Any

import pytest

import kvasync as kv

pytestmark = pytest.mark.gpu

PATHS = ["kernel", "dma", "auto"]


def _torch() -> Any:
    import torch

    return torch


@pytest.mark.parametrize("mutate", ["resize", "set_", "data"])
def test_freed_or_moved_cuda_tensor_is_refused(mutate: str) -> None:
    torch = _torch()
    xs = [torch.randint(0, 256, (16, 1 << 16), dtype=torch.uint8, device="cuda")
          for _ in range(3)]
    off = kv.Offloader(kv.KVCacheLayout.from_tensors(xs), 16, backend="cuda")
    assert off.store(gpu_blocks=list(range(16)), cpu_chunks=list(range(16))).wait(30).success
    x = xs[1]
    if mutate == "resize":
        x.untyped_storage().resize_(0)
    elif mutate == "set_":
        x.set_(torch.zeros(1, dtype=torch.uint8, device="cuda"))
    else:
        x.data = torch.zeros(8, dtype=torch.uint8, device="cuda")
    with pytest.raises(kv.InvalidTransferError, match="KV tensor 1"):
        off.load(cpu_chunks=list(range(16)), gpu_blocks=list(range(16)))
    with pytest.raises(kv.InvalidTransferError, match="KV tensor 1"):
        off.load_layerwise(cpu_chunks=list(range(16)), gpu_blocks=list(range(16)))
    assert off._resources()["inflight"] == 0
    off.close()


def test_batched_pointer_check_answers_both_ways() -> None:
    """On CUDA builds the guard may use torch's one-call pointer comparison; either way it
    must pass for unchanged tensors and fail for a moved one."""
    torch = _torch()
    xs = [torch.zeros((4, 256), dtype=torch.uint8, device="cuda") for _ in range(64)]
    layout = kv.KVCacheLayout.from_tensors(xs)
    layout._guard.check()
    xs[37].set_(torch.zeros(1, dtype=torch.uint8, device="cuda"))
    with pytest.raises(kv.InvalidTransferError, match="KV tensor 37 moved"):
        layout._guard.check()


@pytest.mark.parametrize("mutate", ["set_", "offset", "resize", "data"])
def test_the_one_gather_guard_reads_cuda_tensors(mutate: str) -> None:
    """CUDA tensors, views at an offset among them (K and V halves of one buffer): the
    guard's gather of torch's fields is in use, passes while nothing changed, and fails for
    each change, which the guard then refuses."""
    torch = _torch()
    buf = torch.zeros((2, 8, 1 << 12), dtype=torch.uint8, device="cuda")
    xs = [buf[0], buf[1], torch.zeros((8, 1 << 12), dtype=torch.uint8, device="cuda")]
    guard = kv.KVCacheLayout.from_tensors(xs)._guard
    assert guard._unchanged is not None and guard._unchanged()
    guard.check()
    x = xs[1]
    if mutate == "set_":
        x.set_(torch.zeros(1, dtype=torch.uint8, device="cuda"))
    elif mutate == "offset":
        x.set_(x.untyped_storage(), x.storage_offset() - 512, (8, 1 << 12))
    elif mutate == "resize":
        x.untyped_storage().resize_(0)
    else:
        x.data = torch.zeros(8, dtype=torch.uint8, device="cuda")
    assert not guard._unchanged()
    # the storage both views share is named after the first of them
    with pytest.raises(kv.InvalidTransferError,
                       match="KV tensor 0" if mutate == "resize" else "KV tensor 1"):
        guard.check()


def test_cuda_storage_resized_at_its_old_address_is_refused() -> None:
    """The caching allocator hands a storage resized to 0 and back to a smaller size its old
    block: the pointers match, only the byte count (read in one gather) tells."""
    torch = _torch()
    xs = [torch.zeros((8, 1 << 16), dtype=torch.uint8, device="cuda") for _ in range(4)]
    with kv.Offloader(kv.KVCacheLayout.from_tensors(xs), 8, backend="cuda") as off:
        guard = off.layout._guard
        assert guard._sizes_equal != guard._sizes_equal_py  # the one-gather reader is in use
        assert off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1]).wait(30).success
        s = xs[2].untyped_storage()
        ptr = s.data_ptr()
        s.resize_(0)
        s.resize_((8 << 16) - 4096)
        assert s.data_ptr() == ptr, "the allocator moved it: the case is not exercised"
        with pytest.raises(kv.InvalidTransferError, match="KV tensor 2: its storage was freed"):
            off.load(cpu_chunks=[0], gpu_blocks=[0])
        assert off._resources()["inflight"] == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", ["fa_hnd", "flashinfer", "cross_layer"])
def test_vllm_layouts_round_trip_on_every_path(path: str, shape: str) -> None:
    torch = _torch()
    layers, nb = 4, 32
    if shape == "fa_hnd":
        caches = [torch.randn(2, nb, 8, 16, 64, device="cuda").to(torch.bfloat16)
                  .permute(0, 1, 3, 2, 4) for _ in range(layers)]
        bdim = 1
    elif shape == "flashinfer":
        caches = [torch.randn(nb, 2, 16, 8, 64, device="cuda").to(torch.bfloat16)
                  for _ in range(layers)]
        bdim = 0
    else:
        raw = torch.randn(nb, layers, 2, 16, 8, 64, device="cuda").to(torch.bfloat16)
        caches = [raw[:, i].permute(1, 0, 2, 3, 4) for i in range(layers)]
        bdim = 1
    orig = [c.clone() for c in caches]
    src, dst = [3, 9, 17, 30], [0, 1, 31, 12]
    with kv.Offloader(kv.KVCacheLayout.from_vllm(caches), 8, backend="cuda",
                      copy_path=path) as off:
        off.store(gpu_blocks=src, cpu_chunks=[0, 1, 2, 3]).wait(30)
        for c in caches:
            c.zero_()
        off.load(cpu_chunks=[0, 1, 2, 3], gpu_blocks=dst).wait(30)
    torch.cuda.synchronize()
    for c, o in zip(caches, orig):
        got = c[:, dst] if bdim == 1 else c[dst]
        want = o[:, src] if bdim == 1 else o[src]
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("path", PATHS)
def test_refs_at_an_offset_copy_their_bytes_only(path: str) -> None:
    torch = _torch()
    t = torch.randint(0, 256, (16, 4096), dtype=torch.uint8, device="cuda")
    orig = t.clone()
    layout = kv.KVCacheLayout([t], [[kv.KVRef(0, 1024, offset_bytes=512),
                                     kv.KVRef(0, 2048, offset_bytes=2048)]])
    with kv.Offloader(layout, 4, backend="cuda", copy_path=path) as off:
        off.store(gpu_blocks=[5, 6], cpu_chunks=[0, 1]).wait(30)
        t.zero_()
        off.load(cpu_chunks=[0, 1], gpu_blocks=[9, 10]).wait(30)
    torch.cuda.synchronize()
    got, want = t.cpu(), orig.cpu()
    for d, s in ((9, 5), (10, 6)):
        assert torch.equal(got[d, 512:1536], want[s, 512:1536])
        assert torch.equal(got[d, 2048:], want[s, 2048:])
        assert not got[d, :512].any() and not got[d, 1536:2048].any()
