"""Data of a bench run: rows, run options, units and the targets; no measuring, no GPU.

`report` and `plot` import only this module, so a saved ``bench.json`` can be read, rendered
and plotted on a machine without CUDA, CuPy or torch (and without measuring again).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "DIRECTIONS", "FORMAT", "HOST_LABEL", "GiB", "KiB", "MiB", "Options", "Row", "Run",
    "Section", "bandwidth_row", "fmt_size", "parse_size", "parse_sizes", "pct_us",
]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
#: version of the bench.json layout (bumped when a field changes meaning)
FORMAT = 1
DIRECTIONS = ("h2d", "d2h")
#: what a run on the host backend says at its top: its ratios are not a GPU link's
HOST_LABEL = ("host backend: no GPU ratios (host memory stands in for the GPU; ratios are to "
              "one host memcpy, not to a PCIe link)")

# -- targets (H200; every ratio is to the ceiling measured in the same run) -----------------------
#: `auto` alone reaches this share of the one-memcpy ceiling at these pages, both directions
ALONE_MIN = 0.97
ALONE_PAGES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB)
#: beside a bf16 matmul loop, `auto` keeps this share of the matmul's rate while moving this
#: share of the link, at these pages, both directions
INTERFERENCE_MM_MIN = 0.97
INTERFERENCE_LINK_MIN = 0.85
INTERFERENCE_PAGES = (4 * KiB, 16 * KiB)
#: a store and a load at once (auto/auto) reach this share of the bidirectional ceiling
BIDIR_MIN = 0.90
BIDIR_PAGES = (64 * KiB, 2 * MiB)
#: `store()` of STORE_BLOCKS blocks x STORE_TENSORS tensors holds the caller at most this long
STORE_BLOCKS, STORE_TENSORS = 64, 128
STORE_STAGED_US = 100.0
STORE_AUTO_US = 30.0
#: round trip of one 4 KiB load through `await`
LATENCY_P50_US, LATENCY_P99_US = 12.0, 40.0
#: share of one core the process spends while awaiting a ~20 ms transfer
CPU_MAX = 0.10
#: awaited 64 KiB transfers per second from 64 tasks, and transfers in flight at once
RATE_MIN = 20_000.0
INFLIGHT = 10_000
#: a small urgent load right behind a 512 MiB load completes within this
URGENT_MS = 1.0


@dataclass
class Row:
    """One measurement.

    The spec is `section`, `path`, `direction` ("h2d", "d2h", "both" or "") and `page_bytes`.
    `ratio` is `gbps` over `ceiling_gbps`, the ceiling measured in the same run (None where no
    link ceiling applies, as for latencies). `values` holds the other measured numbers, named
    with their unit (``p50_us``, ``tflops``, ``rate_per_s``...); `samples` the raw ones the
    medians came from; `extra` anything else a section reports (JSON types only).
    """

    section: str
    path: str
    direction: str = ""
    page_bytes: int = 0
    ratio: float | None = None
    gbps: float | None = None
    ceiling_gbps: float | None = None
    values: dict[str, float] = field(default_factory=dict)
    samples: list[float] = field(default_factory=list)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def value(self, name: str, default: float = 0.0) -> float:
        """`values[name]`, or `default` where the section did not measure it."""
        return float(self.values.get(name, default))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        """A Row from its JSON form; keys this version does not know are kept in `extra`."""
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or "section" not in data or "path" not in data:
            raise ValueError(f"a bench row needs 'section' and 'path', got {data!r:.120}")
        row = cls(**{k: v for k, v in data.items() if k in known})
        row.extra.update({k: v for k, v in data.items() if k not in known})
        return row


@dataclass
class Run:
    """A whole run: `meta` (device, date, the exact command, ceilings...) and its rows."""

    meta: dict[str, Any]
    rows: list[Row]

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "rows": [asdict(r) for r in self.rows]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Run:
        """Parse a ``bench.json``; ValueError names what is wrong with it."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError("not a kvasync.bench bench.json: expected an object with 'meta' "
                             "and 'rows'")
        meta = data.get("meta") or {}
        if int(meta.get("format", FORMAT)) > FORMAT:
            raise ValueError(f"bench.json format {meta['format']} is newer than this "
                             f"kvasync.bench reads ({FORMAT})")
        return cls(dict(meta), [Row.from_dict(r) for r in data["rows"]])

    @property
    def on_gpu(self) -> bool:
        return self.meta.get("backend") == "cuda"


@dataclass(frozen=True)
class Options:
    """What one run measures; `quick` shrinks every section to a smoke test."""

    backend: str = "auto"
    #: bytes per timed transfer; None: 1 GiB on a GPU, 128 MiB on the host backend
    total_bytes: int | None = None
    reps: int = 3
    pages: tuple[int, ...] = ALONE_PAGES
    #: KV tensors per layout (a model's layers x K and V)
    tensors: int = 64
    quick: bool = False

    @staticmethod
    def quick_defaults() -> dict[str, Any]:
        """What ``--quick`` sets unless the command line says otherwise."""
        return {"total_bytes": 32 * MiB, "reps": 1, "pages": (4 * KiB, 64 * KiB), "tensors": 8}


@dataclass(frozen=True)
class Section:
    """A family of measurements: `run(ctx)` returns its rows.

    `needs` lists what it cannot run without ("gpu": a CUDA GPU; "torch": torch with CUDA);
    `missing()`, if given, says what else is missing (None: nothing). The runner skips it,
    saying why, where anything is missing (`meta["skipped"]` and the report name it).
    """

    name: str
    run: Callable[[Any], list[Row]]
    needs: tuple[str, ...]
    doc: str
    missing: Callable[[], str | None] | None = None


def fmt_size(n: int) -> str:
    """Bytes as a short label: '4 KiB', '2 MiB', '100 B'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """'4K' / '4KiB' / '2M' / '4096' -> bytes; ValueError on anything else."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in ("K", "M", "G") else t
    value = int(float(number) * mult)
    if value < 1:
        raise ValueError(f"a size must be positive, got {text!r}")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """'4K,64K,2M' -> (4096, 65536, 2097152)."""
    return tuple(parse_size(p) for p in text.split(",") if p.strip())


def pct_us(samples: Sequence[float], q: float) -> float:
    """The q-th percentile of `samples` (seconds), in microseconds (nearest rank)."""
    if not samples:
        return 0.0
    s = sorted(samples)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return round(s[k] * 1e6, 2)


def bandwidth_row(section: str, path: str, direction: str, page: int, samples: list[float],
                  nbytes: int, ceiling: float, device_seconds: float = 0.0, note: str = "",
                  extra: dict[str, Any] | None = None) -> Row:
    """A Row of `nbytes` moved in each of `samples` wall seconds (median), against `ceiling`."""
    sec = statistics.median(samples)
    gbps = nbytes / sec / 1e9 if sec > 0 else 0.0
    values = {"seconds": round(sec, 6), "bytes": float(nbytes), "reps": float(len(samples))}
    if device_seconds > 0:
        values["device_gbps"] = round(nbytes / device_seconds / 1e9, 2)
    return Row(section, path, direction, page, ratio=round(gbps / ceiling, 3) if ceiling else None,
               gbps=round(gbps, 2), ceiling_gbps=round(ceiling, 2), values=values,
               samples=[round(s, 6) for s in samples], note=note, extra=dict(extra or {}))
