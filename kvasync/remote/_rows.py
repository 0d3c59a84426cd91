"""Local staging rows of the remote tier: host buffers in the pool's row layout.

A transfer staged through rows packs its pages into a staging buffer (stores) or unpacks
them from one (loads); NIXL moves the buffer's runs to or from the pool. Buffers are
allocated on first use, registered with NIXL once, and reused: a stream thread takes one
for the length of a transfer and gives it back, so concurrent transfers (stores and loads,
urgent lanes, several streams of a lane) never share one and no lock is held while NIXL
works. There are at most as many buffers as transfers ever ran at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._hostmem import host_memory

__all__ = ["StagingRows"]

PAGE = 4096


class StagingRows:
    """Free list of `slab_bytes` host buffers; `register(ptr, nbytes)` is called once per
    new buffer (it returns the registration `deregister` later takes)."""

    def __init__(self, slab_bytes: int, register: Callable[[int, int], Any],
                 deregister: Callable[[Any], None]) -> None:
        self.slab_bytes = int(slab_bytes)
        self._register = register
        self._deregister = deregister
        self._free: list[Any] = []
        self._all: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        """A buffer (`.ptr`, `.nbytes`) for one transfer; give it back with `give`."""
        with self._lock:
            if self._free:
                return self._free.pop()
        mem = host_memory(self.slab_bytes, PAGE)
        try:
            reg = self._register(mem.ptr, mem.nbytes)
        except BaseException:
            mem.release()
            raise
        with self._lock:
            self._all.append((mem, reg))
        return mem

    def give(self, mem: Any) -> None:
        with self._lock:
            self._free.append(mem)

    @property
    def count(self) -> int:
        """Buffers allocated so far."""
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        """Deregister and free every buffer (call once no transfer runs)."""
        with self._lock:
            bufs, self._all, self._free = self._all, [], []
        for mem, reg in bufs:
            try:
                self._deregister(reg)
            finally:
                mem.release()
