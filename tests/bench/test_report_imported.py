"""The imported layers' table and figure (issue #30 item 3): value ÷ PGD per imported layer and ε for
every end-to-end bound, beside σ_max(J)·ε ÷ PGD, from the rows of a real run over two import
directories (tests/import_models.py ``write_import``); and nothing of them in a report without such
rows (the committed reports/ are built from a baseline that has none)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from import_models import write_import

import bounds
from bench.core.store import load
from bench.report.figures import FIGURES
from bench.report.panels import Skip
from bench.report.render import build
from bench.report.studies import imported_study
from bench.report.tables import TABLES
from bench.sweep.profiles import load_profile
from bench.sweep.runner import run_profile

EPS = (0.01, 0.1)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("imp")
    write_import(tmp / "vit", layers=2, inputs=2, seed=1)
    write_import(tmp / "bert", layers=1, inputs=1, seed=2, residual=(True,))
    (tmp / "p.toml").write_text(f'[run]\npgd_steps = 5\npgd_restarts = 1\n[[sweep]]\nname = "mine"\n'
                                f'imported = ["{tmp / "vit"}", "{tmp / "bert"}"]\neps = [0.01, 0.1]\n')
    return run_profile(load_profile(str(tmp / "p.toml")), tmp / "run", "cpu")[0].parent


def test_the_table_is_the_mean_ratio_per_layer_and_eps(run: Path):
    df = load(run)
    t, caption = TABLES["imported"](df)
    assert len(t) == (2 + 1) * len(EPS)
    assert list(zip(t["model"], t["layer"], t["ε (× median‖x_i‖)"], t["H"], t["inputs"], strict=True)) == [
        ("bert", "0", "0.01", "I", "1"), ("bert", "0", "0.1", "I", "1"),
        ("vit", "0", "0.01", "0", "2"), ("vit", "0", "0.1", "0", "2"),
        ("vit", "1", "0.01", "I", "2"), ("vit", "1", "0.1", "I", "2")]
    raw = pd.read_csv(run / "results.csv")  # value / PGD by hand, from the stored numbers
    for name in imported_study.NAMES:
        col = t[bounds.REGISTRY[name].label]
        for (model, layer, eps), got in zip(zip(t["model"], t["layer"], t["ε (× median‖x_i‖)"],
                                                strict=True), col, strict=True):
            r = raw[(raw["role"] == "bound") & (raw["bound"] == name) & (raw["head"] == -1)
                    & raw["imported"].str.endswith(model) & (raw["imported_layer"] == int(layer))
                    & (raw["eps"] == float(eps))]
            assert len(r) == (1 if model == "bert" else 2)
            assert float(got) == pytest.approx((r["value"] / r["pgd"]).mean(), rel=1e-3)
    for needle in ("relative", "median token norm", "radius", "σ_max(J)·ε is an estimate", "§1.5",
                   "docs/guide/import.md", "sha256"):
        assert needle in caption, needle


def test_the_figure_has_a_panel_per_directory_and_eps(run: Path):
    plot = FIGURES["imported"](load(run))
    titles = [[p.title for p in row] for row in plot.rows]
    assert titles == [["(a) bert, ε = 0.01", "(b) bert, ε = 0.1"], ["(c) vit, ε = 0.01", "(d) vit, ε = 0.1"]]
    vit = plot.panels[2]
    assert {t.label for t in vit.traces} == {bounds.REGISTRY[n].label for n in imported_study.NAMES}
    assert all(t.x == [0.0, 1.0] for t in vit.traces) and vit.ref == 1.0
    assert "median token norm" in plot.caption and "relative" in plot.caption


def test_the_report_shows_them(run: Path, tmp_path: Path):
    text = build(str(run), str(tmp_path / "rep")).read_text()
    assert (tmp_path / "rep" / "imported.png").exists() and (tmp_path / "rep" / "imported.md").exists()
    assert "![imported](imported.png)" in text


def test_without_imported_rows_nothing_is_said(run: Path, tmp_path: Path):
    df = load(run)
    other = df.assign(task="bounds")
    for make in (TABLES["imported"], FIGURES["imported"]):
        with pytest.raises(Skip) as e:
            make(other)
        assert not e.value.listed
    csv = tmp_path / "t.csv"
    df.drop(columns=[c for c in df.columns if c.startswith("imported")]).to_csv(csv, index=False)
    text = build(str(csv), str(tmp_path / "rep")).read_text()
    assert "`imported`" not in text and "imported.png" not in text
    assert not list((tmp_path / "rep").glob("imported*"))
