"""Shared helpers for the remote-tier tests: NIXL availability and pool processes."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvasync.serve import spawn


def nixl_available() -> bool:
    try:
        from kvasync.remote._nixl import nixl

        nixl()
        return True
    except Exception:
        return False


HAS_NIXL = nixl_available()
needs_nixl = pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed (kvasync[nixl])")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PoolProcess:
    """`python -m kvasync.serve` in a child process (its own process group)."""

    def __init__(self, pool_bytes: int = 256 << 20) -> None:
        self.proc, self.address = spawn(pool_bytes, stderr=subprocess.PIPE,
                                        start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> tuple[int, str, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=20)


@contextmanager
def pool_process(pool_bytes: int = 256 << 20) -> Iterator[PoolProcess]:
    pool = PoolProcess(pool_bytes)
    try:
        yield pool
    finally:
        if pool.proc.poll() is None:
            rc, _, err = pool.stop()
            assert rc == 0, err
