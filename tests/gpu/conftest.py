"""GPU tests: everything marked `gpu` here skips without a usable CUDA GPU.

With KVASYNC_REQUIRE_GPU=1 a missing GPU is an error instead of a skip, so a GPU run
cannot pass by skipping everything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).parent


def _gpu_usable() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


HAS_GPU = _gpu_usable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [
        it for it in items
        if _HERE in Path(str(it.fspath)).parents and it.get_closest_marker("gpu") is not None
    ]
    if HAS_GPU or not mine:
        return
    if os.environ.get("KVASYNC_REQUIRE_GPU") == "1":
        raise pytest.UsageError("KVASYNC_REQUIRE_GPU=1 but cupy.is_available() is False")
    skip = pytest.mark.skip(reason="needs a CUDA GPU (cupy.is_available() is False)")
    for item in mine:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def cp() -> Any:
    import cupy

    return cupy


@pytest.fixture
def backend() -> Iterator[Any]:
    from kvasync._backends._cuda import CudaBackend

    b = CudaBackend(0, tensor_kind="cupy")
    yield b
    b.close()
