"""The Cauchy view (docs/bounds.md §3.4): σ_max of each block's Jacobian at its input, on a random
stack (sweep ``cauchy``: :func:`figure`, :func:`table_blocks`) and on the zoo's trained ViTs (sweep
``cauchy_models``: the paper's Table 1 per block, :func:`table_models`, and its violins,
:func:`fig_models`).

Blocks are numbered from 0 everywhere (figures, tables, captions), as the results' ``block`` column
and docs/bounds.md §1.4 (X_{k+1} = f_k(X_k), k = 0 the first block). A vanilla (LayerNorm) model and
a LayerProject one are compared only at equal width d, depth and heads: the models are grouped so
from their rows, and a caption names the groups that hold both kinds (a model trained later that
completes a pair shows up by itself). Imports only :mod:`bench.report.panels` and
:mod:`bench.report.studies.trained_study`.
"""

from __future__ import annotations

import math

import pandas as pd

from ..panels import Panel, Plot, Skip, Trace, letter, sweep
from .trained_study import eg, model_rows, provenance, recipe

CAUCHY = "cauchy_models"
WIDE = 7.0
BLOCKS = "blocks numbered from 0, k = 0 the first, as the results' `block` column"
BLOCK = "block k (0 = first)"
SIGMA = r"$\sigma_{\max}(J_{f_k}(X_k))$"
VANILLA, PROJECT = "#d62728", "#1f77b4"  # vanilla models red, LayerProject ones blue, in every panel


def _mean_std(values: pd.Series) -> str:
    std = values.std() if len(values) > 1 else 0.0
    return f"{values.mean():.4g} ± {std:.2g}"


def figure(df: pd.DataFrame) -> Plot:
    """σ_max varies across inputs by ~1e-3 of its value: one panel shows its level per block, the
    other the deviation from the block's mean, on an axis that resolves it."""
    sub = sweep(df, "cauchy", bound="block_sigma")
    sub = sub[sub["role"] == "block"]
    if sub.empty:
        raise Skip("no block rows in sweep `cauchy`")
    g = sub.groupby("block")["value"]
    blocks = [float(k) for k in g.mean().index]
    level = Trace("σ_max (matrix-free)", blocks, [float(v) for v in g.mean()], "points", PROJECT)
    dev = 100 * (sub["value"] / g.transform("mean") - 1)
    spread = [Trace(f"block {int(k)}", [float(k)] * int((sub["block"] == k).sum()),
                    [float(v) for v in dev[sub["block"] == k]], colour=PROJECT) for k in blocks]
    return Plot([[Panel("(a) level: mean over inputs", BLOCK, SIGMA, [level], yscale="linear"),
                  Panel("(b) spread over inputs", BLOCK, "deviation from block mean (%)", spread,
                        yscale="linear", kind="strip", ref=0.0)]],
                f"The Cauchy view (docs/bounds.md §3.4): sweep `cauchy`, block_sigma (matrix-free "
                f"σ_max of each block's Jacobian) over {sub['sample'].nunique()} inputs per block, "
                f"{BLOCKS}; (a) mean per block (the spread over inputs is far smaller than a "
                f"marker), (b) each input's relative deviation from its block's mean, in % (box: "
                f"quartiles).", (WIDE * 0.8, 2.5), legend="none")


def table_blocks(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    sub = sweep(df, "cauchy", role="block")
    cols = {"block_sigma": "σ_max (matrix-free)", "block_sigma_exact": "σ_max (exact SVD)",
            "block_l1linf": "√(‖J‖₁‖J‖∞)"}
    rows = []
    for k, g in sub.groupby("block", sort=True):
        row = {"block": str(int(k))}
        for b, name in cols.items():
            v = g.loc[g["bound"] == b, "value"]
            row[name] = _mean_std(v) if len(v) else "–"
        rows.append(row)
    return pd.DataFrame(rows), (f"The Cauchy view (docs/bounds.md §3.4): sweep `cauchy`, per block k "
                                f"of the stack ({BLOCKS}), mean ± std over inputs of block_sigma, "
                                f"block_sigma_exact, block_l1linf.")


def _models_of(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(rows of the sweep, block rows, accuracy rows, one row per model in the order shown: by d,
    depth, heads, vanilla first)."""
    sub = sweep(df, CAUCHY)
    blocks = sub[(sub["role"] == "block") & sub["bound"].isin(["block_sigma_exact", "block_sigma"])]
    acc = sub[sub["role"] == "accuracy"]
    if blocks.empty or acc.empty:
        raise Skip(f"no block/accuracy rows in sweep `{CAUCHY}`")
    models = model_rows(sub).assign(vanilla=lambda m: m["vit_c"].isna())
    models = models.sort_values(["vit_d", "vit_depth", "vit_heads", "vanilla", "vit_c", "vit_margin_eps"],
                                ascending=[True, True, True, False, True, True])
    return sub, blocks, acc, models


def _group(m: pd.Series) -> str:
    heads = int(m["vit_heads"])
    return f"d={int(m['vit_d'])}, {int(m['vit_depth'])} blocks, {heads} head{'s' if heads != 1 else ''}"


def pairs(models: pd.DataFrame) -> str:
    """Which vanilla and LayerProject models can be compared (equal d, depth and heads), in words."""
    groups = models.assign(group=models.apply(_group, axis=1)).groupby("group", sort=False)
    both = [(g, m) for g, m in groups if m["vanilla"].any() and (~m["vanilla"]).any()]
    if both:
        return ("Vanilla and LayerProject models compared only at equal d, depth and heads: "
                + "; ".join(f"{g}: {', '.join(m.index)}" for g, m in both) + ".")
    kinds = {v: sorted({_group(m) for _, m in models[models["vanilla"] == v].iterrows()})
             for v in (True, False)}
    return ("No vanilla and LayerProject model here share d, depth and heads, so no two models below "
            "compare the two kinds like for like (vanilla: " + "; ".join(kinds[True] or ["none"])
            + "; LayerProject: " + "; ".join(kinds[False] or ["none"]) + ").")


def table_models(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The Cauchy view's Table 1: per model clean and PGD-20 accuracy and, per block, σ_max mean (std)."""
    sub, blocks, acc, models = _models_of(df)
    depth = int(blocks["block"].max()) + 1
    rows = []
    for model, m in models.iterrows():
        a = acc[acc["model"] == model].set_index("bound")["value"]
        b = blocks[blocks["model"] == model]
        row = {"model": model, "group": _group(m),
               "variant": "vanilla (LayerNorm)" if m["vanilla"] else f"LayerProject, {recipe(m)}",
               "clean": f"{a['clean']:.3f}", "PGD-20": f"{a['pgd_margin']:.3f}"}
        for k in range(depth):
            s = b.loc[b["block"] == k, "value"]
            row[f"σ_max block {k}"] = f"{s.mean():.3f} ({s.std():.3f})" if len(s) > 1 else \
                f"{s.mean():.3f}" if len(s) else "–"
        rows.append(row)
    eps = "/".join(eg(e) for e in sorted(set(sub["eps"])) if not math.isnan(e))
    return pd.DataFrame(rows), (
        f"The Cauchy view, Table 1 (docs/bounds.md §3.4): sweep `{CAUCHY}`; clean accuracy, PGD-20 ℓ2 "
        f"robust accuracy at ε={eps}, and per block ({BLOCKS}) the mean (std) over test images of "
        f"σ_max of that block's Jacobian at its input (exact SVD where n·d fits, else the "
        f"matrix-free estimate); \"–\": the model has fewer blocks. Rows are grouped by width d, "
        f"depth and heads (`group`). {pairs(models)} {provenance(sub)}.")


def fig_models(df: pd.DataFrame) -> Plot:
    """The Cauchy view's Fig. 3: σ_max per block as violins, one panel per model, one row per width
    d (models side by side have equal d), every panel on the same log axis."""
    sub, blocks, _, models = _models_of(df)
    rows: list[list[Panel]] = []
    i = 0
    for _, same_d in models.groupby("vit_d", sort=True):
        row = []
        for model, m in same_d.iterrows():
            b = blocks[blocks["model"] == model]
            tint = VANILLA if m["vanilla"] else PROJECT
            strips = [Trace(f"block {int(k)}", [float(k)] * len(g), [float(v) for v in g["value"]],
                            colour=tint) for k, g in b.groupby("block")]
            kind = "vanilla (LayerNorm)" if m["vanilla"] else \
                f"LayerProject, {'margin' if m['vit_margin_eps'] else 'cross-entropy'}"
            row.append(Panel(f"{letter(i)} {model.removeprefix('digits-')}\n{kind}", BLOCK,
                             "σ_max(J)" if not row else "", strips, yscale="log", kind="violin"))
            i += 1
        rows.append(row)
    ncols = max(len(r) for r in rows)
    return Plot(rows, f"The Cauchy view, Fig. 3 (docs/bounds.md §3.4): sweep `{CAUCHY}`; σ_max of each "
                      f"block's Jacobian at its input over test images, per block ({BLOCKS}): a "
                      f"violin (density of log σ_max, bar: median) and every image as a point; one "
                      f"panel per model (vanilla red, LayerProject blue), one row per width d, so "
                      f"panels side by side have equal d; all panels share the log y axis. "
                      f"{pairs(models)} {provenance(sub)}.",
                (min(WIDE, 2.3 * ncols + 0.4), 2.3 * len(rows)), legend="none", sharey=True)
