"""The NIXL backend's link to the pool and its NIXL requests.

`PeerLink` is the control connection to the pool: a thread blocks on it, and its end means
the pool is gone (`lost` is set, `error` says why). `NixlRequests` posts one NIXL request
of descriptor lists (WRITE for stores, READ for loads) and waits for it by polling
`check_xfer_state` with a sleep that grows from `POLL_FIRST` to `POLL_MAX`, so a waiting
stream costs no core; a request that NIXL reports as failed, that outlives the timeout, or
whose pool went away raises `TransferFailedError`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import numpy as np

from .._backends._base import Direction
from .._backends._host import AddressRanges
from .._errors import TransferFailedError
from ._descriptors import desc_rows

__all__ = ["NixlRequests", "PeerLink"]

log = logging.getLogger("kvasync")


class PeerLink:
    """The control connection to the pool at `peer`, and whether the pool is still there."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.lost = threading.Event()
        self.error = ""
        #: set by the backend's close(): the connection's end is then no failure
        self.closed = False
        self.watcher: threading.Thread | None = None

    def watch(self) -> None:
        """Start the thread that watches the connection (once attached)."""
        self.watcher = threading.Thread(target=self._watch, daemon=True,
                                        name="kvasync-nixl-peer")
        self.watcher.start()

    def _watch(self) -> None:
        """Block on the control connection; its end means the pool is gone."""
        try:
            while True:
                if not self.sock.recv(4096):
                    break
        except OSError:
            pass
        if not self.closed:
            self.error = f"the pool at {self.peer} went away (control connection ended)"
            log.warning("kvasync: %s", self.error)
        self.lost.set()

    def check(self) -> None:
        """Raise where the pool went away or the backend was closed."""
        if self.lost.is_set():
            raise TransferFailedError(self.error or "the remote offloader is closed")

    def drop(self) -> None:
        """Half-close the control connection and wait (bounded) for the pool to close its
        end: it does so after zeroing and taking back this client's region, so when close()
        returns the region is free for the next client."""
        watcher = self.watcher  # none yet while attaching
        try:
            self.sock.shutdown(socket.SHUT_WR if watcher is not None else socket.SHUT_RDWR)
        except OSError:
            pass
        if watcher is not None:
            watcher.join(timeout=10)
        self.sock.close()

    @property
    def watching(self) -> bool:
        return self.watcher is not None and self.watcher.is_alive()


class NixlRequests:
    """Posts NIXL requests between local memory (`local_bounds`, on `device`) and the
    attached region (`remote_bounds`) of the pool's agent `peer_name`, and waits for them."""

    #: the poll's sleep: from the first to the last value, doubling
    POLL_FIRST = 20e-6
    POLL_MAX = 1e-3

    def __init__(self, agent: Any, peer_name: Any, link: PeerLink,
                 local_bounds: AddressRanges, remote_bounds: AddressRanges, *,
                 device: str, device_id: int, timeout: float) -> None:
        self.agent = agent
        self.peer_name = peer_name
        self.link = link
        self.local_bounds = local_bounds
        self.remote_bounds = remote_bounds
        self.device = device
        self.device_id = device_id
        self.timeout = timeout
        self._lock = threading.Lock()
        #: NIXL descriptors and requests posted so far (how many runs the transfers became)
        self.descriptors_posted = 0
        self.requests_posted = 0
        #: requests NIXL would not release (a timed-out one it could not cancel): in all,
        #: and per posting thread (`stuck_here`: a transfer asks about its own requests)
        self.stuck = 0
        self._here = threading.local()

    def post(self, direction: Direction, local: np.ndarray, remote: np.ndarray,
             sizes: np.ndarray, deadline: float) -> None:
        """Post one NIXL request of these descriptor lists (bounds-checked) and wait for it."""
        op = "WRITE" if direction == "d2h" else "READ"
        self.local_bounds.check(local, sizes, "local descriptor")
        self.remote_bounds.check(remote, sizes, "remote descriptor")
        mem = "VRAM" if self.device == "cuda" else "DRAM"
        dev = self.device_id if mem == "VRAM" else 0
        with self._lock:
            self.descriptors_posted += len(sizes)
            self.requests_posted += 1
        self.link.check()
        try:
            handle = self.agent.initialize_xfer(
                op, self.agent.get_xfer_descs(desc_rows(local, sizes, dev), mem),
                self.agent.get_xfer_descs(desc_rows(remote, sizes, 0), "DRAM"),
                self.peer_name)
        except Exception as exc:
            raise TransferFailedError(f"NIXL refused the {op}: {exc}") from exc
        try:
            if self.agent.transfer(handle) == "ERR":
                raise TransferFailedError(f"NIXL failed to post the {op}")
            self._wait(handle, op, deadline)
        finally:
            self._release(handle)

    def stuck_here(self) -> int:
        """Requests posted from this thread that NIXL would not release."""
        return int(getattr(self._here, "stuck", 0))

    def _wait(self, handle: Any, op: str, deadline: float) -> None:
        delay = self.POLL_FIRST
        while True:
            state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                return
            if state != "PROC":
                raise TransferFailedError(f"NIXL reported the {op} as failed ({state})")
            self.link.check()
            if time.monotonic() > deadline:
                raise TransferFailedError(
                    f"the {op} to {self.link.peer} did not finish within {self.timeout} s")
            self.link.lost.wait(delay)
            delay = min(delay * 2, self.POLL_MAX)

    def _release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:  # still active and not cancellable: the agent keeps it
            log.debug("kvasync: releasing a NIXL request failed: %s", exc)
            with self._lock:
                self.stuck += 1  # its local memory may still be read or written
            self._here.stuck = self.stuck_here() + 1
