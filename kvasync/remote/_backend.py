"""`NixlBackend`: the backend seam over NIXL, so the scheduler runs remote transfers as is.

The scheduler's rules (per-direction FIFO through end events, urgent lanes, compute-stream
waits, failures sticking to the transfer that caused them and breaking its direction) come
for free when a NIXL transfer is just another copy on a stream:

- a stream is a `HostStream` (one ordered worker thread); a copy on it builds the NIXL
  descriptor lists of a plan, posts NIXL requests (WRITE for stores, READ for loads) and
  waits for each by polling `check_xfer_state` with a sleep that grows from 20 us to 1 ms, so
  a waiting stream costs no core (`_requests.py`); the events are `HostEvent`s, so the
  completion threads sleep in blocking waits as on the host backend;
- a request that NIXL reports as failed, that outlives `timeout`, or whose pool went away
  (its control connection ended) raises on the stream: its transfer fails, every transfer
  queued behind it in the direction fails, and nothing waits forever.

Local memory is the KV tensors (DRAM on the host, VRAM on a GPU), registered with NIXL when
the offloader registers them; remote memory is the region of a `RemotePool` this backend
attached to. On the host, descriptors are the copy program's runs over the pool's chunk
rows (`_descriptors.py`): pages are packed into (stores) or unpacked from (loads) a local
staging buffer of the same rows (`_rows.py`), and each run of rows, or of a partly covered
row's covered bytes, is one descriptor. CUDA tensors (VRAM), and plans that are not rows,
post the plan's coalesced descriptors straight from the tensors' pages.
"""

from __future__ import annotations

import base64
import ctypes
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._backends._base import Backend, Direction, Event, HostMemory, Stream
from .._backends._host import AddressRanges, HostEvent, HostStream
from .._errors import BackendUnavailableError, InvalidTransferError
from .._program import kernel_plan
from ._descriptors import page_descriptors, remote_program, run_descriptors
from ._nixl import new_agent, parse_address, recv_msg, send_msg
from ._requests import NixlRequests, PeerLink
from ._rows import StagingRows
from ._streams import _NixlStream, _TorchCompute

if TYPE_CHECKING:
    from .._arrays import ArrayInfo
    from .._program import TransferPlan

__all__ = ["NixlBackend"]

log = logging.getLogger("kvasync")


class NixlBackend(Backend):
    """Local tensors <-> a region of a remote pool, through one NIXL agent (UCX).

    Connecting attaches a region of `nbytes` (aligned to `align`) of the pool at `peer`; it
    is the pool's until `close()` or until this process ends.
    """

    name = "nixl"
    paths = ("nixl",)
    poll_from_await = False
    reads_plan_later = True
    #: completion-time prediction seeds of the scheduler (learned from completed transfers)
    initial_bandwidth = 2e9
    initial_latency = 200e-6

    def __init__(self, peer: str | tuple[str, int], nbytes: int, align: int = 4096, *,
                 device: str = "cpu", device_id: int = -1, timeout: float = 30.0,
                 connect_timeout: float = 10.0, staging_bytes: int = 16 << 20) -> None:
        self.device = device
        self.device_id = max(int(device_id), 0)
        self.timeout = float(timeout)
        self._streams: list[_NixlStream] = []
        self._regs: list[Any] = []
        self._bounds = AddressRanges("the registered memory")
        self._lock = threading.Lock()
        self._closed = False
        self._staging = StagingRows(staging_bytes, self._register_staging,
                                    self._deregister_staging)
        host, port = parse_address(peer)
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise BackendUnavailableError(f"cannot reach the pool at {host}:{port}: {exc}"
                                          ) from exc
        self._link = PeerLink(sock, f"{host}:{port}")
        self._agent: Any = None
        try:
            send_msg(sock, {"op": "attach", "nbytes": int(nbytes), "align": int(align)})
            reply = recv_msg(sock)
            if reply is None:
                raise BackendUnavailableError(f"the pool at {host}:{port} closed the connection")
            if not reply.get("ok"):
                raise InvalidTransferError(f"the pool at {host}:{port} refused: "
                                           f"{reply.get('error')}")
            self.remote_base = int(reply["base"])
            self.remote_nbytes = int(reply["nbytes"])
            self._remote_bounds = AddressRanges("the registered memory")
            self._remote_bounds.add(self.remote_base, self.remote_base + self.remote_nbytes)
            self._agent = new_agent(f"kvasync-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self.peer_name = self._agent.add_remote_agent(
                base64.b64decode(reply["metadata"]))
            sock.settimeout(None)
        except OSError as exc:
            self._link.drop()
            raise BackendUnavailableError(f"attaching to the pool at {host}:{port}: {exc}"
                                          ) from exc
        except BaseException:
            self._link.drop()
            raise
        self.peer = f"{host}:{port}"
        self._requests = NixlRequests(self._agent, self.peer_name, self._link, self._bounds,
                                      self._remote_bounds, device=self.device,
                                      device_id=self.device_id, timeout=self.timeout)
        self._link.watch()

    # -- the pool's liveness -------------------------------------------------------------------
    @property
    def peer_lost(self) -> threading.Event:
        """Set once the pool went away (its control connection ended) or on close()."""
        return self._link.lost

    @property
    def peer_error(self) -> str:
        return self._link.error

    @property
    def descriptors_posted(self) -> int:
        """NIXL descriptors posted so far (how many runs the transfers became)."""
        return self._requests.descriptors_posted

    @property
    def requests_posted(self) -> int:
        return self._requests.requests_posted

    # -- memory ------------------------------------------------------------------------------
    def check_device_array(self, info: ArrayInfo, what: str) -> None:
        want = "cuda" if self.device == "cuda" else "cpu"
        if info.device != want:
            raise InvalidTransferError(
                f"{what}: this remote offloader moves {want} memory, got {info.device} memory")

    def register_array(self, info: ArrayInfo) -> None:
        span = self._bounds.add_array(info)
        if span is None:
            return
        lo, hi = span
        mem = "VRAM" if self.device == "cuda" else "DRAM"
        with self._lock:
            self._regs.append(self._agent.register_memory(
                [(lo, hi - lo, self.device_id if mem == "VRAM" else 0, "")], mem))

    def _register_staging(self, ptr: int, nbytes: int) -> Any:
        reg = self._agent.register_memory([(ptr, nbytes, 0, "")], "DRAM")
        self._bounds.add(ptr, ptr + nbytes)
        return reg

    def _deregister_staging(self, reg: Any) -> None:
        try:
            self._agent.deregister_memory(reg)
        except Exception as exc:
            log.warning("kvasync: deregistering a staging buffer failed: %s", exc)

    @property
    def staging_buffers(self) -> int:
        """Local staging buffers allocated so far (one per transfer running at once)."""
        return self._staging.count

    def alloc_host(self, nbytes: int, row_bytes: int) -> HostMemory:
        raise InvalidTransferError("the remote tier keeps its rows in the pool, not locally")

    # -- streams and events ----------------------------------------------------------------
    def new_stream(self) -> Stream:
        s = _NixlStream(None, name=f"kvasync-nixl-{len(self._streams)}")
        self._streams.append(s)
        return s

    def new_event(self, timing: bool = True) -> Event:
        return HostEvent()

    def compute_stream(self, override: Any | None) -> Stream | None:
        if isinstance(override, (HostStream, _TorchCompute)):
            return override
        if self.device != "cuda":
            if override is None:
                return None  # host writes are synchronous: nothing is pending
            raise InvalidTransferError(
                f"a host compute stream must be a HostStream, got {type(override)}")
        import torch

        if override is None:
            return _TorchCompute(torch.cuda.current_stream(self.device_id))
        if isinstance(override, torch.cuda.Stream):
            return _TorchCompute(override)
        raise InvalidTransferError(
            f"the compute stream must be a torch.cuda.Stream, got {type(override)}")

    def can_signal(self, compute: Stream | None) -> bool:
        """Whether `compute` can wait on this backend's events (a layer-wise load's
        per-layer signals): host streams can; a CUDA compute stream cannot."""
        return not isinstance(compute, _TorchCompute)

    # -- copies ----------------------------------------------------------------------------
    def resolve_path(self, path: str, direction: Direction, plan: TransferPlan,
                     host_pinned: bool, urgent: bool = False, other_busy: bool = False,
                     layered: bool = False) -> str:
        return "nixl"

    def enqueue_copy(self, stream: Stream, plan: TransferPlan, direction: Direction,
                     path: str) -> None:
        self.enqueue_pieces(stream, [plan], direction, path)

    def enqueue_pieces(self, stream: Stream, pieces: Sequence[TransferPlan],
                       direction: Direction, path: str,
                       marks: Sequence[Event] | None = None,
                       edges: tuple[bool, bool] = (True, True)) -> None:
        """One `_execute` of every piece on the stream thread; the marks follow it (the
        pieces move as one set of NIXL requests)."""
        if path not in ("nixl", "auto"):
            raise InvalidTransferError(f"the remote tier has no copy path {path!r}")
        assert isinstance(stream, HostStream)
        if any(p.num_descriptors for p in pieces):
            stream.enqueue(self._execute, list(pieces), direction)
        for mark in marks or ():
            stream.record(mark)

    def _execute(self, pieces: list[TransferPlan], direction: Direction) -> None:
        """Run a transfer on a stream thread: staged through local rows where the plan is
        rows (one NIXL request per staging buffer's worth of runs), else one request of
        the plan's own coalesced descriptors."""
        if self.device == "cuda":
            import torch

            torch.cuda.set_device(self.device_id)
        self._link.check()
        deadline = time.monotonic() + self.timeout
        program = (remote_program(pieces, direction, self._staging.slab_bytes)
                   if self.device == "cpu" else None)
        if program is None:
            local, remote, sizes = page_descriptors(pieces, direction)
            self._requests.post(direction, local, remote, sizes, deadline)
            return
        table = pieces[0].table
        buf = self._staging.take()
        stuck = self._requests.stuck_here()
        try:
            for i, slab in enumerate(program.slabs):
                local, remote, sizes = run_descriptors(program, i, buf.ptr)
                kernel = kernel_plan(program, slab, table, buf.ptr)
                if direction == "d2h":
                    self._copy_local(kernel)  # pack the pages into staging rows
                    self._requests.post(direction, local, remote, sizes, deadline)
                else:
                    self._requests.post(direction, local, remote, sizes, deadline)
                    self._copy_local(kernel)  # unpack the rows into the pages
        finally:
            # a request NIXL could not release may still use the buffer: no later transfer
            # packs into it or reads it, and close() does not free it
            if self._requests.stuck_here() == stuck:
                self._staging.give(buf)
            else:
                self._staging.retire(buf)

    def _copy_local(self, plan: TransferPlan) -> None:
        """Pack or unpack between the KV tensors and a staging buffer, bounds-checked."""
        src, dst, sizes = plan.coalesced()
        self._bounds.check(src, sizes, "local descriptor")
        self._bounds.check(dst, sizes, "local descriptor")
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._link.closed = True
        self._link.error = self._link.error or "the remote offloader is closed"
        self._link.lost.set()  # a stream still polling gives up at once
        streams, self._streams = self._streams, []
        for s in streams:
            s.close()
        agent = self._agent
        self._staging.close()
        for reg in self._regs:
            try:
                agent.deregister_memory(reg)
            except Exception as exc:
                log.warning("kvasync: deregistering local memory failed: %s", exc)
        self._regs.clear()
        try:
            agent.remove_remote_agent(self.peer_name)
        except Exception as exc:
            log.debug("kvasync: removing the pool's agent failed: %s", exc)
        self._link.drop()
        self._agent = self._requests.agent = None

    @property
    def live_threads(self) -> int:
        return sum(1 for s in self._streams if s.alive) + int(self._link.watching)
