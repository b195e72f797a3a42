"""What a results table claims, recomputed from its numbers: the one soundness rule, and the check
every reader of a table runs (through :func:`bench.core.store.load`) before it believes a row.

A row's ``ratio`` (value/PGD), ``sound`` (value ≥ PGD·(1 − 1e-6), and for a network ``certify``
row: no image certified by the bound that PGD breaks) and ``violation`` (a certified bound without
a published-statement finding that is not sound) follow from its ``value``, ``pgd`` and network
columns; whether a bound is certified and whether it carries a finding follow from its name in
bounds/registry.py. None of them is read from the stored flags: :func:`derive` recomputes them,
and ``compare`` and ``baseline --update`` judge by :func:`derive` alone.

A stored column that contradicts the recomputation is refused (:func:`check`, InputError: one
``error:`` line naming how many rows and the first, exit 2) rather than silently judged by the
recomputed value. Such a table was not written by bench/sweep/rows.py as it stands (it was edited, or
written by code with another rule), so nothing else in it is to be believed either: its seconds,
its certificates, its other values. Refusing it at the loader also keeps the readers in agreement:
``report`` draws from the stored columns, and would otherwise show a table that ``compare`` judges
differently. A violation the table states honestly (its flags agree with its numbers) is not
refused here: ``compare`` marks it ``x`` and exits 1, ``report`` shows it at the top, and
``baseline --update`` refuses it.

The check also refuses what no judgement can be made of: a value that is NaN (any bound, PGD or
accuracy row) or ±inf (a certified bound without a finding, a PGD value or an accuracy; a
published formula with a finding may overflow to +inf, which claims nothing false), a PGD column
that is not a number > 0 where a ratio needs it, and a bound row whose PGD column is not the value
of its objective's own PGD row (else lowering both value and PGD would pass as sound).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from bounds.certificates import CERTIFIED_KINDS
from bounds.registry import CASCADES, PLUGIN_SHA256, REGISTRY, TAYLOR_NETS
from models import InputError

from .schema import KINDS, NAMED, ROLES

SOUND_RTOL = 1e-6  # a certified value below pgd·(1 − 1e-6) is a violation, never a rounding question
# one per sample of a network cell, repeated on each of its certify rows and on its pgd_margin row
PER_SAMPLE = ["label", "correct", "margin", "pgd_margin", "pgd_broken"]
CERTIFY_NEEDS = [*PER_SAMPLE, "certified_prop1", "certified_pairwise"]
# certify a network by verifying its margins directly, with no δ_features (NaN value); the cascade's
# verdict is naive's or CROWN's, so it has none either; taylor_net bounds each margin's change itself
DIRECT = ("crown", "alpha_crown", *CASCADES, *TAYLOR_NETS)
RATIO_RTOL = 1e-12  # a stored ratio is value/pgd as rows.py divided it; the slack is for other writers


def ratio(value, pgd):
    """value/pgd where pgd is a finite nonzero number, else NaN (scalars or arrays)."""
    value, pgd = np.asarray(value, dtype=float), np.asarray(pgd, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((pgd != 0) & np.isfinite(pgd), value / pgd, np.nan)


def below_pgd(value, pgd):
    """Whether a value lies below its (positive) PGD value beyond rounding: the soundness rule."""
    value, pgd = np.asarray(value, dtype=float), np.asarray(pgd, dtype=float)
    return (pgd > 0) & (value < pgd * (1 - SOUND_RTOL))


def refuted(certified_pairwise, certified_prop1, broken):
    """A network row's image certified (by either test) at ε that PGD breaks within ε."""
    return (np.asarray(certified_pairwise, dtype=bool) | np.asarray(certified_prop1, dtype=bool)) \
        & np.asarray(broken, dtype=bool)


def violation(certified, sound, finding):
    """A certified bound without a finding that is not sound: a bug of this suite, never tuned away."""
    certified, sound, finding = (np.asarray(a, dtype=bool) for a in (certified, sound, finding))
    return certified & ~sound & ~finding


def _registry(df: pd.DataFrame, roles: tuple[str, ...], field, default) -> pd.Series:
    """``field`` of each row's bound in the registry where its role names one, else ``default``."""
    return pd.Series([field(REGISTRY[n]) if r in roles and n in REGISTRY else default
                      for r, n in zip(df["role"], df["bound"], strict=True)], index=df.index, dtype=object)


def flag(df: pd.DataFrame, col: str) -> np.ndarray:
    """A nullable boolean column as bools, missing (or absent) as False."""
    if col not in df.columns:
        return np.zeros(len(df), dtype=bool)
    return df[col].astype("boolean").fillna(False).to_numpy(dtype=bool)


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """Per row, recomputed: ``certified``, ``finding`` and ``objective`` from the registry (False,
    False, None for rows that are not a registered bound's), ``broken`` (pgd_margin ≤ 0),
    ``ratio``, ``sound`` and ``violation``; indexed as ``df``."""
    certified = _registry(df, NAMED, lambda b: b.certified, False).astype(bool)
    finding = _registry(df, NAMED, lambda b: bool(b.finding), False).astype(bool)
    objective = _registry(df, ("bound",), lambda b: b.objective, None)
    value, pgd = df["value"].to_numpy(dtype=float), df["pgd"].to_numpy(dtype=float)
    pgd_margin = (df["pgd_margin"].to_numpy(dtype=float) if "pgd_margin" in df.columns
                  else np.full(len(df), np.nan))
    broken = pgd_margin <= 0
    network = (df["role"] == "certify").to_numpy()
    sound = ~below_pgd(value, pgd) & ~(network & refuted(flag(df, "certified_pairwise"),
                                                         flag(df, "certified_prop1"), broken))
    return pd.DataFrame({"certified": certified, "finding": finding, "objective": objective,
                         "broken": broken, "ratio": ratio(value, pgd), "sound": sound,
                         "violation": violation(certified, sound, finding)}, index=df.index)


def describe(r: pd.Series) -> str:
    """A row by its key, with its value and PGD value, for an error line."""
    return (f"{r['role']} row {r['bound']} in {r['sweep']} cell {r['cell_id']}, sample {r['sample']}, "
            f"head {r['head']}, block {r['block']}: value {r['value']:.6g}, pgd {r['pgd']:.6g}")


def _refuse(df: pd.DataFrame, mask, where: Path | str, what: str, show: str | None = None) -> None:
    """One InputError naming how many rows ``mask`` holds and the first (with its column ``show``)."""
    mask = np.asarray(mask, dtype=bool)
    if mask.any():
        r = df[mask].iloc[0]
        extra = f", stored {show} {r[show]}" if show else ""
        raise InputError(f"{where}: {int(mask.sum())} row(s) {what} (first: {describe(r)}{extra})")


def _same(a: pd.Series, b: pd.Series) -> np.ndarray:
    """Elementwise equality of two columns, NaN equal to NaN (booleans and numbers)."""
    a, b = a.to_numpy(), b.to_numpy()
    both = pd.isna(a) & pd.isna(b)
    with np.errstate(invalid="ignore"):
        return both | (~pd.isna(a) & ~pd.isna(b) & (a == b))


def check(df: pd.DataFrame, where: Path | str) -> None:
    """Refuses (InputError) a table whose stored columns contradict :func:`derive`, or that holds a
    number no judgement can be made of; see the module docstring. ``df`` is typed as
    :func:`bench.core.store.load` types it."""
    role, value = df["role"], df["value"]
    _refuse(df, ~role.isin(ROLES), where, f"of an unknown role (known: {', '.join(ROLES)})")
    named = role.isin(NAMED)
    _check_plugins(df, named, where)
    _refuse(df, named & ~df["bound"].isin(list(REGISTRY)), where,
            "name a bound that bounds/registry.py does not hold")
    d = derive(df)
    _refuse(df, (role == "certify") & ~d["certified"], where,
            "certify a network with a bound the registry does not call certified")
    judged = role.isin(["bound", "pgd", "certify", "accuracy"])
    # a certify row's value is δ_features; a direct verification of the margins (whole-network CROWN)
    # has none, and is judged by its verdict against PGD's (derive: refuted) alone
    direct = (role == "certify") & df["bound"].isin(DIRECT)
    _refuse(df, judged & value.isna() & ~direct, where, "hold a NaN value")
    needs_finite = role.isin(["pgd", "accuracy"]) | (d["certified"] & ~d["finding"])
    _refuse(df, judged & np.isinf(value) & (needs_finite | (value < 0)), where,
            "hold an infinite value where a number is needed (a certified bound without a finding, "
            "a PGD value or an accuracy)")
    _check_pgd(df, d, where)
    if "pgd_margin" in df.columns:
        _check_network(df, d, where)
    _check_flags(df, d, where)


def _check_plugins(df: pd.DataFrame, named: pd.Series, where: Path | str) -> None:
    """Rows of a plugin bound (docs/guide/plugins.md) carry the sha256 of its file, and are judged only
    with that bound registered (``--plugin FILE.py``): its file says whether it certifies. A
    built-in bound's rows carry none."""
    sha = (df["plugin_sha256"].fillna("").astype(str) if "plugin_sha256" in df.columns
           else pd.Series("", index=df.index))
    of_plugin = named & (sha != "")
    unknown = of_plugin & ~df["bound"].isin(list(REGISTRY))
    if unknown.any():
        names = ", ".join(sorted(set(df.loc[unknown, "bound"])))
        raise InputError(f"{where}: {int(unknown.sum())} row(s) of plugin bound(s) {names}, which no "
                         f"plugin given here defines: name the plugin file with --plugin FILE.py")
    plugin = df["bound"].isin(list(PLUGIN_SHA256))
    _refuse(df, named & plugin & (sha == ""), where, "of a plugin bound without its plugin_sha256")
    _refuse(df, of_plugin & ~plugin, where, "of a built-in bound with a plugin_sha256", show="plugin_sha256")


def _check_pgd(df: pd.DataFrame, d: pd.DataFrame, where: Path | str) -> None:
    """The PGD column of bound and certify rows: a number > 0 where a ratio needs it, and on bound
    rows the value of the objective's own PGD row."""
    role, pgd = df["role"], df["pgd"]
    with_objective = (role == "bound") & d["objective"].notna()
    _refuse(df, with_objective & ~(np.isfinite(pgd) & (pgd > 0)), where,
            "need a PGD value > 0 for their ratio and hold none (NaN, inf or ≤ 0)")
    _refuse(df, (role == "bound") & d["objective"].isna() & pgd.notna(), where,
            "hold a PGD value for a bound without a PGD objective")
    _refuse(df, (role == "certify") & ~(np.isfinite(pgd) & (pgd >= 0)), where,
            "hold no attained feature change (pgd must be a number ≥ 0)")
    at = ["sweep", "cell_id", "sample", "head"]
    runs = df.loc[role == "pgd", [*at, "bound", "value"]].rename(columns={"value": "_pgd_row"})
    runs = runs.assign(bound=runs["bound"].str.removeprefix("pgd_")).rename(columns={"bound": "_obj"})
    twice = pd.Series(False, index=df.index)
    twice[runs.index] = runs.duplicated([*at, "_obj"])
    _refuse(df, twice, where, "of PGD repeat another's objective, cell, sample and head")
    bound = df.loc[with_objective, at].assign(_obj=d.loc[with_objective, "objective"])
    joined = bound.merge(runs, on=[*at, "_obj"], how="left")
    joined.index = bound.index
    mask = pd.Series(False, index=df.index)
    mask[bound.index] = ~_same(joined["_pgd_row"], df.loc[bound.index, "pgd"])
    _refuse(df, mask, where, "hold a PGD value that is not their objective's pgd_<objective> row's "
                             "(or that row is missing)")


def _check_network(df: pd.DataFrame, d: pd.DataFrame, where: Path | str) -> None:
    """Certify rows hold their per-sample columns; those agree between a sample's rows and with the
    margin attack: pgd_broken is pgd_margin ≤ 0, and the pgd_margin row's value is the margin drop."""
    role = df["role"]
    certify = role == "certify"
    missing = np.zeros(len(df), dtype=bool)
    for col in CERTIFY_NEEDS:
        missing |= certify.to_numpy() & (df[col].isna().to_numpy() if col in df.columns else True)
    _refuse(df, missing, where, f"of role certify lack one of {', '.join(CERTIFY_NEEDS)}")
    stored = df["pgd_broken"] if "pgd_broken" in df.columns else pd.Series(pd.NA, index=df.index)
    has = df["pgd_margin"].notna() & stored.notna()
    _refuse(df, has & (stored.astype("boolean").fillna(False).to_numpy(dtype=bool) != d["broken"]),
            where, "whose stored pgd_broken contradicts pgd_margin ≤ 0")
    attack = (role == "pgd") & (df["bound"] == "pgd_margin") & df["pgd_margin"].notna()
    if "margin" in df.columns:
        drop = df["margin"] - df["pgd_margin"]
        _refuse(df, attack & ~np.isclose(df["value"], drop, rtol=RATIO_RTOL, atol=0), where,
                "of the margin attack whose value is not margin − pgd_margin")
    _check_accuracy(df, attack, where)
    sample = df[certify | attack]
    cols = [c for c in PER_SAMPLE if c in df.columns]
    if len(sample) and cols:
        n = sample.groupby(["sweep", "cell_id", "sample"])[cols].transform("nunique", dropna=False)
        mask = pd.Series(False, index=df.index)
        mask[sample.index] = (n > 1).any(axis=1)
        _refuse(df, mask, where, f"whose per-sample columns ({', '.join(cols)}) differ from another "
                                 "row of the same image")


def _check_accuracy(df: pd.DataFrame, attack: pd.Series, where: Path | str) -> None:
    """A network cell's accuracy rows against its images: clean = the share classified correctly,
    pgd_margin = the share PGD did not break (pgd_margin > 0), over the cell's margin-attack rows."""
    per = df[attack].assign(_robust=df["pgd_margin"] > 0, _correct=df["correct"].astype("boolean"))
    shares = per.groupby(["sweep", "cell_id"])[["_correct", "_robust"]].mean().astype(float)
    shares.columns = ["clean", "pgd_margin"]
    acc = df[(df["role"] == "accuracy") & df["cell_id"].isin(shares.index.get_level_values("cell_id"))]
    if acc.empty:
        return
    expected = [shares.loc[(r.sweep, r.cell_id), r.bound] if (r.sweep, r.cell_id) in shares.index
                and r.bound in shares.columns else np.nan for r in acc.itertuples()]
    mask = pd.Series(False, index=df.index)
    mask[acc.index] = ~np.isclose(acc["value"].to_numpy(dtype=float), expected, rtol=RATIO_RTOL, atol=0)
    _refuse(df, mask, where, "of accuracy that is not the share of the cell's images (correct, or not "
                             "broken by PGD)")


def _check_flags(df: pd.DataFrame, d: pd.DataFrame, where: Path | str) -> None:
    """The stored flags, certificate and ratio against :func:`derive`."""
    role, cert = df["role"], df["certificate"]
    # the columns that excuse a value below PGD first: a flipped one is named as what it is
    for col in ("certified", "finding"):
        wrong = df[col].to_numpy(dtype=bool) != d[col].to_numpy(dtype=bool)
        _refuse(df, wrong, where, f"whose stored {col} contradicts bounds/registry.py", show=col)
    _refuse(df, d["certified"] & ~cert.isin(CERTIFIED_KINDS), where,
            f"of a certified bound with a certificate not in {', '.join(CERTIFIED_KINDS)}",
            show="certificate")
    _refuse(df, (role == "bound") & ~d["certified"] & (cert != "estimate"), where,
            "of an estimate whose certificate is not 'estimate'", show="certificate")
    _refuse(df, (role == "pgd") & (cert != "attained"), where, "of PGD whose certificate is not 'attained'",
            show="certificate")
    _refuse(df, ~cert.isin(KINDS), where, f"with a certificate not in {', '.join(KINDS)}", show="certificate")
    for col, source in (("violation", "value, pgd and the registry"), ("sound", "value and pgd")):
        wrong = df[col].to_numpy(dtype=bool) != d[col].to_numpy(dtype=bool)
        _refuse(df, wrong, where, f"whose stored {col} contradicts {source}", show=col)
    stored = df["ratio"].to_numpy(dtype=float)
    close = np.isclose(stored, d["ratio"], rtol=RATIO_RTOL, atol=0, equal_nan=True)
    _refuse(df, ~close, where, "whose stored ratio is not value/pgd", show="ratio")
