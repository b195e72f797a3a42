"""The result store: one CSV per finished cell (written atomically, so a killed run loses nothing
finished), gathered into one long table ``results.csv``."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pandas as pd

from models import InputError

TABLE = "results.csv"
KEY = ["sweep", "cell_id", "bound", "sample", "head", "block"]
REQUIRED = [*KEY, "certified", "value", "pgd", "ratio", "sound", "violation", "seconds"]


def cell_file(out: Path, sweep: str, cell_id: str) -> Path:
    digest = hashlib.sha1(f"{sweep}\n{cell_id}".encode()).hexdigest()[:16]
    return out / "cells" / f"{digest}.csv"


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_cell(out: Path, sweep: str, cell_id: str, rows: pd.DataFrame) -> None:
    _atomic_write(cell_file(out, sweep, cell_id), rows.to_csv(index=False))


def write_json(path: Path, obj: dict) -> None:
    _atomic_write(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def gather(out: Path) -> pd.DataFrame:
    """Every finished cell of a run directory as one table, in run order."""
    files = sorted((out / "cells").glob("*.csv"))
    if not files:
        raise InputError(f"{out}: no finished cells")
    df = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    return df.sort_values(["cell_index", "bound", "sample", "head", "block"], kind="stable",
                          ignore_index=True)


def consolidate(out: Path) -> Path:
    _atomic_write(out / TABLE, gather(out).to_csv(index=False))
    return out / TABLE


def load(path: str | Path) -> pd.DataFrame:
    """A results table from a CSV file, or from a run directory (its results.csv, else its cells)."""
    path = Path(path)
    try:
        if path.is_dir():
            df = pd.read_csv(path / TABLE) if (path / TABLE).exists() else gather(path)
        else:
            df = pd.read_csv(path)
    except FileNotFoundError:
        raise InputError(f"no results at {path}") from None
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise InputError(f"cannot read results {path}: {e}") from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise InputError(f"{path}: not a results table (missing columns {missing})")
    return df
