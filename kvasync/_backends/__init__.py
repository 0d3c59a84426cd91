"""Backends by name: "host" (host memory stands in for the GPU) and "cuda" (CuPy).

A backend module is imported only when asked for, so importing kvasync never touches CUDA.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .._errors import BackendUnavailableError
from ._base import Backend, Direction, Event, HostMemory, Overlap, Stream

__all__ = ["Backend", "Direction", "Event", "HostMemory", "Overlap", "Stream", "load_backend"]

_MODULES = {"host": ("._host", "HostBackend"), "cuda": ("._cuda", "CudaBackend")}


def load_backend(name: str, **options: Any) -> Backend:
    """Instantiate the backend called `name`; BackendUnavailableError if it cannot run here."""
    try:
        module_name, cls_name = _MODULES[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; choose one of {sorted(_MODULES)} or 'auto'"
        ) from None
    try:
        module = import_module(module_name, __name__)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}") from exc
    cls = getattr(module, cls_name)
    backend: Backend = cls(**options)
    return backend
