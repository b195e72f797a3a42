"""Whole-network certification (docs/bounds.md §5) as LoFAST reports it: Fig. 2 (certified accuracy
against ε, one panel per model, one line per bound), Table 1 (per model, every method's certified
accuracy at every ε and its seconds per image) and, when a cascade ran, Table 2 (CROWN alone against
the cascade that sends it only the images the suite's bounds leave). Every number is recounted from
the stored rows (:mod:`bench.report.studies.trained_study`); any bound present is shown, in registry order,
named by the registry or :data:`bench.report.studies.trained_study.LABELS`, else by its code name (and shown
last).
"""

from __future__ import annotations

import math

import pandas as pd

from ..panels import Panel, Plot, Skip, Trace, balanced, commits, letter, style
from . import trained_study as tr
from .trained_study import CASCADE, LEVEL, counts, eg, name_of, network

WIDE = 7.0
COLUMNS = 3  # panels per row of Fig. 2 at most: a legend entry of one line fits under a panel
DODGE = 0.02  # share of the log-ε span between two curves' error bars at the same ε
LARGEST, SMALLEST = 6.0, 3.6  # marker sizes (points) of a panel's first and last curves
EPS_AXIS = "ε (ℓ2, log scale)"
DISAGREE = 0.05  # a difference in certified accuracy that ranks two bounds (LoFAST Table 1's models)
BASE, RIVALS = "lofast_M", ("best", "crown", "alpha_crown")


def _num(v: float, digits: int = 3) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.{digits}f}"


def _arch(m: pd.Series) -> tuple[str, str]:
    """A model as two short lines: its data and shape; its caps and training radius."""
    cap = lambda v: "none" if math.isnan(v) else f"{v:g}"
    depth, heads = int(m["vit_depth"]), int(m["vit_heads"])
    return (f"{m['dataset']}, {depth} block{'s' * (depth != 1)} × {heads} head{'s' * (heads != 1)}",
            f"d={int(m['vit_d'])}, c={cap(m['vit_c'])}, q={cap(m['vit_qk'])}, ε_t={m['vit_margin_eps']:g}")


def _provenance(sub: pd.DataFrame, c: pd.DataFrame) -> str:
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


def _names(c: pd.DataFrame) -> list[str]:
    return tr.order(c.index.get_level_values("bound"))


def _size(i: int) -> float:
    """The marker size of a panel's i-th curve: the first largest, so markers that meet show as
    rings one inside the other; PGD's, drawn last and on top, is smaller than all."""
    return max(SMALLEST, LARGEST - 0.3 * i)


def _label(group: list[str]) -> str:
    """One short line: the first bound's name and how many equal ones it stands for."""
    return name_of(group[0]) + (f" (+{len(group) - 1} equal)" if len(group) > 1 else "")


def _curves(at: pd.DataFrame, keep=lambda e: True) -> list[tuple[list[str], pd.DataFrame]]:
    """The groups of bounds equal at every ε of one model's counts ``at`` (each drawn once), with the
    rows of the group's first bound at the ε ``keep`` admits."""
    curves = {b: tuple((e, int(r.k), int(r.n)) for e, r in at.xs(b, level="bound").iterrows())
              for b in _names(at)}
    out = []
    for group in tr.merged(curves):
        rows = at.xs(group[0], level="bound").sort_index()
        out.append((group, rows[[keep(e) for e in rows.index]]))
    return out


def _trace(i: int, group: list[str], x: list[float], y: list[float], **bars) -> Trace:
    b = group[0]
    return Trace(_label(group), x, y, style(b), tr.colour_of(b), marker=tr.marker_of(b), size=_size(i),
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
    return (" Curves equal at every ε of a panel are drawn once, under the first bound's name and "
            "“(+k equal)”, k the number of others: " + "; ".join(parts) + ".")


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
    for i, model in enumerate(m for m in models.index if m in c.index.get_level_values("model")):
        at = c.xs(model, level="model")
        traces = [_trace(j, group, list(map(float, rows.index)), list(map(float, rows["accuracy"])),
                         lo=list(map(float, rows["lo"])), hi=list(map(float, rows["hi"])))
                  for j, (group, rows) in enumerate(_curves(at))]
        if model in ref.index.get_level_values("model"):
            r = ref.xs(model, level="model")["pgd"].dropna().sort_index()
            traces.append(Trace(tr.PGD_REF, list(map(float, r.index)), list(map(float, r)), "reference",
                                size=SMALLEST - 0.6))
        top, bottom = _arch(models.loc[model])
        panels.append(Panel(f"{letter(i)} {top}\n{bottom}", EPS_AXIS, "", traces, xscale="log",
                            yscale="linear", dodge=DODGE))
    rows, height = _rows_of(panels)
    for row in rows:
        row[0].ylabel = "certified accuracy"
    return Plot(rows, f"LoFAST Fig. 2 (docs/bounds.md §5): certified accuracy (the pairwise-head test) of "
                      f"each bound through the whole network against the ℓ2 radius ε over the image "
                      f"(pixels in [0, 1]), one panel per model (blocks × heads, token width d, caps c on "
                      f"‖W^V‖, ‖W^O‖ and q on ‖W^Q‖, ‖W^K‖, training radius ε_t), the y axis shared; "
                      f"bars: {LEVEL:.0%} Wilson score intervals over the images. PGD robust accuracy "
                      f"(black, dashed, drawn on top) is an empirical upper reference: no certified curve "
                      f"may lie above it{_above(c, ref)}.{_equal(panels)} {_provenance(sub, c)}.",
                (WIDE, height), legend="each", sharey=True)


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
        traces = [_trace(j, group, list(map(float, rows.index)),
                         [float(a / pgd[e]) for e, a in rows["accuracy"].items()])
                  for j, (group, rows) in enumerate(_curves(at, lambda e, pgd=pgd: pgd.get(e, 0) > 0))]
        top, bottom = _arch(models.loc[model])
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
                      f"nothing sound lies above it.{_equal(panels)} {_provenance(sub, c)}.",
                (WIDE, height), legend="each", sharey=True)


def _unique(names: list[str]) -> dict[str, str]:
    """Display names for column headers, each once (a repeated label gets its code name)."""
    seen = [name_of(b) for b in names]
    return {b: s if seen.count(s) == 1 else f"{s} [{b}]" for b, s in zip(names, seen, strict=True)}


def table1(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """LoFAST Table 1: one row per model; per method (PGD robust, then every bound present) its
    certified accuracy at each ε, and per bound its seconds per image over all ε."""
    sub, c, ref = network(df), counts(df), tr.references(df)
    eps = sorted(set(c.index.get_level_values("eps")))
    names = _unique(_names(c))
    rows = []
    models = tr.model_order(sub)
    for model, m in models.iterrows():
        if model not in c.index.get_level_values("model"):
            continue
        at = c.xs(model, level="model")
        r = ref.xs(model, level="model") if model in ref.index.get_level_values("model") else \
            pd.DataFrame({"clean": [], "pgd": []}, dtype=float)
        row = {"model": f"{'; '.join(_arch(m))}; clean {_num(float(r['clean'].mean()))}"}
        row |= {f"PGD robust ε={eg(e)}": _num(r["pgd"].get(e, math.nan)) for e in eps}
        for b, text in names.items():
            got = at.xs(b, level="bound") if b in at.index.get_level_values("bound") else None
            row |= {f"{text} ε={eg(e)}": "–" if got is None or e not in got.index else
                    _num(got.loc[e, "accuracy"]) for e in eps}
            row[f"{text} s/sample"] = "–" if got is None else f"{got['seconds'].mean():.3g}"
        rows.append(row)
    return pd.DataFrame(rows), (
        f"LoFAST Table 1 (docs/bounds.md §5): per model (data, blocks × heads, token width d, caps c on "
        f"‖W^V‖, ‖W^O‖ and q on ‖W^Q‖, ‖W^K‖, training radius ε_t, clean accuracy over the same images), "
        f"PGD robust accuracy (an upper bound of the true robust accuracy) and each bound's certified "
        f"accuracy (pairwise-head test) at each ε (ℓ2 over the image, pixels in [0, 1]); s/sample: the "
        f"bound's seconds per image, mean over ε, its certificate included."
        f"{disagreements(c, models['vit_margin_eps'])} "
        f"{_provenance(sub, c)}.")


def disagreements(c: pd.DataFrame, margin: pd.Series, gap: float = DISAGREE) -> str:
    """The caption's word on where the bounds rank: per model, the largest difference in certified
    accuracy between LoFAST (‖M‖) and best or CROWN at one ε where either certifies something, the
    models where it reaches ``gap`` named with it, the others said to tie (docs/bounds.md §5).
    ``c``: :func:`~bench.report.studies.trained_study.counts`; ``margin``: each model's training
    radius ε_t."""
    present = set(c.index.get_level_values("bound"))
    rivals = [b for b in RIVALS if b in present]
    if BASE not in present or not rivals:
        return ""
    acc = c["accuracy"].unstack("bound")
    found, tie = [], []
    for model, at in acc.groupby(level="model"):
        best_gap, where = 0.0, ""
        for (_, e), r in at.iterrows():
            for b in rivals:
                d = abs(r[b] - r[BASE]) if pd.notna(r[b]) and pd.notna(r[BASE]) else 0.0
                if d > best_gap + 1e-12:
                    where = f"{name_of(b)} {r[b]:.2f} vs {name_of(BASE)} {r[BASE]:.2f} at ε={eg(e)}"
                    best_gap = d
        if best_gap >= gap - 1e-12:
            found.append(f"`{model}` ({where})")
        else:
            none = not (at[[BASE, *rivals]].fillna(0) > 0).to_numpy().any()
            tie.append((model, "none" if none else "margin" if margin.get(model, 0) > 0 else "other"))
    out = ""
    if found:
        out += f" The bounds disagree by ≥ {gap:.0%} of the images on " + "; ".join(found) + "."
    why = {"margin": "margin training (ε_t > 0) drives the attention logits toward 0, so attention is "
                     "nearly linear on the data and the bounds reduce to about the same Lipschitz "
                     "product (docs/bounds.md §5)",
           "none": "none of them certifies an image at these ε", "other": "measured so"}
    for reason, text in why.items():
        models = [f"`{m}`" for m, r in tie if r == reason]
        if models:
            out += f" They agree within {gap:.0%} on {', '.join(models)}: {text}."
    return out


def _alone(cascade: str, present: set[str]) -> str:
    """The bound a cascade ends in, run alone: ``cascade_<bound>``'s bound, else CROWN."""
    tail = cascade[len(CASCADE):].lstrip("_")
    return tail if tail in present else "crown"


def _secs(v: float) -> str:
    return f"{v:.3g}"


def _cell(c: pd.DataFrame, key: tuple, col: str, text=_num) -> str:
    """One count's ``col`` as text ("–" where the rows lack the model, ε or bound)."""
    return text(c.loc[key, col]) if key in c.index else "–"


def table2(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """One row per model and ε: the bound each cascade ends in, alone, then every cascade, each with
    its certified accuracy and seconds per image, and the share of images each cascade sent on (when
    its rows record it). A row per cascade would repeat the bound alone, and its name, in each."""
    sub, c = network(df), counts(df)
    present = set(c.index.get_level_values("bound"))
    cascades = [b for b in _names(c) if b.startswith(CASCADE)]
    if not cascades:
        raise Skip("no cascade rows (a bound named `cascade…`) in the network certification rows")
    ends = {cas: _alone(cas, present) for cas in cascades}
    rows = []
    for model, m in tr.model_order(sub).iterrows():
        for e in sorted({k[1] for k in c.index if k[0] == model and k[2] in cascades}):
            row = {"model": "; ".join(_arch(m)), "ε": eg(e)}
            for b in dict.fromkeys(ends.values()):
                row[f"{name_of(b)} alone: certified acc."] = _cell(c, (model, e, b), "accuracy")
                row[f"{name_of(b)} alone: s/image"] = _cell(c, (model, e, b), "seconds", _secs)
            for cas in cascades:
                # "→" says it is a cascade: the registry's "(cascade)" would only lengthen three headers
                head = name_of(cas).replace(" (cascade)", "")
                key = (model, e, cas)
                row[f"{head}: certified acc."] = _cell(c, key, "accuracy")
                row[f"{head}: s/image"] = _cell(c, key, "seconds", _secs)
                row[f"{head}: share of images sent to {name_of(ends[cas])}"] = _cell(c, key, "sent")
            rows.append(row)
    return pd.DataFrame(rows), (
        f"Table 2 (docs/bounds.md §5): CROWN alone against each cascade (the suite's bound named first, "
        f"then CROWN only on the images it leaves), per model and ε: certified accuracy (pairwise-head "
        f"test) and seconds per image of each, and the share of the images that the cascade sent on "
        f"to CROWN (– where its rows do not record it). {_provenance(sub, c)}.")
