"""LoFAST's Figures 1, 3 and 4 (docs/bounds.md §2) from sweeps ``eps``, ``ablation`` and their
trained-layer twins ``eps_trained``, ``ablation_trained``. Imports only :mod:`bench.report.panels`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..panels import (
    PGD_LABEL,
    Panel,
    Plot,
    Trace,
    bound_trace,
    commits,
    letter,
    nearest,
    pgd_trace,
    present,
    sweep,
    trace,
)

WIDE = 7.0  # inches, two columns
EPS = r"radius $\varepsilon$ (log scale)"
# the bounds are upper bounds and PGD's value a lower bound of the same norm, drawn on one axis
NORM = "upper bound or\nPGD lower bound"
FLAT = 1e-4  # PGD's relative change over the noise grid below which the caption calls it flat


def _fig1_row(sub1: pd.DataFrame, subh: pd.DataFrame, h1: int, hmax: int, note: str,
              first: int) -> list[Panel]:
    """LoFAST Fig. 1's three panels, labelled from ``first``: the per-head sub-bounds against the
    PGD of their own objective (the ``pgd`` column of their rows), then the end-to-end bounds
    against PGD of the output."""
    a = present(bound_trace(sub1, "eps", "delta21_M"), bound_trace(sub1, "eps", "delta21_xi"),
                _own_pgd(sub1, "delta21_M"))
    b = present(bound_trace(sub1, "eps", "delta22_tight"), bound_trace(sub1, "eps", "delta22_naive"),
                _own_pgd(sub1, "delta22_tight"))
    # with the newer papers' two beside LoFAST's (docs/bounds.md §3.5, §3.6)
    c = present(*(bound_trace(subh, "eps", n) for n in ["lofast_M", "lofast_xi", "naive",
                                                         "lofast_M_half", "castin", "yudin"]),
                pgd_trace(subh, "eps"))
    heads = "1 head" if h1 == 1 else f"{h1} heads"
    return [Panel(rf"{letter(first)} $\Delta_{{2,1}}$, {heads}{note}", EPS, NORM, a, xscale="log"),
            Panel(rf"{letter(first + 1)} $\Delta_{{2,2}}$, {heads}{note}", EPS, "", b, xscale="log"),
            Panel(f"{letter(first + 2)} end-to-end, {hmax} heads{note}", EPS, "", c, xscale="log")]


def _own_pgd(sub: pd.DataFrame, name: str) -> Trace | None:
    rows = sub[(sub["role"] == "bound") & (sub["bound"] == name)]
    return trace(rows, "eps", "pgd", PGD_LABEL, "reference")


def _fig1_data(df: pd.DataFrame, x_norm: float | None = None, name: str = "eps"):
    sub = sweep(df, name, kind="dot")
    xn = nearest(sub, "x_norm", 1.0) if x_norm is None else x_norm
    sub = sub[sub["x_norm"] == xn]
    h1 = int(nearest(sub, "h", 1))
    hmax = int(nearest(sub, "h", 8))
    return xn, sub[sub["h"] == h1], sub[sub["h"] == hmax], h1, hmax


def fig1(df: pd.DataFrame) -> Plot:
    xn, sub1, subh, h1, hmax = _fig1_data(df)
    return Plot([_fig1_row(sub1, subh, h1, hmax, "", 0)],
                f"LoFAST Fig. 1 (docs/bounds.md §2): sweep `eps`, kind dot, ‖X‖={xn:g}; (a, b) h={h1} "
                f"per-head sub-bounds against the PGD of their own objective (`pgd` column), (c) "
                f"h={hmax} `value` of LoFAST (‖M‖), LoFAST (ξ), naive, LoFAST ½ (‖M‖), Castin et al. "
                f"(§3.5), Yudin et al. (§3.6) and the PGD "
                f"lower bound of the output (docs/bounds.md §4); mean over samples; ε on a log axis.",
                (WIDE, 3.2), legend="below")


def trained_layer(sub: pd.DataFrame) -> str:
    """The trained layer and inputs of an ``x = data`` sweep, in words (empty for random layers)."""
    if "model" not in sub or not (sub["x"] == "data").any():
        return ""
    models, data = "/".join(sorted(set(sub["model"]))), "/".join(sorted(set(sub["dataset"])))
    return (f" Trained layer: the first attention layer of zoo/{models} (its own weights, n="
            f"{int(sub['n'].iloc[0])}, d={int(sub['d'].iloc[0])}, h={int(sub['h'].iloc[0])}) at the tokens "
            f"it sees (after LayerProject) on the first {int(sub['samples'].max())} "
            f"{data} test images, times the input scale; commit {commits(sub)}.")


def fig4(df: pd.DataFrame, name: str = "eps") -> Plot:
    sub = sweep(df, name, kind="dot")
    norms = sorted(sub["x_norm"].unique())
    data = bool((sub["x"] == "data").any())
    what = "input scale s (the layer's real tokens × s)" if data else "‖X‖"
    rows = []
    for i, xn in enumerate(norms):
        _, sub1, subh, h1, hmax = _fig1_data(df, xn, name)
        rows.append(_fig1_row(sub1, subh, h1, hmax, f", {'input ×' if data else '‖X‖='}{xn:g}", 3 * i))
    return Plot(rows, f"LoFAST Fig. 4 (docs/bounds.md §2): Fig. 1 at each {what} of sweep `{name}` "
                      f"(rows: {'s' if data else '‖X‖'} ∈ {{{', '.join(f'{v:g}' for v in norms)}}}; "
                      f"columns: Δ₂,₁ and Δ₂,₂ per head against the PGD of their own objective, then "
                      f"end-to-end against PGD of the output); ε on a log axis.{trained_layer(sub)}",
                (WIDE, 2.0 * len(norms) + 1.0), legend="below")


def _flat(sub: pd.DataFrame, targets: list[str]) -> list[str]:
    """The targets whose noise leaves PGD's value unchanged to 1e-4 relative (per seed and sample)."""
    pgd = sub[(sub["role"] == "pgd") & (sub["objective"] == "output")]
    out = []
    for t in targets:
        g = pgd[pgd["perturb"] == t].groupby(["seed", "sample"])["value"]
        spread = ((g.max() - g.min()) / g.mean().abs()).max()
        if pgd.loc[pgd["perturb"] == t, "noise"].nunique() > 1 and np.isfinite(spread) and spread < FLAT:
            out.append(t)
    return out


def _why_flat(flat: list[str]) -> str:
    if not flat:
        return ""
    return (f" PGD's value changes by less than {FLAT:g} (relative) over the noise on "
            f"{', '.join(flat)}: at these small logits its best perturbation moves every token by the "
            f"same vector, which leaves the softmax almost unchanged, so the change it attains is "
            f"the linear part ε‖I + Σ_l W^V_l W^O_l‖₂, in which W_q, W_k (and X) do not appear; "
            f"the bounds, which also bound how much the softmax can move, do change.")


def fig3(df: pd.DataFrame, name: str = "ablation") -> Plot:
    sub = sweep(df, name)
    where = trained_layer(sub)
    targets = [t for t in ["W_q", "W_k", "W_v", "W_o", "X"] if t in set(sub["perturb"])]
    eps = nearest(sub, "eps", 0.1)
    sub = sub[sub["eps"] == eps]
    panels = []
    for t in targets:
        st = sub[sub["perturb"] == t]
        traces = present(*(_mean_std(bound_trace(st, "noise", n),
                                     st[(st["role"] == "bound") & (st["bound"] == n)])
                           for n in ["lofast_M", "lofast_xi"]),
                         _mean_std(pgd_trace(st, "noise"),
                                   st[(st["role"] == "pgd") & (st["objective"] == "output")]))
        panels.append(Panel(f"{letter(len(panels))} perturb {t}", "noise",
                            f"{NORM} at ε = {eps:g}" if not panels else "", traces))
    return Plot([panels], f"LoFAST Fig. 3 (docs/bounds.md §2): sweep `{name}` (task lofast), "
                          f"ε={eps:g}; `value` of the bounds and of the PGD lower bound of the output, "
                          f"mean ± std over seeds and samples per (perturb, noise); noise = spectral "
                          f"norm of the Gaussian perturbation of the target.{_why_flat(_flat(sub, targets))}"
                          f"{where}", (WIDE, 2.5), sharey=True)


def _mean_std(t: Trace | None, rows: pd.DataFrame) -> Trace | None:
    if t is None:
        return None
    g = rows.groupby("noise")["value"].agg(["mean", "std"]).fillna(0.0).loc[t.x]
    t.lo = [float(v) for v in g["mean"] - g["std"]]
    t.hi = [float(v) for v in g["mean"] + g["std"]]
    return t
