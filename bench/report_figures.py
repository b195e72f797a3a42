"""The report's figures, each drawn from the long results table by column values alone.

Every ``fig_*`` function takes the table and returns a :class:`Figure` (the matplotlib figure
plus the README caption) or raises :class:`Skip` with the reason its data is absent, so a profile
with fewer sweeps still gets the figures it has data for.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # headless CI and CLI: never ask for a display

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

import bounds

COL = 3.3  # inches, one paper column
WIDE = 7.0  # inches, two columns
CAP = 1e4  # tightness plots: ratios above this are drawn at it and labelled


class Skip(Exception):
    """A figure or table whose data is not in this table."""


@dataclass
class Figure:
    fig: plt.Figure
    caption: str


def style() -> None:
    sns.set_theme(context="paper", style="whitegrid", font_scale=0.9,
                  rc={"legend.fontsize": 6.5, "axes.titlesize": 8, "lines.markersize": 4})


def label(bound: str) -> str:
    """The legend name of a bound (the registry's display name), or of a PGD row."""
    if bound.startswith("pgd_"):
        return "PGD (lower bd.)"
    return bounds.REGISTRY[bound].label if bound in bounds.REGISTRY else bound


def sweep(df: pd.DataFrame, name: str, **eq) -> pd.DataFrame:
    sub = df[df["sweep"] == name]
    for k, v in eq.items():
        sub = sub[sub[k] == v]
    if sub.empty:
        raise Skip(f"no rows of sweep `{name}`" + (f" with {eq}" if eq else ""))
    return sub


def nearest(sub: pd.DataFrame, col: str, want: float) -> float:
    """The value of ``col`` closest to ``want`` (a user profile may not hold ``want`` itself)."""
    vals = np.sort(sub[col].unique())
    return vals[np.argmin(np.abs(vals - want))].item()


def _curve(ax, sub: pd.DataFrame, x: str, bound: str, col: str = "value", name: str | None = None,
           **kw) -> None:
    rows = sub[(sub["bound"] == bound) & np.isfinite(sub[col]) & (sub[col] > 0)]
    if rows.empty:
        return
    g = rows.groupby(x)[col].mean()  # over samples (and heads, where a bound has several)
    dashed = bound.startswith(("pgd", "jacobian")) or col == "pgd"
    ax.plot(g.index, g.values, marker="o", ls="--" if dashed else "-",
            color="k" if dashed and "color" not in kw else kw.pop("color", None),
            label=name or label(bound), **kw)


def _fig1_row(axes, sub1: pd.DataFrame, subh: pd.DataFrame, titles: bool) -> None:
    a, b, c = axes
    pal = sns.color_palette("deep")
    _curve(a, sub1, "eps", "delta21_M", color=pal[0])
    _curve(a, sub1, "eps", "delta21_xi", color=pal[1])
    _curve(a, sub1, "eps", "delta21_M", col="pgd", name="PGD (lower bd.)")
    _curve(b, sub1, "eps", "delta22_tight", color=pal[0])
    _curve(b, sub1, "eps", "delta22_naive", color=pal[1])
    _curve(b, sub1, "eps", "delta22_tight", col="pgd", name="PGD (lower bd.)")
    for i, bd in enumerate(["lofast_M", "lofast_xi", "naive", "lofast_M_half"]):
        _curve(c, subh, "eps", bd, color=pal[i])
    _curve(c, subh, "eps", "pgd_output")
    if titles:
        h = int(subh["h"].iloc[0]) if not subh.empty else 0
        a.set_title(r"(a) $\Delta_{2,1}$, 1 head")
        b.set_title(r"(b) $\Delta_{2,2}$, 1 head")
        c.set_title(f"(c) end-to-end, {h} heads")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel(r"$\varepsilon$")


def _legend_below(ax) -> None:
    # inside the axes a legend hides the small-ε points the figure is about
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=6, frameon=False)


def _fig1_data(df: pd.DataFrame, x_norm: float | None = None):
    sub = sweep(df, "eps", kind="dot")
    xn = nearest(sub, "x_norm", 1.0) if x_norm is None else x_norm
    sub = sub[sub["x_norm"] == xn]
    h1 = nearest(sub, "h", 1)
    hmax = nearest(sub, "h", 8)
    return xn, sub[sub["h"] == h1], sub[sub["h"] == hmax], h1, hmax


def fig1(df: pd.DataFrame) -> Figure:
    xn, sub1, subh, h1, hmax = _fig1_data(df)
    fig, axes = plt.subplots(1, 3, figsize=(WIDE, 3.0), constrained_layout=True)
    _fig1_row(axes, sub1, subh, True)
    axes[0].set_ylabel("bound on the norm")
    for ax in axes:
        _legend_below(ax)
    return Figure(fig, f"LoFAST Fig. 1: sweep `eps`, kind dot, ‖X‖={xn:g}; (a,b) h={h1} per-head "
                       f"sub-bounds vs the PGD of their own objective (`pgd` column), (c) h={hmax} "
                       f"`value` of lofast_M/xi, naive, lofast_M_half and `pgd_output`; mean over "
                       f"samples.")


def fig4(df: pd.DataFrame) -> Figure:
    norms = sorted(sweep(df, "eps", kind="dot")["x_norm"].unique())
    fig, axes = plt.subplots(len(norms), 3, figsize=(WIDE, 1.8 * len(norms) + 0.9),
                             constrained_layout=True, squeeze=False)
    for r, xn in enumerate(norms):
        _, sub1, subh, _, _ = _fig1_data(df, xn)
        _fig1_row(axes[r], sub1, subh, r == 0)
        axes[r, 0].set_ylabel(f"‖X‖ = {xn:g}")
        if r < len(norms) - 1:
            for ax in axes[r]:
                ax.set_xlabel("")
    for ax in axes[-1]:
        _legend_below(ax)
    return Figure(fig, f"LoFAST Fig. 4: Fig. 1 at each input norm of sweep `eps` "
                       f"(rows: x_norm ∈ {{{', '.join(f'{v:g}' for v in norms)}}}).")


def fig3(df: pd.DataFrame) -> Figure:
    sub = sweep(df, "ablation")
    targets = [t for t in ["W_q", "W_k", "W_v", "W_o", "X"] if t in set(sub["perturb"])]
    eps = nearest(sub, "eps", 0.1)
    sub = sub[sub["eps"] == eps]
    fig, axes = plt.subplots(1, len(targets), figsize=(WIDE, 2.2), sharey=True,
                             constrained_layout=True, squeeze=False)
    pal = sns.color_palette("deep")
    for ax, t in zip(axes[0], targets, strict=True):
        st = sub[sub["perturb"] == t]
        for i, bd in enumerate(["lofast_M", "lofast_xi", "pgd_output"]):
            g = st[st["bound"] == bd].groupby("noise")["value"].agg(["mean", "std"]).fillna(0.0)
            if g.empty:
                continue
            pgd = bd.startswith("pgd")
            ax.errorbar(g.index, g["mean"], yerr=g["std"], marker="o", capsize=2,
                        ls="--" if pgd else "-", color="k" if pgd else pal[i], label=label(bd))
        ax.set_title(f"perturb {t}")
        ax.set_xlabel("noise")
        ax.set_yscale("log")
    axes[0, 0].set_ylabel(f"bound at ε={eps:g}")
    axes[0, -1].legend(loc="best")
    return Figure(fig, f"LoFAST Fig. 3: sweep `ablation` (task lofast), ε={eps:g}; `value` mean ± "
                       f"std over seeds and samples per (perturb, noise); noise = spectral norm of "
                       f"the Gaussian perturbation of the target.")


def fig_cauchy(df: pd.DataFrame) -> Figure:
    sub = sweep(df, "cauchy", bound="block_sigma")
    fig, ax = plt.subplots(figsize=(COL, 2.4), constrained_layout=True)
    sns.violinplot(data=sub, x="block", y="value", ax=ax, color=sns.color_palette("deep")[0],
                   inner="point", cut=0, density_norm="width")
    ax.set_xlabel("block k")
    ax.set_ylabel(r"$\sigma_{\max}(J_{f_k}(X_k))$")
    return Figure(fig, f"The Cauchy view: sweep `cauchy`, bound block_sigma (matrix-free σ_max of "
                       f"each block's Jacobian) over {sub['sample'].nunique()} inputs per block.")


def fig_olsa_kim(df: pd.DataFrame) -> Figure:
    sub = sweep(df, "olsa_vs_kim")
    sub = sub[sub["bound"].isin(["olsa", "kim"])]
    if sub.empty:
        raise Skip("no olsa or kim rows in sweep `olsa_vs_kim`")
    sub = sub.assign(factor=sub["value"] / sub["eps"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(WIDE * 0.75, 2.3), constrained_layout=True)
    pal = sns.color_palette("deep")
    for i, bd in enumerate(["kim", "olsa"]):
        _curve(a, sub, "n", bd, col="factor", color=pal[i])
        _curve(b, sub, "n", bd, col="ratio", color=pal[i])
    a.set_ylabel("Lipschitz factor (value / ε)")
    b.set_ylabel("bound / PGD")
    b.axhline(1.0, color="k", lw=0.8, ls=":")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _data_ticks(ax, sub["n"])
        ax.set_xlabel("n tokens")
        ax.legend()
    return Figure(fig, "OLSA vs Kim: sweep `olsa_vs_kim`; Lipschitz factor `value/eps` and "
                       "tightness `ratio` (bound / PGD) of each on its own layer (kim: L2-MHA, "
                       "olsa: OLSA layer), over n.")


def _tight(df: pd.DataFrame, name: str) -> pd.DataFrame:
    sub = sweep(df, name)
    sub = sub[(sub["objective"] == "output") & (sub["head"] == -1) & np.isfinite(sub["ratio"])
              & (sub["ratio"] > 0) & (sub["role"] == "bound")]
    if sub.empty:
        raise Skip(f"no end-to-end bound with a finite ratio in sweep `{name}`")
    return sub


def _data_ticks(ax, values: pd.Series) -> None:
    # the grid's own values read better than 2^k or 10^k on a log axis of a handful of points
    vals = sorted(values.unique())
    ax.set_xticks(vals, [f"{v:g}" for v in vals])
    ax.minorticks_off()


def _cap(sub: pd.DataFrame, x: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Ratios above CAP are drawn at CAP and labelled: one bound that is 1e90 times loose (a
    product over blocks) would otherwise flatten every other curve onto the axis."""
    means = sub.groupby(["bound", x])["ratio"].transform("mean")
    over = sub[means > CAP].assign(ratio=means[means > CAP])
    return sub.assign(ratio=sub["ratio"].where(means <= CAP, CAP)), over


def _tight_panels(sub: pd.DataFrame, x: str, facet: str, order: list[str], logx: bool):
    sub, over = _cap(sub, x)
    facets = sorted(sub[facet].unique())
    fig, axes = plt.subplots(1, len(facets), figsize=(min(WIDE, 2.6 * len(facets) + 1.4), 2.5),
                             sharey=True, constrained_layout=True, squeeze=False)
    pal = dict(zip(order, sns.color_palette("tab20", len(order)), strict=True))
    for ax, f in zip(axes[0], facets, strict=True):
        sf = sub[sub[facet] == f]
        for bd in order:
            _curve(ax, sf, x, bd, col="ratio", color=pal[bd])
        for r in over[over[facet] == f].drop_duplicates(["bound", x]).itertuples():
            ax.annotate(f"{r.bound}: {r.ratio:.1e}", (getattr(r, x), CAP), fontsize=5,
                        xytext=(0, -8), textcoords="offset points", ha="center", va="top",
                        color=pal[r.bound])
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_yscale("log")
        if logx:
            ax.set_xscale("log")
        _data_ticks(ax, sub[x])
        ax.set_xlabel(x)
        if len(facets) > 1:
            ax.set_title(f"{facet} = {f}")
    axes[0, 0].set_ylabel("bound / PGD")
    _shared_legend(fig, axes[0])
    return fig


def _shared_legend(fig: plt.Figure, axes) -> None:
    # one legend for all panels: a bound missing from one facet must still be named
    seen: dict = {}
    for ax in axes:
        for h, lb in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lb, h)
    fig.legend(seen.values(), seen.keys(), loc="outside right center", fontsize=5.5)


def _bound_order(sub: pd.DataFrame) -> list[str]:
    return sorted(sub["bound"].unique())


def fig_tight(df: pd.DataFrame, name: str) -> Figure:
    """Tightness of every end-to-end bound along one sweep's axis."""
    sub = _tight(df, name)
    x, facet, logx = {"heads": ("h", "kind", True), "depth": ("depth", "kind", False),
                      "input_norm": ("x_norm", "kind", True), "eps": ("eps", "h", False)}[name]
    if name == "eps":
        sub = sub[sub["x_norm"] == nearest(sub, "x_norm", 1.0)]
    fig = _tight_panels(sub, x, facet, _bound_order(sub), logx)
    extra = f", ‖X‖={sub['x_norm'].iloc[0]:g}" if name == "eps" else ""
    return Figure(fig, f"Tightness vs {x}: sweep `{name}`{extra}, rows with objective == output "
                       f"and head == -1; `ratio` = value / pgd (mean over samples), facets by "
                       f"{facet}; estimates dashed; ratios above {CAP:g} are drawn at {CAP:g} and "
                       f"labelled with their value.")


SCALING = {"scaling": "n", "scaling_d": "d", "scaling_h": "h", "scaling_depth": "depth"}


def fig_scaling(df: pd.DataFrame) -> Figure:
    present = [s for s in SCALING if s in set(df["sweep"])]
    if not present:
        raise Skip("no scaling sweeps")
    fig, axes = plt.subplots(1, len(present), figsize=(WIDE, 2.4), constrained_layout=True,
                             squeeze=False)
    methods = sorted(df[df["sweep"].isin(present) & (df["role"] == "timing")]["bound"].unique())
    pal = dict(zip(methods, sns.color_palette("deep", len(methods)), strict=True))
    for ax, s in zip(axes[0], present, strict=True):
        sub = df[df["sweep"] == s]
        for m in methods:
            g = sub[sub["bound"] == m].groupby(SCALING[s])["seconds"].median()
            if g.empty:
                continue
            ax.plot(g.index, g.values, marker="o", color=pal[m],
                    ls="--" if m.endswith("_dense") else "-",
                    label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _data_ticks(ax, sub[SCALING[s]])
        ax.set_xlabel(SCALING[s])
        ax.set_title(f"sweep {s}")
    axes[0, 0].set_ylabel("seconds per sample")
    _shared_legend(fig, axes[0])
    return Figure(fig, f"Scaling: sweeps {', '.join(f'`{s}`' for s in present)} (task scaling); "
                       f"median `seconds` per sample of the matrix-free (solid) and dense (dashed) "
                       f"solvers of ζ, ‖M_l‖ and σ_max(J), log-log.")


FIGURES = {
    "fig1_lofast": fig1,
    "fig4_lofast_input_norms": fig4,
    "fig3_ablation": fig3,
    "cauchy_violin": fig_cauchy,
    "olsa_vs_kim": fig_olsa_kim,
    "tightness_heads": lambda df: fig_tight(df, "heads"),
    "tightness_depth": lambda df: fig_tight(df, "depth"),
    "tightness_input_norm": lambda df: fig_tight(df, "input_norm"),
    "tightness_eps": lambda df: fig_tight(df, "eps"),
    "scaling": fig_scaling,
}
