"""What a run's transfers are measured against: one contiguous copy of the same bytes.

On a GPU a ceiling is one `cudaMemcpyAsync` per direction between pinned host memory (of
the kind kvasync copies from: `backend.alloc_host`) and the device pool; on the host it is
one `memmove` per direction, each on its own thread. The bidirectional ceiling is the best of
a few such pairs (`BOTH_PIECES`, both placements in the buffers). `sync_round_trips` is the
floor under any awaited round trip.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .common import MiB

__all__ = ["Ceilings", "sync_round_trips"]

_H2D, _D2H = 1, 2  # cudaMemcpyKind

#: how the bidirectional ceiling's two copies are issued, each tried with the load in either
#: half of the buffers; the ceiling is the best: one H200 host measured 76.7 GB/s for one
#: pair of whole copies while the bench's own store + load moved 93.8 GB/s in the same run,
#: and another 101.7 for the pair and 100.8 in 64 MiB pieces
BOTH_PIECES: tuple[int | None, ...] = (None, 64 * MiB)


class Ceilings:
    """GB/s of contiguous copies of `total` bytes between host memory (from `alloc_host`,
    `pool_bytes` of it, allocated at first use) and the device pool at `pool_ptr`
    (CuPy `cp` on a GPU; threads on the host), measured once each and cached."""

    def __init__(self, *, gpu: bool, cp: Any, pool_ptr: int, total: int, pool_bytes: int,
                 reps: int, alloc_host: Callable[[int, int], Any],
                 progress: Callable[[str], None]) -> None:
        self.gpu = gpu
        self.cp = cp
        self.pool_ptr = pool_ptr
        self.total = total
        self.pool_bytes = pool_bytes
        self.reps = reps
        self._alloc_host = alloc_host
        self.progress = progress
        #: "h2d", "d2h", "both" -> GB/s, as measured so far
        self.measured: dict[str, float] = {}
        #: the bidirectional variants tried, name -> GB/s (`bidirectional`)
        self.variants: dict[str, float] = {}
        self._host_buf: Any = None

    @property
    def note(self) -> str:
        if self.gpu:
            return "one contiguous cudaMemcpyAsync of the same bytes, pinned host memory"
        return "one contiguous host memmove of the same bytes"

    def ceiling(self, direction: str) -> float:
        """GB/s of one contiguous copy of `total` bytes in `direction` (median, cached)."""
        if direction not in self.measured:
            self.progress(f"ceiling {direction}")
            hptr, dptr = self._host_ptr(), self.pool_ptr
            copy = (dptr, hptr, self.total, _H2D) if direction == "h2d" else (
                hptr, dptr, self.total, _D2H)
            self.measured[direction] = self.total / statistics.median(
                self._timed_copies([copy])) / 1e9
        return self.measured[direction]

    def bidirectional(self) -> float:
        """GB/s (both directions summed) of two contiguous copies of `total` bytes at once,
        one each way: the best of `BOTH_PIECES` x both placements (median each, cached;
        every variant's figure is kept in `variants`)."""
        if "both" not in self.measured:
            self.progress("bidirectional ceiling")
            hptr, dptr, n = self._host_ptr(), self.pool_ptr, self.total
            for load_at, store_at in ((0, n), (n, 0)):
                copies = [(dptr + load_at, hptr + load_at, n, _H2D),
                          (hptr + store_at, dptr + store_at, n, _D2H)]
                for piece in BOTH_PIECES:
                    name = f"load in half {load_at // n}, {_piece_name(piece)}"
                    self.variants[name] = 2 * n / statistics.median(
                        self._timed_copies(copies, piece)) / 1e9
            self.measured["both"] = max(self.variants.values())
        return self.measured["both"]

    def _host_ptr(self) -> int:
        if self._host_buf is None:
            mem = self._alloc_host(self.pool_bytes, MiB)
            if self.gpu and not mem.pinned:
                print("WARNING: the ceiling's host memory is not pinned", file=sys.stderr)
            self._host_buf = mem
        return int(self._host_buf.ptr)

    def _timed_copies(self, copies: list[tuple[int, int, int, int]],
                      piece: int | None = None) -> list[float]:
        """Wall seconds of the (dst, src, bytes, kind) copies run at once, each on its own
        stream (thread on the host) and issued in `piece`-byte calls (None: one call), per
        rep after one warm-up."""
        times: list[float] = []
        streams = [self.cp.cuda.Stream(non_blocking=True) for _ in copies] if self.gpu else []
        split = [_split(c, piece) for c in copies]
        for rep in range(max(self.reps, 3) + 1):
            t0 = time.perf_counter()
            if self.gpu:
                for parts, s in zip(split, streams):
                    for dst, src, n, kind in parts:
                        self.cp.cuda.runtime.memcpyAsync(dst, src, n, kind, s.ptr)
                for s in streams:
                    s.synchronize()
            else:
                threads = [threading.Thread(target=_memmoves, args=(parts,)) for parts in split]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
            if rep:
                times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        """Release the ceiling's host memory."""
        if self._host_buf is not None:
            self._host_buf.release()
            self._host_buf = None


def _split(copy: tuple[int, int, int, int], piece: int | None
           ) -> list[tuple[int, int, int, int]]:
    """`copy` (dst, src, bytes, kind) as consecutive copies of at most `piece` bytes."""
    dst, src, n, kind = copy
    step = piece or n
    return [(dst + o, src + o, min(step, n - o), kind) for o in range(0, n, max(step, 1))]


def _memmoves(parts: list[tuple[int, int, int, int]]) -> None:
    for dst, src, n, _ in parts:
        ctypes.memmove(dst, src, n)


def _piece_name(piece: int | None) -> str:
    return "one call each" if piece is None else f"{piece // MiB} MiB calls"


def sync_round_trips(cp: Any, nbytes: int, reps: int, warm: int) -> list[float]:
    """Seconds of `cudaMemcpyAsync` (pinned host -> device) + `cudaStreamSynchronize`,
    no asyncio: the floor under any awaited round trip (GPU only)."""
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.cuda.alloc(nbytes)
    stream = cp.cuda.Stream(non_blocking=True)
    out: list[float] = []
    for i in range(reps + warm):
        t0 = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(int(dev.ptr), int(host.ptr), nbytes, _H2D, stream.ptr)
        stream.synchronize()
        if i >= warm:
            out.append(time.perf_counter() - t0)
    return out
