"""Shared fixtures: backend cases (host always; CUDA paths when a GPU is usable)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from support import Gate, Mem


def gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


HAS_GPU = gpu_available()
REQUIRE_GPU = os.environ.get("KVASYNC_REQUIRE_GPU") == "1"

#: (backend, copy_path); CUDA ones carry the gpu mark and skip without a GPU
BACKEND_CASES = [
    pytest.param(("host", "auto"), id="host"),
    pytest.param(("host", "staged"), id="host-staged"),
    *[
        pytest.param(("cuda", p), id=f"cuda-{p}", marks=pytest.mark.gpu)
        for p in ("kernel", "dma", "staged", "auto")
    ],
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    if REQUIRE_GPU:
        raise pytest.UsageError("KVASYNC_REQUIRE_GPU=1 but no usable GPU (cupy.is_available())")
    skip = pytest.mark.skip(reason="needs a CUDA GPU (cupy.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(params=BACKEND_CASES)
def backend_case(request: pytest.FixtureRequest) -> tuple[str, str]:
    case: tuple[str, str] = request.param
    return case


@pytest.fixture
def mem(backend_case: tuple[str, str]) -> Iterator[Mem]:
    yield Mem(backend_case[0])


@pytest.fixture
def names() -> Iterator[Callable[[], str]]:
    """Unique shared-region names for one test; whatever they left in /dev/shm is removed."""
    import uuid

    import region_procs as procs

    from kvasync import SharedHostRegion

    tag = f"t{uuid.uuid4().hex[:12]}"
    count = iter(range(1000))
    yield lambda: SharedHostRegion.new_name(f"{tag}-{next(count)}")
    for f in procs.shm_leftovers(tag):
        os.unlink(os.path.join("/dev/shm", f))


@pytest.fixture
def gate() -> Iterator[Gate]:
    """A held host compute stream (see support.Gate), opened and closed after the test."""
    g = Gate()
    yield g
    g.open()
    g.stream.close()
