"""The report's tables, built from the long results table, and their Markdown and LaTeX forms.

Both forms are written by hand (no tabulate or jinja2 at run time); every cell is already a
string when it reaches them, so the two always show the same digits.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .report_figures import Skip, label, nearest, sweep


def fmt(v: float, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.{digits}g}"


def pm(values: pd.Series) -> str:
    std = values.std() if len(values) > 1 else 0.0
    return f"{fmt(values.mean())} ± {fmt(std, 2)}"


def to_markdown(t: pd.DataFrame) -> str:
    cols = [str(c) for c in t.columns]
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|"]
    lines += ["| " + " | ".join(str(v).replace("|", r"\|") for v in row) + " |"
              for row in t.itertuples(index=False)]
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
        "±": r"$\pm$", "–": "--", "ε": r"$\varepsilon$", "σ": r"$\sigma$", "‖": r"$\|$",
        "√": r"$\surd$", "₁": r"$_1$", "∞": r"$_\infty$", "ξ": r"$\xi$"}


def tex_escape(s: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in str(s))


def to_latex(t: pd.DataFrame, caption: str) -> str:
    spec = "l" + "r" * (len(t.columns) - 1)
    lines = [r"% " + caption.replace("\n", " "), r"\begin{tabular}{" + spec + "}", r"\hline",
             " & ".join(tex_escape(c) for c in t.columns) + r" \\", r"\hline"]
    lines += [" & ".join(tex_escape(v) for v in row) + r" \\" for row in t.itertuples(index=False)]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def summary(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Per bound: certified, median and worst ratio, violations, seconds per sample, rows."""
    sub = df[df["role"] == "bound"]
    if sub.empty:
        raise Skip("no bound rows")
    out = []
    for bound, g in sub.groupby("bound", sort=True):
        r = g["ratio"][np.isfinite(g["ratio"])]
        out.append({"bound": label(bound), "certified": "yes" if g["certified"].any() else "no",
                    "median ratio": fmt(r.median()) if len(r) else "–",
                    "worst ratio": fmt(r.max()) if len(r) else "–",
                    "violations": str(int(g["violation"].sum())),
                    "s/sample": fmt(g["seconds"].median(), 3), "rows": str(len(g))})
    return pd.DataFrame(out), ("Summary: every bound over all sweeps; ratio = value / PGD of the "
                               "bound's own objective (rows with a finite ratio), violations = "
                               "sum of `violation`, s/sample = median `seconds`.")


def table3(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    sub = sweep(df, "eps", kind="dot")
    h = nearest(sub, "h", 8)
    xn = nearest(sub, "x_norm", 1.0)
    sub = sub[(sub["h"] == h) & (sub["x_norm"] == xn) & (sub["head"] == -1)]
    cols = {"pgd_output": "PGD", "lofast_M": "LoFAST (‖M‖)", "lofast_xi": "LoFAST (ξ)",
            "specformer": "SpecFormer"}
    piv = sub[sub["bound"].isin(cols)].pivot_table(index="eps", columns="bound", values="value",
                                                  aggfunc="mean")
    if piv.empty:
        raise Skip("no PGD/LoFAST/SpecFormer rows in sweep `eps`")
    t = pd.DataFrame({"ε": [f"{e:g}" for e in piv.index]})
    for b, name in cols.items():
        t[name] = [fmt(v) for v in piv[b]] if b in piv else "–"
    resid = "residual" if bool(sub["residual"].iloc[0]) else "bare"
    return t, (f"LoFAST Table 3: sweep `eps`, one {resid} dot-product layer, h={h}, ‖X‖={xn:g}, "
               f"n={int(sub['n'].iloc[0])}, d={int(sub['d'].iloc[0])}; `value` (mean over samples) "
               f"of pgd_output, lofast_M, lofast_xi, specformer.")


def cauchy(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    sub = sweep(df, "cauchy")
    cols = {"block_sigma": "σ_max (matrix-free)", "block_sigma_exact": "σ_max (exact SVD)",
            "block_l1linf": "√(‖J‖₁‖J‖∞)"}
    rows = []
    for k, g in sub.groupby("block", sort=True):
        row = {"block": str(int(k))}
        for b, name in cols.items():
            v = g.loc[g["bound"] == b, "value"]
            row[name] = pm(v) if len(v) else "–"
        rows.append(row)
    return pd.DataFrame(rows), ("The Cauchy view: sweep `cauchy`, per block k of the stack, mean ± "
                                "std over inputs of block_sigma, block_sigma_exact, block_l1linf.")


def olsa_kim(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    sub = sweep(df, "olsa_vs_kim")
    sub = sub[sub["bound"].isin(["olsa", "kim"])]
    if sub.empty:
        raise Skip("no olsa or kim rows in sweep `olsa_vs_kim`")
    rows = []
    for (bd, n), g in sub.groupby(["bound", "n"], sort=True):
        rows.append({"bound": bd, "n": str(int(n)), "factor": fmt((g["value"] / g["eps"]).mean()),
                     "ratio": fmt(g["ratio"].mean()),
                     "violations": str(int(g["violation"].sum()))})
    return pd.DataFrame(rows), ("OLSA vs Kim: sweep `olsa_vs_kim`; Lipschitz factor value/eps and "
                                "ratio = value / PGD on each bound's own layer.")


TABLES = {"summary": summary, "table3_lofast": table3, "cauchy": cauchy, "olsa_vs_kim": olsa_kim}
