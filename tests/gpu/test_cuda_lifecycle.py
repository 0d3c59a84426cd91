"""Closing on the GPU while copies wait behind a busy compute stream: the host memory stays
pinned and mapped until they ran, then it is released (by the last completion, with no
second close). Each case runs in a subprocess: the failure this guards against is a crash."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = """
import gc, time, warnings
import torch
import kvasync as kv
from kvasync._backends import _cudart

def until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True

gpu = torch.full((64, 65536), 3, dtype=torch.uint8, device="cuda")
side = torch.cuda.Stream()
off = kv.Offloader(kv.KVCacheLayout.from_tensors([gpu]), 64, backend="cuda",
                   copy_path=PATH, compute_stream=side)
host_ptr = int(off.cpu_tensors[0].ctypes.data)  # no view kept: it would pin the mapping
assert off.host_pinned and _cudart.is_registered(host_ptr)
torch.cuda.synchronize()
with torch.cuda.stream(side):
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the copies below wait for it
st = off.store(gpu_blocks=list(range(32)), cpu_chunks=list(range(32)))
ld = off.load(cpu_chunks=list(range(32, 64)), gpu_blocks=list(range(32, 64)))
"""


def run(path: str, body: str) -> subprocess.CompletedProcess[str]:
    code = f"PATH = {path!r}\n" + PRELUDE + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path", ["kernel", "dma"])
def test_close_timeout_keeps_pinned_memory_until_the_copies_ran(path: str) -> None:
    proc = run(path, """
        try:
            off.close(timeout=0.05)
            raise SystemExit("close(timeout) returned with copies queued")
        except TimeoutError:
            pass
        assert _cudart.is_registered(host_ptr)  # still in use by the queued copies
        assert st.wait(30).success and ld.wait(30).success
        torch.cuda.synchronize()
        assert bool((gpu[32:] == 0).all())  # the load read the mapped (zero) host copy
        assert until(lambda: not _cudart.is_registered(host_ptr))  # released, no close()
        off.close()
        print("ok")
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip() == "ok"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path", ["kernel", "dma"])
def test_dropped_offloader_releases_after_its_copies(path: str) -> None:
    proc = run(path, """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del off
            gc.collect()
        assert any(issubclass(w.category, ResourceWarning) for w in caught)
        assert _cudart.is_registered(host_ptr)
        assert st.wait(30).success and ld.wait(30).success
        torch.cuda.synchronize()
        assert bool((gpu[32:] == 0).all())
        assert until(lambda: not _cudart.is_registered(host_ptr))
        import threading
        assert until(lambda: not [t for t in threading.enumerate()
                                  if t.name.startswith("kvasync-")]), threading.enumerate()
        print("ok")
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip() == "ok"
