"""Figures of a run, from its rows (matplotlib optional: without it, no figures).

- ``bandwidth.png``: each path's ratio to the ceiling per page size, one panel per direction;
- ``interference.png``: matmul kept vs link share per path, one panel per page size, with the
  target corner shaded;
- ``latency_cdf.png``: the distribution of the 4 KiB await round trips per path.

Imports only `common`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import common as c
from .common import Run, fmt_size

__all__ = ["PLOTS", "plot"]

PLOTS = ("bandwidth.png", "interference.png", "latency_cdf.png")


def plot(run: Run, out: Path) -> list[Path]:
    """Write the figures the run's rows allow under `out`; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made: list[Path] = []
    makers: tuple[Callable[[Any, Run], Any], ...] = (_bandwidth, _interference, _latency)
    for name, make in zip(PLOTS, makers):
        fig = make(plt, run)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        made.append(out / name)
    return made


def _title(run: Run) -> str:
    label = " (host backend: no GPU ratios)" if not run.on_gpu else ""
    return f"{run.meta.get('device', '?')}{label}"


def _bandwidth(plt: Any, run: Run) -> Any:
    rows = [r for r in run.rows if r.section == "bandwidth" and r.path not in ("ceiling", "error")]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    ceil = run.meta.get("ceilings_gbps", {})
    for ax, d in zip(axes, c.DIRECTIONS):
        for path in dict.fromkeys(r.path for r in rows):
            pts = sorted((r.page_bytes, r.ratio or 0.0) for r in rows
                         if r.direction == d and r.path == path)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=path)
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        ax.axhline(c.ALONE_MIN, color="red", ls=":", lw=1, label=f"target {c.ALONE_MIN:.2f}")
        ax.set_xscale("log", base=2)
        pages = sorted({r.page_bytes for r in rows})
        ax.set_xticks(pages, [fmt_size(p) for p in pages])
        ax.set_xlabel("page size")
        name = "loads (h2d)" if d == "h2d" else "stores (d2h)"
        ax.set_title(f"{name}, ceiling {ceil.get(d, 0):.1f} GB/s")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ratio to the one-memcpy ceiling (wall time)")
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(run))
    return fig


def _interference(plt: Any, run: Run) -> Any:
    rows = [r for r in run.rows if r.section == "interference" and r.path != "matmul-alone"
            and r.path != "error"]
    if not rows:
        return None
    pages = sorted({r.page_bytes for r in rows})
    fig, axes = plt.subplots(1, len(pages), figsize=(5 * len(pages), 4.5), squeeze=False)
    colors = {p: f"C{i % 10}" for i, p in enumerate(dict.fromkeys(r.path for r in rows))}
    for ax, page in zip(axes[0], pages):
        ax.fill_between([c.INTERFERENCE_LINK_MIN, 1.05], c.INTERFERENCE_MM_MIN, 1.1,
                        color="green", alpha=0.1, label="target")
        for r in (r for r in rows if r.page_bytes == page):
            x, y = r.ratio or 0.0, float(r.extra.get("tflops_ratio", 0.0))
            ax.plot([x], [y], "o" if r.direction == "h2d" else "s", color=colors[r.path])
            ax.annotate(f"{r.path} {r.direction}", (x, y), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlim(0, 1.05)
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{fmt_size(page)} pages")
        ax.set_xlabel("link share (of the one-direction ceiling)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("matmul kept (of its rate alone)")
    fig.suptitle(f"beside a bf16 matmul loop: {_title(run)}")
    return fig


def _latency(plt: Any, run: Run) -> Any:
    rows = [r for r in run.rows if r.section == "latency" and r.samples]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rows:
        xs = sorted(s * 1e6 for s in r.samples)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        label = r.path + (f" ({r.extra['completion']})" if "completion" in r.extra else "")
        ax.plot(xs, ys, "--" if r.extra.get("reference") else "-",
                label=f"{label}: p50 {r.value('p50_us'):.1f}, p99 {r.value('p99_us'):.1f} us")
    ax.axvline(c.LATENCY_P50_US, color="gray", ls=":", lw=1)
    ax.axvline(c.LATENCY_P99_US, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("round trip of a 4 KiB load, call to await returning (us, log)")
    ax.set_ylabel("fraction of reps")
    ax.set_title(_title(run))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    return fig
