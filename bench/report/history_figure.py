"""The figure of ``python -m bench history``: tightness and certified accuracy over the commits that
changed the baseline, asv-style (x: the commits in order, their short hashes as tick labels; one line
per bound or method), drawn by the report's own :func:`bench.report.draw.draw` and theme, so a bound
keeps its colour, style and name from the report."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from . import draw
from .panels import Panel, Plot, Trace, letter, registry_order, style
from .studies.trained_study import colour_of, name_of, order

SHORT = 7  # characters of a commit shown as a tick label
WIDE = 8.0  # the legend beside the panels takes a third
COLUMNS = 2  # panels per row: a model's name is a long title
AXIS = "commit"
CEILING = 1e4  # a ratio above is drawn off scale with its number (specformer's worst is 1e99)


@dataclass
class Version:
    """One commit's baseline, summarised (:func:`bench.report.history.summarise`): ``tight`` indexed
    by bound (columns median, worst), ``accuracy`` by (model, bound)."""

    commit: str
    date: str  # the commit's, short (the rows' own dates may precede it)
    rows: int
    tight: pd.DataFrame
    accuracy: pd.Series


def _points(versions: list[Version], get, log: bool) -> tuple[list[float], list[float]]:
    """(x, y) at the commits where ``get`` has a value drawable on the axis (a ratio of +inf, of a
    published formula that overflowed, is in the table, not on a log axis)."""
    xs, ys = [], []
    for i, v in enumerate(versions):
        y = get(v)
        if y is not None and math.isfinite(y) and (y > 0 or not log):
            xs.append(float(i))
            ys.append(float(y))
    return xs, ys


def _trace(name: str, xy: tuple[list[float], list[float]]) -> Trace | None:
    return Trace(name_of(name), *xy, style(name), colour_of(name)) if xy[0] else None


def plot(versions: list[Version]) -> Plot:
    bounds = registry_order({b for v in versions for b in v.tight.index})
    top = []
    for i, (what, title) in enumerate((("median", "median"), ("worst", "worst (largest)"))):
        traces = [_trace(b, _points(versions, lambda v, b=b, w=what: v.tight[w].get(b), True))
                  for b in bounds]
        top.append(Panel(f"{letter(i)} {title} bound / PGD", AXIS, "bound / PGD" if not i else "",
                         [t for t in traces if t], ref=1.0, ceiling=CEILING))
    pairs = {k for v in versions for k in v.accuracy.index}
    panels = []
    for i, model in enumerate(sorted({m for m, _ in pairs})):
        traces = [_trace(b, _points(versions, lambda v, m=model, b=b: v.accuracy.get((m, b)), False))
                  for b in order({b for m, b in pairs if m == model})]
        panels.append(Panel(f"{letter(i + 2)} {model}", AXIS, "certified accuracy" if i % COLUMNS == 0
                            else "", [t for t in traces if t], yscale="linear"))
    rows = [top, *(panels[i:i + COLUMNS] for i in range(0, len(panels), COLUMNS))]
    return Plot(rows, _caption(versions), (WIDE, 2.6 * len(rows)), legend="right",
                sharey=(False, *([True] * (len(rows) - 1))))


def _caption(versions: list[Version]) -> str:
    first, last = versions[0], versions[-1]
    return (f"The committed baseline over the {len(versions)} commit(s) that changed it and that this "
            f"suite reads ({first.commit[:SHORT]}, {first.date} → {last.commit[:SHORT]}, {last.date}): "
            f"(a) median and (b) worst value/PGD of every certified bound over its rows (log scale; "
            f"dotted: ratio 1, as tight as the attack reaches; above {CEILING:g}: ▲ in the band at the "
            f"top, with its value); then per model the certified accuracy "
            f"of each method, pooled over the model's ε. A line joins the commits where its bound or "
            f"method has rows.")


def png(versions: list[Version]) -> tuple[bytes, str]:
    """The figure as PNG bytes (written by the caller once everything is built) and its caption."""
    p = plot(versions)
    draw.theme()
    fig = draw.draw(p)
    try:
        ticks = list(range(len(versions)))
        for ax in fig.axes:
            if ax.axison:
                ax.set_xticks(ticks, [v.commit[:SHORT] for v in versions], rotation=60, ha="right",
                              fontfamily="monospace")
                ax.set_xlim(-0.5, len(versions) - 0.5)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=200)
    finally:
        plt.close(fig)
    return buf.getvalue(), p.caption
