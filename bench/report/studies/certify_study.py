"""Whole-network certification (docs/bounds.md §5) as LoFAST reports it: Fig. 2 (certified accuracy
against ε, one panel per model, one line per bound), Table 1 (per model, every method's certified
accuracy at every ε and its seconds per image) and, when a cascade ran, Table 2 (CROWN alone against
the cascade that sends it only the images the suite's bounds leave). Every number is recounted from
the stored rows (:mod:`bench.report.studies.trained_study`); any bound present is shown, in registry order,
named by the registry or :data:`bench.report.studies.trained_study.LABELS`, else by its code name (and shown
last).
"""

from __future__ import annotations

import itertools
import math
import textwrap

import pandas as pd

from ..panels import Panel, Plot, Skip, Trace, commits, letter, style
from . import trained_study as tr
from .trained_study import CASCADE, LEVEL, counts, eg, name_of, network

WIDE = 7.0
COLUMNS = 4  # panels per row of Fig. 2
DODGE = 0.02  # share of the log-ε span between two curves' error bars at the same ε
WRAP = 30  # characters per line of a legend entry: a merged one names several bounds
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


def figure(df: pd.DataFrame) -> Plot:
    """LoFAST Fig. 2: per model, each bound's certified accuracy over ε with its Wilson interval,
    PGD robust accuracy as the empirical upper reference; curves equal at every ε of a panel are
    one line whose label joins their names."""
    sub, c, ref = network(df), counts(df), tr.references(df)
    models = tr.model_order(sub)
    panels = []
    for i, model in enumerate(m for m in models.index if m in c.index.get_level_values("model")):
        at = c.xs(model, level="model")
        curves = {b: tuple((e, int(r.k), int(r.n)) for e, r in at.xs(b, level="bound").iterrows())
                  for b in _names(at)}
        traces = []
        for group in tr.merged(curves):
            rows = at.xs(group[0], level="bound").sort_index()
            text = textwrap.fill(" = ".join(name_of(b) for b in group), WRAP)
            traces.append(Trace(text, list(map(float, rows.index)), list(map(float, rows["accuracy"])),
                                style(group[0]), tr.colour_of(group[0]), list(map(float, rows["lo"])),
                                list(map(float, rows["hi"]))))
        if model in ref.index.get_level_values("model"):
            r = ref.xs(model, level="model")["pgd"].dropna().sort_index()
            traces.append(Trace(tr.PGD_REF, list(map(float, r.index)), list(map(float, r)), "reference"))
        top, bottom = _arch(models.loc[model])
        panels.append(Panel(f"{letter(i)} {top}\n{bottom}", EPS_AXIS,
                            "certified accuracy" if i % COLUMNS == 0 else "", traces, xscale="log",
                            yscale="linear", dodge=DODGE))
    rows = [panels[i:i + COLUMNS] for i in range(0, len(panels), COLUMNS)]
    # a panel, its ticks and x label, then its legend: one line per line of its entries
    lines = [max(sum(t.label.count("\n") + 1 for t in p.traces) for p in row) for row in rows]
    return Plot(rows, f"LoFAST Fig. 2 (docs/bounds.md §5): certified accuracy (the pairwise-head test) of "
                      f"each bound through the whole network against the ℓ2 radius ε over the image "
                      f"(pixels in [0, 1]), one panel per model (blocks × heads, token width d, caps c on "
                      f"‖W^V‖, ‖W^O‖ and q on ‖W^Q‖, ‖W^K‖, training radius ε_t), the y axis shared; "
                      f"bars: {LEVEL:.0%} Wilson score intervals over the images. PGD robust accuracy "
                      f"(black, dashed) is an empirical upper reference: no certified curve may lie above "
                      f"it{_above(c, ref)}. Curves equal at every ε of a panel are drawn once, their names "
                      f"joined by “=”. {_provenance(sub, c)}.",
                (WIDE, sum(2.3 + 0.11 * n for n in lines)), legend="each", sharey=True)


def gap_figure(df: pd.DataFrame) -> Plot:
    """The certification gap: per model, each method's certified accuracy divided by PGD's robust
    accuracy at the same ε (1: certified as far as the attack reaches), one line per method, so a
    reader sees at a glance which method closes the gap (docs/bounds.md §5.1)."""
    sub, c, ref = network(df), counts(df), tr.references(df)
    models = tr.model_order(sub)
    panels = []
    for i, model in enumerate(m for m in models.index if m in c.index.get_level_values("model")
                              and m in ref.index.get_level_values("model")):
        at, pgd = c.xs(model, level="model"), ref.xs(model, level="model")["pgd"]
        traces = []
        for b in _names(at):
            rows = at.xs(b, level="bound").sort_index()
            keep = [e for e in rows.index if pgd.get(e, 0) > 0]
            traces.append(Trace(name_of(b), list(map(float, keep)),
                                [float(rows.loc[e, "accuracy"] / pgd[e]) for e in keep], style(b),
                                tr.colour_of(b)))
        top, bottom = _arch(models.loc[model])
        panels.append(Panel(f"{letter(i)} {top}\n{bottom}", EPS_AXIS,
                            "certified ÷ PGD robust" if i % COLUMNS == 0 else "", traces, xscale="log",
                            yscale="linear"))
    if not panels:
        raise Skip("no certify rows with a PGD robust accuracy above 0")
    rows = [panels[i:i + COLUMNS] for i in range(0, len(panels), COLUMNS)]
    lines = [max(len(p.traces) for p in row) for row in rows]
    return Plot(rows, f"The certification gap (docs/bounds.md §5.1): each method's certified accuracy "
                      f"(the pairwise-head test; CROWN and taylor_net verify the margins directly) divided "
                      f"by PGD's robust accuracy on the same images at the same ε, one panel per model, "
                      f"the y axis shared; 1 means certified as far as the attack reaches, and nothing "
                      f"sound lies above it. {_provenance(sub, c)}.",
                (WIDE, sum(2.3 + 0.11 * n for n in lines)), legend="each", sharey=True)


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


def _alone(cascade: str, present: set[str]) -> str | None:
    """The bound a cascade ends in, run alone: ``cascade_<bound>``'s bound, else CROWN."""
    tail = cascade[len(CASCADE):].lstrip("_")
    return tail if tail in present else "crown" if "crown" in present else None


def table2(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Per model, cascade and ε: the bound alone against the cascade, certified accuracy and seconds
    per image, and the share of images the cascade sent on to it (when its rows record it)."""
    sub, c = network(df), counts(df)
    present = set(c.index.get_level_values("bound"))
    cascades = [b for b in _names(c) if b.startswith(CASCADE)]
    if not cascades:
        raise Skip("no cascade rows (a bound named `cascade…`) in the network certification rows")
    rows = []
    for (model, m), cas in itertools.product(tr.model_order(sub).iterrows(), cascades):
        alone = _alone(cas, present)
        for (mod, e, _), r in c.xs(cas, level="bound", drop_level=False).iterrows():
            if mod == model:
                a = c.loc[(model, e, alone)] if alone and (model, e, alone) in c.index else None
                rows.append({"model": "; ".join(_arch(m)), "cascade": name_of(cas), "ε": eg(e),
                             "alone": name_of(alone) if alone else "–",
                             "alone acc.": "–" if a is None else _num(a["accuracy"]),
                             "alone s/sample": "–" if a is None else f"{a['seconds']:.3g}",
                             "cascade acc.": _num(r["accuracy"]), "cascade s/sample": f"{r['seconds']:.3g}",
                             "sent on": _num(r["sent"])})
    return pd.DataFrame(rows), (
        f"Table 2 (docs/bounds.md §5): CROWN alone against the cascade (the suite's cheapest sound "
        f"bound first, CROWN only on the images it leaves), per model and ε: certified accuracy and "
        f"seconds per image of each; sent on: the share of images the cascade passed to CROWN (– where "
        f"its rows do not record it). {_provenance(sub, c)}.")
