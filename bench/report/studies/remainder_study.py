"""Attention's Taylor remainder against an attack on the remainder itself (docs/bounds.md §2.3.1–2.3.2):
per trained or pretrained layer, the bound ``taylor`` pays (``taylor_remainder``) and §2.3's global
one (``taylor_remainder_global``) divided by the attained remainder (PGD on objective ``remainder``),
beside Taylor ÷ PGD and σ_max(J)·ε ÷ PGD of the output. Rows are those of any sweep that holds
``taylor_remainder`` rows (tasks ``pretrained`` and ``bounds`` on a zoo model's layer). Imports only
:mod:`bench.report.panels`.
"""

from __future__ import annotations

import pandas as pd

from ..panels import Panel, Plot, Skip, Trace, label, letter

OURS, GLOBAL = "taylor_remainder", "taylor_remainder_global"
ENDS = ["taylor", "jacobian"]  # the output's bound that pays the remainder, and its first-order part
COLUMNS = {GLOBAL: "global remainder (§2.3) ÷ attained", OURS: "Taylor's remainder ÷ attained",
           "taylor": "Taylor ÷ PGD", "jacobian": "σ_max(J)·ε ÷ PGD (estimate)"}


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    """The bound rows of every (sweep, cell, sample) that holds a ``taylor_remainder`` row."""
    bound = df[df["role"] == "bound"] if "role" in df.columns else df.iloc[:0]
    if "task" in bound.columns:  # the imported layers' remainders: their own rows, not yet a study here
        bound = bound[bound["task"] != "imported"]
    keys = ["sweep", "cell_id", "sample"]
    have = bound.loc[bound["bound"] == OURS, keys].drop_duplicates()
    if have.empty:
        raise Skip(f"no `{OURS}` rows (tasks `pretrained`, or `bounds` on a zoo model's layer)")
    return bound.merge(have, on=keys)


def _where(r: pd.Series) -> str:
    """A layer by what it is: MiniLM's layer k, or a zoo model's first block at a scaled input."""
    if r["task"] == "pretrained":
        return f"MiniLM layer {int(r['layer_index'])}"
    return f"{r['model']}, block 1, ‖x‖×{r['x_norm']:g}"


def _wide(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (sweep, cell, sample): the ratios of both remainders and of the two ends."""
    sub = _rows(df)
    keys = ["sweep", "cell_id", "sample"]
    piv = sub.pivot_table(index=keys, columns="bound", values="ratio", aggfunc="first")
    first = sub.groupby(keys)[["task", "layer_index", "model", "x_norm", "eps"]].first()
    out = first.join(piv[[c for c in (OURS, GLOBAL, *ENDS) if c in piv.columns]])
    out["where"] = [_where(r) for _, r in out.iterrows()]
    return out.reset_index()


def _eps(r: pd.Series) -> str:
    return f"{r['eps']:g}·median‖x_i‖" if r["task"] == "pretrained" else f"{r['eps']:g}"


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows layer × ε: median (and max) over samples of each ratio."""
    wide = _wide(df)
    wide["ε"] = [_eps(r) for _, r in wide.iterrows()]
    rows = []
    for (where, eps), g in wide.groupby(["where", "ε"], sort=False):
        row = {"layer": where, "ε": eps, "samples": str(len(g))}
        for name, text in COLUMNS.items():
            if name in g.columns:
                v = g[name].dropna()
                row[text] = (f"{v.median():.3g}" + (f" (max {v.max():.3g})" if len(v) > 1 else "")
                             if len(v) else "–")
        rows.append(row)
    out = pd.DataFrame(rows)
    ours = wide[OURS].dropna()
    return out, (
        f"Attention's Taylor remainder (docs/bounds.md §2.3.1–2.3.2): on each trained or pretrained "
        f"layer, the certified bound of ‖F(X+Γ) − F(X) − J_F(X)[Γ]‖_F over ‖Γ‖_F ≤ ε that Taylor pays "
        f"({label(OURS)}: the smallest of §2.3's global, §2.3.1's local and §2.3.2's quadratic "
        f"remainders) and §2.3's global one alone, each divided by the remainder an attack attains "
        f"(attacks.pgd.attack_remainder: an ascent at ε/100 finds the quadratic term's maximisers, "
        f"then one at ε); median over the cell's samples (max in brackets). Taylor ÷ PGD and "
        f"σ_max(J)·ε ÷ PGD "
        f"(an estimate) of the output beside them. Over all {len(ours)} layer inputs, "
        f"{label(OURS)} ÷ attained has median {ours.median():.3g} and max {ours.max():.3g}; a value "
        f"below 1 would be a soundness violation (the gate judges these rows).")


def _trace(g: pd.DataFrame, x: str, col: str, style: str) -> Trace | None:
    """Median over the other axes per x, with bars from the minimum to the maximum."""
    if col not in g.columns or g[col].isna().all():
        return None
    by = g.groupby(x)[col]
    med, lo, hi = by.median(), by.min(), by.max()
    return Trace(COLUMNS[col], [float(v) for v in med.index], [float(v) for v in med.values], style,
                 lo=[float(v) for v in lo.values], hi=[float(v) for v in hi.values])


STYLES = {GLOBAL: "bound", OURS: "ours", "taylor": "estimate"}


def figure(df: pd.DataFrame) -> Plot:
    """Per family of layers (MiniLM's layers; each zoo model's first block against ε): both remainder
    bounds ÷ the attained remainder, and Taylor ÷ PGD; medians with min–max bars."""
    wide = _wide(df)
    panels = []
    for (task, model), g in wide.groupby(["task", wide["model"].fillna("")], sort=True):
        pre = task == "pretrained"
        x = "layer_index" if pre else "eps"
        traces = [t for t in (_trace(g, x, c, STYLES[c]) for c in STYLES) if t]
        title = ("all-MiniLM-L6-v2, ε = " + "/".join(f"{e:g}" for e in sorted(g["eps"].unique()))
                 + "·median‖x_i‖") if pre else f"{model}, block 1"
        panels.append(Panel(f"{letter(len(panels))} {title}", "layer" if pre else "ε",
                            "ratio" if not panels else "", traces, xscale="linear" if pre else "log",
                            ref=1.0, dodge=0.0 if pre else 0.02))
    return Plot([panels], (
        "Attention's Taylor remainder (docs/bounds.md §2.3.1–2.3.2): the certified remainder Taylor "
        "pays and §2.3's global one, each divided by the remainder an attack attains "
        "(attacks.pgd.attack_remainder), and Taylor ÷ PGD on the output; medians over sentences, "
        "samples and input scales, bars from min to max (Taylor ÷ PGD dashed). Dotted: 1 (a certified "
        "value below it would be a soundness violation)."), (3.6 * len(panels) + 2.4, 3.4),
        legend="right", sharey=True)
