"""Fixtures of the GPU tests. The skip of `gpu`-marked tests without a usable GPU (and
KVASYNC_REQUIRE_GPU=1 turning it into an error) lives in tests/conftest.py, for all tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


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
