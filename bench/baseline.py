"""``python -m bench baseline --update``: rewrites results/baseline on purpose, never as a side
effect of a run."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .env import ROOT
from .runner import run_profile
from .store import TABLE, load
from .sweeps import load_profile

BASELINE = ROOT / "results" / "baseline"


def update(source: str | None = None) -> Path:
    """Copies a finished run's table (``source``), or runs the quick profile afresh, into the baseline."""
    with tempfile.TemporaryDirectory() as tmp:
        if source is None:
            table, _ = run_profile(load_profile("quick"), Path(tmp) / "run", "cpu")
        else:
            table = Path(source) / TABLE if Path(source).is_dir() else Path(source)
        load(table)  # refuses anything that is not a results table
        BASELINE.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(table, BASELINE / TABLE)
    return BASELINE / TABLE
