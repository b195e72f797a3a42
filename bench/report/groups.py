"""Panels of groups of points (one group per x): a box per group (``strip``) or a violin per group
(``violin``), every point drawn over it. Split from :mod:`bench.report.draw`; reads no results table.

Jitter comes from a fixed seed, so that PDFs stay identical from one build to the next.
"""

from __future__ import annotations

import numpy as np
from matplotlib import cbook, mlab

from .axes import ensure_ticks
from .panels import Panel


def _points(ax, p: Panel) -> None:
    rng = np.random.default_rng(0)
    for t in p.traces:
        ax.plot(t.x + rng.uniform(-0.15, 0.15, len(t.x)), t.y, ls="none", marker="o", alpha=0.7,
                color=t.colour or "C0", markersize=2.5 if p.kind == "violin" else 3, zorder=3)


def _ticks(ax, pos: list[float]) -> None:
    ax.set_xticks(pos, [f"{v:g}" for v in pos])
    ax.set_xlim(min(pos) - 0.6, max(pos) + 0.6)
    ensure_ticks(ax, "x")


def strip(ax, p: Panel) -> None:
    """Box (quartiles) and every point per group."""
    pos = [t.x[0] for t in p.traces]
    ax.boxplot([t.y for t in p.traces], positions=pos, widths=0.5, showfliers=False,
               medianprops={"color": "0.2"}, boxprops={"color": "0.5"}, whiskerprops={"color": "0.5"},
               capprops={"color": "0.5"})
    _points(ax, p)
    _ticks(ax, pos)


def _kde(data: np.ndarray, coords: np.ndarray) -> np.ndarray:
    return mlab.GaussianKDE(data, "scott").evaluate(coords)


def violin(ax, p: Panel) -> None:
    """A violin (kernel density) per group with its median as a bar, and every point. On a log y
    axis the density is that of log10 of the values, so the shape is the one the axis shows; a
    group of fewer than three distinct values has no density and is drawn as points only."""
    log = p.yscale == "log"
    shaped = [t for t in p.traces if len(set(t.y)) >= 3]
    if shaped:
        data = [np.log10(t.y) if log else np.asarray(t.y, dtype=float) for t in shaped]
        stats = cbook.violin_stats(data, _kde, points=100)
        if log:
            for s in stats:
                for k in ("coords", "mean", "median", "min", "max"):
                    s[k] = 10 ** np.asarray(s[k])
        parts = ax.violin(stats, positions=[t.x[0] for t in shaped], widths=0.8,
                          showmeans=False, showextrema=False, showmedians=True)
        for body, t in zip(parts["bodies"], shaped, strict=True):
            body.set_facecolor(t.colour or "C0")
            body.set_edgecolor("0.4")
            body.set_alpha(0.35)
        parts["cmedians"].set_color("0.15")
        parts["cmedians"].set_linewidth(1.2)
    _points(ax, p)
    _ticks(ax, [t.x[0] for t in p.traces])
