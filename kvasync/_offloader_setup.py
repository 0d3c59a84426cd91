"""What the offloader's constructor makes of its arguments, checked in the order it reads them.

`host_geometry` checks the sizes and returns each tensor's sub-block bytes in the host copy
and the number of chunks (given, or as many as `cpu_bytes` holds); `open_backend` opens the
backend, sets its staging memory, checks the copy path and registers the KV tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._arguments import check_sizes, check_staging_bytes, chunks_for, host_chunks, pick_backend
from ._backends import Backend, load_backend
from ._errors import InvalidTransferError
from ._hostmem import row_offsets
from ._layout import KVCacheLayout

__all__ = ["host_geometry", "open_backend"]


def host_geometry(
    layout: Any,
    num_cpu_chunks: int | None,
    blocks_per_chunk: int,
    cpu_bytes: int | None,
    canonical: bool,
    max_streams: int,
    copy_path: str,
    host_region: Any | None,
    host_tensors: Sequence[Any] | None,
) -> tuple[list[int], int]:
    """(bytes of each tensor's block in the host copy, chunks per tensor), sizes checked."""
    if not isinstance(layout, KVCacheLayout):
        raise InvalidTransferError(f"layout must be a KVCacheLayout, got {type(layout)}")
    num_cpu_chunks = host_chunks(host_tensors, host_region, num_cpu_chunks, cpu_bytes,
                                 copy_path)
    check_sizes(num_cpu_chunks, cpu_bytes, blocks_per_chunk, max_streams,
                layout._guard.check)  # its tensors still own the memory the layout read
    canon_sizes = layout.canonical_bytes_per_block() if canonical else None
    sizes = canon_sizes if canon_sizes is not None else [t.page for t in layout.tensors]
    row = row_offsets(layout, [s * int(blocks_per_chunk) for s in sizes])[1]
    chunks = chunks_for(num_cpu_chunks, cpu_bytes, row, len(sizes), int(blocks_per_chunk))
    return list(sizes), chunks


def open_backend(
    layout: KVCacheLayout,
    backend: str | Backend,
    staging_bytes: int | None,
    copy_path: str,
    compute_stream: Any | None,
) -> Backend:
    """The backend (`backend` itself, or the one its name picks for the layout's device),
    with `staging_bytes` set, `copy_path` checked, the KV tensors checked and registered and
    `compute_stream` validated."""
    first = layout.tensors[0].info
    if isinstance(backend, Backend):
        opened = backend
    else:
        opened = load_backend(pick_backend(backend, layout.device),
                              tensor_kind=first.kind, device_id=first.device_id)
    staging = check_staging_bytes(staging_bytes)
    if staging is not None and hasattr(opened, "staging_bytes"):
        opened.staging_bytes = int(staging)
    if copy_path != "auto" and copy_path not in opened.paths:
        raise InvalidTransferError(
            f"copy_path {copy_path!r} is not one of {('auto', *opened.paths)}"
        )
    for i, t in enumerate(layout.tensors):
        opened.check_device_array(t.info, f"KV tensor {i}")
        opened.register_array(t.info)
    opened.compute_stream(compute_stream)  # validate early
    return opened
