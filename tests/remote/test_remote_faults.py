"""Bad requests rejected before enqueue, failures on the transfer that caused them, a pool
killed mid-transfer, and the pool process's own lifecycle."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from remote_support import HAS_NIXL, ROOT, PoolProcess, needs_nixl, pool_process

import kvasync as kv
from kvasync._program import TransferPlan

pytestmark = pytest.mark.timeout(120)


def _make(address: str, blocks: int = 64, page: int = 4096, chunks: int = 32,
          timeout: float = 20.0):
    from kvasync.remote import RemoteOffloader

    rng = np.random.default_rng(5)
    kvs = [rng.integers(0, 256, (blocks, page), dtype=np.uint8) for _ in range(2)]
    off = RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), chunks, peer=address,
                          timeout=timeout)
    return kvs, off


@needs_nixl
@pytest.mark.parametrize("call", [
    lambda off: off.store(gpu_blocks=[0], cpu_chunks=[32]),            # chunk id out of range
    lambda off: off.store(gpu_blocks=[64], cpu_chunks=[0]),            # block id out of range
    lambda off: off.store(gpu_blocks=[0, 1], cpu_chunks=[0]),          # ids do not match
    lambda off: off.load(cpu_chunks=[0, 0], gpu_blocks=[1, 2]),        # fine for loads: one chunk into two blocks
    lambda off: off.load(cpu_chunks=[0, 1], gpu_blocks=[3, 3]),        # two chunks into one block
    lambda off: off.store(gpu_blocks=[0], cpu_chunks=[-1]),
    lambda off: off.store(gpu_blocks=["a"], cpu_chunks=[0]),
    lambda off: off.store(gpu_blocks=[0], cpu_chunks=[0], job_id="x"),
    lambda off: off.store(gpu_blocks=[0], cpu_chunks=[0], stream=object()),
])
def test_bad_requests_rejected_before_enqueue(pool: PoolProcess, call) -> None:
    kvs, off = _make(pool.address)
    try:
        try:
            t = call(off)
        except kv.InvalidTransferError:
            assert off._resources()["inflight"] == 0
            assert all(q.last_transfer is None for q in off._queues.values())
            assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).job_id == 0  # nothing consumed a job id
        else:
            assert t.wait(20).success  # the one valid case
    finally:
        off.close()


@needs_nixl
def test_descriptor_outside_the_region_fails_its_transfer_only(pool: PoolProcess) -> None:
    """A raw plan pointing past the pool region fails that transfer, the ones queued behind
    it in the direction, and leaves the other direction working."""
    kvs, off = _make(pool.address)
    try:
        ok = off.store(gpu_blocks=[1], cpu_chunks=[1]).wait(20)
        assert ok.success
        table = off._tables["d2h"]
        end = off.backend.remote_base + off.backend.remote_nbytes
        src = np.array([kvs[0].ctypes.data], dtype=np.uint64)
        dst = np.array([end - 100], dtype=np.uint64)
        plan = TransferPlan.raw(table, src, dst, np.array([4096], dtype=np.uint64))
        bad = off._enqueue("d2h", plan, None, None)
        behind = off.store(gpu_blocks=[2], cpu_chunks=[2])
        with pytest.raises(kv.TransferFailedError, match="outside the registered") as e:
            bad.wait(20)
        assert e.value.job_id == bad.job_id
        with pytest.raises(kv.TransferFailedError, match="queued behind"):
            behind.wait(20)
        with pytest.raises(kv.OffloaderBrokenError):
            off.store(gpu_blocks=[3], cpu_chunks=[3])
        assert off.load(cpu_chunks=[1], gpu_blocks=[5]).wait(20).success  # loads are independent
        np.testing.assert_array_equal(kvs[0][5], kvs[0][1])
    finally:
        off.close()


@needs_nixl
@pytest.mark.asyncio
async def test_pool_killed_mid_transfer_fails_transfers_and_nothing_hangs() -> None:
    with pool_process(512 << 20) as pool:
        kvs, off = _make(pool.address, blocks=4096, page=4096, chunks=4096, timeout=60)
        try:
            first = await off.store(gpu_blocks=list(range(64)), cpu_chunks=list(range(64)))
            assert first.success
            # ~64 MiB per store of scattered 4 KiB pages: tens of milliseconds each here
            ts = [off.store(gpu_blocks=list(range(4096)), cpu_chunks=list(range(4096))) for _ in range(8)]
            loads = [off.load(cpu_chunks=list(range(4096)), gpu_blocks=list(range(4096))) for _ in range(4)]
            await asyncio.sleep(0.05)
            pool.kill()
            t0 = time.monotonic()
            outcomes = await asyncio.gather(*ts, *loads, return_exceptions=True)
            assert time.monotonic() - t0 < 30
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            assert failed, "killing the pool failed no transfer"
            assert all(isinstance(o, kv.TransferFailedError) for o in failed)
            # once one failed, every later one of its direction failed too (FIFO)
            for group in (outcomes[:8], outcomes[8:]):
                flags = [isinstance(o, BaseException) for o in group]
                assert flags == sorted(flags)
            with pytest.raises(kv.TransferFailedError):
                off.store(gpu_blocks=[0], cpu_chunks=[0])
        finally:
            t0 = time.monotonic()
            off.close()
            assert time.monotonic() - t0 < 30
        res = off._resources()
        assert res["stream_threads"] == 0 and res["completion_threads"] == 0


@needs_nixl
def test_pool_refuses_what_it_cannot_hold() -> None:
    from kvasync.remote import RemoteOffloader

    with pool_process(1 << 20) as pool:
        kvs = [np.zeros((8, 4096), np.uint8)]
        layout = kv.KVCacheLayout.from_tensors(kvs)
        with pytest.raises(kv.InvalidTransferError, match="no free region"):
            RemoteOffloader(layout, 1024, peer=pool.address)
        with RemoteOffloader(layout, 128, peer=pool.address) as off:  # 512 KiB fits
            assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).success


@needs_nixl
def test_unreachable_pool() -> None:
    import socket

    from kvasync.remote import RemoteOffloader

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    layout = kv.KVCacheLayout.from_tensors([np.zeros((8, 64), np.uint8)])
    with pytest.raises(kv.BackendUnavailableError, match="cannot reach"):
        RemoteOffloader(layout, 4, peer=f"127.0.0.1:{port}")


@needs_nixl
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_shuts_down_cleanly_with_a_client_attached(sig: int) -> None:
    from kvasync.remote import RemoteOffloader

    pool = PoolProcess(8 << 20)
    kvs = [np.ones((8, 4096), np.uint8)]
    off = RemoteOffloader(kv.KVCacheLayout.from_tensors(kvs), 8, peer=pool.address)
    try:
        assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).success
        rc, out, err = pool.stop(sig)
        assert rc == 0, err
        assert "kvasync pool closed" in out
        deadline = time.monotonic() + 10
        while not off.broken and time.monotonic() < deadline:
            time.sleep(0.01)
        assert off.broken  # the client noticed its pool went away
    finally:
        off.close()


@needs_nixl
def test_pool_frees_and_zeroes_a_region_when_its_client_goes() -> None:
    from kvasync.remote import RemoteOffloader, RemotePool

    with RemotePool(4 << 20) as pool:
        addr = f"{pool.address[0]}:{pool.address[1]}"
        kvs = [np.full((8, 4096), 7, np.uint8)]
        layout = kv.KVCacheLayout.from_tensors(kvs)
        with RemoteOffloader(layout, 8, peer=addr) as off:
            assert pool.free_bytes == pool.pool_bytes - 8 * 4096
            off.store(gpu_blocks=list(range(8)), cpu_chunks=list(range(8))).wait(20)
        deadline = time.monotonic() + 10
        while pool.free_bytes != pool.pool_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.free_bytes == pool.pool_bytes and pool.num_clients == 0
        # a client process killed while attached gives its region back too
        code = ("import sys, time, numpy as np, kvasync as kv\n"
                "from kvasync.remote import RemoteOffloader\n"
                "t=[np.ones((8,4096),np.uint8)]\n"
                f"o=RemoteOffloader(kv.KVCacheLayout.from_tensors(t), 8, peer='{addr}')\n"
                "o.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20); print('attached', flush=True); time.sleep(60)\n")
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True, cwd=ROOT)
        assert child.stdout is not None and child.stdout.readline().strip() == "attached"
        assert pool.free_bytes < pool.pool_bytes
        child.kill()
        child.wait(20)
        deadline = time.monotonic() + 10
        while pool.free_bytes != pool.pool_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.free_bytes == pool.pool_bytes
        with RemoteOffloader(layout, 8, peer=addr) as off:  # reads back zeros
            kvs[0][:] = 1
            off.load(cpu_chunks=list(range(8)), gpu_blocks=list(range(8))).wait(20)
            assert not kvs[0].any()
    assert threading.active_count() < 50


def test_import_never_imports_nixl() -> None:
    code = ("import sys, kvasync, kvasync.remote, kvasync.serve\n"
            "bad = [m for m in sys.modules if m.split('.')[0].startswith('nixl')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_missing_nixl_names_the_extra() -> None:
    """Without NIXL the first pool raises BackendUnavailableError naming kvasync[nixl]."""
    code = ("import sys\n"
            "for m in ('nixl_cu13', 'nixl_cu12', 'nixl'): sys.modules[m] = None\n"
            "import kvasync as kv\n"
            "from kvasync.remote import RemotePool\n"
            "try:\n    RemotePool(1 << 20)\nexcept kv.BackendUnavailableError as e:\n"
            "    assert 'kvasync[nixl]' in str(e), e; print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60,
                         capture_output=True, text=True).stdout
    assert out.strip() == "ok"


@pytest.mark.timeout(60)
def test_serve_says_so_in_one_line_when_the_pool_cannot_be_allocated() -> None:
    """No traceback: a pool too big for this host's memory is one line and exit status 1."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.Popen([sys.executable, "-m", "kvasync.serve", "--pool-bytes", "64TiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # the kernel overcommits: the pool started
        proc.kill()
        proc.communicate()
        pytest.skip("this host's kernel let a 64 TiB mapping through (overcommit)")
    if proc.returncode == 0 or "listening on" in out:
        pytest.skip("this host's kernel let a 64 TiB mapping through (overcommit)")
    assert proc.returncode == 1, (out, err)
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    if "cannot allocate" not in err:
        # the kernel let the mapping through; without NIXL the pool stops at its agent, and
        # that is said in one line too
        assert not HAS_NIXL and "needs NIXL" in err, err


@needs_nixl
@pytest.mark.timeout(120)
def test_a_closed_clients_region_is_free_when_close_returns() -> None:
    """close() waits for the pool to take the region back: a pool that holds one region
    serves client after client with no wait in between."""
    from kvasync.remote import RemoteOffloader, RemotePool

    with RemotePool(1 << 20) as pool:
        addr = f"{pool.address[0]}:{pool.address[1]}"
        layout = kv.KVCacheLayout.from_tensors([np.full((256, 4096), 5, np.uint8)])
        for _ in range(5):
            with RemoteOffloader(layout, 256, peer=addr) as off:  # the whole pool
                assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).success
            assert pool.free_bytes == pool.pool_bytes


def _kvasync_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("kvasync") and "pool" not in t.name)


@needs_nixl
def test_a_refused_or_dropped_offloader_gives_its_region_and_threads_back() -> None:
    """A constructor refused after the link was made (a bad `completion`), and an offloader
    dropped unclosed, leave no client of the pool, no region held and no thread behind."""
    import gc

    from kvasync.remote import RemoteOffloader, RemotePool

    with RemotePool(4 << 20) as pool:
        addr = f"{pool.address[0]}:{pool.address[1]}"
        layout = kv.KVCacheLayout.from_tensors([np.zeros((8, 4096), np.uint8)])
        before = _kvasync_threads()
        for _ in range(2):
            with pytest.raises(kv.InvalidTransferError, match="completion"):
                RemoteOffloader(layout, 8, peer=addr, completion="bogus")

        def use() -> None:
            off = RemoteOffloader(layout, 8, peer=addr)
            assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).success

        with pytest.warns(ResourceWarning, match="unclosed kvasync RemoteOffloader"):
            for _ in range(2):
                use()
                gc.collect()
        deadline = time.monotonic() + 10
        while pool.free_bytes != pool.pool_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.free_bytes == pool.pool_bytes
        deadline = time.monotonic() + 10
        while _kvasync_threads() != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _kvasync_threads() == before


@needs_nixl
def test_serve_stops_at_once_while_a_big_region_is_attached() -> None:
    """SIGTERM with a client holding 6 GiB of never-touched pool: the client's thread used
    to zero the whole region at close (seconds of page faults) and the pool was unmapped
    under it after 10 s, a segfault. The pool is going: nothing is zeroed."""
    import socket

    from kvasync.remote._nixl import recv_msg, send_msg

    size = 6 << 30
    with pool_process(size) as pool:
        host, port = pool.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as conn:
            send_msg(conn, {"op": "attach", "nbytes": size, "align": 4096})
            assert recv_msg(conn)["ok"]
            rc, out, err = pool.stop(signal.SIGTERM)
            assert rc == 0 and "kvasync pool closed" in out, (rc, err)


@needs_nixl
def test_a_pool_spawned_by_a_process_that_dies_shuts_down() -> None:
    """`serve.spawn` starts the pool with --exit-with-parent: its parent killed without
    stopping it (SIGKILL), the pool notices it was re-parented and exits."""
    import os

    code = ("import os, subprocess; from kvasync.serve import spawn; "
            "p, _ = spawn(16 << 20, stderr=subprocess.DEVNULL, start_new_session=True); "
            "print(p.pid, flush=True); os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 15
    alive = True
    while alive and time.monotonic() < deadline:
        try:  # gone, or a zombie its new parent has not reaped
            with open(f"/proc/{pid}/stat") as f:
                alive = f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            alive = False
        time.sleep(0.1)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the orphaned pool kept running"


@needs_nixl
@pytest.mark.parametrize("peer", ["localhost", "127.0.0.1:99999", ("127.0.0.1", "x"), None])
def test_a_bad_peer_is_an_invalid_transfer_error(peer: object) -> None:
    from kvasync.remote import RemoteOffloader

    layout = kv.KVCacheLayout.from_tensors([np.zeros((8, 4096), np.uint8)])
    with pytest.raises(kv.InvalidTransferError, match="HOST:PORT"):
        RemoteOffloader(layout, 8, peer=peer)  # type: ignore[arg-type]


@needs_nixl
def test_staging_larger_than_the_region_is_the_region() -> None:
    """16 TiB of staging used to be taken as given and fail the first store, breaking its
    direction: no transfer ever stages more than the region."""
    from kvasync.remote import RemoteOffloader, RemotePool

    with RemotePool(1 << 20) as pool:
        addr = f"{pool.address[0]}:{pool.address[1]}"
        layout = kv.KVCacheLayout.from_tensors([np.full((8, 4096), 3, np.uint8)])
        with RemoteOffloader(layout, 8, peer=addr, staging_bytes=1 << 44) as off:
            assert off.store(gpu_blocks=list(range(8)), cpu_chunks=list(range(8))).wait(
                20).success
            assert not off.broken


@needs_nixl
def test_a_pool_that_cannot_bind_names_the_address_and_keeps_no_socket() -> None:
    import gc
    import warnings

    from kvasync.remote import RemotePool

    with RemotePool(1 << 20) as first:
        taken = f"{first.address[0]}:{first.address[1]}"
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)  # an unclosed socket
            with pytest.raises(OSError, match=taken.replace(".", r"\.")):
                RemotePool(1 << 20, taken)
            gc.collect()


def _fork_with_a_link(before_fork: str, child: str) -> str:
    """Run a script that stores a row through a RemoteOffloader, runs `before_fork`, forks,
    runs `child` in the child (indented as written; it ends the child), then has the parent
    load the row back: the first line printed is "<child's exit code> <load succeeded>
    <the bytes came back> <the pool's clients>"."""
    head = textwrap.dedent("""
        import asyncio, os, sys, threading, time, numpy as np, kvasync as kv
        from kvasync.remote import RemoteOffloader, RemotePool
        pool = RemotePool(4 << 20)
        gpu = [np.full((8, 4096), 7, np.uint8)]
        off = RemoteOffloader(kv.KVCacheLayout.from_tensors(gpu), 8,
                              peer="%s:%d" % pool.address)
        assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).success
    """)
    tail = textwrap.dedent("""
        _, status = os.waitpid(pid, 0)
        gpu[0][:] = 0
        ok = off.load(cpu_chunks=[0], gpu_blocks=[0]).wait(20).success
        print(os.waitstatus_to_exitcode(status), ok, bool((gpu[0][0] == 7).all()),
              pool.num_clients)
        off.close()
        pool.close()
    """)
    code = (head + textwrap.dedent(before_fork) + "pid = os.fork()\nif pid == 0:\n"
            + textwrap.indent(textwrap.dedent(child), "    ") + tail)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=90, cwd=ROOT)
    return out.stdout.split("\n")[0] + "\n" + out.stdout + out.stderr


@needs_nixl
def test_a_forked_childs_exit_leaves_its_parents_link_to_the_pool() -> None:
    """An unclosed RemoteOffloader's collection hook runs in a forked child at its exit
    too; it must not drop the link the child inherited: the pool would take the parent's
    rows back and the parent's next load would fail."""
    out = _fork_with_a_link("", """
        sys.exit(0)  # a normal exit: the finalizers run in the child
    """)
    assert out.split("\n")[0] == "0 True True 1", out


@needs_nixl
def test_a_forked_child_is_refused_and_its_close_leaves_the_parents_link() -> None:
    """In a forked child an inherited RemoteOffloader refuses work with a clear error (its
    threads stayed in the parent), and its close() gives nothing of the parent's back."""
    out = _fork_with_a_link("""
        held = threading.Event()
        def hold():  # a parent thread inside the offloader's lock at the fork
            with off._submit_lock:
                held.set()
                time.sleep(2)
        threading.Thread(target=hold).start()
        held.wait()
    """, """
        threading.Timer(10, lambda: os._exit(4)).start()  # a hang exits 4
        refused = []
        for call in (lambda: off.store(gpu_blocks=[1], cpu_chunks=[1]),
                     lambda: off.load_layerwise(cpu_chunks=[0], gpu_blocks=[1]),
                     lambda: off.drain_sync(1)):
            try:
                call()
            except kv.OffloaderBrokenError:
                refused.append(True)
        asyncio.run(off.aclose())  # returns: nothing of the parent's to wait for
        off.close(timeout=5)
        os._exit(0 if refused == [True, True, True] else 3)
    """)
    assert out.split("\n")[0] == "0 True True 1", out


class _StuckAgent:
    """A NIXL agent whose requests never finish and cannot be released (a hung transport)."""

    def __init__(self, agent: object) -> None:
        self._agent = agent
        self.handles: list[object] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._agent, name)

    def check_xfer_state(self, handle: object) -> str:
        return "PROC"

    def release_xfer_handle(self, handle: object) -> None:
        self.handles.append(handle)
        raise RuntimeError("the request is still active")


@needs_nixl
def test_a_staging_buffer_a_stuck_request_may_still_use_is_never_reused(
        pool: PoolProcess) -> None:
    """A request that timed out and that NIXL cannot release may still read or write its
    staging buffer: the transfer fails, and no later transfer packs into that buffer or
    unpacks from it (it used to go back to the free list at once)."""
    kvs, off = _make(pool.address, timeout=0.3)
    try:
        requests = off.backend._requests
        real = requests.agent
        stuck = _StuckAgent(real)
        requests.agent = stuck
        with pytest.raises(kv.TransferFailedError, match="did not finish"):
            off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20)
        assert stuck.handles and requests.stuck == 1
        assert off.backend.staging_buffers == 1
        requests.agent = real  # the transport works again
        kvs[1][3] = 0
        assert off.load(cpu_chunks=[1], gpu_blocks=[3]).wait(20).success
        assert off.backend.staging_buffers == 2  # a new buffer, not the stuck request's
        from kvasync.remote import _rows

        kept = [m for m, _ in _rows._RETIRED]
        assert len(kept) == 1 and kept[0] not in off.backend._staging._free
    finally:
        requests.agent = real
        for h in stuck.handles:
            try:
                real.release_xfer_handle(h)
            except Exception:
                pass
        off.close(timeout=10)


@needs_nixl
@pytest.mark.timeout(120)
def test_a_pool_with_no_thread_left_for_a_client_refuses_it_and_serves_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection the pool cannot start a thread for (a flood of them) is refused; the
    pool goes on accepting, and its close() returns (joining a thread never started
    raised, and the accept loop had died)."""
    import socket

    from kvasync.remote import RemoteOffloader, RemotePool

    real_start = threading.Thread.start
    refused: list[str] = []

    def start(self: threading.Thread) -> None:
        if self.name == "kvasync-pool-client" and not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        real_start(self)

    pool = RemotePool(1 << 20)
    try:
        monkeypatch.setattr(threading.Thread, "start", start)
        flood = socket.create_connection(pool.address)
        try:
            assert flood.recv(1) == b""  # refused: closed at once
        finally:
            flood.close()
        monkeypatch.undo()
        assert refused
        layout = kv.KVCacheLayout.from_tensors([np.full((8, 4096), 5, np.uint8)])
        with RemoteOffloader(layout, 8, peer=pool.address, timeout=20) as off:
            assert off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(20).success
    finally:
        monkeypatch.undo()
        pool.close()
    assert pool.num_clients == 0


def test_a_stuck_request_counts_on_the_thread_that_posted_it() -> None:
    """Each transfer asks whether a request of its own got stuck (its staging buffer is then
    retired): another thread's stuck request must not retire a healthy buffer. No NIXL:
    a fake agent whose request never ends and cannot be released."""
    import socket

    from kvasync._backends._host import AddressRanges
    from kvasync.remote._requests import NixlRequests, PeerLink

    class Agent:
        def get_xfer_descs(self, rows: object, mem: str) -> object:
            return rows

        def initialize_xfer(self, *a: object) -> str:
            return "handle"

        def transfer(self, handle: object) -> str:
            return "PROC"

        def check_xfer_state(self, handle: object) -> str:
            return "PROC"

        def release_xfer_handle(self, handle: object) -> None:
            raise RuntimeError("still active")

    a, b = socket.socketpair()
    bounds = AddressRanges()
    bounds.add(0, 1 << 40)
    req = NixlRequests(Agent(), "pool", PeerLink(a, "peer"), bounds, bounds, device="cpu",
                       device_id=-1, timeout=0.01)
    other: list[int] = []
    try:
        t = threading.Thread(target=lambda: other.append(req.stuck_here()))
        with pytest.raises(kv.TransferFailedError, match="did not finish"):
            req.post("d2h", np.asarray([4096], np.uint64), np.asarray([8192], np.uint64),
                     np.asarray([64], np.uint64), time.monotonic() + 0.01)
        t.start()
        t.join()
        assert req.stuck == 1 and req.stuck_here() == 1 and other == [0]
    finally:
        a.close()
        b.close()
