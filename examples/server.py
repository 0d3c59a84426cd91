"""An async HTTP server that parks idle conversations' KV blocks in host memory.

Each conversation owns KV blocks "on the GPU". Offloading it copies those blocks into host
chunks with ``await off.store(...)`` and frees the GPU blocks for other conversations;
restoring it copies them back with ``await off.load(...)`` into freshly allocated GPU blocks.
Transfers run on kvasync's streams and completion threads, so the event loop keeps serving
other requests (``/health`` included) while megabytes move.

By default this runs on kvasync's host backend (numpy arrays stand in for GPU memory, no GPU
needed); ``--backend cuda`` keeps the blocks in torch CUDA tensors.

    pip install -e ".[examples]"
    python examples/server.py --port 8000            # add --backend cuda on a GPU machine

    curl -X POST localhost:8000/conversations -d '{"blocks": 16, "seed": 1}'
    curl -X POST localhost:8000/conversations/0/offload
    curl -X POST localhost:8000/conversations/0/restore
    curl localhost:8000/conversations/0/sha256      # equals the sha256 create returned
    curl localhost:8000/health
    curl localhost:8000/metrics                     # Prometheus text: kvasync:kv_offload_*

Endpoints (JSON in and out):

    POST   /conversations               {"blocks": n, "seed": s} -> 201, allocate and fill
    GET    /conversations/{id}          where its blocks are
    GET    /conversations/{id}/sha256   hash of its KV bytes, wherever they live now
    POST   /conversations/{id}/offload  GPU -> host; the GPU blocks are freed
    POST   /conversations/{id}/restore  host -> fresh GPU blocks; the host chunks are freed
    DELETE /conversations/{id}          free everything
    GET    /health                      liveness, free blocks, transfers in flight
    GET    /metrics                     Prometheus text: the offloader's stats and the server's
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import kvasync as kv
import kvasync.metrics

T = TypeVar("T")

__all__ = [
    "BlockAllocator",
    "Config",
    "Conversation",
    "ConversationBusy",
    "KVServer",
    "OutOfBlocks",
    "UnknownConversation",
    "create_app",
    "expected_blocks",
]


@dataclass(frozen=True)
class Config:
    """Sizes of the KV cache. The defaults make 8 MiB per 16-block conversation."""

    backend: str = "host"
    #: KV tensors: K and V of each layer, each (gpu_blocks, block_bytes) uint8
    num_tensors: int = 8
    block_bytes: int = 64 * 1024
    gpu_blocks: int = 1024
    cpu_chunks: int = 4096
    #: most blocks one conversation may ask for
    max_blocks: int = 256


class OutOfBlocks(Exception):
    """No room left: the caller should offload or delete conversations first (HTTP 503)."""


class UnknownConversation(LookupError):
    """No conversation has this id (HTTP 404)."""


class ConversationBusy(Exception):
    """The conversation is not in a state that allows this request (HTTP 409)."""


class BlockAllocator:
    """Free list of block (or chunk) ids, FIFO.

    A freed id goes to the back, so a restore lands in other GPU blocks than the ones the
    conversation left, as it would in a busy server whose freed blocks are reused at once.
    Only the event loop's thread touches it, so it needs no lock.
    """

    def __init__(self, count: int, what: str) -> None:
        self.what = what
        self._free: deque[int] = deque(range(count))

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} {self.what}, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)

    @property
    def available(self) -> int:
        return len(self._free)


@dataclass
class Conversation:
    """One conversation's KV: on the GPU (`gpu_blocks`) or in host memory (`cpu_chunks`)."""

    id: int
    num_blocks: int
    seed: int
    sha256: str
    #: "filling" -> "gpu" <-> "offloading" -> "host" -> "restoring" -> "gpu"
    state: str = "filling"
    gpu_blocks: list[int] = field(default_factory=list)
    cpu_chunks: list[int] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "blocks": self.num_blocks,
            "seed": self.seed,
            "gpu_blocks": self.gpu_blocks,
            "cpu_chunks": self.cpu_chunks,
            "sha256": self.sha256,
        }


def expected_blocks(seed: int, num_tensors: int, num_blocks: int, block_bytes: int) -> list[
    np.ndarray
]:
    """The bytes a conversation is filled with: per tensor, (num_blocks, block_bytes) uint8.

    Deterministic in `seed`, so a test (or a client) can recompute what must come back.
    """
    out = []
    for i in range(num_tensors):
        rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, i])))
        words = rng.integers(0, 2**64 - 1, size=num_blocks * block_bytes // 8, dtype=np.uint64,
                             endpoint=True)
        out.append(words.view(np.uint8).reshape(num_blocks, block_bytes))
    return out


def _sha256(parts: Iterable[np.ndarray]) -> str:
    """Hash of the parts' bytes in order; rows hashed one by one hash like their stack."""
    h = hashlib.sha256()
    for p in parts:
        h.update(np.ascontiguousarray(p).data)  # releases the GIL for buffers > 2 KiB
    return h.hexdigest()


class KVServer:
    """The KV cache, its offloader, the allocators and the conversations.

    Every mutation of the conversation table happens on the event loop's thread. Bulk byte
    work (filling, hashing) runs on one worker thread, and copies run on kvasync's streams,
    so no request handler blocks the loop for longer than it takes to submit a transfer.
    """

    def __init__(self, config: Config | None = None) -> None:
        self.config = c = config or Config()
        if c.block_bytes % 8:
            raise ValueError("block_bytes must be a multiple of 8")
        self.tensors = [self._device_tensor(c.gpu_blocks, c.block_bytes)
                        for _ in range(c.num_tensors)]
        layout = kv.KVCacheLayout.from_tensors(self.tensors)
        self.offloader = kv.Offloader(layout, num_cpu_chunks=c.cpu_chunks, backend=c.backend)
        self.gpu = BlockAllocator(c.gpu_blocks, "GPU blocks")
        self.cpu = BlockAllocator(c.cpu_chunks, "CPU chunks")
        self.conversations: dict[int, Conversation] = {}
        self.transfers_in_flight = 0
        self._ids = itertools.count()
        # a registry per server (tests build many): the offloader's transfers by copy path,
        # in flight, queue wait and copy time, plus the server's own block gauges
        self.metrics = CollectorRegistry()
        kvasync.metrics.register(self.offloader, self.metrics)
        for name, doc, fn in (
            ("free_gpu_blocks", "GPU blocks not held by a conversation",
             lambda: self.gpu.available),
            ("free_cpu_chunks", "host chunks not held by a conversation",
             lambda: self.cpu.available),
            ("conversations", "conversations, wherever their blocks are",
             lambda: len(self.conversations)),
        ):
            Gauge(f"kvserver_{name}", doc, registry=self.metrics).set_function(fn)
        # One worker for bulk byte work (filling, hashing). asyncio.to_thread's default pool
        # runs up to cores + 4 such threads at once; on a small machine they crowd the event
        # loop's thread off the CPU and every request waits (tens of ms on 2 cores).
        self._bytes_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-bytes")

    def _device_tensor(self, blocks: int, block_bytes: int) -> Any:
        if self.config.backend == "cuda":
            import torch

            return torch.zeros((blocks, block_bytes), dtype=torch.uint8, device="cuda")
        return np.zeros((blocks, block_bytes), dtype=np.uint8)

    # -- bytes (worker threads) -----------------------------------------------------------
    def _write_gpu(self, blocks: list[int], data: list[np.ndarray]) -> None:
        for t, d in zip(self.tensors, data):
            if isinstance(t, np.ndarray):
                t[blocks] = d
            else:  # torch CUDA: the store waits on torch's current stream, so it sees this
                import torch

                idx = torch.as_tensor(blocks, device=t.device)
                t[idx] = torch.from_numpy(d).to(t.device)

    def _read_gpu(self, blocks: list[int]) -> list[np.ndarray]:
        out = []
        for t in self.tensors:
            if isinstance(t, np.ndarray):
                out.append(t[blocks])
            else:
                import torch

                out.append(t[torch.as_tensor(blocks, device=t.device)].cpu().numpy())
        return out

    def read(self, conv: Conversation) -> list[np.ndarray]:
        """The conversation's bytes as they are now (GPU blocks or host chunks), per tensor."""
        if conv.state == "gpu":
            return self._read_gpu(conv.gpu_blocks)
        if conv.state == "host":
            return [c[conv.cpu_chunks] for c in self.offloader.cpu_tensors]
        raise ConversationBusy(f"conversation {conv.id} is {conv.state}")

    def _rows(self, conv: Conversation) -> Iterator[np.ndarray]:
        """The conversation's blocks, tensor by tensor, as row views where possible: hashing
        them needs no copy of the conversation."""
        if conv.state == "gpu" and isinstance(self.tensors[0], np.ndarray):
            arrays, ids = self.tensors, conv.gpu_blocks
        elif conv.state == "gpu":
            arrays, ids = self._read_gpu(conv.gpu_blocks), list(range(conv.num_blocks))
        elif conv.state == "host":
            arrays, ids = self.offloader.cpu_tensors, conv.cpu_chunks
        else:
            raise ConversationBusy(f"conversation {conv.id} is {conv.state}")
        for a in arrays:
            for i in ids:
                yield a[i]

    def _fill(self, blocks: list[int], seed: int) -> str:
        c = self.config
        data = expected_blocks(seed, c.num_tensors, len(blocks), c.block_bytes)
        self._write_gpu(blocks, data)
        return _sha256(data)

    # -- requests (event loop) ------------------------------------------------------------
    def get(self, cid: int) -> Conversation:
        try:
            return self.conversations[cid]
        except KeyError:
            raise UnknownConversation(f"no conversation {cid}") from None

    async def create(self, num_blocks: int, seed: int) -> Conversation:
        if not 1 <= num_blocks <= self.config.max_blocks:
            raise ValueError(f"blocks must be in [1, {self.config.max_blocks}]")
        blocks = self.gpu.alloc(num_blocks)
        conv = Conversation(next(self._ids), num_blocks, seed, sha256="", gpu_blocks=blocks)
        self.conversations[conv.id] = conv
        try:
            conv.sha256 = await self._off_loop(self._fill, blocks, seed)
        except BaseException:
            del self.conversations[conv.id]
            self.gpu.free(blocks)
            raise
        conv.state = "gpu"
        return conv

    def _begin(self, conv: Conversation, want: str, during: str) -> None:
        if conv.state != want:
            raise ConversationBusy(f"conversation {conv.id} is {conv.state}, not {want}")
        conv.state = during

    async def offload(self, cid: int) -> kv.TransferResult:
        """GPU -> host. The GPU blocks are freed only after the store completed.

        Shielded: a client that goes away mid-transfer must not leave the conversation
        half-moved (the copy itself runs to completion anyway; cancelling an await never
        cancels a kvasync copy).
        """
        return await asyncio.shield(self._offload(self.get(cid)))

    async def _offload(self, conv: Conversation) -> kv.TransferResult:
        self._begin(conv, "gpu", "offloading")
        chunks: list[int] = []
        try:
            chunks = self.cpu.alloc(conv.num_blocks)
            result = await self._transfer(
                self.offloader.store(gpu_blocks=conv.gpu_blocks, cpu_chunks=chunks))
        except BaseException:
            self.cpu.free(chunks)  # whatever reached them is garbage; the GPU copy is intact
            conv.state = "gpu"
            raise
        self.gpu.free(conv.gpu_blocks)
        conv.gpu_blocks, conv.cpu_chunks, conv.state = [], chunks, "host"
        return result

    async def restore(self, cid: int) -> kv.TransferResult:
        """Host -> freshly allocated GPU blocks; the host chunks are freed afterwards."""
        return await asyncio.shield(self._restore(self.get(cid)))

    async def _restore(self, conv: Conversation) -> kv.TransferResult:
        self._begin(conv, "host", "restoring")
        blocks: list[int] = []
        try:
            blocks = self.gpu.alloc(conv.num_blocks)
            result = await self._transfer(
                self.offloader.load(cpu_chunks=conv.cpu_chunks, gpu_blocks=blocks))
        except BaseException:
            self.gpu.free(blocks)
            conv.state = "host"
            raise
        self.cpu.free(conv.cpu_chunks)
        conv.gpu_blocks, conv.cpu_chunks, conv.state = blocks, [], "gpu"
        return result

    async def _transfer(self, transfer: kv.Transfer) -> kv.TransferResult:
        # store()/load() validated and enqueued synchronously (microseconds); awaiting yields
        # the loop until kvasync's completion thread reports the copy done.
        self.transfers_in_flight += 1
        try:
            return await transfer
        finally:
            self.transfers_in_flight -= 1

    async def delete(self, cid: int) -> None:
        conv = self.get(cid)
        if conv.state not in ("gpu", "host"):
            raise ConversationBusy(f"conversation {conv.id} is {conv.state}")
        del self.conversations[cid]
        self.gpu.free(conv.gpu_blocks)
        self.cpu.free(conv.cpu_chunks)

    async def sha256(self, cid: int) -> str:
        conv = self.get(cid)
        if conv.state not in ("gpu", "host"):
            raise ConversationBusy(f"conversation {conv.id} is {conv.state}")
        return await self._off_loop(lambda: _sha256(self._rows(conv)))

    def health(self) -> dict[str, Any]:
        states = [c.state for c in self.conversations.values()]
        return {
            "status": "broken" if self.offloader.broken else "ok",
            "backend": self.offloader.backend.name,
            "conversations": len(states),
            "on_gpu": states.count("gpu"),
            "on_host": states.count("host"),
            "free_gpu_blocks": self.gpu.available,
            "free_cpu_chunks": self.cpu.available,
            "transfers_in_flight": self.transfers_in_flight,
        }

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._bytes_pool, fn, *args)

    async def aclose(self) -> None:
        await self.offloader.aclose()
        self._bytes_pool.shutdown(wait=True)

    async def __aenter__(self) -> KVServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# -- HTTP -------------------------------------------------------------------------------------

Handler = Callable[[Request], Awaitable[Response]]


def _errors(handler: Callable[[Request, KVServer], Awaitable[Response]]) -> Handler:
    """Map domain exceptions to status codes, so handlers stay happy-path only."""

    async def wrapped(request: Request) -> Response:
        server: KVServer = request.app.state.kv
        try:
            return await handler(request, server)
        except UnknownConversation as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except ConversationBusy as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        except OutOfBlocks as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        except kv.OffloaderBrokenError as exc:  # a direction failed earlier: restart needed
            return JSONResponse({"error": str(exc)}, status_code=503)
        except kv.TransferFailedError as exc:
            return JSONResponse({"error": str(exc)}, status_code=500)
        except ValueError as exc:  # includes kv.InvalidTransferError
            return JSONResponse({"error": str(exc)}, status_code=400)

    return wrapped


def _cid(request: Request) -> int:
    return int(request.path_params["cid"])


def _result(conv: Conversation, r: kv.TransferResult) -> dict[str, Any]:
    return {**conv.as_json(), "job_id": r.job_id, "bytes": r.bytes, "seconds": r.seconds}


async def create_conversation(request: Request, server: KVServer) -> Response:
    try:
        body = await request.json() if await request.body() else {}
        blocks, seed = int(body.get("blocks", 16)), int(body.get("seed", 0))
    except (ValueError, TypeError, AttributeError):
        raise ValueError('body must be JSON like {"blocks": 16, "seed": 0}') from None
    conv = await server.create(blocks, seed)
    return JSONResponse(conv.as_json(), status_code=201)


async def show(request: Request, server: KVServer) -> Response:
    return JSONResponse(server.get(_cid(request)).as_json())


async def sha256(request: Request, server: KVServer) -> Response:
    cid = _cid(request)
    return JSONResponse({"id": cid, "sha256": await server.sha256(cid)})


async def offload(request: Request, server: KVServer) -> Response:
    cid = _cid(request)
    r = await server.offload(cid)
    return JSONResponse(_result(server.get(cid), r))


async def restore(request: Request, server: KVServer) -> Response:
    cid = _cid(request)
    r = await server.restore(cid)
    return JSONResponse(_result(server.get(cid), r))


async def delete(request: Request, server: KVServer) -> Response:
    await server.delete(_cid(request))
    return Response(status_code=204)


async def metrics(request: Request, server: KVServer) -> Response:
    """Prometheus text; a scrape takes one `off.stats()` snapshot (microseconds)."""
    return Response(generate_latest(server.metrics), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request, server: KVServer) -> Response:
    h = server.health()
    return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)


def create_app(server: KVServer | None = None, config: Config | None = None) -> Starlette:
    """The ASGI app. With `server`, the caller owns (and closes) it, as tests do; without,
    the app's lifespan builds one from `config` and closes it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if server is not None:
            app.state.kv = server
            yield
            return
        async with KVServer(config) as owned:
            app.state.kv = owned
            yield

    app = Starlette(
        routes=[
            Route("/health", _errors(health), methods=["GET"]),
            Route("/metrics", _errors(metrics), methods=["GET"]),
            Route("/conversations", _errors(create_conversation), methods=["POST"]),
            Route("/conversations/{cid:int}", _errors(show), methods=["GET"]),
            Route("/conversations/{cid:int}", _errors(delete), methods=["DELETE"]),
            Route("/conversations/{cid:int}/sha256", _errors(sha256), methods=["GET"]),
            Route("/conversations/{cid:int}/offload", _errors(offload), methods=["POST"]),
            Route("/conversations/{cid:int}/restore", _errors(restore), methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    if server is not None:  # ASGI transports without lifespan support (httpx) need it now
        app.state.kv = server
    return app


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="kvasync example server: offload/restore KV")
    ap.add_argument("--backend", choices=["host", "cuda"], default="host")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tensors", type=int, default=Config.num_tensors)
    ap.add_argument("--block-kib", type=int, default=Config.block_bytes // 1024)
    ap.add_argument("--gpu-blocks", type=int, default=Config.gpu_blocks)
    ap.add_argument("--cpu-chunks", type=int, default=Config.cpu_chunks)
    args = ap.parse_args(argv)
    config = Config(args.backend, args.tensors, args.block_kib * 1024, args.gpu_blocks,
                    args.cpu_chunks)
    uvicorn.run(create_app(config=config), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
