"""README's numbers are the committed baseline's (issue #25: numbers typed by hand went stale): the
Taylor-vs-ε table, the taylor_net table and its row count, recomputed here from
results/baseline/results.csv to the digits README prints."""

from __future__ import annotations

import pandas as pd
import pytest
from helpers import ROOT

from bench.core.store import READ

README = (ROOT / "README.md").read_text()
BASELINE = ROOT / "results" / "baseline" / "results.csv"


@pytest.fixture(scope="module")
def base() -> pd.DataFrame:
    return pd.read_csv(BASELINE, **READ)


def _table_after(marker: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``marker`` in README."""
    text = README[README.index(marker):]
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    start = text.splitlines().index(lines[0])
    rows = []
    for ln in text.splitlines()[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows[2:]  # header and rule


def _shown(printed: str, value: float) -> bool:
    """Whether ``value`` prints as ``printed`` at the printed number of decimals."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:.{decimals}f}" == printed


def test_the_taylor_eps_table_is_the_baselines(base):
    rows = _table_after("Measured on the quick\nprofile's sweep `taylor_eps`")
    cells = base[(base["sweep"] == "taylor_eps") & (base["role"] == "bound") & (base["x_norm"] == 5)]
    names = {"Taylor": "taylor", "LoFAST (‖M‖)": "lofast_M", "LoFAST ½ (‖M‖) (this suite)": "lofast_M_half",
             "best": "best"}
    eps = [1e-4, 1e-3, 1e-2, 0.1, 1.0]
    assert [r[0] for r in rows] == list(names)
    for r in rows:
        got = cells[cells["bound"] == names[r[0]]].set_index("eps")["ratio"]
        for printed, e in zip(r[1:], eps, strict=True):
            assert _shown(printed, float(got.loc[e])), (r[0], e, printed, float(got.loc[e]))


def _certified(base: pd.DataFrame, model: str, eps: float, bound: str) -> float:
    rows = base[(base["role"] == "certify") & (base["model"] == model) & (base["eps"] == eps)
                & (base["bound"] == bound)]
    return float(rows["certified_pairwise"].astype(bool).mean()) if len(rows) else float("nan")


def _robust(base: pd.DataFrame, model: str, eps: float) -> float:
    rows = base[(base["role"] == "pgd") & (base["bound"] == "pgd_margin") & (base["model"] == model)
                & (base["eps"] == eps)]
    return float((rows["pgd_margin"] > 0).mean())


def test_the_taylor_net_table_is_the_baselines(base):
    head = "taylor_net's verdicts are their own), 0 violations over "
    assert f"{head}{len(base):,} rows" in README
    rows = _table_after(head)
    columns = ["PGD", "taylor_net", "taylor_net_lofast_half", "taylor_net_lofast", "crown", "best"]
    model = None
    checked = 0
    for r in rows:
        model = r[0].strip("`").split("`")[0] or model
        for k, e in enumerate(r[1].split(" / ")):
            for col, cell in zip(columns, r[2:], strict=True):
                if cell in ("–", "the same"):
                    continue
                printed = cell.split(" / ")[k].strip("*")
                want = (_robust(base, model, float(e)) if col == "PGD"
                        else _certified(base, model, float(e), col))
                assert printed == ("0" if want == 0 else f"{want:.2f}"), (model, e, col, printed, want)
                checked += 1
    assert checked > 40
