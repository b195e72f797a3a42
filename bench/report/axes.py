"""Axes of a report figure: scales, limits and labelled ticks (at least two on every axis).

Split from :mod:`bench.report.draw`, which draws the lines; this module sets where a reader reads
them off: log ticks that stay few and round, the grid's own x values where they fit, and the
off-scale band of a log y axis.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib import ticker

from .panels import Panel

LANE = 0.1  # axes fraction of the off-scale band per bound that goes off scale
PAD = 0.06  # log-axis margin, as a fraction of the data's span in decades


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
    for subs in ([1], [1, 2, 5], list(range(1, 10)), [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 9],
                 [1, 1.2, 1.4, 1.6, 1.8, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 9]):
        cands = [float(f"{m * 10.0**k:.3g}") for k in decades for m in subs]  # 0.3, not 0.30000000000000004
        ticks = [v for v in cands if lo <= v <= hi]
        # two decades read well; within less than a decade three ticks leave a half-empty axis
        if len(ticks) >= (2 if subs == [1] else 3 if subs == [1, 2, 5] else 4):
            break
    if len(ticks) < 2:
        ticks = sorted({float(f"{v:.3g}") for v in np.geomspace(lo, hi, 5)[1:4]})
    if len(ticks) > 7 and all(math.log10(t).is_integer() for t in ticks):
        # many decades (a ratio of 1e99): every 2nd, 5th, 10th, 20th … decade, at multiples of it
        step = next(s for s in (2, 5, 10, 20, 25, 50, 100, 200, 500) if len(ticks) / s <= 7)
        kept = [t for t in ticks if round(math.log10(t)) % step == 0]
        if len(kept) >= 2:
            return kept
    return ticks[::math.ceil(len(ticks) / 7)]


def ensure_ticks(ax, which: str) -> None:
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


def x_axis(ax, p: Panel, band: bool) -> None:
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
        decades = [10.0**k for k in range(math.ceil(math.log10(xs[0]) - 1e-9),
                                          math.floor(math.log10(xs[-1]) + 1e-9) + 1)]
        if p.xscale == "log" and len(decades) >= 4:
            # a grid over many decades (ε from 1e-4 to 1): its own values, 0.0001 and 0.0003
            # side by side, would collide; the decades say where each point is
            ax.set_xticks(decades, tick_texts(decades))
        else:
            # the grid's own values read better than 2^k or 10^k; drop those too close to be read
            kept = [xs[0]]
            for v in xs[1:]:
                if math.log(v) - math.log(kept[-1]) >= 0.12 * (hi - lo):
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
    ensure_ticks(ax, "x")


def y_axis(ax, p: Panel, lo: float, hi: float, lanes: int) -> list[float]:
    """Sets the limits and ticks; returns, for each lane of the off-scale band, its y value."""
    if p.yscale == "linear":
        # matplotlib's margin (5 %) around the data of every panel drawn on these limits: a panel
        # whose y is shared with others must not autoscale to its own data alone
        pad = 0.05 * (hi - lo) if hi > lo else max(abs(hi), 1.0) * 0.05
        ax.set_ylim(lo - pad, hi + pad)
        ensure_ticks(ax, "y")
        return []
    ax.set_yscale("log")
    l0, l1 = math.log10(lo), math.log10(hi)
    pad = max(PAD * (l1 - l0), 0.02)
    bottom, top = l0 - pad, l1 + (0 if lanes else pad)
    ticks = log_ticks(10**bottom, 10**top)
    lane_ys: list[float] = []
    texts = tick_texts([*ticks, 10**top] if lanes else ticks)  # one style for ticks and ceiling
    ceiling = texts.pop() if lanes else ""
    if lanes:
        frac = 1 - LANE * lanes  # the band holds one lane per bound off scale
        full = bottom + (top - bottom) / frac
        lane_ys = [10 ** (bottom + (frac + LANE * (i + 0.3)) * (full - bottom)) for i in range(lanes)]
        ax.axhspan(10**top, 10**full, color="0.93", zorder=0.6, lw=0)
        ax.axhline(10**top, color="0.55", lw=0.6, zorder=0.7)
        # a tick at the ceiling would print its value right under the band's "> ceiling", which
        # says it: regular ticks stop half a lane below the band
        below = [i for i, t in enumerate(ticks) if math.log10(t) < top - 0.5 * LANE * (full - bottom)]
        if len(below) >= 2:
            ticks, texts = [ticks[i] for i in below], [texts[i] for i in below]
        ticks.append(10 ** (top + (full - top) / 2))  # the band's own label: "> ceiling"
        texts.append("> " + ceiling)
        top = full
    ax.set_ylim(10**bottom, 10**top)
    ax.set_yticks(ticks, texts)
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    ensure_ticks(ax, "y")
    return lane_ys
