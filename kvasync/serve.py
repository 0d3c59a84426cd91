"""``python -m kvasync.serve --pool-bytes N --listen HOST:PORT``: run a `RemotePool`.

Prints one line ``kvasync pool NAME listening on HOST:PORT (N B)`` once it serves, and runs
until SIGINT or SIGTERM, then disconnects its clients, deregisters and frees the pool, and
exits 0. The control port hands out NIXL metadata to whoever connects: loopback (the
default) or a trusted network only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

__all__ = ["main", "spawn"]


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    value = int(float(t[:-1] if t[-1:] in units else t) * mult)
    if value < 1:
        raise argparse.ArgumentTypeError(f"pool size must be >= 1 B, got {text!r}")
    return value


def spawn(pool_bytes: int, listen: str = "127.0.0.1:0", **popen: Any
          ) -> tuple[subprocess.Popen[str], str]:
    """Start a pool owner in a child process; returns it and its control address once it
    serves (RuntimeError, with its stderr where captured, if it exits first). `popen` goes
    to `subprocess.Popen` (e.g. ``stderr=subprocess.PIPE``, ``start_new_session=True``).
    The child shuts down when this process is gone (``--exit-with-parent``): a caller
    killed before it stops the pool leaves no pool running."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvasync.serve", "--pool-bytes", str(pool_bytes),
         "--listen", listen, "--exit-with-parent", str(os.getpid())],
        stdout=subprocess.PIPE, text=True, env=env, **popen)
    assert proc.stdout is not None
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            proc.wait()
            raise RuntimeError(f"the pool did not start: {err}")
    return proc, line.split(" on ")[1].split(" ")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvasync.serve", description=__doc__)
    parser.add_argument("--pool-bytes", type=_size, required=True,
                        help="host memory to serve, e.g. 8GiB or 1073741824")
    parser.add_argument("--listen", default="127.0.0.1:0",
                        help="control address HOST:PORT (port 0: any free port)")
    parser.add_argument("--name", default=None, help="the pool's NIXL agent name")
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                        help="shut down, as on SIGTERM, once PID is no longer this "
                             "process's parent (it died)")
    args = parser.parse_args(argv)

    from .remote import RemotePool

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        pool = RemotePool(args.pool_bytes, args.listen, name=args.name)
    except Exception as exc:  # a pool that cannot start: one line, not a traceback
        print(f"kvasync.serve: {exc}", file=sys.stderr)
        return 1
    try:
        host, port = pool.address
        print(f"kvasync pool {pool.name} listening on {host}:{port} ({pool.pool_bytes} B)",
              flush=True)
        while not stop.wait(0.5):
            if args.exit_with_parent is not None and os.getppid() != args.exit_with_parent:
                break  # re-parented: the process that started us died
    finally:
        pool.close()
    print("kvasync pool closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
