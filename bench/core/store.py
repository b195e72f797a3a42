"""The result store: one CSV per finished cell (written atomically, so a killed run loses nothing
finished), gathered into one long table ``results.csv``; a lock per run directory; and the one
loader that every reader (report, compare, baseline) goes through, which refuses anything that is
not a complete, numeric results table of this schema version.

Tables that know when they are whole: ``results.csv`` is written once, when a run (or a resume of
it) has every cell, and :func:`consolidate` then seals it: its row count and the sha256 of its bytes
go into the ``table`` entry of ``run.json`` beside it (``baseline --update`` writes the same seal
beside the baseline). A reader compares the table with its seal before believing a row, so a copy
cut short (at a row's end or in the middle of one) is refused as cut, saying how many rows are
intact, and resuming the run gathers the intact cells again. A table without a seal (a bare CSV, a
run written before seals) is checked by its shape only: a last line cut mid-row is refused, one cut
exactly at a row's end cannot be told from a shorter table (bench/core/whole.py)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from models import InputError
from models.io import write_atomic

from . import gate, whole
from .schema import (
    BOOLEAN,
    KEY,
    NUMERIC,
    OPTIONAL_BOOLEAN,
    OPTIONAL_NUMERIC,
    REQUIRED,
    SCHEMA_VERSION,
)
from .whole import MANIFEST

TABLE = "results.csv"
LOCK = ".lock"
# what this suite writes for a missing number; pandas' longer default list would read a stray
# "n/a" or "NULL" in a value column as a number and let it pass
# low_memory=False: types are inferred over the whole file, not per chunk, so a mostly empty text
# column (model_version) does not come back as mixed types with a DtypeWarning
# plugin_sha256 as text: a digest of digits and one e would read as a float
READ = {"keep_default_na": False, "na_values": ["", "nan", "NaN"], "low_memory": False,
        # hashes as text: 16 hex digits that are all digits (or one "e" among them) would read as numbers
        "dtype": {"plugin_sha256": str, "network_sha256": str, "data_sha256": str, "imported_sha256": str,
                  "imported_data": str, "git_commit": str}}


def cell_file(out: Path, sweep: str, cell_id: str) -> Path:
    digest = hashlib.sha1(f"{sweep}\n{cell_id}".encode()).hexdigest()[:16]
    return out / "cells" / f"{digest}.csv"


def writable_dir(path: Path, what: str) -> None:
    """Creates ``path`` as a directory, or says in one InputError why it cannot be one."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{what} {path} is a file, not a directory")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise InputError(f"{what} {path}: {parent} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise InputError(f"{what} {path} is not a writable directory ({e.strerror or e})") from None


def atomic_write(path: Path, text: str | bytes) -> None:
    """:func:`models.io.write_atomic` (a reader sees the old file or the new, never a part; the usual
    mode), its directory created first, its failure one InputError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def load_cell(path: Path) -> pd.DataFrame:
    """One finished cell's rows, read as :func:`gather` reads them."""
    return pd.read_csv(path, **READ)


def write_cell(out: Path, sweep: str, cell_id: str, rows: pd.DataFrame) -> None:
    atomic_write(cell_file(out, sweep, cell_id), rows.to_csv(index=False))


def write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


# a run directory's folder of partial results: cells' batches kept as they finish (bench/core/partial.py)
PARTIAL = "partial"


def remove_stale_temps(out: Path) -> int:
    """Removes the temp files of killed runs (the caller holds the lock, so none is live)."""
    stale = [*out.glob(".*.tmp"), *(out / "cells").glob(".*.tmp"), *(out / PARTIAL).glob("*/.*.tmp")]
    for f in stale:
        f.unlink(missing_ok=True)
    return len(stale)


@contextlib.contextmanager
def lock(out: Path) -> Iterator[None]:
    """An exclusive lock on a run directory for the life of a run.

    flock is released by the kernel when its holder dies, so a killed run never leaves a stale
    lock behind; the holder's pid is written into the file so that the refusal can name it.
    """
    path = out / LOCK
    try:
        f = open(path, "a+")
    except OSError as e:
        raise InputError(f"cannot lock {out}: {e.strerror or e}") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise InputError(f"{out} is in use by another run ({holder}); wait for it to finish "
                             f"or use another --out") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def gather(out: Path) -> pd.DataFrame:
    """Every finished cell of a run directory as one table, in run order."""
    files = sorted((out / "cells").glob("*.csv"))
    if not files:
        raise InputError(f"{out}: no finished cells")
    df = pd.concat([load_cell(f) for f in files], ignore_index=True)
    return df.sort_values(["cell_index", "role", "bound", "sample", "head", "block"], kind="stable",
                          ignore_index=True)


def consolidate(out: Path) -> Path:
    """Writes ``out/results.csv`` from the finished cells, then seals it."""
    df = gather(out)
    atomic_write(out / TABLE, df.to_csv(index=False))
    seal(out, len(df))
    return out / TABLE


def seal(out: Path, rows: int, manifest: dict | None = None) -> None:
    """Records ``rows`` and the sha256 of the bytes of ``out/results.csv`` (read back: what a reader
    will hash) in ``out/run.json``: ``manifest`` if given, else the run.json already there. A crash
    between the table and its seal leaves them disagreeing: refused by readers, never believed."""
    if manifest is None:
        path = out / MANIFEST
        manifest = json.loads(path.read_text()) if path.exists() else {}
    write_json(out / MANIFEST, manifest | {whole.SEAL: whole.record((out / TABLE).read_bytes(), rows)})


def sealed(out: Path) -> dict:
    """The seal in ``out/run.json`` as a manifest entry, for a resumed run that rewrites its manifest
    while the table it sealed is still there; {} where there is none or it is malformed (the run's
    :func:`consolidate` writes a new one)."""
    try:
        s = whole.seal_of(out / TABLE)
    except InputError:
        return {}
    return {whole.SEAL: s} if s is not None else {}


def _as_bool(df: pd.DataFrame, col: str, where: Path, nullable: bool = False) -> None:
    """Booleans from their text; ``nullable`` keeps empty cells as <NA> (pandas' boolean dtype)."""
    if df[col].dtype == bool:
        return
    text = df[col].astype(str).str.strip().str.lower()
    missing = df[col].isna() if nullable else pd.Series(False, index=df.index)
    ok = text.isin(["true", "false", "1", "0"]) | missing
    if not ok.all():
        raise InputError(f"{where}: column {col!r} holds a non-boolean value "
                         f"{df[col][~ok].iloc[0]!r}")
    if nullable:
        df[col] = pd.array([pd.NA if m else t in ("true", "1") for m, t in zip(missing, text, strict=True)],
                           dtype="boolean")
    else:
        df[col] = text.isin(["true", "1"])


def _as_number(df: pd.DataFrame, col: str, where: Path) -> None:
    num = pd.to_numeric(df[col], errors="coerce")
    bad = num.isna() & df[col].notna()
    if bad.any():
        raise InputError(f"{where}: column {col!r} holds a non-numeric value {df[col][bad].iloc[0]!r}")
    df[col] = num


def load(path: str | Path) -> pd.DataFrame:
    """A results table from a CSV file, or from a run directory (its results.csv, else its cells).

    Refuses (InputError) a results.csv that the seal in its run.json says is cut or changed, a table
    whose last row is cut (:mod:`bench.core.whole`), a table with no rows, missing columns, values that
    are not numbers or booleans, another schema version, a key (:data:`KEY`) held by more than one
    row, or whatever :func:`bench.core.gate.check` refuses (stored flags that contradict the numbers,
    NaN and infinite values): every reader judges only tables whose stored columns say what their
    numbers say.
    """
    path = Path(path)
    table = path / TABLE if path.is_dir() else path
    raw, seal_ = None, None
    try:
        if path.is_dir() and not table.exists():
            df = gather(path)  # every cell file is written whole (atomic_write)
        else:
            raw = table.read_bytes()
            seal_ = whole.seal_of(table)
            if seal_ is not None:
                whole.check_seal(table, raw, seal_)
            df = pd.read_csv(io.BytesIO(raw), **READ)
    except FileNotFoundError:
        raise InputError(f"no results at {path}") from None
    except pd.errors.EmptyDataError:
        raise InputError(f"{path}: empty file, not a results table") from None
    except (OSError, UnicodeDecodeError, pd.errors.ParserError) as e:
        if raw is not None and seal_ is None:
            whole.check_shape(table, raw)  # a row cut inside its quotes: say cut, not unparsable
        raise InputError(f"cannot read results {path}: {e}") from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise InputError(f"{path}: not a results table of this suite (missing columns {missing})")
    if raw is not None and seal_ is None:
        whole.check_shape(table, raw)  # a sealed table matched its seal: whole by its bytes
    if df.empty:
        raise InputError(f"{path}: the results table has no rows")
    versions = set(pd.to_numeric(df["schema_version"], errors="coerce").tolist())
    if versions != {SCHEMA_VERSION}:
        raise InputError(f"{path}: results schema version {sorted(map(str, versions))}, this suite "
                         f"reads {SCHEMA_VERSION}; rerun the profile with --fresh")
    for col in NUMERIC + [c for c in OPTIONAL_NUMERIC if c in df.columns]:
        _as_number(df, col, path)
    for col in BOOLEAN:
        _as_bool(df, col, path)
    for col in OPTIONAL_BOOLEAN:
        if col in df.columns:
            _as_bool(df, col, path, nullable=True)
    repeated = df.duplicated(KEY)
    if repeated.any():
        raise InputError(f"{path}: {int(repeated.sum())} row(s) repeat the key of an earlier row "
                         f"(first: {gate.describe(df[repeated].iloc[0])})")
    gate.check(df, path)
    return df
