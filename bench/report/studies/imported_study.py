"""The imported layers (task ``imported``, docs/guide/import.md): per attention layer of a user's model,
as ``python -m bench import`` wrote it, and per ε, each end-to-end bound's value ÷ PGD beside
σ_max(J)·ε ÷ PGD (the ``jacobian`` estimate), as a figure (:func:`figure`) and a table (:func:`table`).
Rows are those of task ``imported`` whatever their sweep's name; means are over the captured inputs of
a (directory, layer, ε). Imports only :mod:`bench.report.panels`.
"""

from __future__ import annotations

from pathlib import PurePath

import pandas as pd

from ..panels import Panel, Plot, Skip, bound_trace, label, letter

# as the pretrained study: LoFAST's two, their halves, ours, the minimum, naive, and the estimate
NAMES = ["lofast_M", "lofast_xi", "lofast_M_half", "lofast_xi_half", "taylor", "best", "naive",
         "castin", "yudin", "jacobian"]
CAP = 1e4  # as the other tightness figures: a ratio above is drawn off scale, with its number
EPS = "ε (× median‖x_i‖)"
WHY = ("ε is relative, as task `pretrained`'s: the radius is the cell's eps × the median token norm "
       "‖x_i‖ of each input (column `radius`), since a model's layers see inputs of unrelated scales "
       "(a LayerNorm's output, a residual stream that grows with depth)")


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    if "task" not in df.columns or "imported" not in df.columns or not (df["task"] == "imported").any():
        raise Skip("no rows of task `imported`", listed=False)  # the user's own models: none is no gap
    sub = df[df["task"] == "imported"]
    return sub


def _ends(sub: pd.DataFrame) -> pd.DataFrame:
    ends = sub[(sub["role"] == "bound") & (sub["objective"] == "output") & (sub["head"] == -1)
               & sub["bound"].isin(NAMES)]
    if ends.empty:
        raise Skip("no end-to-end bound rows of task `imported`")
    return ends


def _name(directory: str) -> str:
    return PurePath(str(directory)).name or str(directory)


def _models(sub: pd.DataFrame) -> str:
    """Each directory with its model's sha256 (first 12 digits), layers and inputs."""
    parts = []
    for directory, g in sub.groupby("imported", sort=True):
        shas = "/".join(sorted({str(s)[:12] for s in g["imported_sha256"]}))
        layers = g["imported_layer"].nunique()
        inputs = g["imported_input"].nunique()
        parts.append(f"{directory} (model sha256 {shas}…; {layers} layer{'s' if layers != 1 else ''}, "
                     f"{inputs} input{'s' if inputs != 1 else ''})")
    return "; ".join(parts)


def _setting(sub: pd.DataFrame) -> str:
    return (f"the attention layers of a user's model as `python -m bench import` read them, each with its "
            f"biases, residual (H = I, docs/bounds.md §1.5) where the block adds the attention's own "
            f"input X, else bare, at the inputs it captured: {_models(sub)}; {WHY}")


def figure(df: pd.DataFrame) -> Plot:
    sub = _rows(df)
    ends = _ends(sub)
    rows, count = [], 0
    for directory, of_dir in ends.groupby("imported", sort=True):  # a row per model, a column per ε
        row = []
        for eps, at in of_dir.groupby("eps", sort=True):
            traces = [t for t in (bound_trace(at, "imported_layer", n, "ratio") for n in NAMES) if t]
            row.append(Panel(f"{letter(count)} {_name(directory)}, ε = {eps:g}", "imported layer k",
                             "bound / PGD" if not row else "", traces, ref=1.0, ceiling=CAP))
            count += 1
        rows.append(row)
    return Plot(rows,
                f"Imported attention (docs/guide/import.md), task `imported`: {_setting(sub)}. A row per "
                f"directory, a column per ε (× the median token norm), each end-to-end bound's value / "
                f"PGD lower bound of the output per layer (mean over the inputs; {label('jacobian')} = "
                f"σ_max(J)·ε is an estimate, dashed; dotted at 1; a ratio above {CAP:g} drawn as ▲ with "
                f"its value).",
                (7.0, 2.4 * len(rows) + 0.6), sharey=True)


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows directory × layer × ε: each bound's mean value/PGD over the inputs."""
    sub = _rows(df)
    ends = _ends(sub)
    keys = ["imported", "imported_layer", "eps"]
    piv = ends.pivot_table(index=keys, columns="bound", values="ratio", aggfunc="mean")
    names = [n for n in NAMES if n in piv.columns]
    first = ends.groupby(keys)[["imported_node", "residual", "n", "d", "h"]].first()
    inputs = ends.groupby(keys)["imported_input"].nunique()
    out = []
    for key, r in piv.iterrows():
        directory, layer, eps = key
        f = first.loc[key]
        row = {"model": _name(directory), "layer": str(int(layer)), "node": str(f["imported_node"]),
               "H": "I" if bool(f["residual"]) else "0",
               "n, d, h": f"{int(f['n'])}, {int(f['d'])}, {int(f['h'])}",
               EPS: f"{eps:g}", "inputs": str(int(inputs.loc[key]))}
        row.update({label(n): f"{float(r[n]):.4g}" if pd.notna(r[n]) else "–" for n in names})
        out.append(row)
    return pd.DataFrame(out), (
        f"Imported attention (docs/guide/import.md), task `imported`: {_setting(sub)}. Per layer and ε: "
        f"each end-to-end bound's value / PGD lower bound of the output (mean over the inputs; "
        f"{label('jacobian')} = σ_max(J)·ε is an estimate, the others certified); H = I: residual.")
