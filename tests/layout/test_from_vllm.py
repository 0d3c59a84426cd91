"""`KVCacheLayout.from_vllm`: vLLM's per-layer KV tensors, in every logical shape and memory
order vLLM uses, become a layout whose copies move exactly the bytes of each block; a shape
whose block dim is ambiguous is refused with the fix in the message."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvasync as kv

ROOT = Path(__file__).resolve().parents[2]
L, NB, BS, H, D = 3, 12, 4, 2, 8  # layers, blocks, block size, KV heads, head size
LIBS = ["torch", "numpy"]


def _lib(name: str) -> Any:
    return pytest.importorskip("torch") if name == "torch" else np


def _rand(lib: str, *shape: int) -> Any:
    """Random 2-byte values (bf16 in torch, as a real cache; float16 in NumPy)."""
    if lib == "torch":
        torch = _lib(lib)
        return torch.randn(*shape).to(torch.bfloat16)
    return np.random.default_rng(0).standard_normal(shape).astype(np.float16)


def _perm(t: Any, *order: int) -> Any:
    return t.transpose(order) if isinstance(t, np.ndarray) else t.permute(*order)


# each maker returns the per-layer tensors in vLLM's *logical* shape, and the logical
# block dim (1 for FlashAttention's (2, NB, ...), 0 otherwise)
def fa_nhd(lib: str) -> tuple[list[Any], int]:
    return [_rand(lib, 2, NB, BS, H, D) for _ in range(L)], 1


def fa_hnd(lib: str) -> tuple[list[Any], int]:  # HND memory under the NHD logical shape
    return [_perm(_rand(lib, 2, NB, H, BS, D), 0, 1, 3, 2, 4) for _ in range(L)], 1


def flashinfer_nhd(lib: str) -> tuple[list[Any], int]:
    return [_rand(lib, NB, 2, BS, H, D) for _ in range(L)], 0


def flashinfer_hnd(lib: str) -> tuple[list[Any], int]:
    return [_perm(_rand(lib, NB, 2, H, BS, D), 0, 1, 3, 2, 4) for _ in range(L)], 0


def mla(lib: str) -> tuple[list[Any], int]:
    return [_rand(lib, NB, BS, 72) for _ in range(L)], 0


def cross_layer_fa(lib: str) -> tuple[list[Any], int]:
    """All layers in one buffer, blocks outermost; each layer a strided FlashAttention view."""
    raw = _rand(lib, NB, L, 2, BS, H, D)
    return [_perm(raw[:, i], 1, 0, 2, 3, 4) for i in range(L)], 1


def cross_layer_kv_first(lib: str) -> tuple[list[Any], int]:
    """One buffer (2, NB, L, ...): K and V far apart, layers interleaved inside them."""
    raw = _rand(lib, 2, NB, L, BS, H, D)
    return [raw[:, :, i] for i in range(L)], 1


LAYOUTS: dict[str, tuple[Callable[[str], tuple[list[Any], int]], int]] = {
    # name: (maker, KVTensors per layer)
    "FlashAttention NHD": (fa_nhd, 2),
    "FlashAttention HND": (fa_hnd, 2),
    "FlashInfer NHD": (flashinfer_nhd, 1),
    "FlashInfer HND": (flashinfer_hnd, 1),
    "MLA": (mla, 1),
    "cross-layer, blocks first": (cross_layer_fa, 1),
    "cross-layer, K/V first": (cross_layer_kv_first, 2),
}


def _block(t: Any, block_dim: int, ids: list[int]) -> Any:
    return t[:, ids] if block_dim == 1 else t[ids]


def _same(a: Any, b: Any) -> bool:
    return bool((a == b).all())


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
def test_round_trip_moves_exactly_each_blocks_bytes(lib: str, name: str, as_dict: bool) -> None:
    maker, per_layer = LAYOUTS[name]
    layers, bdim = maker(lib)
    caches: Any = {f"model.layers.{i}.attn": t for i, t in enumerate(layers)} if as_dict \
        else layers
    layout = kv.KVCacheLayout.from_vllm(caches)
    assert len(layout.tensors) == per_layer * L and len(layout.groups) == 1
    assert [r.tensor_idx for r in layout.groups[0]] == list(range(per_layer * L))
    per_block = sum(_block(t, bdim, [0]).size * 2 if lib == "numpy"
                    else int(_block(t, bdim, [0]).numel()) * 2 for t in layers)
    assert sum(r.page_size_bytes or 0 for r in layout.groups[0]) == per_block
    assert all(t.num_blocks == NB for t in layout.tensors)
    orig = [t.copy() if lib == "numpy" else t.clone() for t in layers]
    src, dst = [1, 7, 4], [0, 11, 5]
    with kv.Offloader(layout, 6, backend="host") as off:
        assert off.store(gpu_blocks=src, cpu_chunks=[0, 1, 2]).wait(10).bytes == 3 * per_block
        for t in layers:
            t[...] = 0
        off.load(cpu_chunks=[0, 1, 2], gpu_blocks=dst).wait(10)
    rest = [b for b in range(NB) if b not in dst]
    for t, o in zip(layers, orig):
        assert _same(_block(t, bdim, dst), _block(o, bdim, src))
        assert not bool(_block(t, bdim, rest).any())


@pytest.mark.parametrize("lib", LIBS)
def test_layers_sharing_a_cache_share_its_tensors(lib: str) -> None:
    """vLLM's KV sharing maps several layer names to one tensor: it is copied once."""
    layers, _ = fa_nhd(lib)
    caches = {"l0": layers[0], "l1": layers[1], "l2": layers[0]}
    layout = kv.KVCacheLayout.from_vllm(caches)
    assert len(layout.tensors) == 4


@pytest.mark.parametrize("lib", LIBS)
def test_fa_layer_becomes_k_and_v_views_with_the_right_strides(lib: str) -> None:
    (k0, *_), _ = fa_hnd(lib)
    base = k0.ctypes.data if lib == "numpy" else k0.data_ptr()
    layout = kv.KVCacheLayout.from_vllm([k0])
    k, v = layout.tensors
    page = BS * H * D * 2
    assert k.info.ptr == base and v.info.ptr == base + NB * page
    assert k.info.row_stride == v.info.row_stride == page == k.page


AMBIGUOUS = [
    ("5-D with 2 blocks", (2, 2, BS, H, D)),
    ("5-D without a K/V dim", (NB, BS, 3, H, D)),
    ("3-D with dim 0 of size 2", (2, BS, 72)),
    ("4-D with dim 0 of size 2", (2, NB, BS, 16)),
]


@pytest.mark.parametrize(("name", "shape"), AMBIGUOUS, ids=[a[0] for a in AMBIGUOUS])
def test_ambiguous_shapes_name_the_fix(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(kv.InvalidTransferError, match="block_dim="):
        kv.KVCacheLayout.from_vllm([np.zeros(shape, np.float16)])


def test_block_dim_resolves_the_ambiguity_both_ways() -> None:
    t = np.arange(2 * 2 * 8, dtype=np.int16).reshape(2, 2, 8)
    fa = kv.KVCacheLayout.from_vllm([t.reshape(2, 2, 2, 2, 2)], block_dim=1)
    fi = kv.KVCacheLayout.from_vllm([t.reshape(2, 2, 2, 2, 2)], block_dim=0)
    assert len(fa.tensors) == 2 and len(fi.tensors) == 1
    assert fa.tensors[1].info.ptr - fa.tensors[0].info.ptr == 2 * 8 * 2  # V after all K
    assert fi.tensors[0].info.row_bytes == 2 * 8 * 2  # K|V of a block together


def test_block_dim_for_other_layouts() -> None:
    """A layout vLLM does not ship: heads first in the logical shape, blocks outermost in
    memory. block_dim=1 reads it; a block that is not one byte range (or K/V halves) is
    refused with the reason."""
    phys = np.zeros((NB, 4, 16), np.float32)
    logical = phys.transpose(1, 0, 2)  # (4, NB, 16)
    layout = kv.KVCacheLayout.from_vllm([logical], block_dim=1)
    assert layout.tensors[0].info.row_bytes == 4 * 16 * 4
    assert kv.KVCacheLayout.from_vllm([logical], block_dim=-2).tensors[0].info.ptr == \
        phys.ctypes.data
    with pytest.raises(kv.InvalidTransferError, match="neither one byte range"):
        kv.KVCacheLayout.from_vllm([np.zeros((4, NB, 16))], block_dim=1)
    for bad in (5, -4, 1.0, True, "1"):
        with pytest.raises(kv.InvalidTransferError, match="block_dim"):
            kv.KVCacheLayout.from_vllm([logical], block_dim=bad)  # type: ignore[arg-type]


def test_from_vllm_refuses_what_is_not_a_list_of_layer_tensors() -> None:
    layers, _ = fa_nhd("numpy")
    with pytest.raises(kv.InvalidTransferError, match="takes a list of tensors, got one ndarray"):
        kv.KVCacheLayout.from_vllm(layers[0])
    with pytest.raises(kv.InvalidTransferError, match="layer 1 is a list"):
        kv.KVCacheLayout.from_vllm([layers[0], [layers[1]]])
    with pytest.raises(kv.InvalidTransferError, match="no layers"):
        kv.KVCacheLayout.from_vllm({})
    with pytest.raises(kv.InvalidTransferError, match="got int"):
        kv.KVCacheLayout.from_vllm(3)


# -- from_tensors no longer reads (2, NB, ...) as 2 blocks ------------------------------------------
@pytest.mark.parametrize("lib", LIBS)
def test_from_tensors_refuses_a_likely_kv_dim_unless_told(lib: str) -> None:
    layers, _ = fa_nhd(lib)
    with pytest.raises(kv.InvalidTransferError, match=r"from_vllm.*block_dim=0"):
        kv.KVCacheLayout.from_tensors(layers)
    with pytest.raises(kv.InvalidTransferError, match="from_vllm"):
        kv.KVCacheLayout([layers[0]])
    two_blocks = kv.KVCacheLayout.from_tensors(layers, block_dim=0)
    assert two_blocks.num_blocks == [2] * L
    # 2-D arrays of 2 blocks are unambiguous; an explicit KVTensor is taken as said
    assert kv.KVCacheLayout.from_tensors([np.zeros((2, 64), np.uint8)]).num_blocks == [2]
    assert kv.KVCacheLayout([kv.KVTensor(layers[0])]).num_blocks == [2]


def test_from_tensors_block_dim_moves_the_blocks_first() -> None:
    phys = np.random.default_rng(0).integers(0, 256, (NB, 3, 32), dtype=np.uint8)
    layout = kv.KVCacheLayout.from_tensors([phys.transpose(1, 0, 2)], block_dim=1)
    assert layout.num_blocks == [NB] and layout.tensors[0].info.row_bytes == 96
    with pytest.raises(kv.InvalidTransferError, match="contiguous"):
        kv.KVCacheLayout.from_tensors([np.zeros((3, NB, 32), np.uint8)], block_dim=1)


@pytest.mark.parametrize("single", [np.zeros((16, 64), np.uint8),
                                    np.zeros((16, 4, 16), np.uint8)])
def test_one_array_where_a_list_belongs_is_refused(single: np.ndarray) -> None:
    """It used to become one tensor per row, each of 1-byte blocks."""
    for build in (kv.KVCacheLayout.from_tensors, kv.KVCacheLayout, kv.KVCacheLayout.from_vllm):
        with pytest.raises(kv.InvalidTransferError, match="takes a list of tensors, got one"):
            build(single)  # type: ignore[operator]


# -- the quickstart's model-shaped example runs as written ---------------------------------------
def _doc_block(path: Path, heading: str) -> str:
    text = path.read_text()
    section = text.split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


@pytest.mark.timeout(300)
def test_quickstart_model_shaped_cache_runs() -> None:
    pytest.importorskip("torch")
    code = _doc_block(ROOT / "docs" / "quickstart.md", "## A real model's cache")
    scope: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, "docs/quickstart.md", "exec"), scope)
    layout = scope["layout"]
    assert len(layout.tensors) == 64 and layout.tensors[0].page == 16 * 8 * 128 * 2
