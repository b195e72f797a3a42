"""What ``baseline --update`` refuses unless the user accepts it by name, and the provenance entry it
appends to results/baseline/CHANGES.md (issue #23).

The new table is judged against the baseline it replaces by :func:`bench.report.compare.compare`
(its markers, nothing recomputed here): rows of the old baseline that NEW lacks (``!``, and ``s``
too: a baseline that loses CROWN's rows because auto_LiRPA is absent here has lost them all the
same), a certified bound whose value/PGD rose beyond the tolerance (``+``), a PGD value that fell
beyond it (``+`` on a pgd row: an attack that got weaker makes every bound look tighter). A
published statement newly broken (a bound with a finding below PGD, where BASE had it sound or
lacked the row) is counted from :func:`bench.core.gate.derive`. A soundness violation is not a
class here: ``baseline --update`` refuses it before any comparison, and no name accepts it.

The entry depends on the data alone (the rows' commit and ``date``, never the clock), so the same
update writes the same text wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from models import InputError

from ..core.gate import NAMED, derive
from ..core.store import KEY
from .compare import compare

# the names --accept takes, each with what it lets through
ACCEPT = {"removed": "row(s) of the baseline missing from the new table (`!`/`s`)",
          "looser": "certified bound row(s) whose value/PGD rose beyond the tolerance (`+`)",
          "weaker": "PGD row(s) whose attained value fell beyond the tolerance (`+`)",
          "finding": "new finding row(s): a published statement PGD breaks where it did not before",
          "incomparable": "the previous baseline cannot be compared with the new table"}
NEVER = {"violation": "a soundness violation is never accepted into the baseline; fix the bound"}
JUDGED = ("bound", "pgd", "certify")  # the roles compare joins
HEADER = """# Changes of the committed baseline

Appended by `python -m bench baseline --update` (bench/cli/baseline.py), one entry per update, never
edited by hand: the commit and date of the new rows (their `git_commit` and `date` columns), how the
new table compared with the one it replaced (`python -m bench compare`'s markers: better `-`, worse
`+`, removed `!`/`s`, added: keys new to the table) and what the update accepted by name
(`--accept`, `--allow-dirty`).
"""


def parse_accept(values: list[str] | None) -> set[str]:
    """The names given to ``--accept`` (comma-separated, the option repeatable); an unknown name is
    one InputError, before any work."""
    names = {n.strip() for v in values or [] for n in v.split(",") if n.strip()}
    if values and not names:
        raise InputError(f"--accept needs names, one or more of {', '.join(ACCEPT)}")
    for n in sorted(names):
        if n in NEVER:
            raise InputError(f"--accept {n}: {NEVER[n]}")
        if n not in ACCEPT:
            raise InputError(f"--accept: unknown name {n!r} (known: {', '.join(ACCEPT)})")
    return names


@dataclass
class Changes:
    """The new table against the old baseline: the counts of the CHANGES.md entry and, per class of
    :data:`ACCEPT`, how many rows fall in it (classes with none left out)."""

    rows: int
    compared: int = 0
    better: int = 0
    worse: int = 0
    removed: int = 0
    added: int = 0
    classes: dict[str, int] = field(default_factory=dict)
    why: str = ""  # why the tables could not be compared (class incomparable), or "first" (no baseline)
    skipped: int = 0  # of ``removed``: the bound's optional package is absent here (``s``)
    findings: list[str] = field(default_factory=list)  # the newly broken bounds, for the message


def _findings(df: pd.DataFrame) -> pd.DataFrame:
    """The keys of rows where a published statement with a finding is below PGD (not sound)."""
    d = derive(df)
    return df.loc[df["role"].isin(NAMED) & d["finding"] & ~d["sound"], KEY]


def _judged_keys(df: pd.DataFrame) -> pd.DataFrame:
    return df.loc[df["role"].isin(JUDGED), KEY]


def judge(base: pd.DataFrame, new: pd.DataFrame, tol: float) -> Changes:
    """``new`` against ``base`` (both as :func:`bench.core.store.load` returns them)."""
    try:
        j = compare(base, new, tol)
    except InputError as e:  # no row in common: tol was checked by the caller
        return Changes(len(new), classes={"incomparable": 1}, why=str(e))
    m = j["marker"]
    gone = m.isin(["!", "s", "p"])  # p: a plugin's rows of another file are gone as well
    pgd = j["role"] == "pgd"
    old = _findings(base).assign(_old=True)
    fresh = _findings(new).merge(old, on=KEY, how="left")
    fresh = fresh[fresh["_old"].isna()]
    added = _judged_keys(new).merge(_judged_keys(base).assign(_in=True), on=KEY, how="left")["_in"].isna()
    counts = {"removed": int(gone.sum()), "looser": int(((m == "+") & ~pgd).sum()),
              "weaker": int(((m == "+") & pgd).sum()), "finding": len(fresh)}
    return Changes(len(new), compared=int((~gone).sum()), better=int((m == "-").sum()),
                   worse=int((m == "+").sum()), removed=counts["removed"], added=int(added.sum()),
                   classes={k: v for k, v in counts.items() if v}, skipped=int((m == "s").sum()),
                   findings=sorted(set(fresh["bound"])))


def dirty_rows(df: pd.DataFrame) -> tuple[int, int]:
    """(rows computed from a dirty tree or not known clean, rows without a commit): the provenance
    of a baseline must name a commit that holds the code the rows were computed with."""
    flag = df["git_dirty"].astype(str).str.strip().str.lower() if "git_dirty" in df else None
    dirty = len(df) if flag is None else int((~flag.isin(["false", "0"])).sum())
    commit = df["git_commit"].astype(str).str.strip() if "git_commit" in df else None
    missing = len(df) if commit is None else \
        int((df["git_commit"].isna() | commit.isin(["", "unknown", "nan"])).sum())
    return dirty, missing


def _dirty(dirty: tuple[int, int]) -> str:
    rows_dirty, no_commit = dirty
    parts = [f"{rows_dirty} row(s) from a dirty tree (git_dirty not False)"] if rows_dirty else []
    return ", ".join(parts + ([f"{no_commit} row(s) without a git_commit"] if no_commit else []))


def _describe(c: Changes, name: str) -> str:
    n = c.classes[name]
    if name == "removed" and c.skipped:
        return f"removed {n} ({c.skipped} of them because the bound's optional package is absent here)"
    if name == "finding":
        return f"finding {n} ({', '.join(c.findings)})"
    if name == "incomparable":
        return f"incomparable ({c.why})"
    return f"{name} {n}"


def refuse(c: Changes, accepted: set[str], dirty: tuple[int, int], allow_dirty: bool,
           against: str, tol: float) -> None:
    """One InputError naming every class not accepted, with its count and the options that would
    accept them all; returns when nothing is left to refuse."""
    left = [k for k in c.classes if k not in accepted]
    parts = [_describe(c, k) for k in left]
    if any(dirty) and not allow_dirty:
        parts.append(_dirty(dirty))
    if not parts:
        return
    flags = ([f"--accept {','.join(c.classes)}"] if c.classes else []) + \
        (["--allow-dirty"] if any(dirty) else [])
    compared = "" if c.why else f"{c.compared} rows compared (tol {tol:g}), "
    raise InputError(f"baseline --update refused against {against}: {compared}{'; '.join(parts)}; "
                     f"see `python -m bench compare`, and accept by name with {' '.join(flags)}")


def _commit(df: pd.DataFrame) -> str:
    vals = sorted({str(v).strip() for v in df.get("git_commit", pd.Series(dtype=str)).dropna()} - {""})
    return "/".join(vals) if vals else "unknown"


def _date(df: pd.DataFrame) -> str:
    """The day of the latest row (the rows' own ``date``, ISO 8601), not the clock's."""
    dates = pd.to_datetime(df.get("date", pd.Series(dtype=str)), errors="coerce", utc=True).dropna()
    return dates.max().strftime("%Y-%m-%d") if len(dates) else "date unknown"


def entry(df: pd.DataFrame, c: Changes, accepted: set[str], dirty: tuple[int, int], tol: float) -> str:
    """The CHANGES.md entry of an update that went through."""
    lines = [f"## {_date(df)}: rows of {_commit(df)}", ""]
    if c.why == "first":
        lines.append(f"- rows {c.rows}; the first baseline recorded here, compared with none")
    elif c.why:
        lines.append(f"- rows {c.rows}; not compared with the previous baseline: {c.why}")
    else:
        lines.append(f"- rows {c.rows}, compared {c.compared} (tol {tol:g}): better {c.better}, "
                     f"worse {c.worse}, removed {c.removed}, added {c.added}")
    took = [k if k == "incomparable" else _describe(c, k) for k in c.classes if k in accepted]
    if any(dirty):
        took.append(f"{_dirty(dirty)} (--allow-dirty)")
    lines.append(f"- accepted: {'; '.join(took) if took else 'nothing'}")
    return "\n".join(lines) + "\n"


def appended(previous: str | None, text: str) -> str:
    """CHANGES.md with ``text`` appended (its header first, when there is no file yet)."""
    head = previous if previous is not None else HEADER
    return head.rstrip("\n") + "\n\n" + text
