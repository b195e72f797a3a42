"""``python -m bench report``: every figure and table of the suite, rebuilt from stored results.

Reads one results table (a run directory or CSV, see :func:`bench.core.store.load`) and writes into
``out``: each figure as PNG and PDF, each table (or each part of one) as Markdown and LaTeX, with the
long table a study chose its parts from as CSV, and a README.md that
shows them all with how each was made. A figure whose sweep is absent is skipped and named in the
README, so a user profile with fewer sweeps still reports what it has. The output depends on the
data alone (no timestamps or paths of this machine), so re-running on the same results gives the
same files. The report is built beside ``out`` and moved into place whole (:mod:`bench.report.outdir`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from ..core.env import ROOT
from ..core.store import TABLE, load
from . import draw, outdir
from . import tables as tabs
from .figures import FIGURES
from .panels import Parts, Skip, label, registry_order

META = ["profile", "device_name", "dtype", "git_commit", "git_dirty", "torch_version",
        "pgd_steps", "pgd_restarts", "date"]
# PDFs stamp their creation time unless told otherwise; PNGs carry only the software tag
PDF_META = {"CreationDate": None, "ModDate": None}


def _run_line(df: pd.DataFrame) -> str:
    parts = []
    for c in META:
        if c in df.columns:
            vals = sorted({str(v) for v in df[c].dropna()})
            if vals:
                parts.append(f"{c} {'/'.join(vals)}")
    return "; ".join(parts) if parts else "no run metadata in the table"


def _violations(df: pd.DataFrame) -> list[str]:
    bad = df[df["violation"].astype(bool)]
    return [f"`{r.bound}` = {r.value:.6g} < PGD {r.pgd:.6g} in sweep `{r.sweep}` cell "
            f"`{r.cell_id}` (sample {r.sample}, head {r.head})" for r in bad.itertuples()]


def _findings(df: pd.DataFrame) -> list[str]:
    """The README's block on published statements this suite found unsound (docs/bounds.md §6):
    per such bound, how many rows broke it here and the worst value/PGD. Calmer than the
    violations block: these are the papers' statements failing, as documented, not this code."""
    marked = df[(df["role"] == "bound") & df["finding"].astype(bool)]
    head = "**Findings of published statements** (docs/bounds.md §6)"
    if marked.empty:
        return [f"{head}: no bound with a finding was evaluated in this table.", ""]
    names = registry_order(marked["bound"])
    broken = marked[~marked["sound"].astype(bool)]
    if broken.empty:
        shown_ = ", ".join(f"{label(n)} (`{n}`, {int((marked['bound'] == n).sum())} rows)" for n in names)
        return [f"{head}: none was reached on these inputs; every row of {shown_} is at or above its "
                f"PGD lower bound.", ""]
    lines = [f"{head}: rows where a bound whose published statement this suite found unsound is "
             f"below its PGD lower bound, i.e. PGD broke the statement on these inputs (counted "
             f"apart from the violations above, which concern this suite's own code).", ""]
    for n in names:
        g, bad = marked[marked["bound"] == n], broken[broken["bound"] == n]
        if bad.empty:
            lines.append(f"- {label(n)} (`{n}`): not reached in {len(g)} rows.")
            continue
        w = bad.loc[bad["ratio"].idxmin()]
        lines.append(f"- {label(n)} (`{n}`): {len(bad)} of {len(g)} rows; worst value/PGD = "
                     f"{w['ratio']:.4g} ({w['value']:.6g} < {w['pgd']:.6g}) in sweep `{w['sweep']}` "
                     f"cell `{w['cell_id']}` (sample {int(w['sample'])}, head {int(w['head'])}).")
    return [*lines, ""]


def _save(fig: plt.Figure, out: Path, stem: str) -> None:
    try:
        fig.savefig(out / f"{stem}.png", dpi=200)
        fig.savefig(out / f"{stem}.pdf", metadata=PDF_META)
    finally:
        plt.close(fig)


def shown(path: str) -> str:
    """A path as the README shows it: relative to the repository root when inside it (no absolute
    path of this machine in a committed report), else as given; a run directory as its table, so
    that the directory and its results.csv give the same README."""
    if Path(path).is_dir() and (Path(path) / TABLE).is_file():
        path = str(Path(path) / TABLE)
    try:
        return Path(path).resolve().relative_to(ROOT.resolve()).as_posix()
    except ValueError:
        return path


def _shown_out(out: str) -> str:
    # outside the repository the output directory is the reader's choice: a placeholder, so the
    # same table gives the same README wherever it is built
    text = shown(out)
    return "OUT" if text == out and Path(out).is_absolute() else text


def build(results: str, out: str) -> Path:
    """Writes the report of ``results`` into ``out`` (replacing a previous report there, whole, only
    once everything is built); returns the README's path."""
    df = load(results)
    with outdir.replacing(Path(out)) as tmp:
        made_figs, made_tabs, skipped = _write(df, tmp)
        readme = _readme(df, results, out, made_figs, made_tabs, skipped)
        (tmp / "README.md").write_text(readme)
    return Path(out) / "README.md"


def _write(df: pd.DataFrame, outp: Path):
    draw.theme()
    made_figs: list[tuple[str, str]] = []
    made_tabs: list[tuple[str, str, str]] = []
    skipped: list[str] = []
    for stem, select in FIGURES.items():
        try:
            plot = select(df)
        except Skip as e:
            skipped += [f"figure `{stem}`: {e}"] if e.listed else []
            continue
        _save(draw.draw(plot), outp, stem)
        made_figs.append((stem, plot.caption))
    for stem, make in tabs.TABLES.items():
        try:
            made = make(df)
        except Skip as e:
            skipped += [f"table `{stem}`: {e}"] if e.listed else []
            continue
        made_tabs += _write_table(made, outp, stem)
    return made_figs, made_tabs, skipped


def _write_table(made: tuple[pd.DataFrame, str] | Parts, outp: Path, stem: str):
    """Each part of a table as ``<stem><suffix>.md`` and ``.tex``, and its long form, if any, as
    ``<stem>_full.csv``; returns per part (its stem, caption, Markdown, the CSV's name or None)."""
    parts = made.parts if isinstance(made, Parts) else (("", *made),)
    csv = None
    if isinstance(made, Parts) and made.full is not None:
        csv = f"{stem}_full.csv"
        (outp / csv).write_text(made.full.to_csv(index=False, lineterminator="\n"))
    out = []
    for suffix, t, caption in parts:
        md = tabs.to_markdown(t)
        (outp / f"{stem}{suffix}.md").write_text(md)
        (outp / f"{stem}{suffix}.tex").write_text(tabs.to_latex(t, caption))
        out.append((stem + suffix, caption, md, csv))
    return out


def _readme(df: pd.DataFrame, results: str, out: str, made_figs, made_tabs, skipped) -> str:
    lines = [outdir.HEADING, ""]
    bad = _violations(df)
    if bad:
        lines += [f"> **SOUNDNESS VIOLATIONS: {len(bad)} rows where a certified bound is below "
                  f"its PGD lower bound.**", ">"]
        lines += [f"> - {b}" for b in bad[:50]]
        if len(bad) > 50:
            lines.append(f"> - … and {len(bad) - 50} more (see summary.md)")
        lines.append("")
    else:
        lines += ["No soundness violations: every certified bound of this suite's code is at or "
                  "above its PGD lower bound in every row (bounds whose published statement has a "
                  "finding are counted apart, below).", ""]
    lines += _findings(df)
    lines += [f"Run: {_run_line(df)}. {len(df)} rows, sweeps: "
              f"{', '.join(f'`{s}`' for s in dict.fromkeys(df['sweep']))}.", "",
              f"Regenerate (from the repository root): `python -m bench report {shown(results)} "
              f"--out {_shown_out(out)}`. Bounds marked *(this suite)* are the ½-Lipschitz-softmax "
              f"tightening of docs/bounds.md §2.2, not LoFAST's; *(estimate)* marks first-order "
              f"Jacobian estimates (docs/bounds.md §3.4), not certificates.", ""]
    lines += ["## Figures", ""]
    for stem, caption in made_figs:
        lines += [f"### {stem}", "", f"![{stem}]({stem}.png)", "",
                  f"{caption} ([PDF]({stem}.pdf))", ""]
    lines += ["## Tables", ""]
    for stem, caption, md, csv in made_tabs:
        also = f", every ε: [{csv}]({csv})" if csv else ""
        lines += [f"### {stem}", "", caption + f" ([{stem}.md]({stem}.md), "
                  f"[{stem}.tex]({stem}.tex){also})", "", md]
    if skipped:  # last: a table of a few sweeps (reports/paper) skips most studies
        lines += ["", "## Skipped (data absent from this table)", ""]
        lines += [f"- {s}" for s in skipped]
    return "\n".join(lines).rstrip() + "\n"
