"""Draws a selected :class:`~bench.report_data.Plot` with matplotlib; reads no results table.

What a reader must be able to trust, whatever the data: every axis has at least two labelled ticks,
every panel a title, legends sit outside the data, and a value too large for the axis is never
drawn at a cap as if it were flat: it goes into an off-scale band at the top, as ▲ with its number.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # headless CI and CLI: never ask for a display

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns
from matplotlib import ticker

from .report_data import Panel, Plot, Trace

# (line style, marker): estimates dashed, this suite's tightenings square, PGD black dashed;
# ▲ is kept for off-scale points
STYLES = {"points": ("none", "o"), "bound": ("-", "o"), "ours": ("-", "s"), "estimate": ("--", "D"),
          "reference": ("--", "o"), "dense": ("--", "s")}
RANK = {"estimate": 1, "reference": 2}  # legend order: certified bounds, estimates, PGD
LANE = 0.1  # axes fraction of the off-scale band per bound that goes off scale
PAD = 0.06  # log-axis margin, as a fraction of the data's span in decades


def theme() -> None:
    sns.set_theme(context="paper", style="whitegrid", font_scale=0.9,
                  rc={"legend.fontsize": 6, "axes.titlesize": 7.5, "lines.markersize": 3.5,
                      "xtick.labelsize": 6.5, "ytick.labelsize": 6.5})


def tick_texts(vals: list[float]) -> list[str]:
    """Plain decimals when every tick of the axis is short that way, else powers of ten for all
    (one axis never mixes 0.01 with 10⁻³, nor shows 2×10⁻¹ where 0.2 reads at once)."""
    if all(v == 0 or 1e-2 <= abs(v) < 1e5 for v in vals):
        return [f"{float(f'{v:.3g}'):.10g}" for v in vals]
    out = []
    for v in vals:
        k = math.floor(math.log10(abs(v)) + 1e-9) if v else 0
        m = v / 10**k
        out.append("0" if v == 0 else rf"$10^{{{k}}}$" if abs(m - 1) < 1e-9
                   else rf"${m:.2g}{{\times}}10^{{{k}}}$")
    return out


def log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks in [lo, hi]: decades where two fit, else the first of 1-2-5, 1…9 per decade, or those
    and halves that gives three; at most ~7 (every other one beyond)."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    ticks: list[float] = []
    for subs in ([1], [1, 2, 5], list(range(1, 10)), [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 9]):
        cands = [float(f"{m * 10.0**k:.3g}") for k in decades for m in subs]  # 0.3, not 0.30000000000000004
        ticks = [v for v in cands if lo <= v <= hi]
        if len(ticks) >= 3 or (len(ticks) == 2 and subs == [1]):  # two decades read well
            break
    if len(ticks) < 2:
        ticks = sorted({float(f"{v:.3g}") for v in np.geomspace(lo, hi, 5)[1:4]})
    return ticks[::math.ceil(len(ticks) / 7)]


def _ensure_ticks(ax, which: str) -> None:
    """Falls back on three labelled ticks inside the limits when fewer than two would show."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    locs = [v for v in axis.get_majorticklocs() if lo <= v <= hi]
    labels = axis.get_major_formatter().format_ticks(locs) if locs else []
    if sum(1 for t in labels if t) >= 2:
        return
    scale = ax.get_xscale() if which == "x" else ax.get_yscale()
    vals = np.geomspace(lo, hi, 5)[1:4] if scale == "log" else np.linspace(lo, hi, 5)[1:4]
    vals = [float(f"{v:.3g}") for v in vals]
    axis.set_major_locator(ticker.FixedLocator(vals))
    axis.set_major_formatter(ticker.FixedFormatter([f"{v:g}" for v in vals]))
    axis.set_minor_locator(ticker.NullLocator())


def _x_axis(ax, p: Panel, band: bool) -> None:
    """Scale, limits and labelled ticks of x; ``band``: the panel has an off-scale band, whose values
    need half a label's room beyond the first and last x."""
    xs = sorted({v for t in p.traces for v in t.x})
    margin = 0.12 if band else 0.06
    if p.xscale in ("log", "log2"):
        ax.set_xscale("log", base=2 if p.xscale == "log2" else 10)
        if len(xs) == 1:
            xs = [xs[0] / 2, xs[0], xs[0] * 2]
        lo, hi = math.log(xs[0]), math.log(xs[-1])
        ax.set_xlim(math.exp(lo - margin * (hi - lo)), math.exp(hi + margin * (hi - lo)))
        # the grid's own values read better than 2^k or 10^k; drop those too close to be read
        kept = [xs[0]]
        for v in xs[1:]:
            if math.log(v) - math.log(kept[-1]) >= 0.09 * (hi - lo):
                kept.append(v)
        ax.set_xticks(kept, [f"{v:g}" for v in kept])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
    else:
        ax.set_xmargin(margin)
    if p.xscale not in ("log", "log2") and xs:
        if len(xs) == 1:
            ax.set_xlim(xs[0] - 1, xs[0] + 1)
            xs = [xs[0] - 1, xs[0], xs[0] + 1]
        gaps = np.diff(xs) / (xs[-1] - xs[0])
        if len(xs) <= 8 and gaps.min() >= 0.15:  # a few grid points (depth, noise): exactly those
            ax.set_xticks(xs, [f"{v:g}" for v in xs])
        else:  # a dense grid (eps): round ticks, as labels of every point would collide
            ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6, integer=all(
                float(v).is_integer() for v in xs)))
    _ensure_ticks(ax, "x")


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


def _y_axis(ax, p: Panel, lo: float, hi: float, lanes: int) -> list[float]:
    """Sets the limits and ticks; returns, for each lane of the off-scale band, its y value."""
    if p.yscale == "linear":
        ax.set_ylim(*ax.get_ylim())  # matplotlib's own margins; freeze them before checking ticks
        _ensure_ticks(ax, "y")
        return []
    ax.set_yscale("log")
    l0, l1 = math.log10(lo), math.log10(hi)
    pad = max(PAD * (l1 - l0), 0.02)
    bottom, top = l0 - pad, l1 + (0 if lanes else pad)
    ticks = log_ticks(10**bottom, 10**top)
    lane_ys: list[float] = []
    if lanes:
        frac = 1 - LANE * lanes  # the band holds one lane per bound off scale
        full = bottom + (top - bottom) / frac
        lane_ys = [10 ** (bottom + (frac + LANE * (i + 0.3)) * (full - bottom)) for i in range(lanes)]
        ax.axhspan(10**top, 10**full, color="0.93", zorder=0.6, lw=0)
        ax.axhline(10**top, color="0.55", lw=0.6, zorder=0.7)
        texts = tick_texts([*ticks, 10**top])
        ticks.append(10 ** (top + (full - top) / 2))  # the band's own label: "> ceiling"
        texts[-1] = "> " + texts[-1]
        top = full
    else:
        texts = tick_texts(ticks)
    ax.set_ylim(10**bottom, 10**top)
    ax.set_yticks(ticks, texts)
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    _ensure_ticks(ax, "y")
    return lane_ys


def _line(ax, t: Trace, p: Panel, colour, lane_y: float | None) -> list[tuple[float, float]]:
    """Draws one trace; returns its off-scale points (x, value), drawn as ▲ in the band at lane_y.

    The line climbs into the band to an off-scale point, never flattens at a cap, and is not drawn
    between two off-scale points (their heights in the band mean nothing)."""
    ls, marker = STYLES.get(t.style, STYLES["bound"])
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
    ax.plot(xs, ys, ls=ls, marker=marker, markevery=marks, color=colour, lw=1.2, label=t.label)
    if t.lo is not None and t.hi is not None:
        lo = np.asarray(t.lo)
        if p.yscale == "log":
            lo = np.maximum(lo, y * 1e-3)  # a mean − std at or below 0 has no place on a log axis
        ax.errorbar(x, y, yerr=[y - lo, np.asarray(t.hi) - y], ls="none", color=colour, capsize=2,
                    elinewidth=0.8)
    if off.any():
        ax.plot(x[off], np.full(int(off.sum()), lane_y), ls="none", marker="^", color=colour,
                markersize=4.5)
    return list(zip(x[off].tolist(), y[off].tolist(), strict=True))


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


def _strip(ax, p: Panel) -> None:
    """Box (quartiles) and every point per group; jitter from a fixed seed, so PDFs stay identical."""
    rng = np.random.default_rng(0)
    pos = [t.x[0] for t in p.traces]
    ax.boxplot([t.y for t in p.traces], positions=pos, widths=0.5, showfliers=False,
               medianprops={"color": "0.2"}, boxprops={"color": "0.5"}, whiskerprops={"color": "0.5"},
               capprops={"color": "0.5"})
    for t in p.traces:
        ax.plot(t.x + rng.uniform(-0.15, 0.15, len(t.x)), t.y, ls="none", marker="o", alpha=0.8,
                color=t.colour or "C0", markersize=3)
    ax.set_xticks(pos, [f"{v:g}" for v in pos])
    ax.set_xlim(min(pos) - 0.6, max(pos) + 0.6)
    _ensure_ticks(ax, "x")


def _panel(ax, p: Panel, lo: float, hi: float, lanes: list[str], colours: dict[str, object]) -> list:
    """Draws one panel; returns its off-scale value texts, one list per bound.

    ``lanes``: the labels that own a lane of the off-scale band, in order (shared panels share
    them, so a bound sits at the same height in every panel)."""
    values = []
    lane_ys = _y_axis(ax, p, lo, hi, len(lanes)) if p.yscale == "log" else []
    if p.kind == "strip":
        _strip(ax, p)
    else:
        offscale = []
        for t in p.traces:
            colour = "k" if t.style == "reference" else t.colour or colours[t.label]
            lane = lane_ys[lanes.index(t.label)] if t.label in lanes else None
            offscale.append((_line(ax, t, p, colour, lane), lane, colour))
        _x_axis(ax, p, bool(lanes))  # before the values are placed: which overlap depends on the x limits
        values = [_offscale_values(ax, *o) for o in offscale if o[0]]
    if p.ref is not None:
        ax.axhline(p.ref, color="k", lw=0.8, ls=":", zorder=1)
    if p.yscale == "linear":
        _y_axis(ax, p, lo, hi, 0)
    ax.set_title(p.title)
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(p.ylabel)
    return values


def _legend(fig: plt.Figure, plot: Plot, axes: np.ndarray) -> None:
    if plot.legend == "none":
        return
    if plot.legend == "below":
        # one per column, under the last row: inside the axes it would hide the small-ε points
        for ax in axes[-1]:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
        return
    # one legend for all panels: a bound missing from one panel must still be named; certified
    # bounds first, then estimates, then PGD, each in the order the panels name them
    seen: dict = {}
    for ax in axes.flat:
        for h, text in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(text, h)
    rank = {t.label: RANK.get(t.style, 0) for p in plot.panels for t in p.traces}
    order = sorted(seen, key=lambda text: rank.get(text, 0))
    fig.legend([seen[k] for k in order], order, loc="outside right center")


def draw(plot: Plot) -> plt.Figure:
    """The matplotlib figure of a Plot (the caller saves and closes it)."""
    nrows, ncols = len(plot.rows), max(len(r) for r in plot.rows)
    fig, axes = plt.subplots(nrows, ncols, figsize=plot.size, constrained_layout=True, squeeze=False)
    labels = list(dict.fromkeys(t.label for p in plot.panels for t in p.traces if not t.colour))
    colours = dict(zip(labels, sns.color_palette("deep", max(len(labels), 1)), strict=False))
    ranges = [_yrange(p) for p in plot.panels]
    shared = (min(r[0] for r in ranges), max(r[1] for r in ranges),
              list(dict.fromkeys(t for p in plot.panels for t in _over(p))))
    i = 0
    values: list[list] = []
    for r, row in enumerate(plot.rows):
        for c in range(ncols):
            if c >= len(row):
                axes[r, c].remove()
                continue
            lo, hi, lanes = shared if plot.sharey else (*ranges[i], _over(row[c]))
            values += _panel(axes[r, c], row[c], lo, hi, lanes, colours)
            i += 1
    _legend(fig, plot, axes)
    _thin(fig, values)
    return fig
