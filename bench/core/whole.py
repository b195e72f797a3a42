"""Whether a results table is whole: the seal a run writes into its run.json beside results.csv (the
row count and sha256 of the file's bytes), checked before the table is believed; and, for a table
without one (a bare CSV, a run written before seals), the shape of its end: a copy cut short ends
mid-row, which pandas would read as a row whose last columns are empty.

Nothing here suggests ``--fresh``: a cut table is a copy gone wrong, while the cells it was gathered
from (one atomic file each) are intact, and resuming the run gathers them again."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path

from models import InputError

MANIFEST = "run.json"
SEAL = "table"  # run.json's key: {"rows": N, "sha256": HEX}


def record(raw: bytes, rows: int) -> dict:
    """The seal of a table's bytes holding ``rows`` data rows."""
    return {"rows": int(rows), "sha256": hashlib.sha256(raw).hexdigest()}


def seal_of(table: Path) -> dict | None:
    """The seal run.json keeps beside ``table`` (a results.csv), or None where there is none."""
    manifest = table.parent / MANIFEST
    if table.name != "results.csv" or not manifest.is_file():
        return None
    try:
        seal = json.loads(manifest.read_text()).get(SEAL)
    except (OSError, ValueError, AttributeError) as e:
        # the run.json of a copy cut short as well: nothing left to tell a whole table by
        raise InputError(f"{manifest} is unreadable ({e}), so whether {table} is whole cannot be "
                         f"told; copy the run directory again") from None
    if seal is not None and not (isinstance(seal, dict) and isinstance(seal.get("rows"), int)
                                 and isinstance(seal.get("sha256"), str)):
        raise InputError(f"{manifest}: its {SEAL!r} entry {seal!r} is not a table seal "
                         f"(rows and sha256); copy the run directory again")
    return seal


def _scan(raw: bytes) -> tuple[int, str | None]:
    """(whole rows before the first defect, that defect in words or None). A row is whole when it
    has the header's fields and a newline after it; more fields than the header pandas refuses."""
    text = raw.decode("utf-8", errors="replace")
    records = [r for r in csv.reader(io.StringIO(text, newline="")) if r]
    if not records:
        return 0, None
    n, last = len(records[0]), len(records) - 1
    for i, r in enumerate(records[1:], 1):
        if len(r) < n:
            where = "its last row" if i == last else f"row {i}"
            return i - 1, f"{where} has {len(r)} of the header's {n} fields"
    if not text.endswith(("\n", "\r")):
        return max(last - 1, 0), "its last line ends without a newline"
    return last, None


def _advice(table: Path) -> str:
    """How to get the whole table back: the run's cells, where they are beside it, else the source."""
    cells = table.parent / "cells"
    kept = len(list(cells.glob("*.csv"))) if table.name == "results.csv" and cells.is_dir() else 0
    if not kept:
        return "copy the whole table again from where it came from"
    try:
        profile = json.loads((table.parent / MANIFEST).read_text())["options"]["profile"]
    except (OSError, ValueError, KeyError, TypeError):
        profile = "PROFILE"
    return (f"its {kept} finished cells are kept in {cells}: resume the run that wrote it (python -m "
            f"bench run with profile {profile} and --out {table.parent}, as it was started) to gather "
            f"them again into a whole table")


def check_seal(table: Path, raw: bytes, seal: dict) -> None:
    """Refuses ``raw`` unless it is the table ``seal`` describes, saying how much of it is intact."""
    if record(raw, seal["rows"]) == seal:
        return
    intact, defect = _scan(raw)
    if defect is not None or intact < seal["rows"]:
        raise InputError(f"{table} is cut: {intact} of the {seal['rows']} rows its {MANIFEST} records "
                         f"are intact; {_advice(table)}")
    raise InputError(f"{table} does not match its {MANIFEST} ({intact} rows, {MANIFEST} records "
                     f"{seal['rows']} and another sha256): it changed after the run wrote it; "
                     f"{_advice(table)}")


def check_shape(table: Path, raw: bytes) -> None:
    """For a table without a seal: refuses one whose end shows it cut, or a row short of fields."""
    intact, defect = _scan(raw)
    if defect is None:
        return
    cut = defect.startswith("its last")
    raise InputError(f"{table} is {'cut' if cut else 'not a whole table'}: {defect} ({intact} whole "
                     f"rows before it); {_advice(table)}")
