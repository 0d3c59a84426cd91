"""Fixtures of the remote-tier tests: one pool process per module (loopback, DRAM)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from remote_support import HAS_NIXL, PoolProcess, pool_process


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    if not HAS_NIXL:
        pytest.skip("NIXL is not installed (kvasync[nixl])")
    with pool_process() as p:
        yield p
