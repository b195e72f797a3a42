"""Whole-network certification (docs/bounds.md §5) as LoFAST reports it: Fig. 2 (certified accuracy
against ε, one panel per model, one line per bound) and the certification gap; its Tables 1 and 2 are
in :mod:`bench.report.studies.certify_tables`. Every number is recounted from
the stored rows (:mod:`bench.report.studies.trained_study`); any bound present is shown, in registry order,
named by the registry or :data:`bench.report.studies.trained_study.LABELS`, else by its code name (and shown
last).
"""

from __future__ import annotations

import math

import pandas as pd

from ..panels import Panel, Plot, Skip, Trace, balanced, commits, letter, style
from . import trained_study as tr
from .trained_study import LEVEL, counts, eg, name_of, network

WIDE = 7.0
COLUMNS = 3  # panels per row of Fig. 2 at most: a legend entry of one line fits under a panel
DODGE = 0.02  # share of the log-ε span between two curves' error bars at the same ε
LARGEST, SMALLEST = 6.0, 3.6  # marker sizes (points) of a panel's first and last curves
EPS_AXIS = "ε (ℓ2, log scale)"


def arch(m: pd.Series) -> tuple[str, str]:
    """A model as two short lines: its data and shape; its caps and training radius."""
    cap = lambda v: "none" if math.isnan(v) else f"{v:g}"
    depth, heads = int(m["vit_depth"]), int(m["vit_heads"])
    return (f"{m['dataset']}, {depth} block{'s' * (depth != 1)} × {heads} head{'s' * (heads != 1)}",
            f"d={int(m['vit_d'])}, c={cap(m['vit_c'])}, q={cap(m['vit_qk'])}, ε_t={m['vit_margin_eps']:g}")


def origin(sub: pd.DataFrame, c: pd.DataFrame) -> str:
    """The caption's provenance of the counts ``c`` of the rows ``sub``: sweeps, images, data, commit."""
    n = sorted(set(int(v) for v in c["n"]))
    images = f"{n[0]}" if len(n) == 1 else f"{n[0]} to {n[-1]}"
    data = "/".join(sorted(set(sub["dataset"])))
    return (f"Sweep(s) {tr.sweeps(sub)}: the first {images} test images of {data} per model and ε; "
            f"commit {commits(sub)}")


def _above(c: pd.DataFrame, ref: pd.DataFrame) -> str:
    """The caption's word on certified accuracies above PGD's robust accuracy at the same model and
    ε: each is a soundness violation or a finding (the suite's checks name which), never hidden."""
    both = c.join(ref, on=["model", "eps"])
    over = both[both["accuracy"] > both["pgd"] + 1e-12]
    if over.empty:
        return ", and none does"
    named = [f"{name_of(b)} on {m} at ε={eg(e)} ({r.accuracy:.3f} > {r.pgd:.3f})"
             for (m, e, b), r in over.iterrows()]
    return "; above it, a soundness violation or a finding (docs/bounds.md §6): " + ", ".join(named)


# a legend entry's most characters: one line under a panel a third of the page wide
LEGEND_CHARS = 45


def _names(c: pd.DataFrame) -> list[str]:
    return tr.order(c.index.get_level_values("bound"))


def _size(i: int) -> float:
    """The marker size of a panel's i-th curve: the first largest, so markers that meet show as
    rings one inside the other; PGD's, drawn last and on top, is smaller than all."""
    return max(SMALLEST, LARGEST - 0.3 * i)


def group_label(group: list[str]) -> str:
    """One short line: the first bound's name and how many equal ones it stands for; where that is
    longer than :data:`LEGEND_CHARS`, the name without its "(this suite)" tag (the caption names
    every bound of the group in full, and the curve's style marks the suite's own)."""
    more = f" (+{len(group) - 1} equal)" if len(group) > 1 else ""
    name = name_of(group[0])
    if len(name + more) > LEGEND_CHARS:
        name = name.removesuffix(" (this suite)")
    return name + more


def group_lead(group: list[str]) -> list[str]:
    """The group with the bound that names its curve first: the first in the registry's order, or
    where its name and "(+k equal)" make more than :data:`LEGEND_CHARS` the one with the shortest
    name (they are equal at every ε: any one stands for the rest)."""
    if len(name_of(group[0]) + f" (+{len(group) - 1} equal)") <= LEGEND_CHARS:
        return group
    lead = min(group, key=lambda b: len(name_of(b)))
    return [lead, *(b for b in group if b != lead)]


def _curves(at: pd.DataFrame, keep=lambda e: True) -> list[tuple[list[str], pd.DataFrame]]:
    """The groups of bounds equal at every ε of one model's counts ``at`` (each drawn once), with the
    rows of the group's first bound at the ε ``keep`` admits."""
    curves = {b: tuple((e, int(r.k), int(r.n)) for e, r in at.xs(b, level="bound").iterrows())
              for b in _names(at)}
    out = []
    for group in map(group_lead, tr.merged(curves)):
        rows = at.xs(group[0], level="bound").sort_index()
        out.append((group, rows[[keep(e) for e in rows.index]]))
    return out


def _trace(i: int, group: list[str], x: list[float], y: list[float], **bars) -> Trace:
    b = group[0]
    return Trace(group_label(group), x, y, style(b), tr.colour_of(b), marker=tr.marker_of(b), size=_size(i),
                 also=tuple(name_of(o) for o in group[1:]), **bars)


def _equal(panels: list[Panel]) -> str:
    """The caption's list of the bounds each merged curve stands for, per panel."""
    parts = []
    for p in panels:
        merged = [f"{t.label.rsplit(' (+', 1)[0]} also stands for {', '.join(t.also)}"
                  for t in p.traces if t.also]
        if merged:
            parts.append(f"in {p.title.split(' ')[0]} " + "; ".join(merged))
    if not parts:
        return ""
    return (" Curves equal at every ε of a panel are drawn once, under the first bound's name (the "
            "shortest, where the first's would not fit one line) and “(+k equal)”, k the number of "
            "others: " + "; ".join(parts) + ".")


def _rows_of(panels: list[Panel]) -> tuple[list[list[Panel]], float]:
    """The panels in even rows, and the figure's height: a panel, its ticks and x label, then its
    legend, one line per entry."""
    rows = balanced(panels, COLUMNS)
    return rows, sum(2.3 + 0.11 * max(len(p.traces) for p in row) for row in rows)


def figure(df: pd.DataFrame) -> Plot:
    """LoFAST Fig. 2: per model, each bound's certified accuracy over ε with its Wilson interval,
    PGD robust accuracy as the empirical upper reference; curves equal at every ε of a panel are
    one line, labelled by the first and the number of others (the caption names them)."""
    sub, c, ref = network(df), counts(df), tr.references(df)
    models = tr.model_order(sub)
    panels = []
    shown = [m for m in models.index if m in c.index.get_level_values("model")]
    labels, shapes = tr.short_labels(shown), {m: arch(models.loc[m]) for m in shown}
    for i, model in enumerate(shown):
        at = c.xs(model, level="model")
        traces = [_trace(j, group, list(map(float, rows.index)), list(map(float, rows["accuracy"])),
                         lo=list(map(float, rows["lo"])), hi=list(map(float, rows["hi"])))
                  for j, (group, rows) in enumerate(_curves(at))]
        if model in ref.index.get_level_values("model"):
            r = ref.xs(model, level="model")["pgd"].dropna().sort_index()
            traces.append(Trace(tr.PGD_REF, list(map(float, r.index)), list(map(float, r)), "reference",
                                size=SMALLEST - 0.6))
        top, bottom = shapes[model]
        # two models of one shape and recipe (a LayerNorm and a BatchNorm ViT) are told apart by name
        alike = list(shapes.values()).count(shapes[model]) > 1
        panels.append(Panel(f"{letter(i)} {top}\n{bottom}" + (f"\n{labels[model]}" if alike else ""),
                            EPS_AXIS, "", traces, xscale="log", yscale="linear", dodge=DODGE))
    rows, height = _rows_of(panels)
    for row in rows:
        row[0].ylabel = "certified accuracy"
    return Plot(rows, f"LoFAST Fig. 2 (docs/bounds.md §5): certified accuracy (the pairwise-head test) of "
                      f"each bound through the whole network against the ℓ2 radius ε over the image "
                      f"(pixels in [0, 1]), one panel per model (blocks × heads, token width d, caps c on "
                      f"‖W^V‖, ‖W^O‖ and q on ‖W^Q‖, ‖W^K‖, training radius ε_t), the y axis shared; "
                      f"bars: {LEVEL:.0%} Wilson score intervals over the images. PGD robust accuracy "
                      f"(black, dashed, drawn on top) is an empirical upper reference: no certified curve "
                      f"may lie above it{_above(c, ref)}.{_equal(panels)} {origin(sub, c)}.",
                (WIDE, height), legend="each", sharey=True)


def _attacked(rows: pd.DataFrame, pgd: pd.Series) -> pd.Series:
    """PGD's robust accuracy on each ε's own images of a method's ``rows`` (CROWN's first 30 where the
    other bounds have 100: :func:`counts`' ``attacked``), the model's reference ``pgd`` only where the rows
    do not record their images' attack."""
    return rows["attacked"].fillna(pgd.reindex(rows.index))


def gap_figure(df: pd.DataFrame) -> Plot:
    """The certification gap: per model, each method's certified accuracy divided by PGD's robust
    accuracy at the same ε (1: certified as far as the attack reaches), one line per method (equal
    ones merged as in Fig. 2), so a reader sees at a glance which method closes the gap
    (docs/bounds.md §5.1)."""
    sub, c, ref = network(df), counts(df), tr.references(df)
    models = tr.model_order(sub)
    panels = []
    for i, model in enumerate(m for m in models.index if m in c.index.get_level_values("model")
                              and m in ref.index.get_level_values("model")):
        at, pgd = c.xs(model, level="model"), ref.xs(model, level="model")["pgd"]
        traces = []
        for j, (group, rows) in enumerate(_curves(at)):
            below = _attacked(rows, pgd)
            kept = below > 0
            if kept.any():
                traces.append(_trace(j, group, list(map(float, rows.index[kept])),
                                     list(map(float, rows["accuracy"][kept] / below[kept]))))
        top, bottom = arch(models.loc[model])
        panels.append(Panel(f"{letter(i)} {top}\n{bottom}", EPS_AXIS, "", traces, xscale="log",
                            yscale="linear", ref=1.0))
    if not panels:
        raise Skip("no certify rows with a PGD robust accuracy above 0")
    rows, height = _rows_of(panels)
    for row in rows:
        row[0].ylabel = "certified ÷ PGD robust"
    return Plot(rows, f"The certification gap (docs/bounds.md §5.1): each method's certified accuracy "
                      f"(the pairwise-head test; CROWN and taylor_net verify the margins directly) divided "
                      f"by PGD's robust accuracy on the same images at the same ε, one panel per model, "
                      f"the y axis shared; 1 (dotted) means certified as far as the attack reaches, and "
                      f"nothing sound lies above it.{_equal(panels)} {origin(sub, c)}.",
                (WIDE, height), legend="each", sharey=True)


# taylor_net's loss terms (docs/bounds.md §5.1), each a share of the clean margin in the table
LOSSES = {"tn_first_order": "first order", "tn_kinks": "kinks", "tn_attention": "attention rem.",
          "tn_project": "project rem."}


def diagnostics(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Where taylor_net's margin goes, per model and ε: over the correctly classified images, the
    median share of the clean margin lost to first order, to the kinks and to the blocks' remainders,
    the median unstable neurons and straddling tokens, and the images certified of those (so the
    next lever is the largest share of the images left)."""
    sub = network(df)
    rows = sub[(sub["role"] == "certify") & (sub["bound"] == "taylor_net")
               & tr.flag(sub.get("correct", pd.Series(False, sub.index)))]
    if rows.empty or not set(LOSSES) <= set(rows.columns) or rows["tn_kinks"].isna().all():
        raise Skip("no taylor_net certify rows with diagnostics (tn_* columns)")
    rows = rows.drop_duplicates(["model", "eps", "sample"])
    out = []
    for (model, eps), g in rows.groupby(["model", "eps"], sort=True):
        margin = g["margin"].astype(float)
        line = {"model": model, "ε": f"{eps:g}", "correct images": str(len(g)),
                "certified": str(int(tr.verdicts(g).sum())), "median margin": f"{margin.median():.3g}"}
        for col, label in LOSSES.items():
            line[label] = f"{(g[col].astype(float) / margin).median():.3g}"
        line["unstable"] = f"{g['tn_unstable'].astype(float).median():.0f}"
        line["straddling"] = f"{g['tn_straddling'].astype(float).median():.0f}"
        out.append(line)
    return pd.DataFrame(out), (
        "taylor_net's diagnostics (docs/bounds.md §5.1): per model and ε, over the correctly classified "
        "images, the median of each loss as a share of the clean margin at the class closest to failing "
        "(first order ε‖Gᵀc‖; the relaxed kinks; attention's and LayerProject's remainders, all blocks "
        "summed), the median ReLU neurons whose range holds 0 and tokens straddling LayerProject's "
        "sphere, and the images certified. A share above 1 alone decides a verdict; the largest share "
        f"is the next lever. {origin(sub, counts(df))}.")
