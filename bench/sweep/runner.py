"""``python -m bench run``: every cell of a profile, each written as soon as it is finished.

A run directory knows what it is: ``run.json`` holds the results schema version, the suite version
and commit, the options, the full list of (sweep, cell id), a fingerprint of every zoo model its cells
read and, once every cell is finished and gathered into results.csv, that table's seal (its rows and
sha256, bench/core/store.py). Resuming into a directory whose manifest differs is refused, naming
``--fresh``; a lock keeps a second concurrent run out; temp files left by a killed run are removed.
A certified bound below its PGD value is a soundness violation: it is printed at once and counted at
the end, never dropped.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from tqdm import tqdm

from bounds import crown
from bounds.registry import unavailable
from models import InputError

from ..core import plugins
from ..core.env import device_name, git_state, resolve_device, resolve_dtype, versions
from ..core.partial import DiskStore, code_salt
from ..core.store import (
    MANIFEST,
    PARTIAL,
    SCHEMA_VERSION,
    cell_file,
    consolidate,
    load_cell,
    lock,
    remove_stale_temps,
    sealed,
    writable_dir,
    write_cell,
    write_json,
)
from .cases import ReadsZooModel
from .memory import check_memory
from .profiles import Profile
from .tasks import CROWN_TASKS, CertifyMemo, check_model_cells, run_cell

if TYPE_CHECKING:
    from .cases import Cell
    from .distributed import Cluster

# what a run directory may hold besides run.json and cells/ (results, compare, report, the partial
# results of cells cut short, the lock, the temp files of a killed write): a directory holding
# anything else is somebody's, not a run's
RUN_FILES = {MANIFEST, "cells", "results.csv", "compare.md", "report", PARTIAL, ".lock"}


class Interrupted(Exception):
    """Ctrl-C during a run, after the finished cells were kept, the temp files removed and the lock
    released: the CLI says how to resume."""

    def __init__(self, out: Path, kept: int, total: int):
        super().__init__(f"{kept} of {total} cells kept in {out}")
        self.out, self.kept, self.total = out, kept, total


def check_run_dir(out: Path) -> None:
    """Refuses an existing directory that is not a run directory (empty, or holding run.json or
    cells/): --fresh would delete in it, and its results.csv or report/ would be overwritten."""
    if not out.is_dir() or (out / MANIFEST).exists() or (out / "cells").is_dir():
        return
    theirs = sorted(p.name for p in out.iterdir()
                    if p.name not in RUN_FILES and not (p.name.startswith(".") and p.name.endswith(".tmp")))
    if theirs:
        shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        raise InputError(f"--out {out} is not a run directory: it holds {shown} and no {MANIFEST}; "
                         f"use a new or empty directory")


def _manifest(profile: Profile, run: dict, overrides: dict | None) -> dict:
    commit, _ = git_state()
    options = {"profile": profile.name, "run": run, "overrides": overrides or {}}
    if profile.plugins:  # a changed plugin file is another run: its resume is refused (absent: none)
        options["plugins"] = plugins.describe(profile.plugins)
    return {"schema_version": SCHEMA_VERSION, "suite_version": versions()["suite"],
            "git_commit": commit, "options": options,
            "cells": [[s, c.id] for s, c in profile.cells()], "models": zoo_fingerprints(profile)}


def zoo_fingerprints(profile: Profile) -> dict[str, str]:
    """The fingerprint of every zoo model the profile's cells read (:meth:`ReadsZooModel.model_fingerprint`),
    by name. A file not there is left out (the profile refuses such a cell when it loads)."""
    cells = {c.model: c for _, c in profile.cells() if isinstance(c, ReadsZooModel) and c.model}
    return {name: c.model_fingerprint() for name, c in sorted(cells.items()) if c.model_path.is_file()}


# what each part of a manifest is called in a refusal
PARTS = {"schema_version": "results schema version", "options": "options", "cells": "cells"}


def _changed(have: dict, want: dict, where: str) -> dict[str, str] | None:
    """The models both manifests name whose zoo files differ, each with both fingerprints' heads; None
    where ``have`` predates the fingerprints (no ``models``). Refuses a ``models`` that is not a map of
    names to fingerprints (``where`` names the directory in the message)."""
    if "models" not in have:
        return None
    theirs = have["models"]
    if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()):
        raise InputError(f"{where}: the models of its {MANIFEST} are unreadable; rerun with --fresh, "
                         f"or adopt from another run")
    return {m: f"{m} (fingerprint {theirs[m][:12]} there, {h[:12]} in zoo/ now)"
            for m, h in want["models"].items() if m in theirs and theirs[m] != h}


def _predates(where: str) -> str:
    return (f"note: {where}: its {MANIFEST} predates the zoo files' fingerprints, so its finished cells "
            f"are taken as made with zoo/'s files as they are now")


def _other(have: dict, want: dict, keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` in which the manifest ``have`` differs from ``want`` (as JSON reads
    it back), named as :data:`PARTS` names it; None where they agree."""
    return next((PARTS[k] for k in keys if have.get(k) != json.loads(json.dumps(want[k]))), None)


def _check_resume(out: Path, want: dict) -> None:
    """Refuses a directory that holds another run: other schema, options, cells or zoo files, or
    another commit's. A manifest from before the zoo files' fingerprints is resumed with a note."""
    path = out / MANIFEST
    if not path.exists():
        if (out / "cells").exists() and any((out / "cells").glob("*.csv")):
            raise InputError(f"{out} holds finished cells but no {MANIFEST}; rerun with --fresh "
                             f"to discard them, or use another --out")
        return
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is unreadable ({e}); rerun with --fresh to start over") from None
    what = _other(have, want, ("schema_version", "options", "cells"))
    if what is not None:
        raise InputError(f"{out} holds a run with other {what}; rerun with --fresh to discard "
                         f"it, or use another --out")
    changed = _changed(have, want, str(out))
    if changed:
        raise InputError(f"{out} holds a run made with another zoo file of {next(iter(changed.values()))}; "
                         f"rerun with --fresh to discard it, or use another --out")
    # a cell's id names its parameters, not the code that computed it: resuming at another commit
    # would store cells of two commits under the one the manifest names
    was, now = have.get("git_commit"), want["git_commit"]
    if "unknown" not in (was, now) and was != now:
        raise InputError(f"{out} holds a run made at commit {str(was)[:12]}, and this checkout is at "
                         f"{now[:12]}: resuming would mix cells of two commits; rerun with --fresh, "
                         f"or resume from a checkout at {str(was)[:12]}")
    if changed is None and want["models"]:
        print(_predates(str(out)), file=sys.stderr)


def _discard(out: Path) -> None:
    for stale in (out / "cells", out / MANIFEST, out / "results.csv", out / "compare.md",
                  out / "report", out / PARTIAL):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)


def check_adopt(source: Path, want: dict) -> dict[str, str]:
    """Refuses, in one line, a run directory whose cells :func:`adopt` cannot take: none there, its
    ``run.json`` unreadable, or its schema or options (the profile's name, ``[run]``, overrides,
    plugins) not this run's. Its commit may differ: that is what adopting is for. Returns the models
    whose zoo files differ from this run's, each with both fingerprints (their cells are not to be
    taken); a manifest from before the fingerprints is taken with a note."""
    path = source / MANIFEST
    if not path.is_file():
        raise InputError(f"--adopt {source}: not a run directory (no {MANIFEST})")
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--adopt {source}: {MANIFEST} is unreadable ({e})") from None
    what = _other(have, want, ("schema_version", "options"))
    if what is not None:
        raise InputError(f"--adopt {source}: a run with other {what} than this one's")
    changed = _changed(have, want, f"--adopt {source}")
    if changed is None and want["models"]:
        print(_predates(f"--adopt {source}"), file=sys.stderr)
    return changed or {}


def adopt(out: Path, source: Path, cells: list[tuple[str, Cell]],
          skip: frozenset[str] = frozenset()) -> dict[str, int]:
    """Copies into ``out`` the finished cells of ``source`` that are cells of this run and not yet
    finished here, but those of the models in ``skip`` (made with other zoo files), their rows as they
    are but for ``cell_index`` (the cell's place in this run, which orders the table; a run of some of
    the profile's cells numbers them its own way): each row keeps the commit it was computed at
    (``git_commit``), which the report names. Returns the cells taken per commit."""
    taken: dict[str, int] = {}
    for index, (sweep, cell) in enumerate(cells):
        theirs, ours = cell_file(source, sweep, cell.id), cell_file(out, sweep, cell.id)
        if theirs.is_file() and not ours.exists() and getattr(cell, "model", "") not in skip:
            rows = load_cell(theirs)
            write_cell(out, sweep, cell.id, rows.assign(cell_index=index))
            commit = str(rows["git_commit"].iloc[0])
            taken[commit] = taken.get(commit, 0) + 1
    return taken


def run_profile(profile: Profile, out: Path, device_arg: str = "auto", dtype_arg: str | None = None,
                overrides: dict | None = None, fresh: bool = False, workers: int | None = None,
                scheduler: str | None = None, sweeps: frozenset[str] | None = None,
                adopt_from: Path | None = None) -> tuple[Path, int]:
    """Runs (or resumes) every cell into ``out``, or only the cells of ``sweeps`` (the run stays the
    whole profile's: its manifest, the cells' indices, and a later run that continues it); returns
    (results table, violations found). ``adopt_from``: a run directory of the same profile and
    options, maybe at another commit, whose finished cells this run takes first (:func:`adopt`).

    Cells run in this process, or as Dask tasks on ``workers`` local processes or the cluster at
    ``scheduler`` (bench/sweep/distributed.py); either way this process writes every file.
    Everything that can be checked is checked before anything is written.
    """
    check_sweeps(profile, sweeps)
    dask = workers is not None or scheduler is not None
    device = None if dask else resolve_device(device_arg)  # Dask workers resolve their own
    run = dict(profile.run)
    if dtype_arg is not None:
        run["dtype"] = dtype_arg
    dtype = resolve_dtype(run["dtype"])
    chosen = _selected(profile, sweeps)  # what this run computes: its needs alone are checked
    if scheduler is None:  # a --scheduler's workers are other machines, whose memory is not ours to see
        check_memory(chosen, run["pgd_restarts"], device)
    want = _manifest(profile, run, overrides)
    changed: dict[str, str] = {}  # with --adopt, the models whose zoo files differ from its run's
    if adopt_from is not None:
        if adopt_from.resolve() == out.resolve():  # with --fresh it would discard what it adopts
            raise InputError(f"--adopt {adopt_from} is --out itself; adopt from another run directory")
        changed = check_adopt(adopt_from, want)
    check_model_cells([c for _, c in chosen])  # a model its task cannot certify, before hours of others
    if any(c.task == "pretrained" for _, c in chosen):
        from models.pretrained import require  # the study's extras, before anything is written

        require()
    if any(c.task in CROWN_TASKS for _, c in chosen) and "crown" in unavailable():
        print(f"note: the CROWN rows are left out: {crown.INSTALL}", file=sys.stderr)
    # the cluster first: a missing Dask or an unreachable scheduler then leaves nothing written; the
    # plugins' bounds join the registry here (their workers register the same text themselves)
    with _shielded_cleanup() as shield, plugins.using(profile.plugins):
        with _cluster(workers, scheduler) if dask else contextlib.nullcontext() as cluster:
            writable_dir(out, "--out")
            check_run_dir(out)
            with lock(out):
                if fresh:
                    _discard(out)
                remove_stale_temps(out)
                _check_resume(out, want)
                if adopt_from is not None:
                    write_json(out / MANIFEST, want | sealed(out))  # a run of this commit, taking cells
                    for commit, k in adopt(out, adopt_from, profile.cells(), frozenset(changed)).items():
                        print(f"adopted {k} finished cell(s) of commit {commit[:12]} from {adopt_from}",
                              file=sys.stderr)
                    for what in changed.values():  # their cells are computed here, with zoo/'s file
                        print(f"note: --adopt {adopt_from}: not taking the cells of {what}", file=sys.stderr)
                try:
                    table = run_cells(profile, out, run, want, device, dtype, cluster, device_arg, sweeps)
                except KeyboardInterrupt:
                    shield()
                    remove_stale_temps(out)  # a write cut short; we hold the lock, so none is live
                    cells = profile.cells()
                    kept = sum(cell_file(out, s, c.id).exists() for s, c in cells)
                    raise Interrupted(out, kept, len(cells)) from None
    return table, int(pd.read_csv(table, usecols=["violation"])["violation"].sum())


@contextlib.contextmanager
def _shielded_cleanup():
    """Yields ``shield``: called at the first Ctrl-C, it ignores further ones until the cleanup (temp
    files, the lock, the cluster's shutdown) has run to its end, when the handler is restored. A
    second Ctrl-C would otherwise cut that cleanup with a traceback and leave the lock or a temp file
    behind; it is short."""
    saved = []

    def shield() -> None:
        try:
            saved.append(signal.signal(signal.SIGINT, signal.SIG_IGN))
        except ValueError:  # not the main thread (a library caller): nothing to protect from here
            pass

    try:
        yield shield
    finally:
        if saved:
            signal.signal(signal.SIGINT, saved[0])


def parse_sweeps(text: str | None) -> frozenset[str] | None:
    """``run --sweeps``'s names (comma-separated), or None for every sweep."""
    if text is None:
        return None
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise InputError("--sweeps names no sweep")
    return names


def check_sweeps(profile: Profile, sweeps: frozenset[str] | None) -> None:
    """Refuses a ``--sweeps`` name the profile does not hold, naming the ones it does."""
    unknown = sorted(sweeps - set(profile.sweeps)) if sweeps is not None else []
    if unknown:
        raise InputError(f"--sweeps: profile {profile.name} has no sweep {unknown[0]!r} "
                         f"(its sweeps: {', '.join(profile.sweeps)})")


def _selected(profile: Profile, sweeps: frozenset[str] | None) -> list[tuple[str, Cell]]:
    return [(s, c) for s, c in profile.cells() if sweeps is None or s in sweeps]


def _cluster(workers: int | None, scheduler: str | None):
    from .distributed import cluster  # Dask is optional: imported only when asked for

    return cluster(workers, scheduler)


def run_cells(profile: Profile, out: Path, run: dict, manifest: dict, device: torch.device | None,
               dtype: torch.dtype, cluster: Cluster | None = None, device_arg: str = "auto",
               sweeps: frozenset[str] | None = None) -> Path:
    _, dirty = git_state()
    where = device_name(device) if device is not None else cluster.where
    # on Dask, device, device_name and torch_version are each worker's, set per cell below
    meta = {"schema_version": SCHEMA_VERSION, "profile": profile.name,
            "suite_version": manifest["suite_version"], "git_commit": manifest["git_commit"],
            "git_dirty": dirty, "torch_version": torch.__version__,
            "device": device.type if device is not None else "", "device_name": where,
            "dtype": run["dtype"], "run_seed": run["seed"],
            "pgd_steps": run["pgd_steps"], "pgd_restarts": run["pgd_restarts"],
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    # a resume keeps the seal of the results.csv still there, until consolidate() seals the new one
    write_json(out / MANIFEST, manifest | sealed(out))
    cells = profile.cells()
    # the cells this run was asked for, each with its index in the whole profile (the bar counts these)
    chosen = [(i, s, c) for i, (s, c) in enumerate(cells) if sweeps is None or s in sweeps]
    todo = [(i, s, c) for i, s, c in chosen if not cell_file(out, s, c.id).exists()]
    bar = tqdm(total=len(chosen), initial=len(chosen) - len(todo), desc=f"{profile.name} on {where}",
               unit="cell", file=sys.stderr, mininterval=5)
    if cluster is None:
        # this run's: each certify cell shares the norms of the one before it, and keeps CROWN's
        # bounds batch by batch in the run directory, where a resumed cell finds them
        memo = CertifyMemo(DiskStore(out / PARTIAL, code_salt()))
        results = ((i, s, c, run_cell(c, run, device, dtype, memo), {}) for i, s, c in todo)
    else:  # in the order they finish; consolidate() restores the run order
        results = cluster.rows(todo, run, device_arg, torch.get_num_threads(), manifest["git_commit"],
                               manifest["models"],
                               profile.plugins, str((out / PARTIAL).resolve()))
    try:
        for i, sweep, cell, rows, env in results:
            df = pd.DataFrame(rows)
            head = {"cell_index": i, "sweep": sweep, "cell_id": cell.id} | cell.params()
            df = pd.concat([pd.DataFrame([head] * len(df)), df, pd.DataFrame([meta | env] * len(df))],
                           axis=1)
            for r in df[df["violation"]].itertuples():
                # a certify row is also refuted when PGD breaks a sample it certifies (bench/sweep/rows.py)
                broken = r.role == "certify" and bool(r.certified_pairwise) and bool(r.pgd_broken)
                what = (f"{r.bound} certifies a sample PGD breaks" if broken
                        else f"{r.bound} = {r.value:.6g} < PGD {r.pgd:.6g}")
                tqdm.write(f"SOUNDNESS VIOLATION: {what} in {sweep} {cell.id} sample {r.sample} "
                           f"head {r.head}", file=sys.stderr)
            write_cell(out, sweep, cell.id, df)
            bar.update(1)
    finally:
        results.close()  # cancels the Dask tasks still queued, while the cluster is still open
        bar.close()  # ends the bar's line, so an error printed after it stands on its own line
    if all(cell_file(out, s, c.id).exists() for s, c in cells):  # nothing left to resume
        shutil.rmtree(out / PARTIAL, ignore_errors=True)
    return consolidate(out)
