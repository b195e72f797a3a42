"""The trained-model figures and tables (docs/bounds.md §5): LoFAST Fig. 2 and Table 1 from sweep
``certify`` (the Cauchy view's, from sweep ``cauchy_models``, are in :mod:`bench.report_cauchy`).
Every number comes from the stored rows; the models' architecture from their ``vit_*`` columns (bench/rows.py
``MODEL_COLUMNS``). Imports only :mod:`bench.report_data`.
"""

from __future__ import annotations

import math

import pandas as pd

from .report_data import Panel, Plot, Skip, Trace, colour, commits, label, registry_order, style, sweep

CERTIFY = "certify"
WIDE = 7.0
# Fig. 2's axes: each varies one of (depth, heads, c) around the zoo's centre model
CENTRE = {"vit_depth": 2, "vit_heads": 2, "vit_c": 0.5}
AXES = {"vit_depth": "depth (blocks)", "vit_heads": "heads per block", "vit_c": "cap c on ‖W^V‖, ‖W^O‖"}


def _provenance(sub: pd.DataFrame) -> str:
    """Which data, how many test images and which commit the rows came from."""
    data = "/".join(sorted(set(sub["dataset"])))
    n = int(sub.loc[sub["role"] == "certify", "sample"].max() + 1) if (sub["role"] == "certify").any() \
        else int(sub["samples"].max())
    return f"{data} test set, first {n} images; commit {commits(sub)}"


def _recipe(m: pd.Series) -> str:
    qk = "" if math.isnan(m["vit_qk"]) else f", ‖W^Q‖,‖W^K‖ ≤ {m['vit_qk']:g}"
    tr = "cross-entropy" if not m["vit_margin_eps"] else f"Lipschitz-margin ε={m['vit_margin_eps']:g}"
    return f"c={m['vit_c']:g}{qk}, {tr}"


def _models(sub: pd.DataFrame) -> pd.DataFrame:
    """One row per model: its architecture columns."""
    cols = ["model", "vit_depth", "vit_heads", "vit_d", "vit_c", "vit_qk", "vit_margin_eps",
            "vit_test_accuracy"]
    missing = [c for c in cols if c not in sub]
    if missing:
        raise Skip(f"sweep rows without the model columns {missing}")
    return sub[cols].drop_duplicates("model").set_index("model")


def certified_accuracy(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, ε): ``clean``, ``pgd`` (robust accuracy) and one column per bound (certified
    accuracy by the pairwise test), plus ``s/<bound>`` (seconds per sample)."""
    sub = sweep(df, CERTIFY)
    cert = sub[sub["role"] == "certify"]
    acc = sub[sub["role"] == "accuracy"]
    if cert.empty or acc.empty:
        raise Skip(f"no certify/accuracy rows in sweep `{CERTIFY}`")
    out = acc.pivot_table(index=["model", "eps"], columns="bound", values="value", aggfunc="mean")
    out = out.rename(columns={"pgd_margin": "pgd"})
    ok = cert["certified_pairwise"].astype(bool).astype(float)
    rate = cert.assign(ok=ok).pivot_table(index=["model", "eps"], columns="bound", values="ok",
                                          aggfunc="mean")
    secs = cert.pivot_table(index=["model", "eps"], columns="bound", values="seconds", aggfunc="mean")
    return out.join(rate).join(secs.add_prefix("s/"))


def _names(table: pd.DataFrame) -> list[str]:
    return registry_order(c for c in table.columns if c not in ("clean", "pgd") and not c.startswith("s/"))


def fig_zoo(df: pd.DataFrame) -> Plot:
    """LoFAST Fig. 2: clean, PGD and certified accuracy at one ε over depth, heads and c, each
    varied around the centre model (depth 2, 2 heads, c = 0.5) among the margin-trained models."""
    table = certified_accuracy(df)
    models = _models(sweep(df, CERTIFY))
    eps = min(table.index.get_level_values("eps"), key=lambda e: abs(math.log(e / 0.02)))
    at = table.xs(eps, level="eps")
    trained = models[models["vit_margin_eps"] > 0]
    if trained.empty:
        raise Skip("no margin-trained model in sweep `certify`")
    panels = []
    for axis, text in AXES.items():
        others = {k: v for k, v in CENTRE.items() if k != axis}
        pick = trained[(trained[list(others)] == pd.Series(others)).all(axis=1)].sort_values(axis)
        if len(pick) < 2:
            continue
        x = [float(v) for v in pick[axis]]
        rows = at.loc[pick.index]
        traces = [Trace("clean", x, [float(v) for v in rows["clean"]], "reference", "#000000"),
                  Trace(f"PGD robust (ε={eps:g})", x, [float(v) for v in rows["pgd"]], "estimate", "#7f7f7f")]
        traces += [Trace(label(n), x, [float(v) for v in rows[n]], style(n), colour(n)) for n in _names(at)]
        panels.append(Panel(f"over {text}", text, "accuracy" if not panels else "", traces,
                            xscale="log2" if axis != "vit_depth" else "linear", yscale="linear"))
    if not panels:
        raise Skip("sweep `certify` varies none of depth, heads, c around the centre model")
    m = trained.iloc[0]
    return Plot([panels], f"LoFAST Fig. 2 (docs/bounds.md §5): sweep `{CERTIFY}`, ViTs of zoo/ with d="
                          f"{int(m['vit_d'])}, {_recipe(m)}; clean accuracy, PGD robust accuracy and "
                          f"certified accuracy (pairwise test) of each network bound at ε={eg(eps)} (ℓ2 over "
                          f"the image, pixels in [0, 1]), varying one of depth, heads, c around depth 2, "
                          f"2 heads, c=0.5. {_provenance(sweep(df, CERTIFY))}.", (WIDE, 2.6))


def eg(v: float) -> str:
    return f"{v:g}"


def table_certify(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """LoFAST Table 1: per model and bound, certified accuracy at each ε and seconds per sample."""
    table = certified_accuracy(df)
    models = _models(sweep(df, CERTIFY))
    eps = sorted(set(table.index.get_level_values("eps")))
    order = models.sort_values(["vit_margin_eps", "vit_depth", "vit_heads", "vit_c"], ascending=[False, True,
                                                                                               True, True])
    rows = []
    for model, m in order.iterrows():
        t = table.xs(model, level="model")
        base = {"model": model, "blocks": str(int(m["vit_depth"])), "heads": str(int(m["vit_heads"])),
                "recipe": _recipe(m), "clean": f"{t['clean'].iloc[0]:.3f}"}
        rows.append(base | {"bound": "PGD robust"} | {f"ε={eg(e)}": f"{t.loc[e, 'pgd']:.3f}" for e in eps}
                    | {"s/sample": "–"})
        for n in _names(t):
            secs = t[f"s/{n}"].mean() if f"s/{n}" in t else math.nan
            rows.append(base | {"bound": label(n)} | {f"ε={eg(e)}": f"{t.loc[e, n]:.3f}" for e in eps}
                        | {"s/sample": f"{secs:.4f}"})
    return pd.DataFrame(rows), (
        f"LoFAST Table 1 (docs/bounds.md §5): sweep `{CERTIFY}`; per model, PGD robust accuracy (an "
        f"upper bound of the true robust accuracy) and each bound's certified accuracy (pairwise test) "
        f"at each ε (ℓ2 over the image), and seconds per sample of the bound (batched, its certificate "
        f"included). {_provenance(sweep(df, CERTIFY))}.")
