"""The plain data a report figure is drawn from, and the selection helpers the figures and tables share.

A figure is selected from the results table as a :class:`Plot` (rows of :class:`Panel`, each a list
of :class:`Trace` with display labels, axis names and a caption) and only then drawn, so what a
figure shows can be checked without matplotlib, and the drawing never reads the table.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

import bounds

from ..core.schema import KINDS

PGD_LABEL = "PGD (lower bd.)"


class Skip(Exception):
    """A figure or table whose data is not in this table. ``listed=False``: a study of the user's own
    data (the imported layers), which no profile of the suite makes: the report does not list it as
    skipped, so a report of the suite's own runs says nothing of it."""

    def __init__(self, message: str, listed: bool = True):
        super().__init__(message)
        self.listed = listed


@dataclass(frozen=True, eq=False)
class Parts:
    """One study's table in several parts, each written as ``<stem><suffix>.md`` and ``.tex`` with its
    caption, and optionally ``full``: every number the parts were chosen from, one per row, written as
    ``<stem>_full.csv`` (its cells already text, so the file depends on the data alone)."""

    parts: tuple[tuple[str, pd.DataFrame, str], ...]  # (stem suffix, table, caption)
    full: pd.DataFrame | None = None


@dataclass
class Trace:
    """One curve (or, in a ``strip`` panel, one group of points at ``x``)."""

    label: str  # the legend's name: a display name, never a code name
    x: list[float]
    y: list[float]
    # bound, ours, estimate, reference (PGD, black), envelope (a minimum of the other curves),
    # and for solver timings: estimate, certificate (probabilistic), dense (exact)
    style: str = "bound"
    colour: str | None = None  # the same bound has the same colour in every figure
    lo: list[float] | None = None  # error bar ends, absolute (None: no bar)
    hi: list[float] | None = None
    legend: bool = True  # False: the panel's title names it (a legend entry would repeat it)
    marker: str | None = None  # None: its style's; a shape of its own where many curves meet
    size: float | None = None  # marker size (points); None: the theme's
    # the other curves equal to this one everywhere in its panel: drawn once, under one short label,
    # and named in the caption (a legend entry chaining them would run to a paragraph)
    also: tuple[str, ...] = ()


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    traces: list[Trace]
    xscale: str = "linear"  # linear, log, log2
    yscale: str = "log"  # log or linear
    kind: str = "line"  # line, strip (box and points per x) or violin (density and points per x)
    ref: float | None = None  # a dotted reference line (ratio 1: the bound equals PGD)
    ceiling: float | None = None  # values above are drawn off scale, in a band, with their number
    note: str = ""  # shown instead of axes when the panel has no trace (why it is empty)
    dodge: float = 0.0  # log x: traces with error bars drawn apart by this share of the x span each
    # a second line under the x tick at a value: a parameter the x axis does not show that changes
    # along the curve (h of the cost cells), so a bend there is not read as the x axis's doing
    xnotes: dict[float, str] = field(default_factory=dict)


@dataclass
class Plot:
    rows: list[list[Panel]]
    caption: str
    size: tuple[float, float]  # inches
    # right: one legend beside all panels; below: one under each column; each: one under every
    # panel (whose traces differ from its neighbours'); none
    legend: str = "right"
    # y axes tied (matplotlib sharey: same limits, band and ticks, labels kept on each panel):
    # every panel (True), each row's panels ("row", when each row plots another quantity), or per
    # row as a tuple of bools (a row of unrelated layers keeps its own axes)
    sharey: bool | str | tuple[bool, ...] = False
    panels: list[Panel] = field(init=False)

    def __post_init__(self) -> None:
        self.panels = [p for row in self.rows for p in row]

    def shared(self, r: int) -> bool:
        """Whether row r's panels share their y axis (with each other, or with all for True)."""
        if isinstance(self.sharey, tuple):
            return r < len(self.sharey) and self.sharey[r]
        return bool(self.sharey)


# a bound keeps its colour across figures; a ½ tightening (this suite) sits next to its parent's
_COLOURS = {
    "lofast_M": "#1f77b4", "lofast_M_half": "#17becf", "lofast_xi": "#ff7f0e",
    "lofast_xi_half": "#bcbd22", "naive": "#d62728", "specformer": "#9467bd", "kim": "#8c564b",
    "olsa": "#e377c2", "jacobian": "#7f7f7f", "jacobian_l1linf": "#2ca02c",
    "jacobian_exp": "#393b79", "delta21_M": "#1f77b4", "delta21_xi": "#ff7f0e",
    "delta22_tight": "#1f77b4", "delta22_naive": "#ff7f0e", "delta2_M": "#1f77b4",
    "delta2_xi": "#ff7f0e", "delta1": "#1f77b4", "naive_delta1": "#d62728", "zeta": "#7f7f7f",
    "taylor": "#006d2c", "best": "#555555", "castin": "#7b4173", "yudin": "#e7969c",
    "yudin_local": "#ad494a",
}


def balanced(panels: list[Panel], most: int = 4) -> list[list[Panel]]:
    """Panels in rows of at most ``most``, as even as can be (6 panels: 3 + 3, not 4 + 2): a ragged
    last row would leave empty cells beside it."""
    if not panels:
        return []
    nrows = -(-len(panels) // most)
    ncols = -(-len(panels) // nrows)
    return [panels[i:i + ncols] for i in range(0, len(panels), ncols)]


def letter(i: int) -> str:
    """The label of the i-th panel of a figure in reading order: (a), (b), … (each once per figure)."""
    return f"({chr(ord('a') + i)})"


def excess(t: Trace | None) -> Trace | None:
    """ratio − 1 of a ratio trace, at the points where it is positive (a log axis has no 0)."""
    if t is None:
        return None
    pts = [(x, y - 1) for x, y in zip(t.x, t.y, strict=True) if y > 1]
    if not pts:
        return None
    return Trace(t.label, [p[0] for p in pts], [p[1] for p in pts], t.style, t.colour)


# a registered bound without a pinned colour (a plugin's, a new one) takes one of these, by a hash of
# its name: the same in every figure and run, never the palette's next colour (which depends on what
# else a figure holds)
_SPARE = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
          "#9edae5", "#637939", "#8c6d31", "#843c39")


def spare(name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` by a hash of ``name``: the same in every figure and run (a colour, a marker)."""
    return choices[int(hashlib.sha256(name.encode()).hexdigest(), 16) % len(choices)]


def colour(name: str) -> str | None:
    """A bound's colour: its pinned one, else a deterministic spare; None for a name the registry
    does not hold (PGD, a solver)."""
    if name in _COLOURS or name not in bounds.REGISTRY:
        return _COLOURS.get(name)
    return spare(name, _SPARE)


def label(name: str) -> str:
    """The display name of a registered bound (its code name when it is not registered)."""
    return bounds.REGISTRY[name].label if name in bounds.REGISTRY else name


def style(name: str) -> str:
    b = bounds.REGISTRY.get(name)
    if b is None:
        return "bound"
    if name == "best":  # it lies on another bound's curve everywhere: drawn as a wide band beneath
        return "envelope"
    return "estimate" if not b.certified else "ours" if b.ours else "bound"


def registry_order(names) -> list[str]:
    """Names in registry order (papers' bounds, then this suite's, then estimates), others last."""
    rank = {n: i for i, n in enumerate(bounds.REGISTRY)}
    return sorted(set(names), key=lambda n: (rank.get(n, len(rank)), n))


def sweep(df: pd.DataFrame, name: str, **eq) -> pd.DataFrame:
    sub = df[df["sweep"] == name]
    for k, v in eq.items():
        sub = sub[sub[k] == v]
    if sub.empty:
        raise Skip(f"no rows of sweep `{name}`" + (f" with {eq}" if eq else ""))
    return sub


def commits(sub: pd.DataFrame) -> str:
    """The short commits the rows were computed at, for a caption ("?" when the table has none)."""
    if "git_commit" not in sub:
        return "?"
    return "/".join(sorted({str(c)[:10] for c in sub["git_commit"]}))


def nearest(sub: pd.DataFrame, col: str, want: float) -> float:
    """The value of ``col`` closest to ``want`` (a user profile may not hold ``want`` itself)."""
    vals = np.sort(sub[col].unique())
    return vals[np.argmin(np.abs(vals - want))].item()


def mean_by(rows: pd.DataFrame, x: str, col: str) -> pd.Series:
    """Mean of ``col`` per ``x`` over samples (and heads), finite positive values only (log axes)."""
    rows = rows[np.isfinite(rows[col]) & (rows[col] > 0)]
    return rows.groupby(x)[col].mean()


def trace(rows: pd.DataFrame, x: str, col: str, text: str, style_: str = "bound",
          colour_: str | None = None) -> Trace | None:
    g = mean_by(rows, x, col)
    if g.empty:
        return None
    return Trace(text, [float(v) for v in g.index], [float(v) for v in g.values], style_, colour_)


def bound_trace(sub: pd.DataFrame, x: str, name: str, col: str = "value") -> Trace | None:
    """The mean ``col`` of one bound's rows along ``x``, labelled and styled from the registry."""
    rows = sub[(sub["role"] == "bound") & (sub["bound"] == name)]
    return trace(rows, x, col, label(name), style(name), colour(name))


def pgd_trace(sub: pd.DataFrame, x: str, objective: str = "output") -> Trace | None:
    rows = sub[(sub["role"] == "pgd") & (sub["objective"] == objective)]
    return trace(rows, x, "value", PGD_LABEL, "reference")


def present(*traces: Trace | None) -> list[Trace]:
    return [t for t in traces if t is not None]




def p_text(p: float) -> str:
    """A failure probability rounded up to two digits: "p ≤ 4e-09" must not understate it."""
    k = math.floor(math.log10(p)) - 1
    return f"{math.ceil(p / 10.0**k * (1 - 1e-12)) * 10.0**k:.2g}"


def certificates(rows: pd.DataFrame) -> str:
    """The certificate kinds of a bound's rows (docs/bounds.md §2.4), strongest first; a
    probabilistic one with the largest failure probability of its rows; "–" where the rows record
    none."""
    if "certificate" not in rows:
        return "–"
    kinds = set(rows["certificate"].dropna())
    seen = [k for k in KINDS if k in kinds] + sorted(kinds - set(KINDS))
    out = []
    for k in seen:
        p = rows.loc[rows["certificate"] == k, "certificate_p"] if "certificate_p" in rows else pd.Series()
        p = p[np.isfinite(p) & (p > 0)]
        out.append(f"{k} (p ≤ {p_text(p.max())})" if k == "probabilistic" and len(p) else k)
    return " / ".join(out) if out else "–"
