"""`RemotePool`: host memory that one process owns, registers with NIXL and lends out.

A pool is one anonymous mapping registered once with NIXL (UCX) as DRAM. Each client that
attaches gets its own region of it, sized by the client (its CPU chunks times its row bytes,
the row layout of an offloader's own host copy), and moves bytes into and out of it with
one-sided NIXL reads and writes. A region is zeroed and returned to the pool when its
client's control connection closes, cleanly or not, so a client never sees another's data.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import os
import socket
import threading
import uuid
from typing import Any

from .._errors import InvalidTransferError
from .._hostmem import host_memory
from ._nixl import new_agent, parse_address, recv_msg, send_msg

__all__ = ["RemotePool"]

log = logging.getLogger("kvasync")

PAGE = 4096


class _Regions:
    """First-fit allocation of byte ranges of the pool (offsets), merged on free."""

    def __init__(self, nbytes: int) -> None:
        self.free: list[tuple[int, int]] = [(0, nbytes)]
        self.lock = threading.Lock()

    def take(self, nbytes: int, align: int) -> int | None:
        with self.lock:
            for i, (start, size) in enumerate(self.free):
                at = -(-start // align) * align
                if at + nbytes <= start + size:
                    rest = [(start, at - start), (at + nbytes, start + size - at - nbytes)]
                    self.free[i : i + 1] = [r for r in rest if r[1] > 0]
                    return at
            return None

    def give(self, start: int, nbytes: int) -> None:
        with self.lock:
            self.free.append((start, nbytes))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for a, n in self.free:
                if merged and merged[-1][0] + merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((a, n))
            self.free = merged

    @property
    def free_bytes(self) -> int:
        with self.lock:
            return sum(n for _, n in self.free)


class RemotePool:
    """Owns `pool_bytes` of host memory, registered with NIXL, served on `listen`.

    `listen` is "HOST:PORT" or (host, port); port 0 picks a free port (see `address`). The
    control port hands NIXL metadata (addresses of this process's memory) to whoever
    connects: bind it to loopback or a trusted network only. `close()` (idempotent) stops
    serving, drops every client, deregisters and frees the memory.
    """

    def __init__(self, pool_bytes: int, listen: str | tuple[str, int] = "127.0.0.1:0",
                 name: str | None = None) -> None:
        if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes < 1:
            raise InvalidTransferError(f"pool_bytes must be an int >= 1, got {pool_bytes!r}")
        host, port = parse_address(listen)
        self.name = name or f"kvasync-pool-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self._mem = host_memory(pool_bytes, PAGE)
        except OSError as exc:
            raise InvalidTransferError(
                f"cannot allocate a pool of {pool_bytes} B of host memory: {exc}") from exc
        self.pool_bytes = self._mem.nbytes
        self._agent: Any = None
        self._reg: Any = None
        self._lock = threading.Lock()
        self._clients: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        try:
            self._agent = new_agent(self.name)
            self._reg = self._agent.register_memory(
                [(self._mem.ptr, self._mem.nbytes, 0, "")], "DRAM")
            self._metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
            self._regions = _Regions(self.pool_bytes)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(64)
        except BaseException as exc:
            sock = getattr(self, "_sock", None)
            if sock is not None:
                sock.close()
            self._release()
            if isinstance(exc, OSError) and sock is not None:  # say which address
                raise OSError(exc.errno, f"{exc.strerror}: {host}:{port}") from exc
            raise
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="kvasync-pool-accept")
        self._accepter.start()
        self._progress = threading.Thread(target=self._progress_loop, daemon=True,
                                          name="kvasync-pool-progress")
        self._progress.start()

    #: seconds between the pool's progress calls. The passive side of a transfer must make
    #: progress too (connection set-up, UCX's rendezvous over shared memory or TCP); NIXL's
    #: own progress thread would do it without sleeping, a core per pool. Measured on 2 CPU
    #: cores, DRAM loopback: 1 ms moved what the busy thread moved (0.4 -> 1.2, 6, 8.6 GB/s at
    #: 4 KiB, 64 KiB, 1 MiB pages) for 5% of a core; 5 ms halved it.
    PROGRESS_TICK = 1e-3

    def _progress_loop(self) -> None:
        while not self._stop.wait(self.PROGRESS_TICK):
            try:
                self._agent.get_new_notifs()
            except Exception as exc:  # keep serving; a broken agent shows up in transfers
                log.warning("kvasync pool: progress failed: %s", exc)
                self._stop.wait(0.1)

    @property
    def free_bytes(self) -> int:
        """Bytes not lent to any attached client."""
        return self._regions.free_bytes

    @property
    def num_clients(self) -> int:
        with self._lock:
            return len(self._clients)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name="kvasync-pool-client")
                self._clients[conn] = t
            try:
                t.start()
            except RuntimeError as exc:  # no thread left to serve it (a flood): refuse it
                log.warning("kvasync pool: refused a client: %s", exc)
                with self._lock:
                    self._clients.pop(conn, None)
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        """One client: attach requests, then wait for the connection to end."""
        held: list[tuple[int, int]] = []
        try:
            while True:
                msg = recv_msg(conn)
                if msg is None:
                    return
                send_msg(conn, self._answer(msg, held))
        except (OSError, ValueError) as exc:
            log.debug("kvasync pool: client dropped: %s", exc)
        finally:
            for start, n in held:
                if self._closed:  # the pool is going: no next client, and no memory soon
                    break
                # the next client must not read this one's KV: zero before lending again
                # (a memset: dropping the pages could leave NIXL's registration stale)
                ctypes.memset(self._mem.ptr + start, 0, n)
                self._regions.give(start, n)
            with self._lock:
                self._clients.pop(conn, None)
            try:
                conn.close()
            except OSError:
                pass

    def _answer(self, msg: dict[str, Any], held: list[tuple[int, int]]) -> dict[str, Any]:
        if msg.get("op") != "attach":
            return {"ok": False, "error": f"unknown op {msg.get('op')!r}"}
        nbytes, align = msg.get("nbytes"), msg.get("align", PAGE)
        if (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1
                or not isinstance(align, int) or not 1 <= align <= 1 << 30):
            return {"ok": False, "error": f"bad attach request {msg!r}"}
        start = self._regions.take(nbytes, align)
        if start is None:
            return {"ok": False, "error": f"the pool has no free region of {nbytes} B "
                    f"({self.free_bytes} of {self.pool_bytes} B free)"}
        held.append((start, nbytes))
        return {"ok": True, "agent": self.name, "metadata": self._metadata,
                "base": self._mem.ptr + start, "nbytes": nbytes}

    def close(self) -> None:
        """Stop serving, disconnect clients, deregister and free the pool (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients = list(self._clients.items())
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._accepter.join(timeout=10)
        self._stop.set()
        self._progress.join(timeout=10)
        for conn, _ in clients:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        stuck = 0
        for _, thread in clients:  # one still zeroing a region writes into the pool
            if thread.ident is None:  # never started (refused above): nothing to wait for
                continue
            thread.join(timeout=120)
            stuck += thread.is_alive()
        if stuck:  # never unmap under it: the process's exit frees the memory
            log.error("kvasync pool: %d client thread(s) did not end in 120 s; the pool's "
                      "memory stays mapped", stuck)
            return
        self._release()

    def _release(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None and self._reg is not None:
            try:
                agent.deregister_memory(self._reg)
            except Exception as exc:  # the process is going away; the memory goes with it
                log.warning("kvasync pool: deregistering failed: %s", exc)
        self._reg = None
        del agent
        self._mem.release()

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.address[0]}:{self.address[1]}"
        return f"<RemotePool {self.name} {self.pool_bytes} B {state}>"
