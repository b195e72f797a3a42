"""The report's tables, built from the long results table, and their Markdown and LaTeX forms.

Both forms are written by hand (no tabulate or jinja2 at run time); every cell is already a
string when it reaches them, so the two always show the same digits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd

import bounds

from .panels import Parts, Skip, certificates, label, nearest, registry_order, sweep
from .studies import cauchy_study, certify_study
from .studies import certify_tables as certify
from .studies import cost_study as cost
from .studies import imported_study as imported
from .studies import pretrained_study as pretrained
from .studies import remainder_study as remainder
from .studies import taylor_study as taylor


def fmt(v: float, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.{digits}g}"


def pm(values: pd.Series) -> str:
    std = values.std() if len(values) > 1 else 0.0
    return f"{fmt(values.mean())} ± {fmt(std, 2)}"


def _numeric(cell: str) -> bool:
    try:
        float(str(cell).split(" ")[0])  # "1.2 ± 0.3" is a number
    except ValueError:
        return str(cell) == "–"
    return True


def align(t: pd.DataFrame) -> list[str]:
    """l or r per column: numbers right (digits line up), names and words left."""
    return ["r" if i and all(_numeric(v) for v in t[c]) else "l" for i, c in enumerate(t.columns)]


def to_markdown(t: pd.DataFrame) -> str:
    cols = [str(c) for c in t.columns]
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align(t)) + "|"]
    lines += ["| " + " | ".join(str(v).replace("|", r"\|") for v in row) + " |"
              for row in t.itertuples(index=False)]
    return "\n".join(lines) + "\n"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "–": "--"}
# characters of the display names that LaTeX sets in math mode; runs of them share one $…$, and
# runs of sub- or superscripts one _{…} or ^{…} (x^{(}^{1} would be a double superscript)
_MATH = {"±": r"\pm", "ε": r"\varepsilon", "σ": r"\sigma", "‖": r"\|", "√": r"\surd", "ξ": r"\xi",
         "δ": r"\delta", "ζ": r"\zeta", "Σ": r"\Sigma", "½": r"\tfrac{1}{2}", "·": r"\cdot",
         "≤": r"\leq", "−": "-", "→": r"\to"}
_SCRIPT = {"∞": ("_", r"\infty"), "⁽": ("^", "("), "⁾": ("^", ")"), "¹": ("^", "1"), "²": ("^", "2"),
           **{chr(0x2080 + i): ("_", str(i)) for i in range(10)}}


def _math(run: list[tuple[str, str]]) -> str:
    text = ""
    for i, (kind, body) in enumerate(run):
        if kind and (i == 0 or run[i - 1][0] != kind):
            text += kind + "{"
        text += body if kind else body + " "
        if kind and (i + 1 == len(run) or run[i + 1][0] != kind):
            text += "}"
    return "$" + text.strip() + "$"


def tex_escape(s: str) -> str:
    out: list[str] = []
    run: list[tuple[str, str]] = []
    for ch in str(s):
        if ch in _MATH or ch in _SCRIPT:
            run.append(_SCRIPT.get(ch) or ("", _MATH[ch]))
            continue
        if run:
            out.append(_math(run))
            run = []
        out.append(_TEX.get(ch, ch))
    if run:
        out.append(_math(run))
    return "".join(out)


def to_latex(t: pd.DataFrame, caption: str) -> str:
    spec = "".join(align(t))
    lines = [r"% " + caption.replace("\n", " "), r"\begin{tabular}{" + spec + "}", r"\hline",
             " & ".join(tex_escape(c) for c in t.columns) + r" \\", r"\hline"]
    lines += [" & ".join(tex_escape(v) for v in row) + r" \\" for row in t.itertuples(index=False)]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def certified(name: str, rows: pd.DataFrame) -> str:
    """yes, estimate, or "yes (finding)" where this suite found the published statement unsound
    (docs/bounds.md §6); a bound the registry does not know falls back on its rows."""
    b = bounds.REGISTRY.get(name)
    if b is None:
        return "yes" if rows["certified"].any() else "estimate"
    if not b.certified:
        return "estimate"
    return "yes (finding)" if b.finding else "yes"


def findings(rows: pd.DataFrame) -> str:
    """Rows where a bound with a finding (docs/bounds.md §6) is below PGD; "–" without a finding."""
    mark = rows["finding"].astype(bool)
    return str(int((mark & ~rows["sound"].astype(bool)).sum())) if mark.any() else "–"


def summary(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Per bound: certified, certificate, median and worst ratio, violations, findings, seconds
    per sample, rows."""
    sub = df[df["role"] == "bound"]
    if sub.empty:
        raise Skip("no bound rows")
    out = []
    for bound in registry_order(sub["bound"]):  # the papers' bounds, this suite's, then estimates
        g = sub[sub["bound"] == bound]
        r = g["ratio"][np.isfinite(g["ratio"])]
        out.append({"bound": label(bound), "name": bound, "certified": certified(bound, g),
                    "certificate": certificates(g),
                    "median ratio": fmt(r.median()) if len(r) else "–",
                    "worst ratio": fmt(r.max()) if len(r) else "–",
                    "violations": str(int(g["violation"].sum())), "findings": findings(g),
                    "s/sample": fmt(g["seconds"].median(), 3), "rows": str(len(g))})
    return pd.DataFrame(out), (
        "Summary: every bound over all sweeps; certificate = how its values are known "
        "(docs/bounds.md §2.4; p = the largest failure probability of its probabilistic rows); "
        "ratio = value / PGD lower bound of the bound's own objective (rows with a finite ratio; "
        "worst = largest); violations = rows where this suite's own certified code is below PGD "
        "(`violation`, must be 0); findings = rows where a bound whose published statement this "
        "suite found unsound (certified \"yes (finding)\", docs/bounds.md §6) is below PGD "
        "(`finding` and not `sound`), \"–\" for bounds without a finding; s/sample = median "
        "`seconds` per sample, which for certified bounds includes the cost of their certificate.")


def table3(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    sub = sweep(df, "eps", kind="dot")
    h = nearest(sub, "h", 8)
    xn = nearest(sub, "x_norm", 1.0)
    sub = sub[(sub["h"] == h) & (sub["x_norm"] == xn) & (sub["head"] == -1)]
    names = ["lofast_M", "lofast_xi", "specformer", "castin", "yudin"]
    cols = {"pgd_output": "PGD", **{n: label(n) for n in names}}
    rows = sub[((sub["role"] == "pgd") & (sub["objective"] == "output"))
               | ((sub["role"] == "bound") & sub["bound"].isin(names))]
    piv = rows.assign(bound=rows["bound"].where(rows["role"] == "bound", "pgd_output")).pivot_table(
        index="eps", columns="bound", values="value", aggfunc="mean")
    if piv.empty:
        raise Skip("no PGD/LoFAST/SpecFormer rows in sweep `eps`")
    t = pd.DataFrame({"ε": [f"{e:g}" for e in piv.index]})
    for b, name in cols.items():
        t[name] = [fmt(v) for v in piv[b]] if b in piv else "–"
    resid = "residual" if bool(sub["residual"].iloc[0]) else "bare"
    return t, (f"LoFAST Table 3 (docs/bounds.md §2): sweep `eps`, one {resid} dot-product layer, "
               f"h={h}, ‖X‖={xn:g}, n={int(sub['n'].iloc[0])}, d={int(sub['d'].iloc[0])}; `value` "
               f"(mean over samples) of pgd_output, lofast_M, lofast_xi, specformer, castin (§3.5), "
               f"yudin (§3.6).")


def olsa_kim(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    sub = sweep(df, "olsa_vs_kim")
    sub = sub[(sub["role"] == "bound") & sub["bound"].isin(["olsa", "kim"])]
    if sub.empty:
        raise Skip("no olsa or kim rows in sweep `olsa_vs_kim`")
    rows = []
    for (bd, n), g in sub.groupby(["bound", "n"], sort=True):
        rows.append({"bound": label(bd), "name": bd, "n": str(int(n)),
                     "factor": fmt((g["value"] / g["eps"]).mean()), "ratio": fmt(g["ratio"].mean()),
                     "violations": str(int(g["violation"].sum()))})
    return pd.DataFrame(rows), ("OLSA vs Kim (docs/bounds.md §3.2, §3.3): sweep `olsa_vs_kim`; "
                                "Lipschitz factor value/eps and ratio = value / PGD on each bound's "
                                "own layer.")


# a stem's function returns (table, caption), or Parts: several tables (``<stem><suffix>``) and the
# long table they were chosen from (``<stem>_full.csv``)
TABLES: dict[str, Callable[[pd.DataFrame], tuple[pd.DataFrame, str] | Parts]] = {
    "summary": summary, "table3_lofast": table3, "cauchy": cauchy_study.table_blocks, "olsa_vs_kim": olsa_kim,
    "taylor_eps": taylor.table, "table1_certified": certify.table1,
    "cauchy_table1_models": cauchy_study.table_models, "pretrained": pretrained.table,
    "imported": imported.table, "imported_networks": imported.network_table, "cost": cost.table,
    "table2_cascade": certify.table2, "remainder": remainder.table,
    "taylor_net_diagnostics": certify_study.diagnostics}
