"""remote: GB/s through the remote tier (NIXL to a pool in another process) by page size and
direction, beside the local ``staged`` path over the same blocks.

The pool is ``python -m kvasync.serve`` started for the section (loopback: on one machine its
memory is this machine's DRAM, so the rows measure NIXL's transport, not a network). Each
transfer moves about ``min(total, 256 MiB)`` of random blocks; GB/s is wall time from the call
until done, and ``ratio`` is to this run's single-copy ceiling of the direction. Skipped where
NIXL is not installed (``pip install 'kvasync[nixl]'``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import kvasync as kv

from ..common import DIRECTIONS, MiB, Row, Section, bandwidth_row
from ..context import Context

#: bytes per timed transfer at most (loopback NIXL moves a few GB/s)
REMOTE_BYTES = 256 * MiB


def _nixl_missing() -> str | None:
    try:
        from kvasync.remote._nixl import nixl

        nixl()
    except Exception as exc:  # not installed, or not loadable here
        return f"NIXL is not available ({type(exc).__name__}: {exc})"
    return None


def _time(off: Any, direction: str, gpu: Any, cpu: Any, reps: int) -> tuple[list[float], int]:
    samples: list[float] = []
    moved = 0
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        if direction == "d2h":
            r = off.store(gpu_blocks=gpu, cpu_chunks=cpu).wait(120)
        else:
            r = off.load(cpu_chunks=cpu, gpu_blocks=gpu).wait(120)
        if rep:
            samples.append(time.perf_counter() - t0)
        moved = r.bytes
    return samples, moved


def run(ctx: Context) -> list[Row]:
    from kvasync.remote import RemoteOffloader

    nbytes = min(ctx.total, REMOTE_BYTES)
    rows: list[Row] = []
    from kvasync.serve import spawn

    proc, address = spawn(nbytes + 64 * MiB)
    try:
        for page in ctx.opts.pages:
            local = ctx.offloader(page)
            gpu, _ = ctx.ids(page, nbytes)
            cpu = ctx.rng.permutation(len(gpu))  # the pool holds just these chunks
            chunks = len(gpu)
            views = ctx.pool_views(page, ctx.tensors)
            remote = RemoteOffloader(kv.KVCacheLayout.from_tensors(views), chunks, peer=address)
            try:
                for direction in DIRECTIONS:
                    ctx.progress(f"remote {page} {direction}")
                    samples, moved = _time(remote, direction, gpu, cpu, ctx.reps)
                    rows.append(bandwidth_row("remote", "nixl", direction, page, samples, moved,
                                              ctx.ceiling(direction), note="NIXL loopback",
                                              extra={"blocks": len(gpu)}))
                    try:
                        t = ctx.time_transfer(local, direction, gpu, cpu, "staged")
                    except kv.InvalidTransferError as exc:  # a row beyond a staging buffer
                        print(f"remote: local staged {page} {direction} not run: {exc}",
                              file=sys.stderr)
                        continue
                    rows.append(bandwidth_row("remote", "staged", direction, page, t.samples,
                                              t.nbytes, ctx.ceiling(direction),
                                              t.device_seconds, "local staged path",
                                              {"blocks": len(gpu)}))
            finally:
                remote.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


SECTION = Section("remote", run, (),
                  "GB/s through NIXL to a pool process vs the local staged path",
                  missing=_nixl_missing)
