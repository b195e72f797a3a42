"""Tightness of every end-to-end bound along one sweep's axis (sweeps ``heads``, ``depth``,
``input_norm``, ``eps``, ``n``): value / PGD lower bound, one column of panels per facet (layer kind, or h).

Two rows, because the bounds differ by up to 99 orders of magnitude: on one axis a SpecFormer ratio
of 1e11 squeezes every useful bound into the decade above 1. The top row holds the bounds a reader
would use, as ``ratio − 1`` on a log axis (as tightness_taylor: 1.01 and 1.5 read apart); the
bottom row the published bounds whose statement this suite found unsound (docs/bounds.md §6) and any
bound more than ``LOOSE`` times PGD, as the ratio itself on a log axis that reaches their largest
value, so a ratio of 1e99 is a point, not a mark. Imports only :mod:`bench.report.panels`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

import bounds

from ..panels import (
    Panel,
    Plot,
    Skip,
    bound_trace,
    excess,
    letter,
    nearest,
    present,
    registry_order,
    sweep,
)

WIDE = 7.0
LOOSE = 1e3  # a bound this many times PGD certifies nothing a reader would use: bottom row
RATIO, EXCESS = "bound / PGD", "bound / PGD − 1"
# sweep: (x column, its axis label, facet column, x scale)
TIGHT = {"heads": ("h", "heads h", "kind", "log2"), "depth": ("depth", "depth (blocks)", "kind", "linear"),
         "input_norm": ("x_norm", "input norm ‖X‖", "kind", "log"),
         "eps": ("eps", r"radius $\varepsilon$", "h", "linear"),
         # Castin et al.'s constant grows as √n (docs/bounds.md §3.5): the n sweep shows it
         "n": ("n", "tokens n", "kind", "log2")}


def _rows(df: pd.DataFrame, name: str) -> tuple[pd.DataFrame, str]:
    sub = sweep(df, name)
    sub = sub[(sub["role"] == "bound") & (sub["objective"] == "output") & (sub["head"] == -1)
              & np.isfinite(sub["ratio"]) & (sub["ratio"] > 0)]
    if sub.empty:
        raise Skip(f"no end-to-end bound with a finite ratio in sweep `{name}`")
    if name != "eps":
        return sub, ""
    xn = nearest(sub, "x_norm", 1.0)
    return sub[sub["x_norm"] == xn], f", ‖X‖={xn:g}"


def apart(sub: pd.DataFrame, x: str, facet: str) -> list[str]:
    """The bounds drawn in the bottom row: a finding, or a mean ratio above LOOSE at some point."""
    worst = sub.groupby(["bound", x, facet])["ratio"].mean()
    loose = set(worst[worst > LOOSE].index.get_level_values("bound"))
    return [n for n in registry_order(sub["bound"])
            if n in loose or (n in bounds.REGISTRY and bounds.REGISTRY[n].finding)]


def _span(v: list[float]) -> str:
    lo, hi = f"{min(v):.4f}", f"{max(v):.4f}"
    return lo if lo == hi else f"{lo}–{hi}"


def fig_tight(df: pd.DataFrame, name: str) -> Plot:
    sub, extra = _rows(df, name)
    x, xlabel, facet, xscale = TIGHT[name]
    far = apart(sub, x, facet)
    facets = sorted(sub[facet].unique())
    top, bottom = [], []
    hidden: dict[str, list[float]] = {}  # per bound, its mean ratios ≤ 1 (none on a log of ratio − 1)
    for i, f in enumerate(facets):
        sf = sub[sub[facet] == f]
        names = registry_order(sf["bound"])
        ratios = present(*(bound_trace(sf, x, n, "ratio") for n in names if n not in far))
        over = present(*map(excess, ratios))
        for t in ratios:
            hidden.setdefault(t.label, []).extend(y for y in t.y if y <= 1)
        top.append(Panel(f"{letter(i)} {facet} = {f}", xlabel, EXCESS if not i else "", over,
                         xscale=xscale, note=f"no bound above PGD without a finding and below "
                                             f"{LOOSE:g}× PGD for {facet} = {f}"))
        rest = present(*(bound_trace(sf, x, n, "ratio") for n in names if n in far))
        bottom.append(Panel(f"{letter(len(facets) + i)} {facet} = {f}", xlabel,
                            f"{RATIO}: finding or > {LOOSE:g}×" if not i else "", rest,
                            xscale=xscale, ref=1.0,
                            note=f"no bound with a finding or above {LOOSE:g}× PGD for {facet} = {f}"))
    rows = [top, bottom] if any(p.traces for p in bottom) else [top]
    gone = {k: v for k, v in hidden.items() if v}
    below = (" Left out of the top row, whose log axis has no place for ratio − 1 ≤ 0: "
             + "; ".join(f"{k} at {_span(v)} × PGD ({len(v)} point{'s' if len(v) > 1 else ''})"
                         for k, v in gone.items()) + ".") if gone else ""
    return Plot(rows, f"Tightness vs {x}: sweep `{name}`{extra}, every end-to-end bound (objective "
                      f"output, head −1); ratio = value / PGD lower bound (mean over samples; "
                      f"docs/bounds.md §4), panels by {facet}; estimates dashed. Top row: bound / "
                      f"PGD − 1 on a log axis, for the bounds without a finding whose ratio stays "
                      f"below {LOOSE:g}.{below} Bottom row: bound / PGD (dotted at 1) of the "
                      f"published bounds this suite found unsound (docs/bounds.md §6) and of any bound "
                      f"above {LOOSE:g}× PGD, each panel on its own log axis.",
                (min(WIDE, 2.4 * len(facets) + 1.9), 5.0 if len(rows) == 2 else 2.7),
                sharey=(True, False))
