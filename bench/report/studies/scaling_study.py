"""The scaling sweeps (task ``scaling``): seconds per sample of each way to get ζ, ‖M_l‖ and
σ_max(J) (docs/bounds.md §2.1, §2.4) along n, d, h and depth, one panel per sweep. Imports only
:mod:`bench.report.panels`.
"""

from __future__ import annotations

import pandas as pd

from ..panels import Panel, Plot, Skip, Trace, letter

WIDE = 7.0

SCALING = {"scaling": "n", "scaling_d": "d", "scaling_h": "h", "scaling_depth": "depth"}
# each sweep's panel: what it varies, in words (its x label is the column's letter)
TITLES = {"n": "tokens n", "d": "width d", "h": "heads h", "depth": "depth"}
FIXED = ["n", "d", "h", "depth"]  # the other parameters, named in the title when one value each
# timing rows name a quantity and a solver; the legend says both in words, the colour is the
# quantity's and the line style the solver's (the three families of docs/bounds.md §2.4)
QUANTITY = {"zeta": "ζ(X)", "M": "‖M_l‖", "jacobian": "σ_max(J)"}
SOLVER = {"lanczos": ("Lanczos estimate", "estimate"),
          "probabilistic": ("probabilistic certificate", "certificate"),
          "dense": ("exact (dense SVD)", "dense")}
_QCOLOUR = {"zeta": "#1f77b4", "M": "#ff7f0e", "jacobian": "#2ca02c"}
FAMILIES = ("Lanczos estimate (dashed): restarted Lanczos from a fixed start, a value from below, "
            "never an upper bound (docs/bounds.md §2.1); probabilistic certificate (solid): "
            "unrestarted Lanczos from a recorded random start in float64, an upper bound except "
            "with probability p = 1e-9 (§2.4); exact (dotted): the dense SVD in float64, where "
            "n·d ≤ 2048 and the layer is not a stack.")


def _timing_label(name: str) -> tuple[str, str, str | None]:
    q, _, solver = name.rpartition("_")
    if q in QUANTITY and solver in SOLVER:
        text, st = SOLVER[solver]
        return f"{QUANTITY[q]}, {text}", st, _QCOLOUR[q]
    return name, "bound", None


def _timing_rank(name: str) -> tuple:
    q, _, solver = name.rpartition("_")
    return (list(QUANTITY).index(q) if q in QUANTITY else len(QUANTITY),
            list(SOLVER).index(solver) if solver in SOLVER else len(SOLVER), name)


def _fixed(sub: pd.DataFrame, x: str) -> str:
    """The parameters a sweep holds fixed, as ", d=32, h=4" (those with one value in its rows)."""
    fixed = [f"{c}={sub[c].iloc[0]:g}" for c in FIXED if c != x and sub[c].nunique() == 1
             and not (c == "depth" and sub[c].iloc[0] == 1)]
    return "\n(" + ", ".join(fixed) + ")" if fixed else ""


def fig_scaling(df: pd.DataFrame) -> Plot:
    timing = df[df["role"] == "timing"]
    present_ = [s for s in SCALING if s in set(timing["sweep"])]
    if not present_:
        raise Skip("no timing rows of the scaling sweeps")
    order = sorted(timing["bound"].unique(), key=_timing_rank)
    panels = []
    for s in present_:
        sub = timing[timing["sweep"] == s]
        traces = []
        for m in order:
            g = sub[sub["bound"] == m].groupby(SCALING[s])["seconds"].median()
            if not g.empty:
                text, st, c = _timing_label(m)
                traces.append(Trace(text, [float(v) for v in g.index], [float(v) for v in g.values],
                                    st, c))
        panels.append(Panel(f"{letter(len(panels))} {TITLES[SCALING[s]]}{_fixed(sub, SCALING[s])}",
                            SCALING[s], "seconds per sample" if not panels else "", traces,
                            xscale="log2"))
    return Plot([panels], f"Scaling (docs/bounds.md §2.1, §2.4): sweeps "
                          f"{', '.join(f'`{s}`' for s in present_)} (task scaling); median `seconds` "
                          f"per sample of each way to get ζ, ‖M_l‖ and σ_max(J) (colour: the "
                          f"quantity), log-log; each panel varies one of n, d, h, depth, the others "
                          f"fixed as its title says. {FAMILIES}", (WIDE, 2.8))
