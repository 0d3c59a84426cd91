"""Prometheus export of `Offloader.stats()`: `pip install "kvasync[metrics]"`.

    from prometheus_client import generate_latest
    import kvasync.metrics

    kvasync.metrics.register(off)          # the default registry, prefix "kvasync"
    text = generate_latest()               # what a /metrics endpoint returns

The names follow vLLM's KV offloading metrics (``vllm:kv_offload_total_bytes`` and
friends), under kvasync's own prefix; `transfer_type` is ``GPU_to_CPU`` (stores) or
``CPU_to_GPU`` (loads), `lane` is ``normal`` or ``urgent``, `path` the concrete copy path:

- counters, labels (transfer_type, lane, path): `kvasync:kv_offload_total_bytes_total`
  (bytes of successful transfers), `..._total_time_total` (their device seconds),
  `..._transfers_total`, `..._failures_total`;
- gauges, labels (transfer_type, lane): `kvasync:kv_offload_in_flight`,
  `..._in_flight_bytes`, `..._oldest_in_flight_seconds` (0 when none is in flight);
- histograms, labels (transfer_type, lane): `kvasync:kv_offload_size` (bytes),
  `..._copy_seconds` (device, start to end event), `..._latency_seconds` (host,
  submission to completion seen), `..._queue_wait_seconds` (latency minus copy time).

docs/metrics.md has the full table and what each time means.

The values are read from a fresh `off.stats()` snapshot at each scrape, so nothing is
recorded twice and the copy path pays nothing for the export. Importing this module (and
kvasync) never needs prometheus_client; `register()` and a scrape do.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._offloader import Offloader
    from ._stats import Distribution, OffloaderStats

__all__ = ["Collector", "register"]

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_TRANSFER_TYPE = {"d2h": "GPU_to_CPU", "h2d": "CPU_to_GPU"}


def _prometheus() -> Any:
    try:
        import prometheus_client.core as core
    except ImportError as exc:
        raise ImportError(
            "kvasync.metrics needs prometheus_client: pip install \"kvasync[metrics]\""
        ) from exc
    return core


class Collector:
    """A Prometheus collector of offloaders' `stats()` (see the module docstring).

    A registry refuses two collectors with the same metric names, so one collector exports
    every offloader of a process that shares a registry: `add()` the others, each with its
    own values of the same `labels` keys (say ``{"rank": "0"}``, ``{"rank": "1"}``); the
    labels are added to every sample. Offloaders are held weakly: a collected one exports
    nothing, and exporting one does not keep it alive.
    """

    def __init__(self, off: Offloader, prefix: str = "kvasync",
                 labels: Mapping[str, str] | None = None) -> None:
        if not isinstance(prefix, str) or not _NAME.match(prefix):
            raise ValueError(f"prefix must be a Prometheus metric name prefix, got {prefix!r}")
        extra = dict(labels or {})
        for key in extra:
            if not isinstance(key, str) or not _NAME.match(key) or ":" in key:
                raise ValueError(f"label names must be Prometheus label names, got {key!r}")
            if key in ("transfer_type", "lane", "path", "le"):
                raise ValueError(f"label {key!r} is kvasync's own; choose another name")
        self.prefix = prefix
        self._keys = sorted(extra)
        self._offloaders: list[tuple[weakref.ref[Offloader], list[str]]] = []
        self._lock = threading.Lock()
        self.add(off, extra)

    def add(self, off: Offloader, labels: Mapping[str, str] | None = None) -> None:
        """Export `off` too, under `labels` (the same keys as the first offloader's, other
        values: two offloaders with equal labels would export the same time series)."""
        extra = dict(labels or {})
        if sorted(extra) != self._keys:
            raise ValueError(f"labels must have the keys {self._keys}, got {sorted(extra)}")
        values = [str(extra[k]) for k in self._keys]
        with self._lock:
            self._offloaders = [(r, v) for r, v in self._offloaders if r() is not None]
            if any(v == values for _, v in self._offloaders):
                raise ValueError(f"an offloader with labels {extra} is exported already")
            self._offloaders.append((weakref.ref(off), values))

    def describe(self) -> Iterator[Any]:
        """The metric families without samples (lets a registry refuse duplicate names)."""
        return iter(self._families(None))

    def collect(self) -> Iterator[Any]:
        """The metric families, filled from a fresh `stats()` snapshot of each offloader."""
        with self._lock:
            live = [(r(), v) for r, v in self._offloaders]
        snaps = [(off.stats(), v) for off, v in live if off is not None]
        if not snaps:
            return iter(())
        return iter(self._families(snaps))

    def _families(self, snaps: list[tuple[OffloaderStats, list[str]]] | None) -> list[Any]:
        core = _prometheus()
        p, keys = self.prefix, self._keys
        by_path = [*keys, "transfer_type", "lane", "path"]
        by_lane = [*keys, "transfer_type", "lane"]

        def counter(name: str, doc: str) -> Any:
            return core.CounterMetricFamily(f"{p}:{name}", doc, labels=by_path)

        def gauge(name: str, doc: str) -> Any:
            return core.GaugeMetricFamily(f"{p}:{name}", doc, labels=by_lane)

        def histogram(name: str, doc: str) -> Any:
            return core.HistogramMetricFamily(f"{p}:{name}", doc, labels=by_lane)

        total_bytes = counter("kv_offload_total_bytes", "Bytes of successful KV transfers")
        total_time = counter("kv_offload_total_time",
                             "Device seconds of successful KV transfers (start to end event)")
        transfers = counter("kv_offload_transfers", "Successful KV transfers")
        failures = counter("kv_offload_failures", "Failed KV transfers")
        in_flight = gauge("kv_offload_in_flight", "KV transfers submitted and not completed")
        in_flight_bytes = gauge("kv_offload_in_flight_bytes", "Bytes of KV transfers in flight")
        oldest = gauge("kv_offload_oldest_in_flight_seconds",
                       "Seconds since the oldest KV transfer in flight was submitted")
        size = histogram("kv_offload_size", "KV transfer size in bytes")
        copy = histogram("kv_offload_copy_seconds",
                         "Device time of a KV transfer, start to end event")
        wait = histogram("kv_offload_queue_wait_seconds",
                         "Host latency of a KV transfer minus its device copy time")
        latency = histogram("kv_offload_latency_seconds",
                            "Host time from a KV transfer's submission to its completion")
        for stats, values in snaps or ():
            for lane in stats.lanes:
                at = [*values, _TRANSFER_TYPE[lane.direction], lane.lane]
                for path, ps in lane.paths.items():
                    total_bytes.add_metric([*at, path], ps.bytes)
                    total_time.add_metric([*at, path], ps.seconds)
                    transfers.add_metric([*at, path], ps.transfers)
                    failures.add_metric([*at, path], ps.failures)
                in_flight.add_metric(at, lane.in_flight)
                in_flight_bytes.add_metric(at, lane.in_flight_bytes)
                oldest.add_metric(at, lane.oldest_in_flight_seconds)
                for family, dist in ((size, lane.size), (copy, lane.copy),
                                     (wait, lane.queue_wait), (latency, lane.latency)):
                    family.add_metric(at, _buckets(dist), sum_value=dist.sum)
        return [total_bytes, total_time, transfers, failures, in_flight, in_flight_bytes,
                oldest, size, copy, wait, latency]


def _buckets(dist: Distribution) -> list[tuple[str, float]]:
    out = [(repr(float(b)), float(c)) for b, c in zip(dist.buckets, dist.counts)]
    out.append(("+Inf", float(dist.count)))
    return out


def register(off: Offloader, registry: Any | None = None, prefix: str = "kvasync",
             labels: Mapping[str, str] | None = None) -> Collector:
    """Export `off.stats()` to Prometheus: registers a `Collector` in `registry` (default:
    prometheus_client's global `REGISTRY`) and returns it; `c.add(other, labels)` exports
    more offloaders through it, `registry.unregister(c)` removes it. Raises ImportError
    naming the extra if prometheus_client is missing."""
    core = _prometheus()
    collector = Collector(off, prefix, labels)
    (core.REGISTRY if registry is None else registry).register(collector)
    return collector
