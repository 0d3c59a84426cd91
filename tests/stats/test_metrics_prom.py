"""The Prometheus export (`kvasync.metrics`); skipped without prometheus_client."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import kvasync as kv

pytestmark = pytest.mark.timeout(60)

PAGE = 1024


def test_kvasync_and_its_metrics_module_import_without_prometheus_client() -> None:
    """Runs even without prometheus_client: it is blocked in a fresh interpreter."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import numpy as np, kvasync as kv, kvasync.metrics as m\n"
        "t = [np.zeros((4, 64), np.uint8)]\n"
        "off = kv.Offloader(kv.KVCacheLayout.from_tensors(t), 4, backend='host')\n"
        "off.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10)\n"
        "assert off.stats().stores.transfers == 1\n"
        "try:\n"
        "    m.register(off)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "off.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 'pip install "kvasync[metrics]"' in out.stdout


prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import kvasync.metrics  # noqa: E402


@pytest.fixture
def off() -> Iterator[kv.Offloader]:
    gpu = [np.zeros((64, PAGE), np.uint8) for _ in range(2)]
    o = kv.Offloader(kv.KVCacheLayout.from_tensors(gpu), 64, backend="host")
    yield o
    o.close()


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition text, parsed back: (name, labels) -> value."""
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def labels(**kw: str) -> frozenset[tuple[str, str]]:
    return frozenset(kw.items())


def test_counters_follow_vllms_names_under_our_prefix(off: kv.Offloader) -> None:
    registry = CollectorRegistry()
    kvasync.metrics.register(off, registry=registry)
    for i in range(3):
        off.store(gpu_blocks=[i], cpu_chunks=[i]).wait(10)
    off.store(gpu_blocks=[9], cpu_chunks=[9], path="staged").wait(10)
    off.load(cpu_chunks=[0, 1], gpu_blocks=[4, 5], urgent=True).wait(10)
    got = scrape(registry)
    store = labels(transfer_type="GPU_to_CPU", lane="normal", path="memmove")
    staged = labels(transfer_type="GPU_to_CPU", lane="normal", path="staged")
    urgent = labels(transfer_type="CPU_to_GPU", lane="urgent", path="memmove")
    assert got[("kvasync:kv_offload_total_bytes_total", store)] == 3 * 2 * PAGE
    assert got[("kvasync:kv_offload_transfers_total", store)] == 3
    assert got[("kvasync:kv_offload_total_bytes_total", staged)] == 2 * PAGE
    assert got[("kvasync:kv_offload_total_bytes_total", urgent)] == 2 * 2 * PAGE
    assert got[("kvasync:kv_offload_failures_total", urgent)] == 0
    assert got[("kvasync:kv_offload_total_time_total", store)] == pytest.approx(
        off.stats().stores.paths["memmove"].seconds)
    lane = labels(transfer_type="GPU_to_CPU", lane="normal")
    assert got[("kvasync:kv_offload_copy_seconds_count", lane)] == 4
    assert got[("kvasync:kv_offload_latency_seconds_count", lane)] == 4
    assert got[("kvasync:kv_offload_queue_wait_seconds_bucket", lane | {("le", "+Inf")})] == 4
    assert got[("kvasync:kv_offload_size_bucket", lane | {("le", "4096.0")})] == 4
    assert got[("kvasync:kv_offload_size_sum", lane)] == 4 * 2 * PAGE
    assert got[("kvasync:kv_offload_in_flight", lane)] == 0


def test_failures_and_in_flight_gauges(off: kv.Offloader) -> None:
    from kvasync._backends._host import HostStream

    registry = CollectorRegistry()
    kvasync.metrics.register(off, registry=registry, prefix="kv", labels={"rank": "3"})
    off.backend.inject_fault()  # type: ignore[attr-defined]
    with pytest.raises(kv.TransferFailedError):
        off.load(cpu_chunks=[0], gpu_blocks=[0]).wait(10)
    gate = threading.Event()
    compute = HostStream(name="gate")
    compute.enqueue(gate.wait)
    try:
        held = off.store(gpu_blocks=[1, 2], cpu_chunks=[1, 2], stream=compute)
        got = scrape(registry)
        lane = labels(rank="3", transfer_type="GPU_to_CPU", lane="normal")
        assert got[("kv:kv_offload_in_flight", lane)] == 1
        assert got[("kv:kv_offload_in_flight_bytes", lane)] == 2 * 2 * PAGE
        assert got[("kv:kv_offload_oldest_in_flight_seconds", lane)] >= 0
        failed = labels(rank="3", transfer_type="CPU_to_GPU", lane="normal", path="memmove")
        assert got[("kv:kv_offload_failures_total", failed)] == 1
        assert got[("kv:kv_offload_transfers_total", failed)] == 0
    finally:
        gate.set()
        compute.close()
    held.wait(10)
    assert scrape(registry)[("kv:kv_offload_in_flight", lane)] == 0


def test_two_offloaders_share_a_registry_with_their_own_labels(off: kv.Offloader) -> None:
    other = kv.Offloader(kv.KVCacheLayout.from_tensors([np.zeros((4, PAGE), np.uint8)]), 4,
                         backend="host")
    try:
        registry = CollectorRegistry(auto_describe=True)
        collector = kvasync.metrics.register(off, registry, labels={"rank": "0"})
        with pytest.raises(ValueError, match="Duplicated"):  # the registry goes by names
            kvasync.metrics.register(other, registry, labels={"rank": "1"})
        collector.add(other, labels={"rank": "1"})
        with pytest.raises(ValueError, match="exported already"):
            collector.add(other, labels={"rank": "1"})
        with pytest.raises(ValueError, match="keys"):
            collector.add(other, labels={"tp": "1"})
        other.store(gpu_blocks=[0], cpu_chunks=[0]).wait(10)
        off.store(gpu_blocks=[0, 1], cpu_chunks=[0, 1]).wait(10)
        got = scrape(registry)
        name = "kvasync:kv_offload_transfers_total"
        at = {"transfer_type": "GPU_to_CPU", "lane": "normal", "path": "memmove"}
        assert got[(name, labels(rank="1", **at))] == 1
        assert got[(name, labels(rank="0", **at))] == 1
        assert got[("kvasync:kv_offload_total_bytes_total", labels(rank="0", **at))] == 4 * PAGE
    finally:
        other.close()


def test_the_collector_does_not_keep_an_offloader_alive() -> None:
    registry = CollectorRegistry()
    o = kv.Offloader(kv.KVCacheLayout.from_tensors([np.zeros((4, PAGE), np.uint8)]), 4,
                     backend="host")
    collector = kvasync.metrics.register(o, registry)
    o.close()
    del o
    gc.collect()
    assert list(collector.collect()) == []
    assert "kvasync:" not in generate_latest(registry).decode()
    registry.unregister(collector)


def test_default_registry_and_bad_arguments(off: kv.Offloader) -> None:
    collector = kvasync.metrics.register(off)
    try:
        assert "kvasync:kv_offload_in_flight" in generate_latest().decode()
    finally:
        prometheus_client.REGISTRY.unregister(collector)
    with pytest.raises(ValueError, match="prefix"):
        kvasync.metrics.Collector(off, prefix="kv-async")
    with pytest.raises(ValueError, match="kvasync's own"):
        kvasync.metrics.Collector(off, labels={"lane": "x"})
    with pytest.raises(ValueError, match="label names"):
        kvasync.metrics.Collector(off, labels={"a b": "x"})
