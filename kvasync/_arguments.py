"""Checks of the public calls' arguments that are not about the request itself.

`ids_by_keyword` makes the ids of `store`/`load` keyword-only with a TypeError that shows
the right call; `chunks_for` turns a host-copy size given in bytes into whole chunks;
`check_sizes`, `check_staging_bytes` and `layer_spec` check the offloader's sizes and a
layer-wise load's layers.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from ._errors import BackendUnavailableError, InvalidTransferError

__all__ = [
    "check_job_id",
    "check_sizes",
    "check_staging_bytes",
    "chunks_for",
    "host_chunks",
    "ids_by_keyword",
    "layer_spec",
    "pick_backend",
]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def ids_by_keyword(example: str) -> Callable[[_Method], _Method]:
    """Refuse positional ids with a TypeError that shows the keyword call.

    `store` takes GPU blocks then CPU chunks and `load` the reverse, so positional ids
    meant for the other call would copy the wrong blocks without any error.
    """

    def decorate(method: _Method) -> _Method:
        @functools.wraps(method)
        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
            if args:
                raise TypeError(
                    f"Offloader.{method.__name__}() takes its ids by keyword only: {example} "
                    f"(got {len(args)} positional argument{'s' if len(args) > 1 else ''})"
                )
            return method(self, **kwargs)

        return cast(_Method, checked)

    return decorate


def check_job_id(job_id: Any) -> None:
    """A job id is an int (or None: the offloader's counter draws one)."""
    if job_id is not None and (isinstance(job_id, bool) or not isinstance(job_id, int)):
        raise InvalidTransferError(f"job_id must be an int, got {job_id!r}")


def chunks_for(
    num_cpu_chunks: int | None, cpu_bytes: int | None, row_bytes: int, num_tensors: int,
    blocks_per_chunk: int,
) -> int:
    """Chunks per tensor: `num_cpu_chunks`, or as many whole chunks as `cpu_bytes` holds
    (`row_bytes`: one chunk of every tensor as the host rows lay it out, alignment
    included)."""
    if num_cpu_chunks is not None:
        return int(num_cpu_chunks)
    assert cpu_bytes is not None
    chunks = int(cpu_bytes) // row_bytes
    if chunks < 1:
        raise InvalidTransferError(
            f"cpu_bytes={cpu_bytes} holds no whole chunk: one chunk of the {num_tensors} KV "
            f"tensors ({blocks_per_chunk} block(s) each) takes {row_bytes} B"
        )
    return chunks


def host_chunks(
    host_tensors: Any, host_region: Any, num_cpu_chunks: Any, cpu_bytes: Any,
    copy_path: str = "auto",
) -> Any:
    """`num_cpu_chunks` as given; with `host_tensors` (which are the host copy, so neither
    `host_region` nor `cpu_bytes` may come too) by default the rows they all have. They are
    one array per tensor, not chunk rows, so `copy_path="staged"` is refused with them."""
    if host_tensors is None:
        return num_cpu_chunks
    if host_region is not None or cpu_bytes is not None:
        raise InvalidTransferError(
            "host_tensors are the host copy: give neither host_region nor cpu_bytes with them"
        )
    if copy_path == "staged":
        raise InvalidTransferError(
            "copy_path 'staged' needs host memory in chunk rows; host_tensors are one array "
            "per KV tensor: use copy_path='auto' (or 'kernel'/'dma' on CUDA)"
        )
    if num_cpu_chunks is not None:
        return num_cpu_chunks
    if not isinstance(host_tensors, (list, tuple)) or not host_tensors:
        raise InvalidTransferError("host_tensors must be a non-empty list, one per KV tensor")
    shapes: list[tuple[int, ...]] = [tuple(getattr(x, "shape", ())) for x in host_tensors]
    if not all(shapes):
        raise InvalidTransferError(
            "host_tensors must each be a NumPy array or a CPU torch tensor with rows"
        )
    rows = {int(s[0]) for s in shapes}
    if len(rows) != 1:
        raise InvalidTransferError(
            f"host_tensors have different row counts {sorted(rows)}: pass num_cpu_chunks"
        )
    return rows.pop()


def check_sizes(
    num_cpu_chunks: Any, cpu_bytes: Any, blocks_per_chunk: Any, max_streams: Any,
    check_layout: Callable[[], None],
) -> None:
    """The offloader's sizes: exactly one of `num_cpu_chunks` and `cpu_bytes`, every size an
    int >= 1. `check_layout` runs between the two checks (the order of the errors)."""
    if (num_cpu_chunks is None) == (cpu_bytes is None):
        raise InvalidTransferError(
            "give the host copy's size as num_cpu_chunks or as cpu_bytes (exactly one), "
            f"got num_cpu_chunks={num_cpu_chunks!r}, cpu_bytes={cpu_bytes!r}"
        )
    check_layout()
    for name, value, low in (
        ("num_cpu_chunks", num_cpu_chunks, 1),
        ("cpu_bytes", cpu_bytes, 1),
        ("blocks_per_chunk", blocks_per_chunk, 1),
        ("max_streams", max_streams, 1),
    ):
        if value is None and name in ("num_cpu_chunks", "cpu_bytes"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InvalidTransferError(f"{name} must be an int >= {low}, got {value!r}")


def check_timeout(timeout: float | None) -> float | None:
    """A timeout is None or a number of seconds (<= 0: do not wait; beyond what a lock wait
    takes, inf included: no limit, None), checked before anything is shut."""
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, (int, float, np.integer,
                                                            np.floating))
                                or timeout != timeout):  # NaN
        raise InvalidTransferError(f"timeout must be None or a number of seconds, got "
                                   f"{timeout!r}")
    return None if timeout is None or timeout >= threading.TIMEOUT_MAX else float(timeout)


def check_staging_bytes(staging_bytes: int | None) -> int | None:
    """`staging_bytes` as given (None: the backend's default), refused unless an int >= 2."""
    if staging_bytes is not None and (
            isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int)
            or staging_bytes < 2):
        raise InvalidTransferError(f"staging_bytes must be an int >= 2, got {staging_bytes!r}")
    return staging_bytes


def layer_spec(layers: Sequence[Sequence[int]] | None, n: int) -> list[list[int]]:
    """The layers of a layer-wise load: tensor indices, every one of the `n` exactly once
    (default: one layer per tensor); InvalidTransferError otherwise."""
    if layers is None:
        return [[i] for i in range(n)]

    def index(i: object) -> int | None:  # NumPy integers too (a layer may be an array)
        ok = isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
        return int(cast(int, i)) if ok else None

    try:
        spec = [[index(i) for i in x] for x in layers]
    except TypeError:
        spec = [[None]]
    flat = sorted((i for layer in spec for i in layer), key=lambda v: (v is None, v or 0))
    if flat != list(range(n)) or any(not layer for layer in spec):
        raise InvalidTransferError(
            f"layers must partition the {n} tensor indices into non-empty groups of ints, "
            f"got {layers!r}"
        )
    return cast("list[list[int]]", spec)


def pick_backend(name: str, device: str) -> str:
    """The backend `name` asks for; "auto": "host" for host tensors, "cuda" for CUDA ones
    (BackendUnavailableError where CuPy cannot use the GPU)."""
    if name != "auto":
        return name
    if device != "cuda":
        return "host"
    try:
        import cupy

        if cupy.is_available():
            return "cuda"
    except ImportError:
        pass
    raise BackendUnavailableError(
        "the KV tensors are CUDA tensors but CuPy cannot use the GPU; install "
        "kvasync[cuda12] or kvasync[cuda13]"
    )
