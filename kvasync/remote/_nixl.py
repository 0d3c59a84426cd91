"""NIXL, loaded lazily, and the small control protocol between a pool and its clients.

Importing kvasync (or kvasync.remote) never imports NIXL: `nixl()` does, at the first agent,
and names the extra to install when it is missing. The wheels are `nixl-cu13` (module
`nixl_cu13`), `nixl-cu12` (`nixl_cu12`) and the `nixl` meta package (`nixl`); the first that
imports is used.

Control protocol (TCP, one connection per client, kept open while the client is attached):
each message is a 4-byte big-endian length and a JSON object. The client sends
``{"op": "attach", "nbytes": N, "align": A}``; the pool answers ``{"ok": true, "agent": name,
"metadata": base64(agent metadata), "base": address, "nbytes": N}`` or ``{"ok": false,
"error": text}``. The region stays the client's until its connection closes, so a client that
dies frees its rows, and a client sees its pool die as the end of the connection.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from importlib import import_module
from typing import Any

from .._errors import BackendUnavailableError, InvalidTransferError

__all__ = ["MAX_MESSAGE", "new_agent", "nixl", "parse_address", "recv_msg", "send_msg"]

_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_lock = threading.Lock()
_module: Any = None

#: a control message is small (the agent metadata is a few KiB); refuse anything larger
MAX_MESSAGE = 16 << 20


def nixl() -> Any:
    """The NIXL Python module; BackendUnavailableError naming the extra if none imports."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        errors = []
        for name in _MODULES:
            try:
                mod = import_module(name)
                mod.nixl_agent  # noqa: B018 - the meta package without a variant lacks it
            except (ImportError, AttributeError) as exc:
                errors.append(f"{name}: {exc}")
                continue
            if not os.environ.get("NIXL_LOG_LEVEL"):  # it logs every agent at INFO to stdout
                logging.getLogger("nixl").setLevel(logging.WARNING)
            _module = mod
            return mod
        raise BackendUnavailableError(
            "the remote tier needs NIXL: pip install 'kvasync[nixl]' (or nixl-cu12 on CUDA "
            f"12); tried {', '.join(errors)}"
        )


def new_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend, safe to call from several threads (stores and
    loads run on different stream threads).

    NIXL's progress thread is off: it polls without sleeping (a whole core per agent,
    measured: 2.0 s of CPU in 2 s idle). A client's requests progress when it polls their
    state; a pool is the passive side of one-sided reads and writes."""
    mod = nixl()
    sync = mod.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    cfg = mod.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                backends=["UCX"], sync_mode=sync)
    agent = mod.nixl_agent(name, cfg)
    if "UCX" not in agent.backends:
        raise BackendUnavailableError("NIXL's UCX backend plugin could not be instantiated")
    return agent


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """("host", port) from "host:port" (IPv6 as "[::1]:port") or a (host, port) tuple;
    InvalidTransferError (a ValueError) for anything else."""
    if isinstance(address, tuple):
        if (len(address) == 2 and isinstance(address[1], int)
                and not isinstance(address[1], bool) and 0 <= address[1] < 65536):
            return str(address[0]), int(address[1])
    else:
        host, sep, port_text = str(address).rpartition(":")
        if sep and port_text.isdigit() and int(port_text) < 65536:
            return host.strip("[]") or "127.0.0.1", int(port_text)
    raise InvalidTransferError(f"address must be HOST:PORT or (host, port), got {address!r}")


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_MESSAGE:
        raise ValueError(f"control message of {n} B exceeds {MAX_MESSAGE} B")
    body = _recv_exact(sock, n)
    if body is None:
        return None
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError("control message is not a JSON object")
    return msg
