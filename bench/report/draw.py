"""Draws a selected :class:`~bench.report.panels.Plot` with matplotlib; reads no results table.

What a reader must be able to trust, whatever the data: every axis has at least two labelled ticks,
every panel a title, legends sit outside the data, and a value too large for the axis is never
drawn at a cap as if it were flat: it goes into an off-scale band at the top, as ▲ with its number.
"""

from __future__ import annotations

import math
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")  # headless CI and CLI: never ask for a display

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns
from matplotlib.transforms import ScaledTranslation

from .axes import x_axis, y_axis
from .groups import strip, violin
from .panels import Panel, Plot, Trace

# (line style, marker): estimates dashed, this suite's tightenings square, PGD black dashed, a
# minimum of the other curves a wide pale band without markers (it would hide the curve it follows);
# solver timings: estimate dashed, probabilistic certificate solid, exact (dense) dotted.
# ▲ is kept for off-scale points
STYLES = {"points": ("none", "o"), "bound": ("-", "o"), "ours": ("-", "s"), "estimate": ("--", "D"),
          "reference": ("--", "o"), "certificate": ("-", "o"), "dense": (":", "s"),
          "envelope": ("-", "")}
RANK = {"estimate": 1, "reference": 2}  # legend order: certified bounds, estimates, PGD
Z_REF = 3  # PGD's zorder: above every bound's line, marker and error bar
SIZES, PGD_SIZE = (4.8, 3.0, 0.3), 2.8  # marker sizes: a panel's first, smallest, step; PGD's
LOG = "log scale"  # said in an axis label whose ticks are not decades (2, 5, 10 look linear)


def theme() -> None:
    sns.set_theme(context="paper", style="whitegrid", font_scale=0.9,
                  # a long handle: solid and dashed stay apart around a large marker
                  rc={"legend.fontsize": 6, "legend.handlelength": 3.0, "axes.titlesize": 7.5,
                      "lines.markersize": 3.5, "xtick.labelsize": 6.5, "ytick.labelsize": 6.5})


def _over(p: Panel) -> list[str]:
    """Labels of the traces with a value above the panel's ceiling."""
    return [t.label for t in p.traces if p.ceiling and any(v > p.ceiling for v in t.y)]


def _yrange(p: Panel) -> tuple[float, float]:
    """(lowest, highest) value drawn to scale in one panel (the ceiling, when a value is above)."""
    vals = [v for t in p.traces for v in [*t.y, *(t.lo or []), *(t.hi or [])]
            if np.isfinite(v) and (p.yscale == "linear" or v > 0)]
    vals += [p.ref] if p.ref is not None else []
    inside = [v for v in vals if not p.ceiling or v <= p.ceiling]
    if _over(p):
        inside.append(p.ceiling)
    return (min(inside), max(inside)) if inside else (1.0, 10.0)


def _line(ax, t: Trace, p: Panel, colour, lane_y: float | None) -> list[tuple[float, float]]:
    """Draws one trace; returns its off-scale points (x, value), drawn as ▲ in the band at lane_y.

    The line climbs into the band to an off-scale point, never flattens at a cap, and is not drawn
    between two off-scale points (their heights in the band mean nothing)."""
    ls, marker = STYLES.get(t.style, STYLES["bound"])
    marker = t.marker or marker
    x, y = np.asarray(t.x, dtype=float), np.asarray(t.y, dtype=float)
    off = y > p.ceiling if p.ceiling and lane_y is not None else np.zeros(len(y), bool)
    xs: list[float] = []
    ys: list[float] = []
    marks: list[int] = []
    for i in range(len(x)):
        if i and off[i] and off[i - 1]:
            xs.append(np.nan)
            ys.append(np.nan)
        if not off[i]:
            marks.append(len(xs))
        xs.append(x[i])
        ys.append(lane_y if off[i] else y[i])
    # an estimate often lies on the dotted ratio-1 line or on PGD's curve: drawn on top of both;
    # PGD, the reference every bound is read against, on top of all (its marker is the smallest)
    z = 1.5 if t.style == "envelope" else Z_REF if t.style == "reference" else \
        2.5 if t.style == "estimate" else 2
    wide = {"lw": 4.5, "alpha": 0.3} if t.style == "envelope" else {"lw": 1.2}
    ring = {"markersize": t.size, "markeredgecolor": "white", "markeredgewidth": 0.4} if t.size else {}
    ax.plot(xs, ys, ls=ls, marker=marker or None, markevery=marks, color=colour, zorder=z,
            label=t.label if t.legend else "_nolegend_", **wide, **ring)
    if t.lo is not None and t.hi is not None:
        lo = np.asarray(t.lo)
        if p.yscale == "log":
            lo = np.maximum(lo, y * 1e-3)  # a mean − std at or below 0 has no place on a log axis
        ax.errorbar(x, y, yerr=[y - lo, np.asarray(t.hi) - y], ls="none", color=colour, capsize=2,
                    elinewidth=0.8, zorder=z)
    if off.any():
        ax.plot(x[off], np.full(int(off.sum()), lane_y), ls="none", marker="^", color=colour,
                markersize=4.5)
    return list(zip(x[off].tolist(), y[off].tolist(), strict=True))


def _dodged(t: Trace, p: Panel) -> Trace:
    """The trace as drawn: with ``p.dodge``, each trace with error bars moved sideways on its log x
    axis by a share of the panel's span, so that bars at the same x do not hide each other (the
    ticks stay at the data's own x; the spread stays inside the axis margin)."""
    bars = [b for b in p.traces if b.lo is not None]
    if not p.dodge or len(bars) < 2 or not any(b is t for b in bars) or p.xscale == "linear":
        return t
    xs = [v for b in p.traces for v in b.x]
    span = np.log(max(xs) / min(xs)) if max(xs) > min(xs) else np.log(4.0)
    step = min(p.dodge, 0.08 / (len(bars) - 1)) * span
    i = next(k for k, b in enumerate(bars) if b is t)
    return replace(t, x=[v * float(np.exp(step * (i - (len(bars) - 1) / 2))) for v in t.x])


def _offscale_values(ax, points: list[tuple[float, float]], lane_y: float, colour) -> list:
    """Prints each off-scale value above its ▲; returns the texts, for :func:`_thin`."""
    # centred over its own ▲ (an edge-aligned value would sit over a neighbour's); the x margin
    # of a panel with off-scale values leaves room for half a value at either end
    return [ax.annotate(f"{v:.2g}", (x, lane_y), xytext=(0, 2.5), textcoords="offset points",
                        ha="center", va="bottom", fontsize=5, color=colour) for x, v in points]


def _thin(fig: plt.Figure, lanes: list[list]) -> None:
    """Removes the off-scale values that would overlap a neighbour in their lane, measured once the
    layout is final; the first and the last of a lane stay (how far the bound grew)."""
    if not any(lanes):
        return
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    for texts in lanes:
        boxes = [t.get_window_extent(renderer) for t in texts]
        keep: list[int] = []
        for i, b in enumerate(boxes):
            if not keep or b.x0 >= boxes[keep[-1]].x1 + 2:
                keep.append(i)
            elif i == len(boxes) - 1 and len(keep) > 1 and b.x0 >= boxes[keep[-2]].x1 + 2:
                keep[-1] = i
        for i, t in enumerate(texts):
            if i not in keep:
                t.remove()


def _notes(ax, notes: dict[float, str]) -> None:
    """Adds each note as a second line under the tick at its x (a tick of its own if it has none)."""
    if not notes:
        return
    locs = [float(v) for v in ax.get_xticks()]
    texts = ax.xaxis.get_major_formatter().format_ticks(locs)
    labels = dict(zip(locs, texts, strict=True))
    for x, note in notes.items():
        at = next((v for v in locs if math.isclose(v, x, rel_tol=1e-9)), x)
        labels[at] = f"{labels.get(at, f'{x:g}')}\n{note}"
    lo, hi = ax.get_xlim()  # set_xticks would widen the limits to a tick outside them
    ax.set_xticks(sorted(labels), [labels[v] for v in sorted(labels)])
    ax.set_xlim(lo, hi)


def decades(ax, which: str) -> bool:
    """Whether the labelled ticks of a log axis are all powers of ten (the band's "> ceiling" aside):
    1, 10, 100 say the scale is logarithmic, 2, 5, 10 do not."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    locs = [v for v in axis.get_majorticklocs() if lo <= v <= hi and v > 0]
    texts = axis.get_major_formatter().format_ticks(locs) if locs else []
    shown = [v for v, t in zip(locs, texts, strict=True) if t and not t.startswith(">")]
    return bool(shown) and all(abs(math.log10(v) - round(math.log10(v))) < 1e-9 for v in shown)


def _log(label: str) -> str:
    """The label with "(log scale)" after it, on a line of its own where the last is long already (a
    y label longer than its axis is cut off)."""
    if not label:
        return LOG
    return f"{label}\n({LOG})" if len(label.split("\n")[-1]) > 18 else f"{label} ({LOG})"


def _say_log(grid: list[list]) -> None:
    """Says "log scale" in the label of every log axis whose ticks are not decades; an unlabelled
    y axis leaves it to its row's first label when that one is on a log axis too (one label per row)."""
    for row in grid:
        lead = next((a for a in row if a.axison and a.get_ylabel()), None)
        for ax in (a for a in row if a.axison):
            if ax.get_xscale() == "log" and not decades(ax, "x") and "log" not in ax.get_xlabel():
                ax.set_xlabel(_log(ax.get_xlabel()))
            if ax.get_yscale() != "log" or decades(ax, "y"):
                continue
            own = ax.get_ylabel()
            by = lead if not own and lead is not None and lead.get_yscale() == "log" else ax
            if "log" not in by.get_ylabel():
                by.set_ylabel(_log(by.get_ylabel()))


def _panel(ax, p: Panel, lo: float, hi: float, lanes: list[str], colours: dict[str, object]) -> list:
    """Draws one panel; returns its off-scale value texts, one list per bound.

    ``lanes``: the labels that own a lane of the off-scale band, in order (shared panels share
    them, so a bound sits at the same height in every panel)."""
    values = []
    if not p.traces:  # nothing to draw: say why, without axes that would suggest a scale
        ax.set_axis_off()
        ax.set_title(p.title)
        ax.text(0.5, 0.5, p.note or "no data", ha="center", va="center", wrap=True, fontsize=6,
                color="0.35", transform=ax.transAxes)
        return values
    lane_ys = y_axis(ax, p, lo, hi, len(lanes)) if p.yscale == "log" else []
    if p.kind in ("strip", "violin"):
        (strip if p.kind == "strip" else violin)(ax, p)
    else:
        offscale = []
        # PGD last: a bound's marker at the same point must not be drawn over it
        for i, t in enumerate(sorted(p.traces, key=lambda t: t.style == "reference")):
            # markers that meet at one point show as rings, one inside the other: the first curve's
            # largest, each next one smaller, PGD's (last, on top) the smallest
            size = t.size or (PGD_SIZE if t.style == "reference" else max(SIZES[1], SIZES[0] - SIZES[2] * i))
            colour = "k" if t.style == "reference" else t.colour or colours[t.label]
            lane = lane_ys[lanes.index(t.label)] if t.label in lanes else None
            offscale.append((_line(ax, replace(_dodged(t, p), size=size), p, colour, lane), lane, colour))
        x_axis(ax, p, bool(lanes))  # before the values are placed: which overlap depends on the x limits
        _notes(ax, p.xnotes)
        values = [_offscale_values(ax, *o) for o in offscale if o[0]]
    if p.ref is not None:
        ax.axhline(p.ref, color="k", lw=0.8, ls=":", zorder=1)
    if p.yscale == "linear":
        y_axis(ax, p, lo, hi, 0)
    if p.kind == "violin" and p.yscale == "log":  # the violins' tails must not be cut off
        ax.set_ylim(min(ax.get_ylim()[0], lo / 1.15), max(ax.get_ylim()[1], hi * 1.15))
    ax.set_title(p.title)
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(p.ylabel)
    return values


def _legend(fig: plt.Figure, plot: Plot, grid: list[list]) -> None:
    if plot.legend == "none":
        return
    if plot.legend in ("below", "each"):
        # one per column, under the last row: inside the axes it would hide the small-ε points;
        # "each": one under every panel, whose traces (merged per panel) differ from its neighbours'
        if plot.legend == "below":
            for ax in grid[-1]:
                ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
            return
        # a fixed distance below the x axis, clear of its ticks and label whatever the panel's height
        below = ScaledTranslation(0, -0.42, fig.dpi_scale_trans)
        for ax in [a for a in fig.axes if a.axison and a.get_legend_handles_labels()[0]]:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=ax.transAxes + below,
                      frameon=False)
        return
    # one legend for all panels: a bound missing from one panel must still be named; certified
    # bounds first, then estimates, then PGD, each in the order the panels name them
    seen: dict = {}
    for ax in (a for row in grid for a in row):
        for h, text in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(text, h)
    rank = {t.label: RANK.get(t.style, 0) for p in plot.panels for t in p.traces}
    order = sorted(seen, key=lambda text: rank.get(text, 0))
    fig.legend([seen[k] for k in order], order, loc="outside right center")


def _shared(panels: list[Panel]) -> tuple[float, float, list[str]]:
    """The y range and off-scale lanes of panels drawn on the same limits (an empty panel has none)."""
    ranges = [_yrange(p) for p in panels if p.traces] or [(1.0, 10.0)]
    return (min(r[0] for r in ranges), max(r[1] for r in ranges),
            list(dict.fromkeys(t for p in panels for t in _over(p))))


def _share(plot: Plot, grid: list[list]) -> None:
    """Ties the y axes of the panels a reader compares (matplotlib's sharey: one set of limits and
    ticks, kept on every panel): all panels (sharey True) or each row's ("row")."""
    lead = None
    for r, row in enumerate(plot.rows):
        if plot.sharey is not True:
            lead = None
        if not plot.shared(r):
            continue
        for c, p in enumerate(row):
            if not p.traces:
                continue
            if lead is None:
                lead = grid[r][c]
            else:
                grid[r][c].sharey(lead)


def _grid(fig: plt.Figure, plot: Plot) -> list[list]:
    """One axes per panel and no empty cell: a row of fewer panels than another spreads its panels
    over the whole width (each spans lcm / len(row) columns of the grid)."""
    widths = [max(len(r), 1) for r in plot.rows]
    span = math.lcm(*widths)
    gs = fig.add_gridspec(len(widths), span)
    return [[fig.add_subplot(gs[r, c * span // n:(c + 1) * span // n]) for c in range(n)]
            for r, n in enumerate(widths)]


def draw(plot: Plot) -> plt.Figure:
    """The matplotlib figure of a Plot (the caller saves and closes it)."""
    fig = plt.figure(figsize=plot.size, layout="constrained")
    grid = _grid(fig, plot)
    labels = list(dict.fromkeys(t.label for p in plot.panels for t in p.traces if not t.colour))
    colours = dict(zip(labels, sns.color_palette("deep", max(len(labels), 1)), strict=False))
    values: list[list] = []
    _share(plot, grid)
    for r, row in enumerate(plot.rows):
        together = plot.panels if plot.sharey is True else row
        shared = _shared(together) if plot.shared(r) else None
        for c, p in enumerate(row):
            lo, hi, lanes = shared or (*_yrange(p), _over(p))
            values += _panel(grid[r][c], p, lo, hi, lanes, colours)
    _say_log(grid)
    _legend(fig, plot, grid)
    _thin(fig, values)
    return fig
