"""Which dim of a KV tensor indexes blocks, and vLLM's per-layer caches as a layout.

vLLM's attention backends hand a worker one tensor per layer (a list, or a dict of layer
name -> tensor), in one of a few logical shapes:

============================  ================================  =======================
backend family                logical shape                     blocks, K/V
============================  ================================  =======================
FlashAttention (and similar)  ``(2, NB, block, heads, head)``   dim 1; K, V in dim 0
FlashInfer (and similar)      ``(NB, 2, block, heads, head)``   dim 0; K, V in dim 1
MLA                           ``(NB, block, head)``             dim 0; one latent
============================  ================================  =======================

The memory order is free: vLLM may allocate HND under an NHD logical shape, or all layers
in one buffer with the blocks outermost, and hand out permuted or strided views. So the
block dim comes from the shape, and how a block lies in memory from the strides: the dims
other than the block dim are one byte range per block (one tensor, one ref), or two byte
ranges split by a K/V dim of size 2 (two tensors, the K and the V view, one ref each).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ._arrays import array_info, is_array, move_to_front, select
from ._errors import InvalidTransferError

__all__ = ["blocks_first", "check_list", "vllm_block_views"]


def check_list(tensors: Any, where: str) -> None:
    """Refuse one array where a list of them belongs (it would iterate into its rows)."""
    if is_array(tensors):
        shape = tuple(getattr(tensors, "shape", ()))
        raise InvalidTransferError(
            f"{where} takes a list of tensors, got one {type(tensors).__name__} of shape "
            f"{shape}; pass [tensor]"
        )


def _viewable(t: Any) -> Any:
    """`t` as an object we can take views of (array-interface objects through NumPy)."""
    if not hasattr(t, "transpose") and hasattr(t, "__array_interface__"):
        return np.asarray(t)
    return t


def _block_dim_arg(block_dim: Any, shape: tuple[int, ...], what: str) -> int:
    if isinstance(block_dim, bool) or not isinstance(block_dim, (int, np.integer)):
        raise InvalidTransferError(f"block_dim must be an int, got {block_dim!r}")
    nd = len(shape)
    if not -nd <= int(block_dim) < nd:
        raise InvalidTransferError(
            f"block_dim {block_dim} is out of range for {what} of shape {shape}"
        )
    return int(block_dim) % nd


def blocks_first(t: Any, i: int, block_dim: int | None = None) -> Any:
    """`t` (tensor `i` of a list) with its block dim first: dim 0 when `block_dim` is None,
    refused when dim 0 has size 2 in 3 or more dims (more likely K/V than 2 blocks)."""
    what = f"tensor {i}"
    shape = array_info(t, what).shape
    if block_dim is None:
        if len(shape) >= 3 and shape[0] == 2:
            raise InvalidTransferError(
                f"{what} has shape {shape}: is dim 0 two blocks, or K and V as in vLLM's "
                "FlashAttention cache (2, num_blocks, ...)? Use KVCacheLayout.from_vllm for "
                "vLLM caches, or KVCacheLayout.from_tensors(..., block_dim=0) if dim 0 really "
                "indexes 2 blocks"
            )
        return t
    dim = _block_dim_arg(block_dim, shape, what)
    return move_to_front(_viewable(t), dim) if dim else t


def _guess_block_dim(shape: tuple[int, ...], what: str) -> int:
    """The block dim of one of vLLM's logical shapes, or an error naming `block_dim=`."""
    fix = "pass block_dim= (the index of the dim that counts blocks)"
    if len(shape) == 5:
        kv0, kv1 = shape[0] == 2, shape[1] == 2
        if kv0 and kv1:
            raise InvalidTransferError(
                f"{what} has shape {shape}: with 2 blocks, FlashAttention (2, num_blocks, ...) "
                f"and FlashInfer (num_blocks, 2, ...) read it differently; {fix}"
            )
        if kv0 or kv1:
            return 1 if kv0 else 0
        raise InvalidTransferError(
            f"{what} has shape {shape}, not vLLM's (2, num_blocks, ...) or (num_blocks, 2, "
            f"...); {fix}"
        )
    if len(shape) >= 3 and shape[0] == 2:
        raise InvalidTransferError(
            f"{what} has shape {shape}: is dim 0 two blocks or K and V? {fix}"
        )
    if len(shape) < 2:
        raise InvalidTransferError(f"{what} has shape {shape}; a KV cache has a block dim "
                                   "and at least one more")
    return 0


def _split(t: Any, block_dim: int, what: str) -> list[Any]:
    """Views of `t` with the blocks first, each one byte range per block: one view, or the
    K and V views when a dim of size 2 separates them in memory."""
    moved = move_to_front(t, block_dim) if block_dim else t
    info = array_info(moved, what)
    if any(st < 0 for sz, st in zip(info.shape, info.strides) if sz > 1):
        raise InvalidTransferError(f"{what}: negative strides {info.strides} are not supported")
    if info.inner_dense():
        return [moved]
    kv = [d for d in range(1, len(info.shape)) if info.shape[d] == 2 and info.inner_dense(skip=d)]
    if len(kv) != 1:
        raise InvalidTransferError(
            f"{what}: with dim {block_dim} as the block dim, a block of shape {info.shape} "
            f"and byte strides {info.strides} is neither one byte range nor K and V halves "
            "split by a dim of size 2; pass another block_dim= or build the layout from "
            "KVTensor/KVRef"
        )
    return [select(moved, kv[0], 0), select(moved, kv[0], 1)]


def _entries(kv_caches: Any) -> list[tuple[str, Any]]:
    """(name, tensor) per layer of a list or a dict of layer name -> tensor."""
    check_list(kv_caches, "from_vllm")
    if isinstance(kv_caches, Mapping):
        items = [(str(k), v) for k, v in kv_caches.items()]
    elif isinstance(kv_caches, Sequence) and not isinstance(kv_caches, (str, bytes)):
        items = [(f"layer {i}", v) for i, v in enumerate(kv_caches)]
    else:
        raise InvalidTransferError(
            "from_vllm takes a list of per-layer tensors or a dict of layer name -> tensor, "
            f"got {type(kv_caches).__name__}"
        )
    if not items:
        raise InvalidTransferError("from_vllm: no layers")
    for name, v in items:
        if not is_array(v):
            raise InvalidTransferError(
                f"from_vllm: {name} is a {type(v).__name__}, not a tensor (each layer needs "
                "one KV tensor; build other caches from KVTensor/KVRef)"
            )
    return items


def vllm_block_views(kv_caches: Any, block_dim: int | None = None) -> Iterator[Any]:
    """The views `KVCacheLayout.from_vllm` makes one `KVTensor` each of, in layer order:
    blocks first, one byte range per block; a layer sharing another's cache is skipped.
    A generator, so each view is checked as the layout takes it."""
    seen: set[tuple[Any, ...]] = set()
    for name, t in _entries(kv_caches):
        t = _viewable(t)
        info = array_info(t, name)
        key = (info.device, info.device_id, info.ptr, info.shape, info.strides, info.itemsize)
        if key in seen:  # a layer that shares another layer's cache (vLLM's KV sharing)
            continue
        seen.add(key)
        dim = (_guess_block_dim(info.shape, name) if block_dim is None
               else _block_dim_arg(block_dim, info.shape, name))
        yield from _split(t, dim, name)
