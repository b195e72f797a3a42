"""What each report figure shows: the rows it reads from the long results table, as a :class:`Plot`.

Every function takes the table and returns a Plot (no matplotlib here) or raises :class:`Skip` with
the reason its data is absent, so a profile with fewer sweeps still gets the figures it has data for.
The figures live in modules named for what they show; this one holds the registry and OLSA vs Kim.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from .panels import Panel, Plot, Skip, bound_trace, present, sweep
from .studies import cauchy_study as cauchy
from .studies import certify_study as certify
from .studies import cost_study as cost
from .studies import imported_study as imported
from .studies import pretrained_study as pretrained
from .studies import remainder_study as remainder
from .studies import taylor_study as taylor
from .studies.lofast_study import fig1, fig3, fig4
from .studies.scaling_study import fig_scaling
from .studies.tight_study import fig_tight

WIDE = 7.0  # inches, two columns
RATIO = "bound / PGD"


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


FIGURES: dict[str, Callable[[pd.DataFrame], Plot]] = {
    "fig1_lofast": fig1,
    "fig4_lofast_input_norms": fig4,
    "fig3_ablation": fig3,
    "fig4_trained_layer": lambda df: fig4(df, "eps_trained"),
    "fig3_trained_ablation": lambda df: fig3(df, "ablation_trained"),
    "fig2_certified_accuracy": certify.figure,
    "certification_gap": certify.gap_figure,
    "cauchy_models_violin": cauchy.fig_models,
    "cauchy_violin": cauchy.figure,
    "olsa_vs_kim": fig_olsa_kim,
    "tightness_heads": lambda df: fig_tight(df, "heads"),
    "tightness_depth": lambda df: fig_tight(df, "depth"),
    "tightness_input_norm": lambda df: fig_tight(df, "input_norm"),
    "tightness_eps": lambda df: fig_tight(df, "eps"),
    "tightness_n": lambda df: fig_tight(df, "n"),
    "tightness_taylor": taylor.figure,
    "scaling": fig_scaling,
    "pretrained": pretrained.figure,
    "imported": imported.figure,
    "remainder": remainder.figure,
    "cost": cost.figure,
}
