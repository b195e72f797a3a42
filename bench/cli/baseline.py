"""``python -m bench baseline --update``: rewrites results/baseline and its report on purpose, never
as a side effect of a run.

The committed ``reports/`` is the report of the committed baseline and of nothing else, so both
change together, here. A table that is not a complete results table, that the loader refuses
(bench/core/gate.py: stored flags that contradict the numbers, NaN or infinite values, repeated keys),
or that holds a soundness violation (recomputed by :func:`bench.core.gate.derive`, never read from the
stored ``violation``), never replaces the baseline. The table is copied with its run's ``run.json``
and sealed there (bench/core/store.py), so that a cut copy of the baseline is refused as one.

Nor does a table replace the baseline unnoticed (issue #23): it is first compared with the baseline
it replaces (:mod:`bench.report.changes`, through ``compare``), and rows that disappear, a certified
bound that got looser, a PGD attack that got weaker, a published statement newly broken, or rows
computed from a dirty tree (or with no commit) are refused with one ``error:`` line holding the
counts, unless accepted by name (``--accept removed,looser,…``, ``--allow-dirty``). What went
through is appended to ``CHANGES.md`` beside the table, committed with it. With no previous baseline
the entry is written without a comparison.

Two profiles have a committed table: ``quick`` (``results/baseline``, its report ``reports/``; what
``tox -e bench`` compares with) and ``paper-cpu`` (``results/paper``, ``reports/paper``: LoFAST's
tables on Fashion-MNIST, hours on a CPU, so run in the background and copied with ``--from``).
``BASELINE``, ``REPORTS``, ``PAPER`` and ``PAPER_REPORTS`` are read at each call (CHANGES.md lives beside
the table), so a test moves them with monkeypatch and never writes the committed ones.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from models import InputError

from ..core.env import ROOT
from ..core.gate import derive
from ..core.store import MANIFEST, TABLE, atomic_write, load, seal
from ..report import changes
from ..report.render import build, shown
from ..sweep.profiles import load_profile
from ..sweep.runner import run_profile

BASELINE = ROOT / "results" / "baseline"
REPORTS = ROOT / "reports"
PAPER = ROOT / "results" / "paper"
PAPER_REPORTS = REPORTS / "paper"  # a report inside reports/, carried over when that is rebuilt
CHANGES = "CHANGES.md"
PROFILES = ("quick", "paper-cpu")


def places(profile: str) -> tuple[Path, Path]:
    """Where a profile's committed table and its report live."""
    if profile not in PROFILES:
        raise InputError(f"--profile: only {' and '.join(PROFILES)} have a committed table, not "
                         f"{profile!r}")
    return (BASELINE, REPORTS) if profile == "quick" else (PAPER, PAPER_REPORTS)


def _judge(df, tol: float, home: Path) -> changes.Changes:
    """The new table against the one it replaces; the first update has none to compare with."""
    previous = home / TABLE
    if not previous.is_file():
        return changes.Changes(len(df), why="first")
    try:
        base = load(previous)
    except InputError as e:  # an older schema, a cut copy: nothing this suite can compare with
        # the committed CHANGES.md names the path as the repository does, not as this machine does
        why = str(e).replace(str(previous), shown(str(previous)))
        return changes.Changes(len(df), classes={"incomparable": 1}, why=f"it is refused: {why}")
    return changes.judge(base, df, tol)


def update(source: str | None = None, accept: list[str] | None = None, allow_dirty: bool = False,
           tol: float = 0.02, profile: str = "quick") -> Path:
    """Copies a finished run's table (``source``), or runs ``profile`` afresh, into that profile's
    committed table (:func:`places`) once :mod:`bench.report.changes` lets it through (``accept``: the
    names of what it may let through, ``allow_dirty``: rows from a dirty tree), appends its
    CHANGES.md entry, then rebuilds its report from it. Rows of the other committed profile are
    refused (they would replace one committed table with the other's)."""
    home, reports = places(profile)
    accepted = changes.parse_accept(accept)  # before a run of the profile, not after
    if not 0 <= tol < 1:
        raise InputError(f"--tol must be in [0, 1), got {tol}")
    with tempfile.TemporaryDirectory() as tmp:
        if source is None:
            table, _ = run_profile(load_profile(profile), Path(tmp) / "run", "cpu")
        else:
            table = Path(source) / TABLE if Path(source).is_dir() else Path(source)
        df = load(table)
        # rows of the other committed profile would replace one committed table with the other's
        other = set(PROFILES) - {profile}
        theirs = sorted({str(v) for v in df["profile"].dropna()} & other) if "profile" in df else []
        if theirs:
            raise InputError(f"{table}: its rows are of profile {theirs[0]}, whose table is not "
                             f"{shown(str(home))}; pass --profile {theirs[0]}")
        bad = df[derive(df)["violation"]]
        if len(bad):
            r = bad.iloc[0]
            raise InputError(f"{table}: {len(bad)} soundness violation(s) (first: {r['bound']} in "
                             f"{r['cell_id']}); a baseline must hold none")
        judged, dirty = _judge(df, tol, home), changes.dirty_rows(df)
        changes.refuse(judged, accepted, dirty, allow_dirty, shown(str(home / TABLE)), tol)
        home.mkdir(parents=True, exist_ok=True)
        log = home / CHANGES
        text = changes.appended(log.read_text() if log.is_file() else None,
                                changes.entry(df, judged, accepted, dirty, tol))
        atomic_write(home / TABLE, table.read_bytes())
        # sealed as a run's table is, with its run's manifest where it has one (a sealed results.csv:
        # load() read it just now), so that a baseline cut short is refused as cut
        beside = table.parent / MANIFEST
        manifest = json.loads(beside.read_text()) if table.name == TABLE and beside.is_file() else {}
        seal(home, len(df), manifest)
        atomic_write(log, text)
    build(str(home / TABLE), str(reports))
    return home / TABLE
