"""Shared helpers for the remote-tier tests: NIXL availability and pool processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


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
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvasync.serve", "--pool-bytes", str(pool_bytes),
             "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = ""
        while "listening on" not in line:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"the pool did not start: {err}")
        self.address = line.split(" on ")[1].split(" ")[0]

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
