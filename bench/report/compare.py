"""``python -m bench compare BASE NEW``: tightness and soundness against a baseline, asv-style.

Per (cell, bound, sample, head, block) it compares the ratio value/PGD of every certified bound
(larger is worse: the bound got looser) and the value of every PGD lower bound (smaller is worse:
the attack got weaker). Markers: ``x`` soundness violation, ``+`` worse beyond the tolerance,
``-`` better beyond it, ``~`` an estimate moved (not judged), ``c`` the certificate got weaker
(e.g. exact → probabilistic; shown, not failed), ``!`` missing from NEW, ``s`` missing because
the bound's optional package is absent from this environment (CROWN without auto_LiRPA: the run
left those rows out with a note; shown, not failed), ``p`` a plugin bound's row whose plugin file
changed (another sha256, docs/guide/plugins.md): never compared with the old file's rows. Exit 1 on
any ``x`` or ``+``, and on ``!`` or ``p`` unless ``--allow-missing``: a run that lost cells must not
pass as one that kept its tightness.
Either table empty, not a results table, or no row in common (whatever ``--allow-missing`` says):
exit 2.

Nothing judged is read from the stored flags: ratio, soundness, violation and whether a bound is
certified are recomputed by :func:`bench.core.gate.derive` from value, pgd, the network columns and the
bound's name in the registry; a table whose stored flags contradict that recomputation (or that
holds NaN or infinite values, or a key twice) is refused by the loader (bench/core/gate.py says why
refused, not judged). Network ``certify`` rows are judged for soundness (``x``: an image certified
by a finding-free bound that PGD breaks, or a δ_features below the attained feature change), for
presence (``!``) and by their verdicts: an image certified in BASE (by either test) that NEW no
longer certifies is ``+``, one NEW certifies anew ``-``. A verdict is what the row measured, as a
bound's value is; a NEW that claims one it did not earn is refused where PGD breaks the image.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from bounds.registry import unavailable
from models import InputError

from ..core.gate import derive, flag
from ..core.schema import KEY, PLUGIN
from ..core.schema import KINDS as STRENGTH  # strongest first
from ..core.store import atomic_write, load

MARKERS = {"x": "soundness violation", "+": "worse", "-": "better", "~": "estimate moved",
           "c": "certificate weaker", "!": "missing in NEW",
           "s": "skipped here (the bound's optional package is not installed)",
           "p": "plugin file changed (another sha256): not compared"}
# a network certify row's verdicts, one per test (docs/bounds.md §5): judged image by image
VERDICTS = ("certified_pairwise", "certified_prop1")


def absent_here() -> set[str]:
    """The bounds whose optional package this environment lacks (CROWN without auto_LiRPA): a run here
    leaves their rows out with a note, so their absence from NEW is ``s``, not ``!``. Judged from
    this environment, never from the tables, by the registry's one question
    (bounds.registry.unavailable), which the runner asks too."""
    return unavailable()


def _judge(r, tol: float, skipped: set[str]) -> tuple[str, float]:
    """(marker, factor) for one joined row; factor = new/base of the compared quantity."""
    if r.present == "left_only":
        if r.plugin_changed:
            return "p", math.nan
        return ("s" if r.role != "pgd" and r.bound in skipped else "!"), math.nan
    if r.violation_new:
        return "x", r.ratio_new / r.ratio_base if r.ratio_base else math.nan
    if r.role == "certify":  # an image's verdict, per test: lost is worse, gained better
        lost = any(getattr(r, f"{c}_base") and not getattr(r, f"{c}_new") for c in VERDICTS)
        gained = any(getattr(r, f"{c}_new") and not getattr(r, f"{c}_base") for c in VERDICTS)
        return ("+" if lost else "-" if gained else " "), math.nan
    is_pgd = r.role == "pgd"
    base, new = (r.value_base, r.value_new) if is_pgd else (r.ratio_base, r.ratio_new)
    if not (isinstance(base, float) and math.isfinite(base) and base > 0 and math.isfinite(new)):
        return " ", math.nan
    factor = new / base
    worse = factor < 1 - tol if is_pgd else factor > 1 + tol
    better = factor > 1 + tol if is_pgd else factor < 1 - tol
    weaker = (r.certificate_base in STRENGTH and r.certificate_new in STRENGTH
              and STRENGTH.index(r.certificate_new) > STRENGTH.index(r.certificate_base))
    if not (worse or better):
        return ("c" if weaker else " "), factor
    if not (is_pgd or r.certified_new):
        return "~", factor
    return ("+" if worse else "-"), factor


def compare(base: pd.DataFrame, new: pd.DataFrame, tol: float = 0.02) -> pd.DataFrame:
    """One row per compared key with its marker and factor; ``certified``, ``ratio`` and
    ``violation`` are :func:`bench.core.gate.derive`'s, whatever the tables store."""
    if not (0 <= tol < 1):
        raise InputError(f"--tol must be in [0, 1), got {tol}")
    cols = [*KEY, PLUGIN, "certified", "certificate", "value", "pgd", "ratio", "violation", *VERDICTS]

    def keep(df: pd.DataFrame) -> pd.DataFrame:
        df = df[df["role"].isin(["bound", "pgd", "certify"])]
        d = derive(df)
        sha = df[PLUGIN].fillna("").astype(str) if PLUGIN in df.columns else ""
        return df.assign(certified=d["certified"], ratio=d["ratio"], violation=d["violation"],
                         **{PLUGIN: sha}, **{c: flag(df, c) for c in VERDICTS})[cols]

    kb, kn = keep(base), keep(new)
    # a plugin's rows join only rows of the same file (its sha256): a changed file is never equal
    j = kb.merge(kn, on=[*KEY, PLUGIN], how="outer", suffixes=("_base", "_new"), indicator="present")
    in_new = pd.MultiIndex.from_frame(kn[KEY].astype(str))
    j["plugin_changed"] = ((j["present"] == "left_only") & (j[PLUGIN] != "")
                           & pd.MultiIndex.from_frame(j[KEY].astype(str)).isin(in_new))
    if not (j["present"] == "both").any():
        # nothing compared: an empty table and OK would pass any NEW, --allow-missing or not
        raise InputError(f"BASE and NEW have no row in common (of {len(kb)} and {len(kn)} bound, pgd "
                         f"and certify rows, none shares its cell, bound, sample, head and block): "
                         f"nothing to compare; are they runs of the same profile?")
    j = j[j["present"] != "right_only"].copy()
    j["violation_new"] = j["violation_new"].fillna(False).astype(bool)
    skipped = absent_here()
    judged = [_judge(r, tol, skipped) for r in j.itertuples()]
    j["marker"] = [m for m, _ in judged]
    j["factor"] = [f for _, f in judged]
    return j.drop(columns=["present", "plugin_changed"]).reset_index(drop=True)


def failures(j: pd.DataFrame, allow_missing: bool = False) -> list[str]:
    """The markers in ``j`` that fail a comparison."""
    fail = ["x", "+"] if allow_missing else ["x", "+", "!", "p"]
    return [m for m in fail if (j["marker"] == m).any()]


def summary(j: pd.DataFrame, tol: float, base_name: str, new_name: str,
            allow_missing: bool = False) -> str:
    counts = j["marker"].value_counts()
    lines = [f"# compare: {new_name} against {base_name} (tol {tol:g})", "",
             f"{len(j)} rows compared. " + ", ".join(
                 f"`{m}` {MARKERS[m]}: {int(counts.get(m, 0))}" for m in MARKERS), ""]
    flagged = j[j["marker"].isin(["x", "+", "!", "p", "c"])]
    if len(flagged):
        lines += ["| | bound | cell | sample | head | base | new | factor | certificate |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in flagged.head(40).itertuples():
            if r.role == "certify":  # verdicts, not numbers
                b, n = (", ".join(c.removeprefix("certified_") for c in VERDICTS if getattr(r, f"{c}_{s}"))
                        or "not certified" for s in ("base", "new"))
            else:
                is_pgd = r.role == "pgd"
                b, n = (f"{v:.4g}" for v in ((r.value_base, r.value_new) if is_pgd else
                                             (r.ratio_base, r.ratio_new)))
            lines.append(f"| {r.marker} | {r.bound} | `{r.cell_id}` | {r.sample} | {r.head} | "
                         f"{b} | {n} | {r.factor:.4f} | {r.certificate_new} |")
        if len(flagged) > 40:
            lines.append(f"| … | {len(flagged) - 40} more | | | | | | | |")
        lines.append("")
    per = j[j["factor"].notna()].groupby("bound")["factor"].agg(["median", "min", "max"])
    lines += ["| bound | median factor | min | max |", "|---|---|---|---|"]
    lines += [f"| {b} | {r['median']:.4f} | {r['min']:.4f} | {r['max']:.4f} |" for b, r in per.iterrows()]
    bad = failures(j, allow_missing)
    lines += ["", f"FAILED: {', '.join(MARKERS[m] for m in bad)}" if bad else "OK"]
    return "\n".join(lines) + "\n"


def run(base_path: str, new_path: str, tol: float, allow_missing: bool = False) -> int:
    base, new = load(base_path), load(new_path)
    j = compare(base, new, tol)
    text = summary(j, tol, str(base_path), str(new_path), allow_missing)
    if Path(new_path).is_dir():
        atomic_write(Path(new_path) / "compare.md", text)  # first: a failed write prints nothing
    print(text, end="")
    return 1 if failures(j, allow_missing) else 0
