"""``python -m bench baseline --update``: rewrites results/baseline and its report on purpose, never
as a side effect of a run.

The committed ``reports/`` is the report of the committed baseline and of nothing else, so both
change together, here. A table that is not a complete results table, that the loader refuses
(bench/core/gate.py: stored flags that contradict the numbers, NaN or infinite values, repeated keys),
or that holds a soundness violation (recomputed by :func:`bench.core.gate.derive`, never read from the
stored ``violation``), never replaces the baseline. The table is copied with its run's ``run.json``
and sealed there (bench/core/store.py), so that a cut copy of the baseline is refused as one.
``BASELINE`` and ``REPORTS`` are read at each call, so a test moves them with monkeypatch and never
writes the committed ones.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from models import InputError

from ..core.env import ROOT
from ..core.gate import derive
from ..core.store import MANIFEST, TABLE, atomic_write, load, seal
from ..report.render import build
from ..sweep.profiles import load_profile
from ..sweep.runner import run_profile

BASELINE = ROOT / "results" / "baseline"
REPORTS = ROOT / "reports"


def update(source: str | None = None) -> Path:
    """Copies a finished run's table (``source``), or runs the quick profile afresh, into the
    baseline, then rebuilds ``reports/`` from it."""
    with tempfile.TemporaryDirectory() as tmp:
        if source is None:
            table, _ = run_profile(load_profile("quick"), Path(tmp) / "run", "cpu")
        else:
            table = Path(source) / TABLE if Path(source).is_dir() else Path(source)
        df = load(table)
        bad = df[derive(df)["violation"]]
        if len(bad):
            r = bad.iloc[0]
            raise InputError(f"{table}: {len(bad)} soundness violation(s) (first: {r['bound']} in "
                             f"{r['cell_id']}); a baseline must hold none")
        atomic_write(BASELINE / TABLE, table.read_bytes())
        # sealed as a run's table is, with its run's manifest where it has one (a sealed results.csv:
        # load() read it just now), so that a baseline cut short is refused as cut
        beside = table.parent / MANIFEST
        manifest = json.loads(beside.read_text()) if table.name == TABLE and beside.is_file() else {}
        seal(BASELINE, len(df), manifest)
    build(str(BASELINE / TABLE), str(REPORTS))
    return BASELINE / TABLE
