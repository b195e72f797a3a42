"""The report is rebuilt from a real (tiny) stored run: every figure and table is written, every
figure is readable (ticks, titles, display names, legends off the data, off-scale values marked),
the report directory is replaced whole or not at all, and bad input ends in InputError (library)
or exit code 2 with one stderr line (CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from helpers import ROOT
from import_models import write_import
from matplotlib.transforms import Bbox
from test_report_pretrained import stored_rows

import bounds
from bench.core import store
from bench.report import figures as report_select
from bench.report import outdir
from bench.report import render as report_mod
from bench.report.draw import draw, theme
from bench.report.figures import FIGURES
from bench.report.panels import Parts, Skip, p_text
from bench.report.panels import label as report_label
from bench.report.render import build
from bench.report.studies import taylor_study as report_taylor
from bench.report.studies.certify_tables import short_labels
from bench.report.tables import TABLES, summary
from bench.sweep.profiles import load_profile
from bench.sweep.runner import run_profile
from models import InputError

# one tiny cell (or a handful) per sweep the figures read, so the run takes seconds
TINY = """
[run]
pgd_steps = 2
pgd_restarts = 1
seed = 0

[[sweep]]
name = "eps"
kind = "dot"
n = 4
d = 8
h = [1, 2]
x_norm = [0.5, 1.0]
eps = [0.01, 0.1]

[[sweep]]
name = "heads"
kind = "dot"
n = 4
d = 8
h = [1, 2]

[[sweep]]
name = "input_norm"
kind = ["dot", "l2"]
n = 4
d = 8
h = 2
x_norm = [0.5, 2.0]

[[sweep]]
name = "olsa_vs_kim"
kind = ["l2", "olsa"]
residual = false
n = [4, 8]
d = 8
h = 2

[[sweep]]
name = "n"
kind = "dot"
n = [2, 4]
d = 8
h = 2

[[sweep]]
name = "depth"
kind = ["dot", "l2"]
depth = 2
n = 4
d = 8
h = 2

[[sweep]]
name = "ablation"
task = "lofast"
kind = "dot"
n = 4
d = 8
h = 2
perturb = ["W_q", "X"]
noise = [0.0, 0.5]
seed = [0, 1]
eps = 0.1

[[sweep]]
name = "scaling"
task = "scaling"
n = [4, 8]
d = 8
h = 2

[[sweep]]
name = "scaling_d"
task = "scaling"
n = 4
d = [8, 16]
h = 2

[[sweep]]
name = "scaling_h"
task = "scaling"
n = 4
d = 8
h = [1, 2]

[[sweep]]
name = "scaling_depth"
task = "scaling"
n = 4
d = 8
h = 2
depth = [2, 3]

[[sweep]]
name = "cost"
task = "cost"
n = [4, 8]
d = 8
h = 2

[[sweep]]
name = "taylor_eps"
task = "totals"
kind = "dot"
n = 4
d = 8
h = 2
x = "fro"
x_norm = [1, 5]
eps = [1e-3, 0.1]

[[sweep]]
name = "cauchy"
task = "cauchy"
depth = 2
n = 4
d = 8
h = 2
samples = 3

[[sweep]]
name = "certify"
task = "certify"
model = ["digits-d32-b1-h2-c0.5-q1-m0.003", "digits-d32-b2-h2-c0.5-q1-m0.003"]
eps = [0.02, 0.1]
samples = 2

[[sweep]]
name = "cauchy_models"
task = "cauchy_model"
model = ["digits-d16-b2-h1-vanilla", "digits-d32-b2-h2-c0.5-q1-m0.003"]
eps = 0.1
samples = 2

[[sweep]]
name = "eps_trained"
kind = "dot"
model = "tiny-digits-d16-b1-h1-c0.5"
x = "data"
n = 16
d = 16
h = 1
x_norm = [0.5, 1.0]
eps = [0.01, 0.1]

[[sweep]]
name = "ablation_trained"
task = "lofast"
kind = "dot"
model = "tiny-digits-d16-b1-h1-c0.5"
x = "data"
n = 16
d = 16
h = 1
perturb = ["W_q", "X"]
noise = [0.0, 0.5]
eps = 0.1
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    toml = tmp / "tiny.toml"
    # an imported model's layers (task imported): a directory as `python -m bench import` writes one
    write_import(tmp / "imported", layers=2)
    toml.write_text(TINY + f'[[sweep]]\nname = "imported"\nimported = ["{tmp / "imported"}"]\n'
                           f'eps = [0.01, 0.1]\n')
    run_profile(load_profile(str(toml)), tmp / "run", "cpu")
    # the pretrained study's rows, made up (its real cells need the extras and ~15 s each): stored
    # as one more finished cell, so every figure and table below has its data
    stored_rows(10_000).to_csv(tmp / "run" / "cells" / "pretrained.csv", index=False)
    store.consolidate(tmp / "run")
    return tmp / "run"


@pytest.fixture(scope="module")
def report(run_dir: Path) -> Path:
    return build(str(run_dir), str(run_dir.parent / "rep"))


def test_build_writes_every_figure_and_table(report: Path, table: pd.DataFrame):
    readme = report
    out = readme.parent
    assert readme == out / "README.md"
    text = readme.read_text()
    for stem in FIGURES:
        for ext in ("png", "pdf"):
            f = out / f"{stem}.{ext}"
            assert f.exists() and f.stat().st_size > 0, f
        assert f"]({stem}.png)" in text, stem
    for stem, make in TABLES.items():
        try:
            made = make(table)
        except Skip as e:  # Table 2 compares a cascade with CROWN: the tiny run has neither, and says so
            # a study of the user's own files (network files) is not listed as skipped, nor written
            assert (stem == "table2_cascade" or not e.listed) and not list(out.glob(f"{stem}*")), stem
            continue
        # a table in parts (Table 1: one per dataset) is written as <stem><suffix>, each listed
        for name in [stem + p[0] for p in made.parts] if isinstance(made, Parts) else [stem]:
            for ext in ("md", "tex"):
                f = out / f"{name}.{ext}"
                assert f.exists() and f.stat().st_size > 0, f
            assert f"### {name}\n" in text, name
    assert not (out / "table1_certified.md").exists() and (out / "table1_certified_digits.md").exists()
    full = (out / "table1_certified_full.csv").read_text()
    assert full.startswith("dataset,model,method,label,certificate,eps,k,n,certified_accuracy,") and \
        "every ε: [table1_certified_full.csv](table1_certified_full.csv)" in text
    skipped = text.split("## Skipped")[-1].split("## Figures")[0] if "## Skipped" in text else ""
    assert [line[:25] for line in skipped.splitlines() if line.startswith("- ")] == [
        "- table `table2_cascade`:"]
    assert "No soundness violations" in text
    assert "| LoFAST (‖M‖) |" in (out / "summary.md").read_text()
    assert r"\begin{tabular}" in (out / "table3_lofast.tex").read_text()


def test_build_is_deterministic(run_dir: Path, report: Path, tmp_path: Path):
    a = report.parent
    b = build(str(run_dir), str(tmp_path / "b")).parent
    for f in sorted(a.iterdir()):
        if f.suffix in (".md", ".tex", ".pdf", ".csv"):
            assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    assert list(a.glob("*.csv"))
    outdir.check(a)  # a report with its full CSV is a report: the next build may replace it


def test_missing_sweeps_are_skipped_and_named(run_dir: Path, tmp_path: Path):
    df = store.load(run_dir)
    part = tmp_path / "part.csv"
    df[df["sweep"] == "eps"].to_csv(part, index=False)
    text = build(str(part), str(tmp_path / "rep")).read_text()
    assert "## Skipped" in text and "`cauchy_violin`" in text
    # after what was made: a report of a few sweeps does not open with a list of what it lacks
    assert text.index("## Tables") < text.index("## Skipped")
    assert (tmp_path / "rep" / "fig1_lofast.png").exists()
    assert not (tmp_path / "rep" / "scaling.png").exists()


def test_violation_is_reported_at_the_top(run_dir: Path, tmp_path: Path):
    df = store.load(run_dir)
    df = df[df["sweep"] == "eps"].copy()  # only the README's header matters here
    text = build(str(_planted(df, tmp_path, "lofast_M")), str(tmp_path / "rep")).read_text()
    assert "SOUNDNESS VIOLATIONS: 1 rows" in text.split("## ")[0]


def test_load_garbage_raises_input_error(tmp_path: Path):
    junk = tmp_path / "junk.csv"
    junk.write_bytes(b"\x00\xff\xfe garbage\n1,2\n")
    with pytest.raises(InputError):
        store.load(junk)
    with pytest.raises(InputError):
        store.load(tmp_path / "nonexistent")


def test_cli_report_on_missing_results_exits_2(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "bench", "report", str(tmp_path / "nonexistent"),
                        "--out", str(tmp_path / "rep")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "error" in p.stderr


# ---- figures a reader can trust, checked on the matplotlib Figures themselves ----------------------


@pytest.fixture(scope="module")
def table(run_dir: Path) -> pd.DataFrame:
    return store.load(run_dir)


def _labelled(axis) -> list[str]:
    """The tick labels of an axis that are shown, non-empty and within its limits (after a draw)."""
    lo, hi = sorted(axis.get_view_interval())
    slack = 1e-9 * (hi - lo)
    return [t.get_text() for loc, t in zip(axis.get_majorticklocs(), axis.get_majorticklabels(),
                                           strict=True)
            if t.get_visible() and t.get_text().strip() and lo - slack <= loc <= hi + slack]


def _drawn(df: pd.DataFrame, stem: str) -> plt.Figure:
    theme()
    fig = draw(FIGURES[stem](df))
    fig.canvas.draw()
    return fig


# code names a legend must never show: registry names with another display name, and the
# timing rows' solver names
RAW = ({name for name, b in bounds.REGISTRY.items() if b.label != name}
       | {f"{q}_{s}" for q in ("zeta", "M", "jacobian") for s in ("lanczos", "dense", "probabilistic")}
       | {"pgd_output"})


@pytest.mark.parametrize("stem", list(FIGURES))
def test_figure_is_readable(table: pd.DataFrame, stem: str):
    """Every panel: a title, ≥ 2 labelled ticks on each axis within its limits; every legend: display
    names only, and clear of every panel's data area."""
    fig = _drawn(table, stem)
    try:
        assert fig.axes
        for ax in fig.axes:
            assert ax.get_title().strip(), f"{stem}: a panel without a title"
            if not ax.axison:  # an empty panel: no axes, a note that says why
                assert any(t.get_text().strip() for t in ax.texts), (stem, ax.get_title())
                continue
            assert len(_labelled(ax.yaxis)) >= 2, (stem, ax.get_title(), _labelled(ax.yaxis))
            assert len(_labelled(ax.xaxis)) >= 2, (stem, ax.get_title(), _labelled(ax.xaxis))
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        for leg in legends:
            texts = {t.get_text() for t in leg.get_texts()}
            assert not RAW & texts, (stem, RAW & texts)
            box = leg.get_window_extent(renderer)
            for ax in fig.axes:
                inter = Bbox.intersection(box, ax.get_window_extent(renderer))
                assert inter is None or inter.width * inter.height < 1.0, (stem, ax.get_title())
    finally:
        plt.close(fig)


def test_a_ratio_of_1e99_is_marked_not_flattened(table: pd.DataFrame):
    df = table.copy()
    heads = df["sweep"] == "heads"
    i = heads & (df["bound"] == "lofast_M") & (df["h"] == df.loc[heads, "h"].max())
    assert i.any()
    df.loc[i, "ratio"] = 1e99
    fig = _drawn(df, "tightness_heads")
    try:
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        reached = any(ax.get_ylim()[1] >= 1e99 for ax in fig.axes)
        assert reached or any("1e+99" in t for t in texts), texts
    finally:
        plt.close(fig)


def test_cauchy_figure_resolves_the_spread(table: pd.DataFrame):
    """σ_max varies by ~1e-3 of its value across inputs: one axis must span about that spread."""
    fig = _drawn(table, "cauchy_violin")
    try:
        sub = table[(table["sweep"] == "cauchy") & (table["bound"] == "block_sigma")]
        spread = sub.groupby("block")["value"].agg(lambda v: v.max() / v.mean() - 1).max() * 100
        spans = [abs(ax.get_ylim()[1] - ax.get_ylim()[0]) for ax in fig.axes]
        assert min(spans) < 20 * spread, (spans, spread)
    finally:
        plt.close(fig)


def test_summary_rows_name_bounds_and_their_status(table: pd.DataFrame):
    t, _ = summary(table)
    assert list(t.columns) == ["bound", "name", "certified", "certificate", "median ratio",
                               "worst ratio", "violations", "findings", "s/sample", "rows"]
    status = dict(zip(t["name"], t["certified"], strict=True))
    assert status["specformer"] == "yes (finding)"
    assert status["lofast_M"] == "yes"
    assert status["jacobian"] == "estimate"
    assert dict(zip(t["name"], t["bound"], strict=True))["delta21_M"] == bounds.REGISTRY["delta21_M"].label
    findings = dict(zip(t["name"], t["findings"], strict=True))
    assert findings["kim"] == "0" and findings["lofast_M"] == "–"
    cert = dict(zip(t["name"], t["certificate"], strict=True))
    # the fixture's larger layers take the Cholesky-checked (deterministic) certificate
    assert cert["lofast_M"] == "exact / deterministic" and cert["jacobian"] == "estimate"


def test_summary_names_certificates_and_their_failure_probability(table: pd.DataFrame):
    df = table.copy()
    i = df.index[(df["role"] == "bound") & (df["bound"] == "lofast_M")]
    df.loc[i, "certificate"] = "exact"
    df.loc[i[:2], "certificate"] = "probabilistic"
    df.loc[i[:2], "certificate_p"] = [1e-9, 3.21e-9]
    t, caption = summary(df)
    cert = dict(zip(t["name"], t["certificate"], strict=True))
    # the largest p of the rows, rounded up (3.21e-9 must not read as 3.2e-9)
    assert cert["lofast_M"] == "exact / probabilistic (p ≤ 3.3e-09)", cert["lofast_M"]
    assert "certificate" in caption and "median `seconds`" in caption
    assert p_text(4e-9) == "4e-09" and p_text(1e-9) == "1e-09"


def _planted(table: pd.DataFrame, tmp_path: Path, bound: str) -> Path:
    """The table with one row of ``bound`` at half its PGD value, marked as the runner would."""
    df = table.copy()
    i = df.index[(df["role"] == "bound") & (df["bound"] == bound)][0]
    df.loc[i, ["value", "ratio", "sound"]] = [df.loc[i, "pgd"] * 0.5, 0.5, False]
    df.loc[i, "violation"] = not bool(df.loc[i, "finding"])
    path = tmp_path / "planted.csv"
    df.to_csv(path, index=False)
    return path


def test_a_broken_published_statement_is_a_finding_not_a_violation(table: pd.DataFrame,
                                                                   tmp_path: Path):
    path = _planted(table, tmp_path, "kim")
    text = build(str(path), str(tmp_path / "rep")).read_text()
    head = text.split("## ")[0]
    assert "SOUNDNESS VIOLATIONS" not in head and "No soundness violations" in head
    block = head.split("Findings of published statements")[1]
    assert "Kim et al. (Thm 3.2) (`kim`): 1 of" in block and "value/PGD = 0.5" in block
    assert "docs/bounds.md §6" in head
    t = pd.DataFrame([r.strip(" |").split(" | ") for r in
                      (tmp_path / "rep" / "summary.md").read_text().splitlines()[2:]])
    row = t[t[1] == "kim"].iloc[0]
    assert (row[6], row[7]) == ("0", "1")  # violations, findings


def test_no_finding_reached_is_said(report: Path):
    head = report.read_text().split("## ")[0]
    assert "Findings of published statements" in head and "none was reached" in head


def test_a_violation_of_the_suite_is_not_a_finding(table: pd.DataFrame, tmp_path: Path):
    path = _planted(table, tmp_path, "taylor")
    head = build(str(path), str(tmp_path / "rep")).read_text().split("## ")[0]
    assert "SOUNDNESS VIOLATIONS: 1 rows" in head and "none was reached" in head


def test_taylor_eps_figure_and_table(table: pd.DataFrame):
    plot = FIGURES["tightness_taylor"](table)
    assert len(plot.rows) == 2 and [len(r) for r in plot.rows] == [2, 2]  # ratio, ratio − 1
    titles = [p.title for p in plot.panels]
    assert any("= 1" in t for t in titles) and any("= 5" in t for t in titles)
    want = {bounds.REGISTRY[n].label for n in report_taylor.NAMES}
    assert {t.label for t in plot.rows[0][0].traces} == want
    assert all(p.xscale == "log" and p.yscale == "log" for p in plot.panels)
    assert plot.rows[0][0].ref == 1.0
    assert all(y > 0 for p in plot.rows[1] for t in p.traces for y in t.y)
    t, caption = TABLES["taylor_eps"](table)
    assert len(t) == 4 and list(t["ε"]) == ["0.001", "0.1"] * 2 and list(t["‖X‖_F"]) == ["1"] * 2 + ["5"] * 2
    assert set(t["smallest"]) <= want - {bounds.REGISTRY["best"].label}
    for needle in ("`taylor_eps`", "n=4", "d=8", "h=2", "residual", "Frobenius", "§2.3"):
        assert needle in caption, needle


def test_ratio_text_shows_how_close_to_1():
    assert report_taylor.ratio_text(1.000012) == "1.000012"
    assert report_taylor.ratio_text(1.0805) == "1.081"
    assert report_taylor.ratio_text(3.379535) == "3.380"
    assert report_taylor.ratio_text(1.2e7) == "1.2e+07"


# ---- the report directory: replaced whole or not at all ------------------------------------------


@pytest.fixture(scope="module")
def small(table: pd.DataFrame, tmp_path_factory) -> str:
    """One sweep's rows: a report of one figure and a few tables, quick to build again and again."""
    path = tmp_path_factory.mktemp("small") / "results.csv"
    table[table["sweep"] == "olsa_vs_kim"].to_csv(path, index=False)
    return str(path)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _leftovers(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_failed_build_leaves_the_previous_report_whole(small: str, tmp_path: Path, monkeypatch):
    out = tmp_path / "rep"
    build(small, str(out))
    before = _snapshot(out)
    assert "olsa_vs_kim.png" in before

    def boom(df):
        raise RuntimeError("figure failed midway")

    # the last figure fails, after olsa_vs_kim.png has been written anew
    monkeypatch.setitem(report_select.FIGURES, "scaling", boom)
    with pytest.raises(RuntimeError, match="midway"):
        build(small, str(out))
    assert _snapshot(out) == before
    assert _leftovers(out) == []


def test_leftovers_of_a_killed_build_are_removed(small: str, tmp_path: Path):
    out = tmp_path / "rep"
    dead = tmp_path / ".rep.report-building.999999.dead"
    dead.mkdir()
    (dead / "fig1_lofast.png").write_bytes(b"half")
    build(small, str(out))
    assert not dead.exists()
    assert (out / "README.md").exists() and _leftovers(out) == []


def test_out_that_is_not_a_report_directory_is_refused(small: str, tmp_path: Path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    with pytest.raises(InputError, match="not a report directory"):
        build(small, str(mine))
    assert _snapshot(mine) == {"notes.txt": b"my notes"}
    # a previous report with a user's file dropped into it is not ours to delete either
    rep = tmp_path / "rep"
    build(small, str(rep))
    (rep / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a report directory"):
        build(small, str(rep))
    assert (rep / "notes.txt").read_text() == "mine"


def test_a_report_nested_in_a_report_is_carried_over_and_a_folder_of_notes_is_not(
        small: str, tmp_path: Path, monkeypatch):
    """reports/paper inside reports/: rebuilding the outer report keeps the inner one byte for byte,
    also when the build fails; a folder that is not a report makes the outer one not ours."""
    out = tmp_path / "rep"
    build(small, str(out))
    build(small, str(out / "paper"))
    inner = _snapshot(out / "paper")
    build(small, str(out))
    assert _snapshot(out / "paper") == inner and (out / "README.md").exists()
    monkeypatch.setitem(report_select.FIGURES, "scaling", lambda df: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build(small, str(out))
    assert _snapshot(out / "paper") == inner and _leftovers(out) == []
    monkeypatch.undo()
    (out / "mine").mkdir()
    (out / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a report directory"):
        build(small, str(out))
    assert (out / "mine" / "notes.txt").read_text() == "mine"


def test_out_at_or_under_a_file_is_refused(small: str, tmp_path: Path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    for out in (f, f / "rep"):
        with pytest.raises(InputError, match="file"):
            build(small, str(out))
    assert f.read_text() == "x"


def test_empty_out_directory_is_filled(small: str, tmp_path: Path):
    out = tmp_path / "empty"
    out.mkdir()
    assert build(small, str(out)) == out / "README.md"


def test_readme_shows_no_absolute_path_of_this_machine(small: str, tmp_path: Path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    (repo / "results" / "t.csv").write_bytes(Path(small).read_bytes())
    monkeypatch.setattr(report_mod, "ROOT", repo)
    text = build(str(repo / "results" / "t.csv"), str(repo / "reports")).read_text()
    assert "`python -m bench report results/t.csv --out reports`" in text
    assert str(tmp_path) not in text
    assert "SPEC" not in text and "docs/bounds.md §" in text


def test_cli_report_into_a_file_exits_2(run_dir: Path, tmp_path: Path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "bench", "report", str(run_dir), "--out", str(f)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "error" in p.stderr, p.stderr


def test_trained_model_figures_and_tables_read_the_stored_rows(table: pd.DataFrame):
    """LoFAST Fig. 2 / Table 1 and the Cauchy Table 1 recount the stored rows: certified accuracy
    is the mean of the pairwise verdicts, per model and ε; captions name the models and commit."""
    (suffix, tab, caption), = TABLES["table1_certified"](table).parts
    cert = table[(table["sweep"] == "certify") & (table["role"] == "certify")]
    assert suffix == "_digits" and len(tab.columns) == 2 + 2 * cert["model"].nunique()
    labels = short_labels(sorted(cert["model"].unique()))
    at = tab.set_index("method")
    for (model, bound), g in cert[cert["eps"] == 0.02].groupby(["model", "bound"]):
        assert float(at.loc[report_label(bound), f"{labels[model]}: certified"]) == pytest.approx(
            g["certified_pairwise"].mean(), abs=5e-4)
    assert "commit" in caption and "digits" in caption and "The other ε (0.1)" in caption
    plot = FIGURES["fig2_certified_accuracy"](table)
    assert len(plot.panels) == 2 and "ε" in plot.panels[0].xlabel
    assert plot.panels[0].traces[0].x == [0.02, 0.1]
    ctab, _ = TABLES["cauchy_table1_models"](table)
    assert set(ctab["model"]) == {"digits-d16-b2-h1-vanilla", "digits-d32-b2-h2-c0.5-q1-m0.003"}
    assert "zoo/tiny-digits-d16-b1-h1-c0.5" in FIGURES["fig4_trained_layer"](table).caption
