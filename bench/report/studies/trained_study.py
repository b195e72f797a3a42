"""The trained models' rows as the report reads them: the models' architecture (``vit_*`` columns,
bench/core/schema.py ``MODEL_COLUMNS``), and per (model, ε, bound) how many test images a bound certified
through the whole network (docs/bounds.md §5), with its 95 % Wilson score interval. The figures and
tables drawn from these are in :mod:`bench.report.studies.certify_study` (LoFAST Fig. 2),
:mod:`bench.report.studies.certify_tables` (its Tables 1 and 2) and
:mod:`bench.report.studies.cauchy_study`. Imports only :mod:`bench.report.panels`, the registry and
the schema.

Every bound present in the rows is counted, whatever its name: the network bounds of the registry,
CROWN and α-CROWN, and a cascade (a bound whose name starts with ``cascade``).
"""

from __future__ import annotations

import math

import pandas as pd
from scipy.stats import binomtest

import bounds

from ...core.schema import FILE_TASKS
from ..panels import Skip, colour, commits, label, spare

LEVEL = 0.95  # the confidence of every interval the report draws around a certified accuracy
CASCADE = "cascade"  # a bound whose name starts so is a cascade (cheapest sound bound first, then CROWN)
# a boolean column of a cascade's rows: True where the cascade sent the image on to CROWN
SENT = "sent_to_crown"
# display names of cascades the registry does not hold, in the order they are shown after the
# registry's (CROWN, α-CROWN and cascade_crown are registered and named there); any other unknown name
# is shown as it is, last. The colours of the CROWN family, which panels' palette lacks
LABELS = {"cascade": "cascade (suite → CROWN)", "cascade_alpha_crown": "cascade (suite → α-CROWN)"}
COLOURS = {"crown": "#e7298a", "alpha_crown": "#7570b3", "cascade": "#a6761d", "cascade_crown": "#a6761d",
           "cascade_alpha_crown": "#66a61e", "taylor_net": "#d95f02", "cascade_taylor_net": "#1b9e77"}
PGD_REF = "PGD robust (upper ref.)"
# a shape per bound: up to a dozen curves meet at 0 or at PGD in one panel of Fig. 2, and a colour
# alone does not tell them apart there (the minimum "best" is a band and has none)
MARKERS = {"naive": "o", "lofast_M": "v", "lofast_xi": "^", "lofast_M_half": "<", "lofast_xi_half": ">",
           "specformer": "D", "taylor": "s", "taylor_net": "P", "taylor_net_lofast": "X",
           "taylor_net_lofast_half": "p", "taylor_net_best": "x", "crown": "h", "alpha_crown": "H",
           "cascade": "*", "cascade_crown": "*", "cascade_taylor_net_crown": "d", "cascade_alpha_crown": "8",
           "castin": "1", "yudin": "2", "taylor_net_alpha": "4", "taylor_net_bab": "+"}
# a bound not pinned above (a plugin's, a new one) takes a shape no pinned bound has, by its name's hash
SPARE_MARKERS = ("3", "|", "_", ".")


def name_of(bound: str) -> str:
    """The display name of a bound of the network rows (its code name when nobody named it)."""
    return label(bound) if bound in bounds.REGISTRY else LABELS.get(bound, bound)


def colour_of(bound: str) -> str | None:
    return COLOURS.get(bound) or colour(bound)  # the network figures' own pins first


def marker_of(bound: str) -> str | None:
    return MARKERS[bound] if bound in MARKERS else spare(bound, SPARE_MARKERS)


def order(names) -> list[str]:
    """The registry's bounds in its order, then those of :data:`LABELS`, then any other by name."""
    rank = {n: i for i, n in enumerate([*bounds.REGISTRY, *LABELS])}
    return sorted(set(names), key=lambda n: (rank.get(n, len(rank)), n))


def eg(v: float) -> str:
    return f"{v:g}"


def provenance(sub: pd.DataFrame) -> str:
    """Which data, how many test images and which commit the rows came from."""
    data = "/".join(sorted(set(sub["dataset"])))
    n = int(sub.loc[sub["role"] == "certify", "sample"].max() + 1) if (sub["role"] == "certify").any() \
        else int(sub["samples"].max())
    return f"{data} test set, first {n} images; commit {commits(sub)}"


def short_labels(models: list[str]) -> dict[str, str]:
    """Column labels: the tokens of each model's name (split at "-") that not every model has, in
    their order (``b2-q1-m0.003`` when all share ``digits-d32-…-h2-c0.5``); the whole names where
    that leaves a label empty or two alike."""
    tokens = {m: m.split("-") for m in models}
    common = set.intersection(*(set(t) for t in tokens.values())) if models else set()
    out = {m: "-".join(t for t in ts if t not in common) for m, ts in tokens.items()}
    if "" in out.values() or len(set(out.values())) < len(out):
        return {m: m for m in models}
    return out


def recipe(m: pd.Series) -> str:
    qk = "" if math.isnan(m["vit_qk"]) else f", ‖W^Q‖,‖W^K‖ ≤ {m['vit_qk']:g}"
    tr = "cross-entropy" if not m["vit_margin_eps"] else f"Lipschitz-margin ε={m['vit_margin_eps']:g}"
    return f"c={m['vit_c']:g}{qk}, {tr}"


def model_rows(sub: pd.DataFrame) -> pd.DataFrame:
    """One row per model: its architecture columns."""
    cols = ["model", "vit_depth", "vit_heads", "vit_d", "vit_c", "vit_qk", "vit_margin_eps",
            "vit_test_accuracy", "dataset"]
    missing = [c for c in cols if c not in sub]
    if missing:
        raise Skip(f"sweep rows without the model columns {missing}")
    return sub[cols].drop_duplicates("model").set_index("model")



def network(df: pd.DataFrame, files: bool = False) -> pd.DataFrame:
    """The rows of every sweep that certified images through a zoo model (role ``certify``): a sweep
    of CROWN or of the cascade beside the suite's ``certify`` sweep is read as well; ``files``: those
    of the networks read from files instead."""
    # a network read from a user's file has its own table (imported_study.network_table), not Fig. 2
    # and Tables 1–2
    ours = df["task"].isin(FILE_TASKS) if "task" in df else pd.Series(False, df.index)
    df = df[ours if files else ~ours]
    names = df.loc[df["role"] == "certify", "sweep"].unique()
    if not len(names):
        what = "of a network file (task `certify_file`)" if files else "(role `certify`)"
        raise Skip(f"no whole-network certification rows {what} in this table", listed=not files)
    return df[df["sweep"].isin(names)]


def sweeps(sub: pd.DataFrame) -> str:
    return ", ".join(f"`{s}`" for s in dict.fromkeys(sub["sweep"]))


def flag(col: pd.Series) -> pd.Series:
    """A boolean column as stored (bool, pandas' nullable boolean, or text): missing is False."""
    if col.dtype == object:
        col = col.map(lambda v: str(v).strip().lower() in ("true", "1"))
    return col.fillna(False).astype(bool)


def verdicts(cert: pd.DataFrame) -> pd.Series:
    """Whether each image is certified: the pairwise-head test (which implies LoFAST's Proposition
    1); a bound that records one verdict alone in ``certified_prop1`` is read from there."""
    v = cert["certified_pairwise"] if "certified_pairwise" in cert else pd.Series(pd.NA, cert.index)
    if "certified_prop1" in cert:
        v = v.astype("boolean").fillna(cert["certified_prop1"].astype("boolean"))
    return flag(v)


def counts(df: pd.DataFrame, files: bool = False) -> pd.DataFrame:
    """Per (model, eps, bound): ``k`` images certified of ``n``, ``accuracy`` = k/n, its Wilson
    interval ``lo``, ``hi``, ``seconds`` per image, (a cascade's, when its rows say) the share of
    images ``sent`` on to CROWN, and ``attacked``, PGD's robust accuracy over the same images (classified
    right and not broken, as each row records; NaN where a row does not). An image stored by two
    sweeps counts once. ``files``: of the networks read from files (:func:`network`)."""
    sub = network(df, files)
    cert = sub[sub["role"] == "certify"].drop_duplicates(["model", "eps", "bound", "sample"])
    attack = {"correct", "pgd_broken"} <= set(cert)  # older tables lack the columns
    known = cert["correct"].notna() & cert["pgd_broken"].notna() if attack else False
    robust = (flag(cert["correct"]) & ~flag(cert["pgd_broken"])).astype(float) if attack else math.nan
    cert = cert.assign(ok=verdicts(cert).astype(int),
                       sent=flag(cert[SENT]).astype(float).where(cert[SENT].notna()) if SENT in cert
                       else math.nan,
                       robust=robust, known=known)
    g = cert.groupby(["model", "eps", "bound"])
    out = pd.DataFrame({"k": g["ok"].sum(), "n": g["ok"].size(), "seconds": g["seconds"].mean(),
                        "sent": g["sent"].mean()})
    # an image's PGD verdict is known only where its row says: the share over those rows alone would
    # be of other images, so a bound with any row unknown has none
    out["attacked"] = g["robust"].mean().where(g["known"].all())
    out["accuracy"] = out["k"] / out["n"]
    ci = [wilson(k, n) for k, n in zip(out["k"], out["n"], strict=True)]
    out["lo"], out["hi"] = [c[0] for c in ci], [c[1] for c in ci]
    return out


def wilson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n (scipy's binomtest)."""
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def references(df: pd.DataFrame, files: bool = False) -> pd.DataFrame:
    """Per (model, eps): ``clean`` accuracy and ``pgd`` robust accuracy over the certified images:
    those of the sweep with the most images; two sweeps attacking as many (the same first images)
    give two upper bounds of the robust accuracy, of which the smaller is kept. ``files``: as
    :func:`counts`."""
    sub = network(df, files)
    acc = sub[sub["role"] == "accuracy"]
    if acc.empty:
        raise Skip(f"no accuracy rows in sweep(s) {sweeps(sub)}")
    acc = acc[acc["samples"] == acc.groupby(["model", "eps"])["samples"].transform("max")]
    clean = acc[acc["bound"] == "clean"].groupby(["model", "eps"])["value"].mean()
    pgd = acc[acc["bound"] == "pgd_margin"].groupby(["model", "eps"])["value"].min()
    return pd.DataFrame({"clean": clean, "pgd": pgd})


def model_order(sub: pd.DataFrame) -> pd.DataFrame:
    """The models of the rows, margin-trained first, then by depth, heads and c."""
    return model_rows(sub).sort_values(["vit_margin_eps", "vit_depth", "vit_heads", "vit_c"],
                                    ascending=[False, True, True, True])


def merged(curves: dict[str, tuple]) -> list[list[str]]:
    """Groups of the bounds whose curves are equal (the same key: (ε, k, n) at every ε), each group
    in the order of ``curves``, the groups in the order of their first member."""
    groups: dict[tuple, list[str]] = {}
    for name, key in curves.items():
        groups.setdefault(key, []).append(name)
    return list(groups.values())
