"""What each report figure shows: the rows it reads from the long results table, as a :class:`Plot`.

Every function takes the table and returns a Plot (no matplotlib here) or raises :class:`Skip` with
the reason its data is absent, so a profile with fewer sweeps still gets the figures it has data for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from . import report_cost as cost
from . import report_pretrained as pretrained
from . import report_taylor as taylor
from . import report_trained as trained
from .report_data import (
    PGD_LABEL,
    Panel,
    Plot,
    Skip,
    Trace,
    bound_trace,
    commits,
    nearest,
    pgd_trace,
    present,
    registry_order,
    sweep,
    trace,
)

COL = 3.3  # inches, one paper column
WIDE = 7.0  # inches, two columns
# tightness plots: a ratio above this (a bound 10⁴ times loose, useless as a certificate) is drawn
# off scale with its value printed, so that one bound 1e99 times loose does not squash the others
CAP = 1e4
RATIO = "bound / PGD"


def _fig1_row(sub1: pd.DataFrame, subh: pd.DataFrame, h1: int, hmax: int, note: str) -> list[Panel]:
    """LoFAST Fig. 1's three panels: the per-head sub-bounds against the PGD of their own objective
    (the ``pgd`` column of their rows), then the end-to-end bounds against PGD of the output."""
    eps = r"$\varepsilon$"
    a = present(bound_trace(sub1, "eps", "delta21_M"), bound_trace(sub1, "eps", "delta21_xi"),
                _own_pgd(sub1, "delta21_M"))
    b = present(bound_trace(sub1, "eps", "delta22_tight"), bound_trace(sub1, "eps", "delta22_naive"),
                _own_pgd(sub1, "delta22_tight"))
    c = present(*(bound_trace(subh, "eps", n) for n in ["lofast_M", "lofast_xi", "naive",
                                                         "lofast_M_half"]), pgd_trace(subh, "eps"))
    heads = "1 head" if h1 == 1 else f"{h1} heads"
    return [Panel(rf"(a) $\Delta_{{2,1}}$, {heads}{note}", eps, "bound on the norm", a),
            Panel(rf"(b) $\Delta_{{2,2}}$, {heads}{note}", eps, "", b),
            Panel(f"(c) end-to-end, {hmax} heads{note}", eps, "", c)]


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
    return Plot([_fig1_row(sub1, subh, h1, hmax, "")],
                f"LoFAST Fig. 1 (docs/bounds.md §2): sweep `eps`, kind dot, ‖X‖={xn:g}; (a, b) h={h1} "
                f"per-head sub-bounds against the PGD of their own objective (`pgd` column), (c) "
                f"h={hmax} `value` of LoFAST (‖M‖), LoFAST (ξ), naive, LoFAST ½ (‖M‖) and the PGD "
                f"lower bound of the output (docs/bounds.md §4); mean over samples.",
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
    what = "input scale" if data else "‖X‖"
    rows = []
    for xn in norms:
        _, sub1, subh, h1, hmax = _fig1_data(df, xn, name)
        rows.append(_fig1_row(sub1, subh, h1, hmax, f", {'×' if data else '‖X‖='}{xn:g}"))
    return Plot(rows, f"LoFAST Fig. 4 (docs/bounds.md §2): Fig. 1 at each {what} of sweep `{name}` "
                      f"(rows: {what} ∈ {{{', '.join(f'{v:g}' for v in norms)}}}).{trained_layer(sub)}",
                (WIDE, 2.0 * len(norms) + 1.0), legend="below")


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
        panels.append(Panel(f"perturb {t}", "noise", f"bound at ε={eps:g}" if not panels else "",
                            traces))
    return Plot([panels], f"LoFAST Fig. 3 (docs/bounds.md §2): sweep `{name}` (task lofast), "
                          f"ε={eps:g}; `value` mean ± std over seeds and samples per (perturb, noise); "
                          f"noise = spectral norm of the Gaussian perturbation of the target.{where}",
                (WIDE, 2.5), sharey=True)


def _mean_std(t: Trace | None, rows: pd.DataFrame) -> Trace | None:
    if t is None:
        return None
    g = rows.groupby("noise")["value"].agg(["mean", "std"]).fillna(0.0).loc[t.x]
    t.lo = [float(v) for v in g["mean"] - g["std"]]
    t.hi = [float(v) for v in g["mean"] + g["std"]]
    return t


def fig_cauchy(df: pd.DataFrame) -> Plot:
    """σ_max varies across inputs by ~1e-3 of its value: one panel shows its level per block, the
    other the deviation from the block's mean, on an axis that resolves it."""
    sub = sweep(df, "cauchy", bound="block_sigma")
    sub = sub[sub["role"] == "block"]
    if sub.empty:
        raise Skip("no block rows in sweep `cauchy`")
    g = sub.groupby("block")["value"]
    blocks = [float(k) for k in g.mean().index]
    level = Trace("σ_max (matrix-free)", blocks, [float(v) for v in g.mean()], "points", "#1f77b4")
    dev = 100 * (sub["value"] / g.transform("mean") - 1)
    spread = [Trace(f"block {int(k)}", [float(k)] * int((sub["block"] == k).sum()),
                    [float(v) for v in dev[sub["block"] == k]], colour="#1f77b4") for k in blocks]
    sigma = r"$\sigma_{\max}(J_{f_k}(X_k))$"
    return Plot([[Panel("(a) level: mean over inputs", "block k", sigma, [level], yscale="linear"),
                  Panel("(b) spread over inputs", "block k", "deviation from block mean (%)", spread,
                        yscale="linear", kind="strip", ref=0.0)]],
                f"The Cauchy view (docs/bounds.md §3.4): sweep `cauchy`, block_sigma (matrix-free "
                f"σ_max of each block's Jacobian) over {sub['sample'].nunique()} inputs per block; "
                f"(a) mean per block (the spread over inputs is far smaller than a marker), (b) each "
                f"input's relative deviation from its block's mean, in % (box: quartiles).",
                (WIDE * 0.8, 2.5), legend="none")


def fig_olsa_kim(df: pd.DataFrame) -> Plot:
    sub = sweep(df, "olsa_vs_kim")
    sub = sub[(sub["role"] == "bound") & sub["bound"].isin(["olsa", "kim"])]
    if sub.empty:
        raise Skip("no olsa or kim rows in sweep `olsa_vs_kim`")
    sub = sub.assign(factor=sub["value"] / sub["eps"])
    factor = present(*(bound_trace(sub, "n", n, "factor") for n in ["kim", "olsa"]))
    ratio = present(*(bound_trace(sub, "n", n, "ratio") for n in ["kim", "olsa"]))
    return Plot([[Panel("(a) Lipschitz factor", "n tokens", "value / ε", factor, xscale="log2"),
                  Panel("(b) tightness", "n tokens", RATIO, ratio, xscale="log2", ref=1.0)]],
                "OLSA vs Kim (docs/bounds.md §3.2, §3.3): sweep `olsa_vs_kim`; Lipschitz factor "
                "`value/eps` and tightness `ratio` (bound / PGD) of each on its own layer (Kim: "
                "L2-MHA, OLSA: the OLSA layer), over n; mean over samples.", (WIDE * 0.8, 2.4))


# sweep: (x column, its axis label, facet column, x scale)
TIGHT = {"heads": ("h", "heads h", "kind", "log2"), "depth": ("depth", "depth (blocks)", "kind", "linear"),
         "input_norm": ("x_norm", "input norm ‖X‖", "kind", "log"),
         "eps": ("eps", r"radius $\varepsilon$", "h", "linear")}


def fig_tight(df: pd.DataFrame, name: str) -> Plot:
    """Tightness of every end-to-end bound along one sweep's axis, one panel per facet."""
    sub = sweep(df, name)
    sub = sub[(sub["role"] == "bound") & (sub["objective"] == "output") & (sub["head"] == -1)
              & np.isfinite(sub["ratio"]) & (sub["ratio"] > 0)]
    if sub.empty:
        raise Skip(f"no end-to-end bound with a finite ratio in sweep `{name}`")
    x, xlabel, facet, xscale = TIGHT[name]
    extra = ""
    if name == "eps":
        xn = nearest(sub, "x_norm", 1.0)
        sub, extra = sub[sub["x_norm"] == xn], f", ‖X‖={xn:g}"
    panels = []
    for f in sorted(sub[facet].unique()):
        sf = sub[sub[facet] == f]
        traces = present(*(bound_trace(sf, x, n, "ratio") for n in registry_order(sf["bound"])))
        panels.append(Panel(f"{facet} = {f}", xlabel, RATIO if not panels else "", traces, xscale=xscale,
                            ref=1.0, ceiling=CAP))
    return Plot([panels], f"Tightness vs {x}: sweep `{name}`{extra}, every end-to-end bound "
                          f"(objective output, head −1); `ratio` = value / PGD lower bound (mean over "
                          f"samples; docs/bounds.md §4), panels by {facet}; estimates dashed. A ratio "
                          f"above {CAP:g} is drawn as ▲ in the band at the top, with its value.",
                (min(WIDE, 2.4 * len(panels) + 1.9), 2.7), sharey=True)


SCALING = {"scaling": "n", "scaling_d": "d", "scaling_h": "h", "scaling_depth": "depth"}
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
        panels.append(Panel(f"sweep {s}", SCALING[s], "seconds per sample" if not panels else "",
                            traces, xscale="log2"))
    return Plot([panels], f"Scaling (docs/bounds.md §2.1, §2.4): sweeps "
                          f"{', '.join(f'`{s}`' for s in present_)} (task scaling); median `seconds` "
                          f"per sample of each way to get ζ, ‖M_l‖ and σ_max(J) (colour: the "
                          f"quantity), log-log. {FAMILIES}", (WIDE, 2.6))


FIGURES: dict[str, Callable[[pd.DataFrame], Plot]] = {
    "fig1_lofast": fig1,
    "fig4_lofast_input_norms": fig4,
    "fig3_ablation": fig3,
    "fig4_trained_layer": lambda df: fig4(df, "eps_trained"),
    "fig3_trained_ablation": lambda df: fig3(df, "ablation_trained"),
    "fig2_certified_accuracy": trained.fig_zoo,
    "cauchy_models_violin": trained.fig_cauchy_models,
    "cauchy_violin": fig_cauchy,
    "olsa_vs_kim": fig_olsa_kim,
    "tightness_heads": lambda df: fig_tight(df, "heads"),
    "tightness_depth": lambda df: fig_tight(df, "depth"),
    "tightness_input_norm": lambda df: fig_tight(df, "input_norm"),
    "tightness_eps": lambda df: fig_tight(df, "eps"),
    "tightness_taylor": taylor.figure,
    "scaling": fig_scaling,
    "pretrained": pretrained.figure,
    "cost": cost.figure,
}
