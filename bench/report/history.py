"""``python -m bench history``: the committed baseline over the commits that changed it, asv-style.

Every version of results/baseline/results.csv that git holds (``git log -- PATH`` in the checkout,
each read once by ``git show``) goes through the one loader (:func:`bench.core.store.load`); a version
it refuses (an older schema, a bound the registry no longer holds) is skipped with a one-line note
naming the commit, never a crash. Per version: the median and the worst (largest) value/PGD of each
certified bound (role ``bound``, ratio and certified as :func:`bench.core.gate.derive` recomputes
them), and each model's certified accuracy per method, counted as the report counts it
(:func:`bench.report.studies.trained_study.counts`), pooled over the model's ε. The figure
(:mod:`bench.report.history_figure`) and the Markdown table go under ``results/history`` (git-ignored)
by default; nothing is cached, and the output depends on the versions alone.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from models import InputError

from ..core.env import ROOT
from ..core.gate import derive
from ..core.store import atomic_write, load, writable_dir
from .history_figure import SHORT, Version, png
from .panels import Skip, registry_order
from .studies.trained_study import counts, order
from .tables import fmt, to_markdown

PATH = "results/baseline/results.csv"


def _git(*args: str) -> subprocess.CompletedProcess:
    """git in the checkout, ``ROOT`` (read at each call, so a test points it at a throwaway
    repository with monkeypatch)."""
    if shutil.which("git") is None:
        raise InputError("history reads the baseline's versions from git, and no git is on PATH")
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise InputError(f"git {args[0]} failed in {ROOT}: {e}") from None


def _said(p: subprocess.CompletedProcess) -> str:
    text = p.stderr.decode(errors="replace").strip()
    return text.splitlines()[0] if text else f"exit {p.returncode}"


def commits() -> list[tuple[str, str]]:
    """(commit, date) of every commit that changed the baseline, oldest first."""
    p = _git("rev-parse", "--is-inside-work-tree")
    if p.returncode != 0 or p.stdout.strip() != b"true":
        raise InputError(f"{ROOT} is not a git checkout ({_said(p)}); history reads the "
                         f"baseline's versions from git")
    p = _git("log", "--format=%H %cd", "--date=short", "--", PATH)
    if p.returncode != 0 and _git("rev-parse", "--verify", "-q", "HEAD").returncode == 0:
        raise InputError(f"git log -- {PATH} failed in {ROOT}: {_said(p)}")
    # a repository without a commit yet fails the log: no commit changed the baseline either
    lines = p.stdout.decode().splitlines() if p.returncode == 0 else []
    found = [tuple(line.split(" ", 1)) for line in lines if line.strip()]
    if not found:
        raise InputError(f"no commit in {ROOT} changed {PATH}: no history to show")
    return [(c, d) for c, d in reversed(found)]


def summarise(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
    """(per certified bound: median and worst value/PGD; per (model, method): certified accuracy)."""
    d = derive(df)
    sel = (df["role"] == "bound") & d["certified"] & d["ratio"].notna()
    ratio = pd.DataFrame({"bound": df.loc[sel, "bound"], "ratio": d.loc[sel, "ratio"].astype(float)})
    g = ratio.groupby("bound")["ratio"]
    tight = pd.DataFrame({"median": g.median(), "worst": g.max()})
    try:
        c = counts(df)
    except Skip:  # no certify rows in this version
        return tight, pd.Series(dtype=float)
    pooled = c.groupby(["model", "bound"])[["k", "n"]].sum()
    return tight, (pooled["k"] / pooled["n"]).rename("accuracy")


def read(found: list[tuple[str, str]]) -> tuple[list[Version], list[str]]:
    """Each commit's version, loaded and summarised; the notes of those skipped."""
    versions, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for commit, date in found:
            short = commit[:SHORT]
            p = _git("show", f"{commit}:./{PATH}")
            if p.returncode != 0:  # the commit removed the file
                notes.append(f"{short}: no {PATH} at this commit ({_said(p)})")
                continue
            path = Path(tmp) / f"{short}.csv"  # not results.csv: no run.json is looked for beside it
            path.write_bytes(p.stdout)
            try:
                df = load(path)
            except InputError as e:
                notes.append(f"{short}: skipped, the loader refuses it: "
                             f"{str(e).replace(str(path), PATH)}")
                continue
            finally:
                path.unlink()
            versions.append(Version(commit, date, len(df), *summarise(df)))
    return versions, notes


def _ratio(v: float) -> str:
    return "inf" if v == np.inf else fmt(v)


def tables(versions: list[Version]) -> dict[str, pd.DataFrame]:
    """The Markdown tables: one column per commit (short hash), oldest first; – where absent."""
    cols = [v.commit[:SHORT] for v in versions]
    out = {}
    names = registry_order({b for v in versions for b in v.tight.index})
    for what in ("median", "worst"):
        out[what] = pd.DataFrame([{"bound": f"`{b}`", **{c: _ratio(v.tight[what].get(b, np.nan))
                                                         for c, v in zip(cols, versions, strict=True)}}
                                  for b in names])
    pairs = {k for v in versions for k in v.accuracy.index}
    rank = {b: i for i, b in enumerate(order({b for _, b in pairs}))}
    pairs = sorted(pairs, key=lambda k: (k[0], rank[k[1]]))
    out["accuracy"] = pd.DataFrame([{"model": f"`{m}`", "method": f"`{b}`",
                                     **{c: fmt(v.accuracy.get((m, b), np.nan), 3)
                                        for c, v in zip(cols, versions, strict=True)}} for m, b in pairs])
    return out


def markdown(versions: list[Version], notes: list[str], caption: str) -> str:
    t = tables(versions)
    lines = ["# Baseline history", "",
             f"The committed baseline (`{PATH}`) at every commit that changed it, oldest first "
             f"(`python -m bench history`). Ratios are value/PGD of the certified bounds (role `bound`, "
             f"recomputed from value and PGD; 1 is as tight as the attack reaches, larger is looser); "
             f"certified accuracy is the share of a model's certified images over all its ε (the "
             f"report's count: the pairwise-head test). – : not in that version.", "",
             "| commit | date | rows |", "|---|---|---:|"]
    lines += [f"| `{v.commit[:SHORT]}` ({v.commit}) | {v.date} | {v.rows} |" for v in versions]
    if notes:
        lines += ["", "Skipped:", ""] + [f"- {n}" for n in notes]
    lines += ["", "![history](history.png)", "", caption, ""]
    for key, title in (("median", "Median value/PGD per certified bound"),
                       ("worst", "Worst (largest) value/PGD per certified bound"),
                       ("accuracy", "Certified accuracy per model and method, all ε pooled")):
        body = to_markdown(t[key]) if len(t[key]) else "No rows of this kind in any version.\n"
        lines += [f"## {title}", "", body]
    return "\n".join(lines).rstrip() + "\n"


def run(out: str | None = None) -> int:
    """Writes history.md and history.png into ``out`` (default results/history); prints where."""
    found = commits()
    versions, notes = read(found)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if not versions:
        raise InputError(f"none of the {len(found)} commit(s) that changed {PATH} holds a table this "
                         f"suite reads (see the notes above)")
    image, caption = png(versions)
    text = markdown(versions, notes, caption)
    where = Path(out) if out is not None else ROOT / "results" / "history"
    writable_dir(where, "--out")
    atomic_write(where / "history.png", image)
    atomic_write(where / "history.md", text)
    print(f"history: {where / 'history.md'} ({len(versions)} version(s)), figure {where / 'history.png'}")
    return 0

