"""Checks of the public calls' arguments that are not about the request itself.

`ids_by_keyword` makes the ids of `store`/`load` keyword-only with a TypeError that shows
the right call; `chunks_for` turns a host-copy size given in bytes into whole chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ._errors import InvalidTransferError

__all__ = ["chunks_for", "ids_by_keyword"]

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


def chunks_for(
    num_cpu_chunks: int | None, cpu_bytes: int | None, pages: list[int], blocks_per_chunk: int
) -> int:
    """Chunks per tensor: `num_cpu_chunks`, or as many whole chunks as `cpu_bytes` holds."""
    if num_cpu_chunks is not None:
        return int(num_cpu_chunks)
    assert cpu_bytes is not None
    per_chunk = sum(pages) * blocks_per_chunk  # one chunk of every tensor
    chunks = int(cpu_bytes) // per_chunk
    if chunks < 1:
        raise InvalidTransferError(
            f"cpu_bytes={cpu_bytes} holds no whole chunk: one chunk of the {len(pages)} KV "
            f"tensors ({blocks_per_chunk} block(s) each) takes {per_chunk} B"
        )
    return chunks
