"""The example server, driven in-process over HTTP.

Checks what a server author cares about: every byte of an offloaded conversation comes back
after a restore into other GPU blocks, many conversations move at once, and the event loop
keeps answering ``/health`` (p99 within 40 ms) while a GiB of KV moves.

Needs the examples extra (``pip install -e ".[examples]"``); skipped without it.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("starlette")  # the examples extra
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import httpx
import pytest_asyncio
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from server import Config, KVServer, create_app, expected_blocks

#: 8 tensors x BLOCKS x 64 KiB = 16 MiB per conversation; all of them move at once. Two
#: conversations' worth of spare GPU blocks: with the FIFO allocator every restore then lands
#: in blocks other than the ones its conversation left.
CONVERSATIONS, BLOCKS, ROUNDS = 12, 32, 3
CONFIG = Config(num_tensors=8, block_bytes=64 * 1024, gpu_blocks=(CONVERSATIONS + 2) * BLOCKS,
                cpu_chunks=CONVERSATIONS * BLOCKS)
#: p99 budgets that tell a responsive loop from a blocked one, not latency targets (those
#: are the benchmark's job): a loop stuck in a synchronous wait stalls for the whole transfer
#: queue (~100 ms here), while on a loaded 2-core CI machine the p99 of a healthy loop was
#: seen at 4-16 ms (the host backend's copy threads compete for the GIL, and each hand-off
#: can wait out Python's 5 ms switch interval)
HEALTH_BUDGET_S = 0.04
#: the due-time measure also carries the probe's own sleep overshoot (epoll rounds timeouts up
#: to whole milliseconds) and the answers of other requests queued on the loop
STALL_BUDGET_S = 0.05
#: an idle /health through a real uvicorn thread: its GIL hand-offs with the client's loop
#: can each wait out Python's 5 ms switch interval on a loaded 2-core machine, so this only
#: tells "answers" from "blocked" (a loop stuck in a synchronous wait takes seconds)
IDLE_HEALTH_BUDGET_S = 0.05
PROBE_INTERVAL_S = 0.001


@pytest_asyncio.fixture
async def kvs() -> AsyncIterator[KVServer]:
    async with KVServer(CONFIG) as server:
        yield server


@pytest_asyncio.fixture
async def client(kvs: KVServer) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(kvs))
    async with httpx.AsyncClient(transport=transport, base_url="http://kv") as c:
        yield c


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99))


def assert_holds(kvs: KVServer, cid: int, seed: int) -> None:
    """The conversation's current GPU blocks hold exactly the bytes it was created with."""
    conv = kvs.conversations[cid]
    expected = expected_blocks(seed, CONFIG.num_tensors, conv.num_blocks, CONFIG.block_bytes)
    for got, want in zip(kvs.read(conv), expected):
        np.testing.assert_array_equal(got, want)


def scribble_free_gpu_blocks(kvs: KVServer) -> None:
    """Overwrite every free GPU block, as other conversations reusing them would: a restore
    that copied nothing could not pass by finding the old bytes still there."""
    used = {b for c in kvs.conversations.values() for b in c.gpu_blocks}
    free = [b for b in range(CONFIG.gpu_blocks) if b not in used]
    for t in kvs.tensors:
        t[free] = 0xA5


@dataclass
class Sample:
    answer_s: float  # from sending the request to its answer
    stall_s: float  # from when it was due (the previous answer + the interval) to its answer
    in_flight: int  # transfers the handler saw


class HealthProbe:
    """Sequential /health requests, PROBE_INTERVAL_S apart, until stopped.

    Two latencies per request: how long the answer took (`HEALTH_BUDGET_S`), and how late it
    came from when it was *due*. The second catches a loop that stalls while the probe
    sleeps, which the first cannot see (coordinated omission). Only requests due inside a
    window (`open()` .. `close()`) and answered before it closed count.
    """

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._window: tuple[float, float] | None = None
        self.samples: list[Sample] = []
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    def open(self) -> None:
        self._window = (time.perf_counter(), float("inf"))

    def close(self) -> None:
        assert self._window is not None
        self._window = (self._window[0], time.perf_counter())

    async def _run(self) -> None:
        due = time.perf_counter()
        while not self._stop.is_set():
            sent = time.perf_counter()
            r = await self.client.get("/health")
            now = time.perf_counter()
            assert r.status_code == 200, r.text
            if self._window is not None and self._window[0] <= due and now <= self._window[1]:
                self.samples.append(Sample(now - sent, now - due, r.json()["transfers_in_flight"]))
            due = now + PROBE_INTERVAL_S
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def stop(self) -> list[Sample]:
        self._stop.set()
        await self._task
        return self.samples


async def move_all(client: httpx.AsyncClient, kvs: KVServer, probe: HealthProbe, verb: str,
                   convs: Iterable[int]) -> list[httpx.Response]:
    """POST /conversations/{id}/{verb} for every conversation at once; the probe's window
    covers the time the transfers run and complete.

    The window opens once every request has handed its transfer to kvasync (no conversation
    is left in its old state). Before that the loop is parsing a burst of simultaneous
    requests, on both sides: in-process, the client's work runs on the server's loop too.
    """
    before = {"offload": "gpu", "restore": "host"}[verb]
    requests = asyncio.gather(*(client.post(f"/conversations/{c}/{verb}") for c in convs))
    while any(c.state == before for c in kvs.conversations.values()) and not requests.done():
        await asyncio.sleep(PROBE_INTERVAL_S / 2)
    probe.open()
    try:
        return await requests
    finally:
        probe.close()


@pytest.mark.asyncio
async def test_offload_restore_many_conversations_keeps_bytes_and_loop_responsive(
    kvs: KVServer, client: httpx.AsyncClient
) -> None:
    created = await asyncio.gather(*(
        client.post("/conversations", json={"blocks": BLOCKS, "seed": s})
        for s in range(CONVERSATIONS)
    ))
    assert all(r.status_code == 201 for r in created), created[0].text
    convs = {r.json()["id"]: r.json() for r in created}
    want_hashes = [c["sha256"] for c in convs.values()]

    async def hashes() -> list[str]:
        rs = await asyncio.gather(*(client.get(f"/conversations/{c}/sha256") for c in convs))
        return [r.json()["sha256"] for r in rs]

    probe = HealthProbe(client)
    moved = 0
    for _ in range(ROUNDS):  # full round trips of every conversation
        old_blocks = {cid: kvs.conversations[cid].gpu_blocks for cid in convs}
        offloaded = await move_all(client, kvs, probe, "offload", convs)
        assert all(r.status_code == 200 and r.json()["state"] == "host" for r in offloaded)
        moved += sum(r.json()["bytes"] for r in offloaded)
        assert await hashes() == want_hashes  # the host copy is exact
        # the test's own bulk byte work runs off the loop too, or the probe would (rightly)
        # blame the stall on the server
        await asyncio.to_thread(scribble_free_gpu_blocks, kvs)

        restored = await move_all(client, kvs, probe, "restore", convs)
        assert all(r.status_code == 200 and r.json()["state"] == "gpu" for r in restored)
        moved += sum(r.json()["bytes"] for r in restored)
        for r in restored:  # other GPU blocks than the conversation left
            assert not set(r.json()["gpu_blocks"]) & set(old_blocks[r.json()["id"]])
        assert await hashes() == want_hashes
        for cid in (min(convs), max(convs)):  # and, byte for byte, without the hash
            await asyncio.to_thread(assert_holds, kvs, cid, convs[cid]["seed"])
    samples = await probe.stop()

    assert moved == 2 * ROUNDS * CONVERSATIONS * BLOCKS * CONFIG.num_tensors * CONFIG.block_bytes
    assert len(samples) >= 20, f"only {len(samples)} health probes ran during transfers"
    answer = [x.answer_s for x in samples]
    stall = [x.stall_s for x in samples]
    report = (
        f"{len(samples)} health probes during {moved / 2**20:.0f} MiB of transfers (up to "
        f"{max(x.in_flight for x in samples)} in flight): answered in median "
        f"{statistics.median(answer) * 1e3:.2f} ms, p99 {p99(answer) * 1e3:.2f} ms, max "
        f"{max(answer) * 1e3:.2f} ms; late from due: p99 {p99(stall) * 1e3:.2f} ms, max "
        f"{max(stall) * 1e3:.2f} ms"
    )
    print(report)
    assert p99(answer) < HEALTH_BUDGET_S, report
    # the loop never stalled for long while the probe slept either (a loop blocked by a
    # synchronous wait stalls for the whole transfer queue: ~100 ms here)
    assert p99(stall) < STALL_BUDGET_S, report
    assert max(x.in_flight for x in samples) >= CONVERSATIONS // 2, report  # they overlapped
    health = (await client.get("/health")).json()
    assert health["on_gpu"] == CONVERSATIONS and health["transfers_in_flight"] == 0


@pytest_asyncio.fixture
async def small_client() -> AsyncIterator[httpx.AsyncClient]:
    """A tiny server: 8 GPU blocks, 4 CPU chunks, at most 4 blocks per conversation."""
    small = Config(num_tensors=2, block_bytes=4096, gpu_blocks=8, cpu_chunks=4, max_blocks=4)
    async with KVServer(small) as kvs, httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(kvs)), base_url="http://kv"
    ) as client:
        yield client


@pytest.mark.asyncio
async def test_http_errors(small_client: httpx.AsyncClient) -> None:
    client = small_client
    assert (await client.post("/conversations/99/offload")).status_code == 404
    assert (await client.post("/conversations", json={"blocks": 0})).status_code == 400
    assert (await client.post("/conversations", content=b"[1]")).status_code == 400
    assert (await client.post("/conversations", json={"blocks": 5})).status_code == 400
    four = {"blocks": 4}
    assert (await client.post("/conversations", json=four)).status_code == 201
    assert (await client.post("/conversations", json=four)).status_code == 201
    full = await client.post("/conversations", json=four)  # all 8 GPU blocks are taken
    assert full.status_code == 503 and "free" in full.json()["error"]
    assert (await client.post("/conversations/0/restore")).status_code == 409  # not offloaded
    assert (await client.post("/conversations/0/offload")).status_code == 200
    assert (await client.post("/conversations/0/offload")).status_code == 409
    no_room = await client.post("/conversations/1/offload")  # the 4 CPU chunks are taken
    assert no_room.status_code == 503
    assert (await client.get("/conversations/1")).json()["state"] == "gpu"  # left as it was
    assert (await client.delete("/conversations/0")).status_code == 204
    assert (await client.get("/conversations/0")).status_code == 404
    health = (await client.get("/health")).json()
    assert health["free_cpu_chunks"] == 4 and health["on_gpu"] == 1


@pytest.fixture
def live_server() -> Iterator[str]:
    """A real uvicorn server on a free loopback port, in a thread. Its lifespan builds the
    KVServer at startup and must close it (and its offloader) at shutdown."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP;
    # with socket.socket()'s proto 0 every response waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(config=Config(gpu_blocks=64, cpu_chunks=64))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive()
        assert app.state.kv.offloader.closed


@pytest.mark.asyncio
async def test_round_trip_through_a_real_uvicorn_server(live_server: str) -> None:
    async with httpx.AsyncClient(base_url=live_server, trust_env=False, timeout=10) as c:
        made = (await c.post("/conversations", json={"blocks": 8, "seed": 7})).json()
        assert (await c.post(f"/conversations/{made['id']}/offload")).json()["state"] == "host"
        back = (await c.post(f"/conversations/{made['id']}/restore")).json()
        assert back["state"] == "gpu" and back["bytes"] == 8 * 8 * 64 * 1024
        digest = (await c.get(f"/conversations/{made['id']}/sha256")).json()["sha256"]
        assert digest == made["sha256"]
        latencies = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert (await c.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
        assert statistics.median(latencies) < IDLE_HEALTH_BUDGET_S


@pytest.mark.asyncio
async def test_metrics_endpoint_counts_the_moves(small_client: httpx.AsyncClient) -> None:
    """/metrics is Prometheus text: the offloader's counters by direction, lane and path,
    its timing histograms and in-flight gauges, and the server's own gauges."""
    client = small_client
    made = (await client.post("/conversations", json={"blocks": 3})).json()
    await client.post(f"/conversations/{made['id']}/offload")
    await client.post(f"/conversations/{made['id']}/restore")
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(response.text) for s in fam.samples}
    moved = 3 * 2 * 4096  # 3 blocks of 2 tensors of 4 KiB
    for kind in ("GPU_to_CPU", "CPU_to_GPU"):
        at = (("lane", "normal"), ("path", "memmove"), ("transfer_type", kind))
        assert samples[("kvasync:kv_offload_total_bytes_total", at)] == moved
        assert samples[("kvasync:kv_offload_transfers_total", at)] == 1
        assert samples[("kvasync:kv_offload_failures_total", at)] == 0
        lane = (("lane", "normal"), ("transfer_type", kind))
        assert samples[("kvasync:kv_offload_copy_seconds_count", lane)] == 1
        assert samples[("kvasync:kv_offload_queue_wait_seconds_count", lane)] == 1
        assert samples[("kvasync:kv_offload_in_flight", lane)] == 0
    assert samples[("kvserver_free_gpu_blocks", ())] == 8 - 3
    assert samples[("kvserver_free_cpu_chunks", ())] == 4
    assert samples[("kvserver_conversations", ())] == 1
