"""The ``cost`` task's rows (bench/sweep/cost.py) as a figure and a table: seconds and peak memory per sample
of every certified end-to-end bound, its parts and the PGD that checks it, against problem size n·d,
with the matmul-bound estimate of ζ + ‖M_l‖ from the machine's rate measured in the same run.
Imports only :mod:`bench.report.panels`."""

from __future__ import annotations

import pandas as pd

import bounds

from ..panels import PGD_LABEL, Panel, Plot, Skip, Trace, colour, label, style

PARTS = {"zeta": "ζ(X)", "M": "‖M_l‖ (all heads)", "xi": "ξ_l (all heads)"}
BOUND = "matmul_bound"
SIZE = "problem size n·d"


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    sub = df[(df["role"] == "timing") & df["bound"].astype(str).str.startswith(("cost_", BOUND, "matmul"))]
    if sub.empty:
        raise Skip("no rows of the cost task")
    return sub.assign(size=sub["n"] * sub["d"])


def _name(code: str) -> tuple[str, str, str | None]:
    """(legend text, style, colour) of a ``cost_<x>`` row name."""
    x = code.removeprefix("cost_")
    if x == "pgd":
        return PGD_LABEL, "reference", None
    if x in PARTS:
        return PARTS[x], "estimate", colour(x if x != "xi" else "lofast_xi")
    return label(x), style(x), colour(x)


def _rank(code: str) -> tuple:
    """ζ, ‖M_l‖, ξ_l first, then the bounds in registry order."""
    x = code.removeprefix("cost_")
    order = [*PARTS, *bounds.REGISTRY]
    return (order.index(x) if x in order else len(order), x)


def _where(sub: pd.DataFrame) -> str:
    names = sorted({str(v) for v in sub.get("device_name", pd.Series(["?"])).dropna()})
    return ", ".join(names) or "?"


def _trace(sub: pd.DataFrame, code: str, col: str) -> Trace | None:
    g = sub[sub["bound"] == code].groupby("size")[col].median().dropna()
    if g.empty:
        return None
    text, st, c = _name(code)
    return Trace(text, [float(v) for v in g.index], [float(v) for v in g.values], st, c)


def _heads(sub: pd.DataFrame) -> tuple[dict[float, str], str]:
    """Where the cells' number of heads h changes along n·d (the ViT cell has more): h under every
    tick, and the caption's word on it; nothing when one h holds throughout."""
    h = sub.groupby("size")["h"].agg(lambda v: "/".join(f"{x:g}" for x in sorted(set(v))))
    if h.nunique() < 2:
        return {}, f" (h = {h.iloc[0]} throughout)" if len(h) else ""
    return ({float(k): f"h={v}" for k, v in h.items()},
            " (the number of heads h changes along it, as written under each n·d: a step there is "
            "partly h's)")


def figure(df: pd.DataFrame) -> Plot:
    sub = _rows(df)
    codes = sorted({b for b in sub["bound"] if b.startswith("cost_")},
                   key=lambda b: (b == "cost_pgd", _rank(b)))
    secs = [t for t in (_trace(sub, c, "seconds") for c in codes) if t]
    est = _trace(sub, BOUND, "seconds")
    if est:
        secs.append(Trace("matmul bound of ζ + ‖M_l‖", est.x, est.y, "dense", "#000000"))
    mem = [t for t in (_trace(sub, c, "peak_mib") for c in codes) if t]
    notes, heads = _heads(sub)
    panels = [Panel("(a) seconds per sample", SIZE, "seconds", secs, xscale="log", xnotes=notes)]
    if mem:
        panels.append(Panel("(b) peak memory per call", SIZE, "MiB above the start", mem, xscale="log",
                            xnotes=notes))
    rate = sub[sub["bound"] == "matmul"]["value"]
    return Plot([panels], f"Cost (task cost, bench/sweep/cost.py) on {_where(sub)}: "
                          f"each certified end-to-end "
                          f"bound computed alone (its certificate included), its parts ζ, ‖M_l‖, ξ_l "
                          f"(dashed), and the PGD that checks it (black), against n·d{heads}; cells "
                          f"{', '.join(sorted(set(sub['sweep'])))}. The dotted black line is the "
                          f"matmul-bound estimate of ζ + ‖M_l‖: operator products × flops per product "
                          f"÷ the float64 matmul rate measured in the same run (median "
                          f"{rate.median():.1f} GFLOP/s). Peak memory: GPU max_memory_allocated, CPU "
                          f"the resident set sampled every 2 ms.", (7.0, 3.0))


def table(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Per cell (n, d, h): seconds of each bound and PGD, PGD/bound, the matmul bound and its ratio."""
    sub = _rows(df)
    out = []
    for (n, d, h), g in sub.groupby(["n", "d", "h"]):
        sec = g.groupby("bound")["seconds"].median()
        pgd = sec.get("cost_pgd", float("nan"))
        row = {"n": f"{n:g}", "d": f"{d:g}", "h": f"{h:g}", "PGD s": f"{pgd:.3g}"}
        for code in sorted((c for c in sec.index if c.startswith("cost_") and c != "cost_pgd"), key=_rank):
            ratio = pgd / sec[code]
            row[_name(code)[0]] = f"{sec[code]:.3g} ({ratio:.0f}×)" if ratio >= 10 else \
                f"{sec[code]:.3g} ({ratio:.2g}×)"
        zm = sec.get("cost_zeta", float("nan")) + sec.get("cost_M", float("nan"))
        est = sec.get(BOUND, float("nan"))
        row["ζ+‖M‖ / matmul bound"] = f"{zm / est:.2g}"
        out.append(row)
    return pd.DataFrame(out).fillna("–"), (
        f"Cost on {_where(sub)} (task cost): median seconds per sample of each certified bound "
        f"computed alone, with (in brackets) how many times cheaper than the PGD that checks it "
        f"(PGD s / bound s; the aim is ≥ 20×); the last column is the measured time of ζ and ‖M_l‖ "
        f"over their matmul-bound estimate (the aim at ViT-B size is ≤ 2).")
