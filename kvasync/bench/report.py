"""The printed tables and the target summary of a run, from its rows or a saved bench.json.

Imports only `common`: re-rendering a run needs no GPU and measures nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from . import common as c
from .common import HOST_LABEL, Row, Run, fmt_size

__all__ = ["render", "summary"]

_ORDER = ("bandwidth", "pipeline", "interference", "calibrate", "bidirectional", "latency", "cpu",
          "hostcost", "priority", "layerwise", "rate")


def _table(title: str, heads: Iterable[str], lines: list[list[str]]) -> list[str]:
    """`title`, then `lines` in columns under `heads`."""
    heads = list(heads)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(heads)]
    out = [title] if title else []
    out += ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip(),
            "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in lines]
    return out


def _paths(rows: list[Row]) -> list[str]:
    """Path names in the order the rows first name them."""
    return list(dict.fromkeys(r.path for r in rows))


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _bandwidth(rows: list[Row]) -> list[str]:
    data = [r for r in rows if r.path != "ceiling"]
    paths = _paths(data)
    by = {(r.direction, r.page_bytes, r.path): r for r in data}
    lines = []
    for d in c.DIRECTIONS:
        for page in sorted({r.page_bytes for r in data}):
            cells = [by.get((d, page, p)) for p in paths]
            if not any(cells):
                continue
            auto = by.get((d, page, "auto"))
            lines.append([d, fmt_size(page)] + [
                f"{x.gbps:.1f} ({_num(x.ratio, '.2f')})" if x else "-" for x in cells] + [
                f"{auto.extra.get('ran', '?')} ({auto.value('device_gbps'):.1f})" if auto
                else "-", f"{auto.value('call_seconds') * 1e3:.2f}" if auto else "-"])
    return _table("GB/s (ratio to the ceiling), each path alone, wall time from call to done:",
                  ["dir", "page", *paths, "auto ran (device GB/s)", "auto call ms"], lines)


def _pipeline(rows: list[Row]) -> list[str]:
    by = {(r.direction, r.page_bytes, r.path, r.extra.get("mode")): r for r in rows}
    lines = []
    for d, page, path in dict.fromkeys((r.direction, r.page_bytes, r.path) for r in rows):
        run, held = by.get((d, page, path, "as-run")), by.get((d, page, path, "held"))
        either = run or held
        lines.append([d, fmt_size(page), path, either.extra.get("ran", "?") if either else "?",
                      _num(run.value("wall_ratio") if run else None, ".3f"),
                      _num(run.ratio if run else None, ".3f"),
                      _num(held.ratio if held else None, ".3f")])
    return _table("ratio to the ceiling; event time as run, and with every slab enqueued "
                  "before the device starts (held):",
                  ["dir", "page", "path", "ran", "as run (wall)", "as run (device)",
                   "held (device)"], lines)


def _interference(rows: list[Row]) -> list[str]:
    alone = [r.value("tflops") for r in rows if r.path == "matmul-alone"]
    title = (f"bf16 matmul loop alone: {' / '.join(f'{x:.0f}' for x in alone)} TFLOP/s "
             "(start / end); beside each path's transfers:")
    lines = [[fmt_size(r.page_bytes), r.direction, r.path,
              f"{r.extra.get('tflops_ratio', 0):.0%}", f"{r.ratio or 0:.0%}",
              f"{r.value('tflops'):.0f}", _num(r.gbps), str(r.extra.get("ran", "?"))]
             for r in rows if r.path != "matmul-alone"]
    return _table(title, ["page", "dir", "path", "matmul kept", "link", "TFLOP/s", "GB/s", "ran"],
                  lines)


def _calibrate(rows: list[Row]) -> list[str]:
    lines = [[fmt_size(r.page_bytes), r.direction, r.path,
              f"{r.value('alone_ratio'):.0%}", f"{r.ratio or 0:.0%}",
              f"{r.extra.get('tflops_ratio', 0):.0%}", "auto" if r.extra.get("chosen") else "",
              "auto" if r.extra.get("incumbent") else "",
              f"{r.value('seconds'):.1f}"] for r in rows]
    return _table("Offloader.calibrate(): link share alone and beside its compute load, the "
                  "load's kept share, the path auto prefers after it and took before it:",
                  ["page", "dir", "path", "alone", "beside", "load kept", "chosen", "before",
                   "took s"], lines)


def _bidirectional(rows: list[Row]) -> list[str]:
    ceil = next((r for r in rows if r.path == "ceiling"), None)
    title = (f"store + load at once; bidirectional ceiling {_num(ceil.gbps if ceil else None)} "
             "GB/s:")
    lines = [[fmt_size(r.page_bytes), r.path, _num(r.gbps), _num(r.ratio, ".0%"),
              f"{r.value('store_device_gbps'):.1f}", f"{r.value('load_device_gbps'):.1f}",
              str(r.extra.get("ran", "?"))] for r in rows if r.path != "ceiling"]
    return _table(title, ["page", "path", "GB/s", "ratio", "store device GB/s",
                          "load device GB/s", "ran"], lines)


def _latency(rows: list[Row]) -> list[str]:
    lines = [[r.path, str(r.extra.get("completion", "-")), f"{r.value('p50_us'):.1f}",
              f"{r.value('p99_us'):.1f}",
              _num(r.values.get("call_p50_us")), _num(r.values.get("device_p50_us")),
              str(r.extra.get("ran", "-"))] for r in rows]
    return _table("round trip of one 4 KiB load through await (us):",
                  ["path", "completion", "p50", "p99", "call p50", "device p50", "ran"], lines)


def _cpu(rows: list[Row]) -> list[str]:
    lines = [[r.path, str(r.extra.get("completion")), f"{r.value('cpu_frac'):.1%}",
              f"{r.value('seconds') * 1e3:.1f}", _num(r.gbps), str(r.extra.get("ran", "?"))]
             for r in rows]
    return _table("CPU share of the process while awaiting one big load:",
                  ["path", "completion", "CPU", "wall ms", "GB/s", "ran"], lines)


def _hostcost(rows: list[Row]) -> list[str]:
    paths = _paths(rows)
    by = {(int(r.value("blocks")), r.path): r for r in rows}
    lines = []
    for n in sorted({int(r.value("blocks")) for r in rows}):
        tensors = next(int(r.value("tensors")) for r in rows if int(r.value("blocks")) == n)
        cells = [by.get((n, p)) for p in paths]
        lines.append([f"{n} x {tensors}"] + [
            f"{x.value('p50_us'):.1f} / {x.value('p99_us'):.1f}" if x else "-" for x in cells])
    return _table("store() call, p50 / p99 us (blocks x tensors):", ["blocks", *paths], lines)


def _priority(rows: list[Row]) -> list[str]:
    groups: dict[tuple[str, int, str], dict[bool, Row]] = {}
    for r in rows:
        key = (str(r.extra.get("big_pages")), r.page_bytes, r.path)
        groups.setdefault(key, {})[bool(r.extra.get("urgent"))] = r
    lines = []
    for (kind, page, path), pair in groups.items():
        cells = [f"{x.value('p50_us') / 1e3:.3f} / {x.value('max_us') / 1e3:.3f}" if x else "-"
                 for x in (pair.get(False), pair.get(True))]
        any_row = next(iter(pair.values()))
        lines.append([f"{fmt_size(int(any_row.extra.get('big_bytes', 0)))} {kind} "
                      f"{fmt_size(page)}", path, *cells, f"{any_row.value('big_ms'):.1f}"])
    return _table("a small load right behind a big load, ms from its call to its await:",
                  ["big load", "path", "normal p50 / max", "urgent p50 / max", "big load ms"],
                  lines)


def _layerwise(rows: list[Row]) -> list[str]:
    lines = [[r.path, str(r.extra.get("mode")), f"{r.value('total_ms'):.2f}",
              f"{r.value('first_layer_ms'):.2f}", f"{r.value('load_ms'):.2f}",
              f"{r.value('compute_ms'):.2f}", f"{r.value('call_ms'):.2f}"] for r in rows]
    out = _table("per-layer compute beside the load (device ms):",
                 ["path", "mode", "total", "first layer", "load alone", "compute alone", "call"],
                 lines)
    for path in _paths(rows):
        ser, lay = (_find(rows, path=path, mode=m) for m in ("serial", "layerwise"))
        if ser and lay and lay.value("total_ms") > 0:
            out.append(f"{path}: layer-wise x{ser.value('total_ms') / lay.value('total_ms'):.2f} "
                       "faster than serial")
    return out


def _rate(rows: list[Row]) -> list[str]:
    lines = [[r.direction, r.path, f"{r.value('rate_per_s'):,.0f}", _num(r.gbps),
              str(r.extra.get("ran", "?"))] for r in rows if "inflight" not in r.extra]
    out = _table("awaited transfers per second from many tasks:",
                 ["dir", "path", "transfers/s", "GB/s", "ran"], lines)
    for r in (r for r in rows if "inflight" in r.extra):
        x = r.extra
        out.append(f"{x['inflight']:,} loads in flight: {x.get('resolved', 0):,} resolved, "
                   f"{x.get('lost')} lost, in order: {x.get('completed_in_order')}, "
                   f"{r.value('seconds') * 1e3:.0f} ms")
    return out


def _generic(rows: list[Row]) -> list[str]:
    lines = [[r.path, r.direction, fmt_size(r.page_bytes), _num(r.gbps), _num(r.ratio, ".2f"),
              r.note] for r in rows]
    return _table("", ["path", "dir", "page", "GB/s", "ratio", "note"], lines)


_RENDER: dict[str, Callable[[list[Row]], list[str]]] = {
    "bandwidth": _bandwidth, "pipeline": _pipeline, "interference": _interference,
    "calibrate": _calibrate,
    "bidirectional": _bidirectional,
    "latency": _latency, "cpu": _cpu, "hostcost": _hostcost, "priority": _priority,
    "layerwise": _layerwise, "rate": _rate,
}


def _header(run: Run) -> list[str]:
    m = run.meta
    ceil = m.get("ceilings_gbps", {})
    out = [f"kvasync bench on {m.get('device', '?')} ({m.get('backend', '?')} backend), "
           f"{m.get('date', '?')}",
           f"command: {m.get('command', '?')}"]
    if "paths" in m:
        out.append(f"paths: {', '.join(m['paths'])}; {m.get('tensors')} KV tensors per layout, "
                   f"{fmt_size(int(m.get('total_bytes', 0)))} per transfer, median of "
                   f"{m.get('reps')}")
    if ceil:
        how = f" ({m['ceiling']})" if m.get("ceiling") else ""
        out.append("ceilings: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in ceil.items()) + how)
    if m.get("backend") == "host":
        out.append(HOST_LABEL)
    return out


def render(run: Run) -> str:
    """Every section's table, the target summary, then skipped sections and errors."""
    out = _header(run)
    names = [s for s in _ORDER if any(r.section == s for r in run.rows)]
    names += [s for s in dict.fromkeys(r.section for r in run.rows) if s not in names]
    for name in names:
        rows = [r for r in run.rows if r.section == name and r.path != "error"]
        if rows:
            out += ["", f"== {name} ==", *_RENDER.get(name, _generic)(rows)]
    lines = summary(run)
    if lines:
        scope = "" if run.on_gpu else " (set for the H200: shown, not judged, on the host)"
        out += ["", *_table(f"== targets{scope} ==", ["target", "measured", "met"], lines)]
    for name, why in run.meta.get("skipped", {}).items():
        out.append(f"skipped {name}: {why}")
    for r in (r for r in run.rows if r.path == "error"):
        out.append(f"ERROR in section {r.section}: {r.note}")
    return "\n".join(out)


# -- targets ------------------------------------------------------------------------------------
def _find(rows: list[Row], section: str | None = None, path: str | None = None,
          direction: str | None = None, page: int | None = None, **extra: Any) -> Row | None:
    for r in rows:
        if ((section is None or r.section == section) and (path is None or r.path == path)
                and (direction is None or r.direction == direction)
                and (page is None or r.page_bytes == page)
                and all(r.extra.get(k) == v for k, v in extra.items())):
            return r
    return None


def summary(run: Run) -> list[list[str]]:
    """[target, measured, met] per target the run has rows for."""
    rows = [r for r in run.rows if r.path != "error"]
    out: list[list[str]] = []

    def add(target: str, measured: str, ok: bool | None) -> None:
        met = "-" if ok is None else ("n/a" if not run.on_gpu else ("yes" if ok else "NO"))
        out.append([target, measured, met])

    for d in c.DIRECTIONS:
        got = [(p, _find(rows, "bandwidth", "auto", d, p)) for p in c.ALONE_PAGES]
        have = [(p, r) for p, r in got if r is not None and r.ratio is not None]
        if have:
            add(f"auto alone >= {c.ALONE_MIN:.2f} of the ceiling, {d}",
                ", ".join(f"{fmt_size(p)} {r.ratio:.2f}" for p, r in have),
                all((r.ratio or 0) >= c.ALONE_MIN for _, r in have))
        bare = [(p, _find(rows, "pipeline", "ref-rows", d, p)) for p in c.ALONE_PAGES]
        bound = [(p, r) for p, r in bare if r is not None and r.ratio is not None]
        if bound:  # what the copy engines do with the same rows, nothing else in the way
            add(f"(bound) copy engines alone on those host rows, event time, {d}",
                ", ".join(f"{fmt_size(p)} {r.ratio:.2f}" for p, r in bound), None)
    for page in c.INTERFERENCE_PAGES:
        for d in c.DIRECTIONS:
            r = _find(rows, "interference", "auto", d, page)
            if r is not None:
                mm, link = float(r.extra.get("tflops_ratio", 0)), r.ratio or 0.0
                add(f"beside a matmul, auto keeps >= {c.INTERFERENCE_MM_MIN:.0%} of it at >= "
                    f"{c.INTERFERENCE_LINK_MIN:.0%} of the link, {fmt_size(page)} {d}",
                    f"matmul {mm:.0%}, link {link:.0%}",
                    mm >= c.INTERFERENCE_MM_MIN and link >= c.INTERFERENCE_LINK_MIN)
    for page in c.BIDIR_PAGES:
        r = _find(rows, "bidirectional", "auto", "both", page)
        if r is not None:
            add(f"store + load at once, auto >= {c.BIDIR_MIN:.2f} of the bidirectional ceiling, "
                f"{fmt_size(page)}", f"{r.ratio or 0:.2f}", (r.ratio or 0) >= c.BIDIR_MIN)
    store = {r.path: r for r in rows if r.section == "hostcost"
             and r.value("blocks") == c.STORE_BLOCKS and r.value("tensors") == c.STORE_TENSORS}
    for path, limit in (("staged", c.STORE_STAGED_US), ("auto", c.STORE_AUTO_US)):
        if path in store:
            p50 = store[path].value("p50_us")
            add(f"store() of {c.STORE_BLOCKS} blocks x {c.STORE_TENSORS} tensors, {path}, p50 "
                f"<= {limit:g} us", f"{p50:.1f} us", p50 <= limit)
    auto_cost = {int(r.value("blocks")): r.value("p50_us") for r in rows
                 if r.section == "hostcost" and r.path == "auto"}
    if auto_cost.get(64) and 512 in auto_cost:
        growth = auto_cost[512] / auto_cost[64]
        add("store() cost grows sub-linearly, 64 -> 512 blocks, auto",
            f"x{growth:.2f} (linear: x8)", growth < 8)
    r = _find(rows, "latency", "auto", completion="hybrid")
    if r is not None:
        add(f"4 KiB await round trip p50 <= {c.LATENCY_P50_US:g} us, p99 <= "
            f"{c.LATENCY_P99_US:g} us", f"{r.value('p50_us'):.1f} / {r.value('p99_us'):.1f} us",
            r.value("p50_us") <= c.LATENCY_P50_US and r.value("p99_us") <= c.LATENCY_P99_US)
    for r in (r for r in rows if r.section == "cpu" and r.path == "auto"):
        add(f"CPU <= {c.CPU_MAX:.0%} of a core awaiting a ~20 ms load, "
            f"{r.extra.get('completion')}", f"{r.value('cpu_frac'):.1%}",
            r.value("cpu_frac") <= c.CPU_MAX)
    r = next((r for r in rows if r.section == "rate" and r.path == "auto"
              and r.direction == "h2d" and "inflight" not in r.extra), None)
    if r is not None:
        add(f">= {c.RATE_MIN:,.0f} awaited 64 KiB loads/s from 64 tasks, auto",
            f"{r.value('rate_per_s'):,.0f}/s", r.value("rate_per_s") >= c.RATE_MIN)
    for r in (r for r in rows if r.section == "rate" and "inflight" in r.extra):
        x = r.extra
        add(f"{x['inflight']:,} loads in flight: all resolved, in order",
            f"{x.get('resolved', 0):,} resolved, {x.get('lost')} lost, in order "
            f"{x.get('completed_in_order')}",
            x.get("lost") == 0 and bool(x.get("completed_in_order")))
    for r in (r for r in rows if r.section == "priority" and r.path == "auto"
              and r.extra.get("urgent")):
        add(f"urgent small load behind {fmt_size(int(r.extra.get('big_bytes', 0)))} "
            f"({r.extra.get('big_pages')} {fmt_size(r.page_bytes)} pages) < {c.URGENT_MS:g} ms",
            f"p50 {r.value('p50_us') / 1e3:.3f}, max {r.value('max_us') / 1e3:.3f} ms",
            r.value("max_us") < c.URGENT_MS * 1e3)
    ser = _find(rows, "layerwise", "auto", mode="serial")
    lay = _find(rows, "layerwise", "auto", mode="layerwise")
    if ser and lay:
        add("layer-wise load overlaps the per-layer compute, auto",
            f"{lay.value('total_ms'):.1f} vs {ser.value('total_ms'):.1f} ms serial, first "
            f"layer {lay.value('first_layer_ms'):.1f} ms",
            lay.value("total_ms") < ser.value("total_ms"))
    return out
